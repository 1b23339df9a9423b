"""Which image processor backend a checkpoint is run with.

transformers 5 loads the torchvision ("fast") image processor whenever torchvision is installed, and the PIL one
otherwise; the two round differently (a grey level or two on a fraction of a percent of the pixels), so a score
would move with what else is installed. A checkpoint runs with the kind of processor it was saved with, as the
code that saved it did: :func:`capeval_plugins.resources.loading.load_processor` loads the PIL one again
(:func:`pil_backend`) when transformers picked torchvision for a checkpoint saved with a slow processor.
"""
from __future__ import annotations

import json
import os
from typing import Any


def torchvision_backend(processor: Any) -> bool:
    """Whether ``processor`` (or its image processor) is transformers' torchvision ("fast") one."""
    image = getattr(processor, "image_processor", processor)
    return any(c.__name__ in ("TorchvisionBackend", "BaseImageProcessorFast") for c in type(image).__mro__)


def saved_fast(folder: str | None) -> bool:
    """Whether the checkpoint in ``folder`` was saved with a fast (torchvision) image processor: its
    ``image_processor_type`` ends in ``Fast`` (in ``preprocessor_config.json``, or ``processor_config.json``)."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        try:
            with open(os.path.join(folder or "", name), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            continue
        config = config.get("image_processor", config) if isinstance(config, dict) else {}
        kind = config.get("image_processor_type") if isinstance(config, dict) else None
        if isinstance(kind, str):
            return kind.endswith("Fast")
    return False


def pil_backend() -> dict:
    """The keyword that loads the PIL image processor: ``backend="pil"`` where transformers has it,
    ``use_fast=False`` before."""
    import importlib.util

    # the releases that take ``backend`` are those with image processing backends
    has_backends = importlib.util.find_spec("transformers.image_processing_backends") is not None
    return {"backend": "pil"} if has_backends else {"use_fast": False}
