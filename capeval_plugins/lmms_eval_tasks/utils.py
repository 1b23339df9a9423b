"""Helpers for capeval task YAMLs, named as ``!function capeval_plugins.lmms_eval_tasks.utils.<name>``."""


def doc_to_image(doc):
    """A document's ``image`` column (a PIL image, as the task's dataset decodes it: with its EXIF orientation
    applied) in RGB, as every capeval metric converts it (16-bit and float images scaled by their range), so the
    captioning model is shown the image the metrics score."""
    from capeval_plugins.inputs import to_rgb

    return [to_rgb(doc["image"])]
