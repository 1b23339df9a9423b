"""MSD-Score's local vision-language aligner (paper Sec. 3.2): frozen CLIP vision tower and LLM, a trained linear
projector of the patches into the LLM's input-embedding space, a contrastive and a reconstruction objective.

* :mod:`capeval_plugins.models.msd_aligner.model` (the inference side, beside the metrics that use it):
  settings, the aligner (patch and token embeddings for the ``msd_score`` / ``soft_msd`` metrics,
  ``aligner=DIR``), reading its checkpoint directory; :func:`.train.save_aligner` writes one;
* :mod:`.train`: :func:`~.train.train_aligner`, resumable, with an optional cache of the vision features;
* :mod:`.data`: image-caption pairs (LLaVA ``chat.json`` or ``{image, caption}`` records);
* :mod:`.synthetic`: coloured shapes captioned by colour and shape, for tests and trials.

The command line is ``capeval train msd-aligner ...``; see docs/training.md.
"""

# Names the command line needs before anything heavy is imported (the model's: capeval_plugins.models.msd_aligner).
SCHEDULES = ("cosine", "constant")
