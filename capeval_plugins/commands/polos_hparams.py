"""The hyper-parameters of a released Polos run, read for ``capeval convert polos``: only the ones the conversion
uses, only from the checkpoint itself and the ``hparams.yaml`` of its own folder (as the official
``load_checkpoint`` reads it) or a file the user names, and always said.

``hparams.yaml`` is read as plain YAML: at most :data:`MAX_BYTES`, no aliases (``*name``: a 352-byte "billion
laughs" file would expand to gigabytes), nested at most :data:`MAX_DEPTH` deep, no tags that build objects
(``!!python/...``; ``yaml.SafeLoader`` refuses them), a mapping at the top. A file beside the checkpoint that
another user owns is refused (a file planted in a shared folder would silently change the converted model),
and a value that disagrees with the checkpoint's own hyper-parameters is refused by name.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from capeval_plugins import files
from capeval_plugins.commands.convert import ConversionError

MAX_BYTES = 64 * 1024  # the released hparams.yaml is under 2 KB
MAX_DEPTH = 16
USED = ("pool", "layer", "activations", "final_activation", "hidden_sizes")


def _plain_loader() -> type:
    import yaml

    class PlainLoader(yaml.SafeLoader):
        """``yaml.SafeLoader`` that refuses aliases and nesting deeper than :data:`MAX_DEPTH`."""

        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                raise yaml.YAMLError("it uses an alias (*name), which is not read: write the value out")
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    raise yaml.YAMLError(f"it is nested more than {MAX_DEPTH} levels deep")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return PlainLoader


def read_plain_yaml(path: Path) -> dict:
    """The mapping a small, plain YAML file holds (see the module docstring); ConversionError otherwise."""
    import yaml

    if path.stat().st_size > MAX_BYTES:
        raise ConversionError(f"{path}: {path.stat().st_size} bytes, more than a run's hyper-parameters take "
                              f"({MAX_BYTES} at most)")
    try:
        values = yaml.load(files.read_input(path, "hparams.yaml").decode("utf-8"), Loader=_plain_loader())
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as err:
        first = " ".join(str(err).split())[:200]
        raise ConversionError(f"{path}: not plain YAML hyper-parameters ({first})") from None
    if not isinstance(values, Mapping):
        raise ConversionError(f"{path}: its top level is not a mapping of hyper-parameters")
    return dict(values)


def _embedded(checkpoint: Any) -> dict:
    """The hyper-parameters a Lightning checkpoint saved inside itself (an inert stand-in's state, a dict)."""
    from capeval_plugins.commands.convert_official import _Inert

    saved = checkpoint.get("hyper_parameters") if isinstance(checkpoint, Mapping) else None
    if isinstance(saved, _Inert):
        saved = dict(saved) or saved.__dict__.get("state")
    if not isinstance(saved, Mapping) and hasattr(saved, "__dict__"):
        saved = vars(saved)
    return {k: v for k, v in saved.items() if k in USED} if isinstance(saved, Mapping) else {}


def polos_hyperparameters(checkpoint: Any, source: Path, hparams: str | os.PathLike | None) -> tuple[dict, str]:
    """(the hyper-parameters the conversion uses, where they were read): ``hparams`` when given (the user's
    file), else the ``hparams.yaml`` in the checkpoint's own folder when there is one, owned by the checkpoint's
    owner, else the checkpoint's own; a value of a file that disagrees with the checkpoint's own is refused."""
    own = _embedded(checkpoint)
    if hparams:
        path = Path(hparams)
        if not path.is_file():
            raise ConversionError(f"{hparams}: no such file")
    else:
        path = source.parent / "hparams.yaml"
        if not path.is_file():
            return own, f"the checkpoint's own hyper-parameters ({source.name})" if own else "none (released defaults)"
        if path.stat().st_uid != source.stat().st_uid:
            raise ConversionError(f"{path} belongs to another user (uid {path.stat().st_uid}) than {source} (uid "
                                  f"{source.stat().st_uid}): it is not read; pass --hparams to use it")
    read = {k: v for k, v in read_plain_yaml(path).items() if k in USED}
    differ = sorted(k for k in read if k in own and str(read[k]) != str(own[k]))
    if differ:
        key = differ[0]
        raise ConversionError(f"{path} says {key}={read[key]!r} but {source} itself says {own[key]!r}: refused (a "
                              "file planted beside the checkpoint?); pass --hparams to choose")
    return {**own, **read}, str(path)


def describe(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={values[k]!r}" for k in USED if k in values) or "none"


def add_parser(subparsers) -> None:
    """Nothing at the top level: ``capeval convert polos`` reads hyper-parameters through this module;
    ``commands.add_all`` calls this for every module of the package."""
