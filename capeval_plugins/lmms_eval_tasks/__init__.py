"""Task YAMLs for lmms-eval (see docs/ecosystems/lmms-eval.md); ``python -m capeval_plugins.lmms_eval_tasks``
prints this folder for ``--include_path``."""
