"""``python -m capeval_plugins.lmms_eval_tasks`` prints this folder, for lmms-eval's ``--include_path``."""
from pathlib import Path

print(Path(__file__).resolve().parent)
