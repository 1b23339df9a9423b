"""Task YAMLs for lm-eval (the shipped ``capeval_caption`` task, see docs/ecosystems/lm-eval.md) and the helpers its
``!function`` entries name (:mod:`.utils`, loaded by lm-eval by path)."""
