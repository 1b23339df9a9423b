"""Training for metrics that need it: Rigel (Koyama et al., 2026) in two phases.

* :func:`~capeval_plugins.training.phase1.train_phase1`: the backbone frozen, its hidden states at the score
  position cached once, the scoring head distilled from the LM head's score-token distribution with the
  temperature-scaled 1-D EMD, early stopping on validation Kendall tau-c;
* :func:`~capeval_plugins.training.phase2.train_phase2`: the head frozen, LoRA on the backbone against the
  one-hot of the averaged human score (needs ``peft``: the ``lora`` extra).

Both write a checkpoint directory (:mod:`~capeval_plugins.models.rigel`) that the ``rigel`` metric loads,
save their state as they go and continue an interrupted run. Data: :mod:`~capeval_plugins.training.data`.
The command line is ``capeval train rigel --phase 1|2 ...``; see docs/training.md.
"""
