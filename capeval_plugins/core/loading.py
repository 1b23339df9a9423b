"""Model loading in one place.

Hub id or local path through ``from_pretrained``; ``local_files_only`` honoured; safetensors only;
``trust_remote_code`` off unless asked; device and dtype chosen once (overridable); and one loaded model
shared by every metric instance that asks for the same thing.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

_cache: dict[Hashable, Any] = {}
_lock = threading.RLock()

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class ModelSpec:
    """Which checkpoint to load and how: one spec, one shared model (encoders, LVLM judges)."""

    model: str
    device: str | None = None
    dtype: str | None = None
    revision: str | None = None
    local_files_only: bool | None = None
    trust_remote_code: bool = False

    @classmethod
    def from_config(cls, config: Any, model: str | None = None) -> "ModelSpec":
        """From a metric's ``ModelConfig`` (``model`` overrides ``config.model``)."""
        return cls(model or config.model, config.device, config.dtype, config.revision, config.local_files_only,
                   config.trust_remote_code)

    def hub(self) -> dict[str, Any]:
        return {"revision": self.revision, "local_files_only": self.local_files_only,
                "trust_remote_code": self.trust_remote_code}


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The explicit device, else CUDA when available, else CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(
    dtype: str | torch.dtype | None, device: torch.device, gpu_default: torch.dtype = torch.float32
) -> torch.dtype:
    """The explicit dtype, else ``gpu_default`` on accelerators and float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None:
        try:
            return _DTYPES[str(dtype).lower()]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None
    return gpu_default if device.type != "cpu" else torch.float32


def _source_key(name_or_path: str) -> str:
    return os.path.realpath(name_or_path) if os.path.isdir(name_or_path) else name_or_path


def hub_kwargs(revision: str | None, local_files_only: bool | None, trust_remote_code: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"trust_remote_code": bool(trust_remote_code)}
    if revision is not None:
        kwargs["revision"] = revision
    if local_files_only is not None:
        kwargs["local_files_only"] = bool(local_files_only)
    return kwargs


def shared(key: Hashable, factory: Callable[[], Any]) -> Any:
    """Build once per process per key; later callers get the same object."""
    with _lock:
        if key not in _cache:
            _cache[key] = factory()
        return _cache[key]


def load_model(
    loader: Any,
    name_or_path: str,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    gpu_dtype: torch.dtype = torch.float32,
    revision: str | None = None,
    local_files_only: bool | None = None,
    trust_remote_code: bool = False,
    share: bool = True,
    **kwargs: Any,
) -> Any:
    """``loader.from_pretrained(name_or_path)`` in eval mode on the resolved device and dtype, without
    gradients; shared with every caller that asks for the same thing, unless ``share=False`` (a model that
    will be changed in place, e.g. by injecting LoRA layers, must be a copy of its own)."""
    if not name_or_path:
        raise ValueError("no model given (a hub id or a local path)")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev, gpu_dtype)
    key = ("model", loader.__name__, _source_key(name_or_path), revision, str(dev), str(dt),
           bool(trust_remote_code), tuple(sorted(kwargs.items())))

    def build() -> Any:
        try:
            model = loader.from_pretrained(
                name_or_path,
                dtype=dt,
                use_safetensors=True,
                **hub_kwargs(revision, local_files_only, trust_remote_code),
                **kwargs,
            )
        except OSError as err:  # no such folder, not cached offline, no safetensors weights
            raise _load_error("model", name_or_path, err) from err
        return model.to(dev).eval().requires_grad_(False)

    return shared(key, build) if share else build()


def load_processor(
    loader: Any,
    name_or_path: str,
    *,
    revision: str | None = None,
    local_files_only: bool | None = None,
    trust_remote_code: bool = False,
    **kwargs: Any,
) -> Any:
    key = ("processor", loader.__name__, _source_key(name_or_path), revision, bool(trust_remote_code),
           tuple(sorted(kwargs.items())))
    def build() -> Any:
        try:
            return loader.from_pretrained(name_or_path, **hub_kwargs(revision, local_files_only, trust_remote_code),
                                          **kwargs)
        except OSError as err:
            raise _load_error("processor", name_or_path, err) from err

    return shared(key, build)


def clear_cache() -> None:
    """Drop every shared model (frees memory once no metric holds them)."""
    with _lock:
        _cache.clear()


class ModelLoadError(OSError):
    """A model or processor that cannot be loaded (no such local folder, not in the cache offline, ...)."""


def source_key(name_or_path: str) -> str:
    """A hub id as it is; a local folder by its real path."""
    return _source_key(name_or_path)


def local_path_problem(value: str) -> str | None:
    """Why ``value``, written as a local path, does not exist; None when it exists or reads as a hub id
    (``org/name``, ``name``), which only the loader can check."""
    if os.path.exists(os.path.expanduser(value)):
        return None
    local = os.path.isabs(value) or value.startswith(("./", "../", "~", ".\\")) or value.count("/") > 1 or "\\" in value
    return f"no such file or folder: {value}" if local else None


def _load_error(kind: str, name_or_path: str, err: Exception) -> ModelLoadError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return ModelLoadError(f"cannot load {kind} {name_or_path!r}: {first}")
