"""Helpers for capeval task YAMLs, named as ``!function capeval_plugins.lmms_eval_tasks.utils.<name>``."""


def doc_to_image(doc):
    """A document's ``image`` column (a PIL image, as the task's dataset decodes it), in RGB."""
    return [doc["image"].convert("RGB")]
