"""Pieces every trained checkpoint directory's writer shares (Rigel's, the MSD aligner's): strict JSON and the output
folder (written through :mod:`capeval_plugins.files`). Reading a checkpoint's config is the resources floor's
(:func:`capeval_plugins.resources.trained.read_checkpoint_config`): the metrics load what training wrote."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from capeval_plugins import files
from capeval_plugins.core import heads
from capeval_plugins.models.rigel import (ADAPTER_DIR, CONFIG_FILE, FORMAT, FORMAT_VERSION, HEAD_FILE,
                                          RigelSettings)


def json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as None (strict JSON), tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


OUTPUT_KIND = "training"


def output_folder(path: str | os.PathLike) -> files.Claim:
    """A training run's output folder (made if missing), as a :class:`~capeval_plugins.files.Claim`: the
    checkpoint files and the resumable state are written, replaced and removed through it, so a file of the
    user's in the folder is never overwritten or deleted (``--overwrite`` discards only the package's own)."""
    try:
        return files.Claim(path, OUTPUT_KIND).open()
    except files.UnsafePath as err:
        raise FileExistsError(str(err)) from None


def tensor_bytes(tensors: dict) -> bytes:
    """A safetensors file's bytes (written whole through the claim, never by path)."""
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})


def json_bytes(value: Any) -> bytes:
    return (json.dumps(json_safe(value), indent=2) + "\n").encode()


def save_checkpoint(path: str | os.PathLike, settings: RigelSettings, head: heads.ScoringHead | None,
                    peft_model: Any = None, record: dict[str, Any] | None = None) -> Path:
    """Write a Rigel checkpoint directory (see :mod:`capeval_plugins.models.rigel`); files are replaced atomically. No head file
    for a model scored through the LM head (``head`` None)."""
    out = output_folder(path)
    if head is not None:
        state = {k: v.detach().to("cpu", torch.float32) for k, v in head.state_dict().items()}
        out.write(HEAD_FILE, tensor_bytes(state))
    elif out.owns(HEAD_FILE):  # an earlier run's head, which this checkpoint does not use
        out.remove([HEAD_FILE])
    if peft_model is not None:
        with out.staging() as staged:  # peft writes by path: into a private folder, then moved in
            peft_model.save_pretrained(str(staged / ADAPTER_DIR))
    out.write(CONFIG_FILE, json_bytes({"format": FORMAT, "version": FORMAT_VERSION, "settings": settings.to_dict(),
                                       "training": record or {}}))
    return Path(path)
