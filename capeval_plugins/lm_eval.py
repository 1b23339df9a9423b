"""``import capeval_plugins.lm_eval`` registers every capeval metric with lm-eval (beside its built-ins).

See :mod:`capeval_plugins.adapters.lm_eval`; ``capeval-lm-eval`` is lm-eval's CLI with this done, the
shipped caption tasks on the include path and every task checked before generation.
"""
from capeval_plugins.adapters.lm_eval import (CaptionItem, CaptionTask, aggregate, check_tasks, main, register,
                                              tasks_dir)

__all__ = ["CaptionItem", "CaptionTask", "aggregate", "check_tasks", "main", "register", "tasks_dir"]
