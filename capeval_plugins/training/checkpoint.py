"""Pieces every trained checkpoint directory shares (Rigel's, the MSD aligner's): strict JSON, the output folder
(written through :mod:`capeval_plugins.files`), and reading a config whose format and version are checked."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from capeval_plugins import files
from capeval_plugins.core import jsonio


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


def read_checkpoint_config(checkpoint: str | os.PathLike, file: str, format: str, version: int, what: str,
                           how: str) -> dict[str, Any]:
    """The JSON config of a trained checkpoint directory, its format and version checked; ``what`` names the kind
    of checkpoint in errors, ``how`` says how to make one."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise FileNotFoundError(f"{what} directory not found: {path}")
    config = path / file
    if not config.is_file():
        raise FileNotFoundError(f"{path} holds no {file}: it is no {what} ({how})")
    data = jsonio.loads(config.read_text(encoding="utf-8"))
    if data.get("format") != format:
        raise ValueError(f"{config}: format {data.get('format')!r}, expected {format!r} ({what})")
    if int(data.get("version", 0)) > version:
        raise ValueError(f"{config}: format version {data['version']} is newer than this package reads "
                         f"({version}); upgrade capeval-plugins")
    return data
