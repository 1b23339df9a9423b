"""Reading a trained checkpoint directory's config (Rigel's, the MSD aligner's), its format and version checked:
the inference models (:mod:`capeval_plugins.models`) load what training (:mod:`capeval_plugins.training`) wrote."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from capeval_plugins.core import jsonio


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
