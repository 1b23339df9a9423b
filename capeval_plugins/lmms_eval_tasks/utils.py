"""Helpers for capeval task YAMLs (named through ``!function capeval_plugins.lmms_eval_tasks.utils.<name>``)."""


def doc_to_image(doc):
    """The document's ``image`` column (a PIL image, as lmms-eval's datasets decode it), in RGB."""
    return [doc["image"].convert("RGB")]
