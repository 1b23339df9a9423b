"""The official code of Polos (the ``polos`` package, 0.1.3) run side by side with this package's PAC-S and Polos
(tests, benchmarks/pacs_polos_throughput.py), on the installed libraries.

``polos`` ships OpenAI's CLIP (``polos.clip``: model code, ``tokenize`` and ``bpe_simple_vocab_16e6.txt.gz``, the
same files PAC-S's ``models/clip`` vendors) and Polos's estimator. It targets Python <= 3.10 and old libraries,
so it is used from the installed package or from its wheel (``make test`` downloads it into
``.cache/reference-wheels``, never installing it) and three imports it makes but never uses on the scoring path
are supplied for the import only: ``pkg_resources.packaging`` (a version check), ``fairseq`` (the XLM-R encoder
Polos does not use) and ``torchvision.transforms`` (the names ``polos.clip`` imports for its ``_transform``;
the image transform of a side-by-side run is :func:`torchvision_transform`, the same steps on PIL).
"""
from __future__ import annotations

import contextlib
import os
import sys
import types
import zipfile
from argparse import Namespace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

WHEELS = Path(os.environ.get("CAPEVAL_REFERENCE_WHEELS",
                             Path(__file__).resolve().parents[2] / ".cache" / "reference-wheels"))
_extracted: Path | None = None


def _put_wheels_on_path() -> bool:
    global _extracted
    if _extracted is not None:
        return True
    wheels = sorted(WHEELS.glob("polos-*.whl")) + sorted(WHEELS.glob("pytorch_nlp-*.whl"))
    if len(wheels) < 2:
        return False
    from capeval_plugins.testing import scratch_folder

    target = scratch_folder("capeval-reference-code-")
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
    sys.path.append(str(target))
    _extracted = target
    return True


@contextlib.contextmanager
def _import_shims():
    import packaging
    import packaging.version  # noqa: F401

    import pytorch_lightning  # noqa: F401  (imported first: it probes for torchvision itself)
    import transformers  # noqa: F401

    shims: dict[str, types.ModuleType] = {}
    pkg = shims["pkg_resources"] = types.ModuleType("pkg_resources")
    pkg.packaging = packaging  # type: ignore[attr-defined]
    fairseq, models, roberta = (types.ModuleType(n) for n in ("fairseq", "fairseq.models", "fairseq.models.roberta"))
    roberta.XLMRModel = object  # type: ignore[attr-defined]
    fairseq.models, models.roberta = models, roberta  # type: ignore[attr-defined]
    shims.update({"fairseq": fairseq, "fairseq.models": models, "fairseq.models.roberta": roberta})
    vision, transforms = types.ModuleType("torchvision"), types.ModuleType("torchvision.transforms")
    for name in ("Compose", "Resize", "CenterCrop", "ToTensor", "Normalize"):
        setattr(transforms, name, None)
    transforms.InterpolationMode = Namespace(BICUBIC=Image.BICUBIC)  # type: ignore[attr-defined]
    vision.transforms = transforms  # type: ignore[attr-defined]
    shims.update({"torchvision": vision, "torchvision.transforms": transforms})
    added = [name for name in shims if name not in sys.modules]
    sys.modules.update({name: shims[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def polos_modules() -> Namespace | None:
    """The official modules (``clip``, ``model``, ``estimator``, ``scalar_mix``, ``feedforward``, ``bert``), or None
    when neither the package nor its wheel is here."""
    try:
        import ftfy  # noqa: F401  (polos.simple_tokenizer needs it)
    except ImportError:
        return None
    if importlib_find("polos") is None and not _put_wheels_on_path():
        return None
    with _import_shims():
        import polos.clip as clip
        import polos.model as model
        from polos.models.encoders import bert
        from polos.models.estimators import estimator_base, polos_estimator
        from polos.modules import feedforward, scalar_mix
    return Namespace(clip=clip, model=model, estimator=polos_estimator, base=estimator_base, bert=bert,
                     scalar_mix=scalar_mix, feedforward=feedforward)


def importlib_find(name: str):
    import importlib.util

    return importlib.util.find_spec(name)


def bpe_path() -> Path:
    """OpenAI's ``bpe_simple_vocab_16e6.txt.gz`` as the official package ships it."""
    modules = polos_modules()
    assert modules is not None
    return Path(modules.clip.__file__).with_name("bpe_simple_vocab_16e6.txt.gz")


def torchvision_transform(size: int, mean: Sequence[float], std: Sequence[float]):
    """``Compose([Resize(size, BICUBIC), CenterCrop(size), convert('RGB'), ToTensor(), Normalize(mean, std)])`` on a
    PIL image, written out step by step on PIL and numpy (float64 until the end)."""

    def transform(image: Image.Image) -> torch.Tensor:
        width, height = image.size
        new = (size, int(size * height / width)) if width <= height else (int(size * width / height), size)
        if new != (width, height):
            image = image.resize(new, Image.BICUBIC)
        width, height = image.size
        top, left = int(round((height - size) / 2.0)), int(round((width - size) / 2.0))
        image = image.crop((left, top, left + size, top + size)).convert("RGB")
        pixels = np.asarray(image, dtype=np.float64).transpose(2, 0, 1) / 255.0
        pixels = (pixels - np.asarray(mean)[:, None, None]) / np.asarray(std)[:, None, None]
        return torch.from_numpy(pixels.astype(np.float32))

    return transform


def openai_clip(modules: Namespace, state: dict, gelu: bool = False) -> torch.nn.Module:
    """OpenAI's CLIP model built by the official ``build_model`` from a state dict, then ``float()`` and the state
    dict loaded again, as PAC-S's scripts and Polos's checkpoint loading do (``build_model`` alone rounds the
    weights to float16); eval mode. ``gelu`` replaces QuickGELU by exact GELU (open_clip's ViT-L/14, the one
    architectural difference)."""
    model = modules.model.build_model({k: v.clone() for k, v in state.items()}).float()
    model.load_state_dict(state)
    model.eval()
    if gelu:
        for block in model.modules():
            if hasattr(block, "mlp") and hasattr(block.mlp, "gelu"):
                block.mlp.gelu = torch.nn.GELU()
    return model


class PolosReference(torch.nn.Module):
    """The official ``PolosEstimator``'s scoring path (``predict`` -> ``prepare_sample`` -> ``forward`` ->
    ``get_sentence_embedding``, the official functions themselves) on the official submodules, without
    PyTorch Lightning's trainer plumbing, which scoring does not use."""

    def __init__(self, modules: Namespace, state: dict, text_folder: str, hidden_sizes: str, clip_size: int = 224,
                 activations: str = "Tanh"):
        super().__init__()
        self.hparams = Namespace(pretrained_model=str(text_folder), pool="cls", batch_size=1, layer="mix")
        self.trainer = None
        self.layer = "mix"
        self.parallel_feature_extraction = True
        self.encoder = modules.bert.BERTEncoder.from_pretrained(self.hparams)
        layers = self.encoder.num_layers
        self.scalar_mix = modules.scalar_mix.ScalarMixWithDropout(mixture_size=layers, dropout=0.1, do_layer_norm=True)
        width = self.encoder.output_units * 4 + state["clip.text_projection"].shape[1] * 6
        self.ff = torch.nn.Sequential(modules.feedforward.FeedForward(
            in_dim=width, hidden_sizes=hidden_sizes, activations=activations, dropout=0.1, final_activation=False),
            torch.nn.Sigmoid())
        self.clip = openai_clip(modules, {k[5:]: v for k, v in state.items() if k.startswith("clip.")})
        self.clip_preprocess = torchvision_transform(clip_size, (0.48145466, 0.4578275, 0.40821073),
                                                     (0.26862954, 0.26130258, 0.27577711))
        own = {k: v for k, v in state.items() if k.startswith(("scalar_mix.", "ff.", "encoder.model."))}
        missing = self.load_state_dict(own, strict=False)
        assert not missing.unexpected_keys, missing.unexpected_keys
        self.eval()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def predict(self, samples: list[dict[str, Any]], batch_size: int = 1) -> list[float]:
        return self._base.predict(self, samples, batch_size=batch_size, show_progress=False)[1]


def polos_reference(modules: Namespace, state: dict, text_folder: str, hidden_sizes: str) -> PolosReference:
    cls = type("OfficialPolos", (PolosReference,), {
        "_base": modules.base.Estimator,
        "forward": modules.estimator.PolosEstimator.forward,
        "prepare_sample": modules.estimator.PolosEstimator.prepare_sample,
        "get_sentence_embedding": modules.base.Estimator.get_sentence_embedding,
        "masked_global_average_pooling": modules.estimator.PolosEstimator.masked_global_average_pooling,
    })
    return cls(modules, state, text_folder, hidden_sizes)


def expand2square(image: Image.Image, background) -> Image.Image:
    """LLaVA's ``llava/mm_utils.py`` ``expand2square`` (the official FLEUR / EXPERT scripts' padding): the image
    centred on a square of ``background``, for reference computations beside the package's own padding."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    result = Image.new(image.mode, (side, side), background)
    result.paste(image, (0, (side - height) // 2) if width > height else ((side - width) // 2, 0))
    return result
