"""Helpers of the shipped capeval_caption task (loaded by lm-eval through ``!function``)."""
from capeval_plugins.adapters.lm_eval import CaptionTask  # noqa: F401  (named by the task YAML)
from capeval_plugins.caption_files import load_caption_docs
from capeval_plugins.inputs import InputError


def load_captions(captions=None, images=None, limit=None, **_):
    """``--metadata '{"captions": FILE, "images": DIR}'`` -> ``{"test": [doc, ...]}``."""
    if captions is None:
        raise InputError('capeval_caption needs a caption file: --metadata \'{"captions": "FILE.jsonl", "images": '
                         '"DIR"}\'')
    import datasets

    for key, value in (("captions", captions), ("images", images)):
        if value is not None and not isinstance(value, str):
            raise InputError(f"capeval_caption: --metadata {key!r} must be a path (a string), got "
                             f"{type(value).__name__}")
    docs = load_caption_docs(captions, images, limit)
    if not docs:
        raise InputError(f"capeval_caption: {captions} holds no captions" + (f" (with limit {limit})" if limit else ""))
    return {"test": datasets.Dataset.from_list(docs)}


def doc_to_image(doc):
    """The image as every capeval metric decodes it (16-bit and float images scaled by their range)."""
    from PIL import Image

    from capeval_plugins.inputs import to_rgb

    with Image.open(doc["image_path"]) as img:
        return [to_rgb(img)]


def doc_to_target(doc):
    return doc["references"][0] if doc["references"] else ""
