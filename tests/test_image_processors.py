"""The image processor a checkpoint is run with is the one it was saved with, whatever else is installed
(capeval_plugins.resources.image_processors): transformers 5 takes the torchvision one whenever torchvision is
installed, and its pixels differ from the PIL one's."""
from __future__ import annotations

import json

import pytest

from capeval_plugins.resources import image_processors, loading
from capeval_plugins.testing import tiny_checkpoint

IMAGE_KINDS = ["clip", "dino", "vilt", "blip_itm", "llava", "llava_next"]  # (Qwen's needs torchvision)


@pytest.mark.parametrize("kind", IMAGE_KINDS)
def test_the_pil_keyword_loads_the_pil_processor_on_this_transformers(kind, tiny_root):
    from transformers import AutoImageProcessor, AutoProcessor

    path = str(tiny_checkpoint(kind, root=tiny_root))
    for loader in (AutoProcessor, AutoImageProcessor):
        processor = loader.from_pretrained(path, **image_processors.pil_backend())
        assert not image_processors.torchvision_backend(processor), (loader.__name__, type(processor))
        assert image_processors.saved_fast(path) is False  # every tiny checkpoint is saved slow, as the real ones


class TorchvisionBackend:  # what transformers' torchvision image processors derive from, by name
    pass


def _as_torchvision(processor):
    image = getattr(processor, "image_processor", processor)
    image.__class__ = type(type(image).__name__ + "Fast", (type(image), TorchvisionBackend), {})
    return processor


def test_a_processor_loaded_with_torchvision_is_loaded_again_with_pil_unless_saved_fast(clip_copy):
    """As where torchvision is installed: the loader returns the torchvision processor unless told the PIL
    keyword; load_processor loads the PIL one for a checkpoint saved slow, and keeps a checkpoint saved fast."""
    from transformers import AutoProcessor

    calls = []

    class Loader:
        __name__ = "AutoProcessor"

        @staticmethod
        def from_pretrained(path, **kwargs):
            calls.append(kwargs)
            processor = AutoProcessor.from_pretrained(path, **kwargs)
            return processor if set(image_processors.pil_backend()) <= set(kwargs) else _as_torchvision(processor)

    processor = loading.load_processor(Loader, str(clip_copy))
    assert not image_processors.torchvision_backend(processor) and len(calls) == 2
    assert calls[1] == {**calls[0], **image_processors.pil_backend()}

    config_file = clip_copy / "processor_config.json"
    config = json.loads(config_file.read_text())
    config["image_processor"]["image_processor_type"] += "Fast"
    config_file.write_text(json.dumps(config))
    loading.clear_cache()
    calls.clear()
    assert image_processors.saved_fast(str(clip_copy))
    assert image_processors.torchvision_backend(loading.load_processor(Loader, str(clip_copy))) and len(calls) == 1
