"""Text-to-image generation for cycle metrics: one interface, Stable Diffusion 3 through diffusers (an
optional extra, imported only when used), an on-disk cache, and folders of images generated earlier.

Every image is generated from its own seeded generator (on the CPU, so the initial noise is the same on any
device), so an image depends on its caption and seed only, never on which batch it was generated in. That
is what makes the cache sound: an image is stored under a key of (generator identity: model, steps, size,
guidance; caption; seed) and any later run asking for the same key reads it back instead of generating.
"""
from __future__ import annotations

import abc
import hashlib
import io
import json
import os
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from capeval_plugins.core import jsonio
from capeval_plugins.files import paths
from capeval_plugins.resources import loading, wholeness
from capeval_plugins.core.messages import DataError, MissingExtra, install_extra

SD3_MODEL = "stabilityai/stable-diffusion-3-medium-diffusers"
_PNG_KEY = "capeval-generation"


class MissingImageError(KeyError):
    """A folder of pre-generated images has no image for some captions."""

    def __init__(self, message: str, captions: Sequence[str]):
        super().__init__(message)
        self.captions = list(captions)

    def __str__(self) -> str:
        return str(self.args[0])


class TextToImage(abc.ABC):
    """Generates one image per (caption, seed)."""

    @abc.abstractmethod
    def identity(self) -> dict[str, Any]:
        """Everything besides caption and seed that decides the images (JSON-serialisable)."""

    @abc.abstractmethod
    def generate(self, captions: Sequence[str], seeds: Sequence[int]) -> list:
        """PIL images, one per caption, in order."""


def caption_seed(caption: str, seed: int) -> int:
    """A seed derived from the caption text and a base seed (for a different initial noise per caption)."""
    digest = hashlib.sha256(f"{seed}\x00{caption}".encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _require_diffusers():
    try:
        import diffusers
    except ImportError as err:
        raise MissingExtra(
            f"Stable Diffusion 3 generation needs diffusers, an optional extra: {install_extra('diffusion')} "
            "(or point generated_images at a folder of images made earlier)"
        ) from err
    return diffusers


class StableDiffusion3(TextToImage):
    """A diffusers ``StableDiffusion3Pipeline`` (hub id or local path), loaded once per process and shared."""

    def __init__(
        self,
        model: str = SD3_MODEL,
        *,
        steps: int = 40,
        height: int = 1024,
        width: int = 1024,
        guidance_scale: float = 7.0,
        batch_size: int = 4,
        device: str | None = None,
        dtype: str | None = None,
        revision: str | None = None,
        local_files_only: bool | None = None,
    ):
        if steps < 1 or batch_size < 1:
            raise ValueError(f"steps and batch_size must be at least 1, got {steps} and {batch_size}")
        if height % 16 or width % 16 or height < 16 or width < 16:
            raise ValueError(f"Stable Diffusion 3 needs a height and width divisible by 16, got {height}x{width}")
        self.model, self.steps, self.height, self.width = model, int(steps), int(height), int(width)
        self.guidance_scale, self.batch_size = float(guidance_scale), int(batch_size)
        self.device = loading.resolve_device(device)
        self.dtype = loading.resolve_dtype(dtype, self.device, gpu_default=torch.float16)
        self.revision, self.local_files_only = revision, local_files_only

    def identity(self) -> dict[str, Any]:
        return {"generator": "sd3", "model": self.model, "revision": self.revision, "steps": self.steps,
                "height": self.height, "width": self.width, "guidance_scale": self.guidance_scale}

    @property
    def pipeline(self):
        source = os.path.realpath(self.model) if os.path.isdir(self.model) else self.model
        key = ("StableDiffusion3Pipeline", source, self.revision, str(self.device), str(self.dtype))
        return loading.shared(key, self._load, (self.model,))

    def _load(self):
        diffusers = _require_diffusers()
        folder = loading.check_source(self.model, self.revision)  # FIFOs, devices, crafted safetensors: one line
        # diffusers 0.40 renamed from_pretrained's torch_dtype to dtype (earlier releases ignore dtype, later ones
        # warn on torch_dtype)
        from importlib.metadata import version

        from packaging.version import Version

        dtype_name = "dtype" if Version(version("diffusers")) >= Version("0.40") else "torch_dtype"
        kwargs: dict[str, Any] = {dtype_name: self.dtype, "use_safetensors": True}
        if self.revision is not None:
            kwargs["revision"] = self.revision
        if self.local_files_only is not None:
            kwargs["local_files_only"] = bool(self.local_files_only)
        with loading.loader_boundary("the Stable Diffusion 3 pipeline", self.model):
            parts = wholeness.pipeline_parts(folder) if folder else {}  # sizes against weights, before building
            pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(self.model, **kwargs)
            problem = wholeness.pipeline_problem(pipe, parts, folder)  # every part there, exactly its weights
            if problem is None:
                pipe = pipe.to(self.device)
                problem = wholeness.pipeline_values_problem(pipe, parts)  # finite, no zero matrix, not mapped
            if problem:
                raise loading.ModelLoadError(f"cannot load the Stable Diffusion 3 pipeline {self.model!r}: {problem}")
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @torch.inference_mode()
    def generate(self, captions: Sequence[str], seeds: Sequence[int]) -> list:
        if len(captions) != len(seeds):
            raise ValueError(f"got {len(seeds)} seeds for {len(captions)} captions")
        pipe, images = self.pipeline, []
        for start in range(0, len(captions), self.batch_size):
            chunk = list(captions[start : start + self.batch_size])
            generators = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds[start : start + len(chunk)]]
            out = pipe(prompt=chunk, num_inference_steps=self.steps, height=self.height, width=self.width,
                       guidance_scale=self.guidance_scale, generator=generators, output_type="pil")
            images.extend(out.images)
        return images


def cache_key(identity: Mapping[str, Any], caption: str, seed: int) -> str:
    """Hex digest naming one generated image: generator identity, caption and seed."""
    record = json.dumps({"identity": dict(identity), "caption": caption, "seed": int(seed)}, sort_keys=True)
    return hashlib.sha256(record.encode("utf-8")).hexdigest()


def default_cache_dir() -> Path:
    """``$CAPEVAL_CACHE/generated``, else ``$XDG_CACHE_HOME/capeval_plugins/generated`` (``~/.cache``; see
    :func:`capeval_plugins.files.paths.cache_dir`)."""
    return paths.cache_dir("generated")


class CachedGenerator(TextToImage):
    """Wraps a generator with a cache shared by every run (and every process) that uses the same ``store``:
    where the images are kept, as PNG bytes (``store.read(sub, name) -> bytes | None`` and
    ``store.write(sub, name, data)``, written atomically so concurrent DDP ranks can share it; e.g.
    :class:`capeval_plugins.files.CacheFolder`, for the core reads and writes no file itself). ``generated`` and
    ``reused`` count what happened in this process."""

    def __init__(self, generator: TextToImage, store: Any):
        self.generator = generator
        self.store = store
        self.generated = 0
        self.reused = 0
        self._lock = threading.Lock()

    def identity(self) -> dict[str, Any]:
        return self.generator.identity()

    def entry(self, caption: str, seed: int) -> tuple[str, str]:
        """Where the image of ``(caption, seed)`` is kept in the store: a subfolder and a name."""
        key = cache_key(self.identity(), caption, seed)
        return key[:2], f"{key}.png"

    def path(self, caption: str, seed: int) -> Path:
        """The entry's file, for a store in a folder (``store.root``)."""
        return Path(self.store.root).joinpath(*self.entry(caption, seed))

    def generate(self, captions: Sequence[str], seeds: Sequence[int]) -> list:
        if len(captions) != len(seeds):
            raise ValueError(f"got {len(seeds)} seeds for {len(captions)} captions")
        wanted = list(dict.fromkeys(zip(captions, (int(s) for s in seeds))))
        found = {k: self._read(*self.entry(*k)) for k in wanted}
        missing = [k for k, image in found.items() if image is None]
        if missing:
            fresh = self.generator.generate([c for c, _ in missing], [s for _, s in missing])
            for key, image in zip(missing, fresh):
                self._write(self.entry(*key), image, *key)
                found[key] = image
        with self._lock:
            self.generated += len(missing)
            self.reused += len(wanted) - len(missing)
        return [found[(c, int(s))] for c, s in zip(captions, seeds)]

    def _read(self, sub: str, name: str):
        from PIL import Image

        data = self.store.read(sub, name)  # None: not there, a link, not a regular file
        if data is None:
            return None
        try:
            with Image.open(io.BytesIO(data)) as img:
                return img.convert("RGB")
        except (OSError, TypeError):  # a truncated file from a killed run: generate again
            return None

    def _write(self, entry: tuple[str, str], image, caption: str, seed: int) -> None:
        from PIL.PngImagePlugin import PngInfo

        info = PngInfo()
        info.add_itxt(_PNG_KEY, json.dumps({"identity": self.identity(), "caption": caption, "seed": seed}))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", pnginfo=info)
        self.store.write(*entry, buffer.getvalue())  # a new file renamed over: concurrent ranks are safe


def read_index(path: str | os.PathLike) -> dict[str, str]:
    """Caption -> image path from a JSON Lines (``{"caption": ..., "image": ...}`` per line), JSON (an object
    caption -> image, or a list of such records) or CSV (columns ``caption``, ``image``) file."""
    import csv

    path = Path(path)
    try:
        text = jsonio.decode_text(path.read_bytes(), str(path))
        if path.suffix == ".csv":
            rows = list(csv.DictReader(io.StringIO(text, newline=""), strict=True))
        elif path.suffix == ".json":
            data = jsonio.loads(text)
            rows = [{"caption": c, "image": i} for c, i in data.items()] if isinstance(data, dict) else data
        else:
            rows = [row for _, row in jsonio.json_lines(text, str(path))]
    except (jsonio.JSONLinesError, json.JSONDecodeError, csv.Error) as err:
        raise DataError(f"{path}: cannot read the generated-image index ({err})") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a list of {{caption, image}} records or an object caption -> image")
    index = {}
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not isinstance(row.get("caption"), str) or not row.get("image"):
            raise DataError(f"{path}: entry {n} needs a 'caption' string and an 'image' path")
        index[row["caption"]] = str(row["image"])
    return index


class FolderGenerator(TextToImage):
    """Images generated earlier, by any means: a folder and an index file mapping each caption to its image
    (relative to the folder, or absolute). Seeds are ignored: the folder holds one image per caption."""

    INDEX_NAMES = ("index.jsonl", "index.json", "index.csv")

    def __init__(self, root: str | os.PathLike, index: str | os.PathLike | None = None):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"no folder of generated images at {self.root}")
        if index is None:
            index = next((self.root / n for n in self.INDEX_NAMES if (self.root / n).is_file()), None)
            if index is None:
                raise FileNotFoundError(
                    f"{self.root} has no index mapping captions to images (one of {', '.join(self.INDEX_NAMES)})"
                )
        self.index = read_index(index)

    def identity(self) -> dict[str, Any]:
        return {"generator": "folder", "root": os.path.realpath(self.root)}

    def generate(self, captions: Sequence[str], seeds: Sequence[int] | None = None) -> list:
        from PIL import Image

        missing = [c for c in dict.fromkeys(captions) if c not in self.index]
        if missing:
            shown = "; ".join(repr(c) for c in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise MissingImageError(f"{self.root}: no generated image for {len(missing)} caption(s): {shown}", missing)
        images = {}
        for caption in dict.fromkeys(captions):
            path = self.root / self.index[caption]
            try:
                with Image.open(path) as img:
                    images[caption] = img.convert("RGB")
            except OSError as err:
                raise MissingImageError(f"cannot read the generated image {path} of {caption!r}: {err}", [caption]) from err
        return [images[c] for c in captions]
