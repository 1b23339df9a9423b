"""``capeval convert vilbert SRC DST``: a released ViLBERT checkpoint as a safetensors folder the metrics load.

    capeval convert vilbert multi_task_model.bin vilbert-12in1 --tokenizer bert-base-uncased-vocab/
    capeval score --metric vilbertscore --model vilbert-12in1 -o features=FEATURES/ --captions captions.jsonl

``SRC`` is ``pretrained_model.bin`` or ``multi_task_model.bin`` of facebookresearch/vilbert-multi-task (PyTorch
pickles of a state dict), or a ``.safetensors`` file of the same names. This is the one place in the package
where a pickle is read, and it is read with ``torch.load(weights_only=True)``: tensors, containers and numbers
only. A checkpoint holding any other object is refused, never unpickled. A zip checkpoint (``torch.save``'s format
since PyTorch 1.6) is checked first, for every kind of ``capeval convert`` (:func:`check_archive`): members stored
as they are, each matching its CRC-32.

Every released parameter is accounted for: kept (renamed), left out on purpose (heads and parts scoring never
uses, listed by reason), unknown (an error unless ``--allow-unknown``) or missing (always an error). ``DST``
gets ``config.json``, ``model.safetensors``, the BERT-base uncased WordPiece tokenizer (from ``--tokenizer``: a
folder, a ``vocab.txt`` or a hub id; a hub id that cannot be fetched now is recorded and loaded at scoring time)
and ``conversion.json``, the report. Every kind writes its folder the same way (:func:`converted_folder`): all its
files, the report included, are staged and moved in only when none would replace a file of the user's.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pickle
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from capeval_plugins import files
from capeval_plugins.core import jsonio

DEFAULT_TOKENIZER = "bert-base-uncased"


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message says which file and why."""


@dataclass
class ConversionReport:
    source: str
    sha256: str
    destination: str
    kept: int
    ignored: dict[str, list[str]] = field(default_factory=dict)
    unknown_dropped: list[str] = field(default_factory=list)
    config_keys_ignored: list[str] = field(default_factory=list)
    task_tokens: int = 0
    tokenizer: str = ""

    def summary(self) -> str:
        lines = [f"converted {self.source} -> {self.destination}",
                 f"  kept {self.kept} tensors; task tokens: {self.task_tokens or 'none'}"]
        for reason, names in self.ignored.items():
            lines.append(f"  left out on purpose, {reason}: {len(names)}")
        if self.unknown_dropped:
            lines.append(f"  unknown, dropped (--allow-unknown): {len(self.unknown_dropped)}: "
                         + ", ".join(self.unknown_dropped))
        if self.config_keys_ignored:
            lines.append("  configuration keys not used for inference: " + ", ".join(self.config_keys_ignored))
        lines.append(f"  tokenizer: {self.tokenizer}")
        return "\n".join(lines)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with files.open_input(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since PyTorch 1.6 is a zip archive; earlier ones are bare pickles
CRC_BLOCK = 1 << 24  # bytes read at a time while the members' CRC-32 are checked


def check_archive(path: Path) -> None:
    """Refuse a zip archive ``torch.save`` could not have written, or one damaged or cut short, before anything
    reads it. From the central directory first (nothing is inflated): a compressed member (``torch.save`` stores
    its members as they are; a 2.9 MB file inflated to 256 MB), a name that is absolute or climbs out (``..``),
    members declaring more bytes than the file holds. Then every member is read once against its CRC-32, which
    ``torch.load`` never checks: a download cut short into a file allocated whole beforehand (aria2) holds zeros
    where the data stopped and converted with exit 0. A file that is not a zip (torch's pre-1.6 format, which
    carries no checksum) is left to ``torch.load``."""
    with files.open_input(path) as f:
        zipped = f.read(len(ZIP_MAGIC)) == ZIP_MAGIC
    if not zipped and not zipfile.is_zipfile(path):
        return
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, ValueError, EOFError) as err:
        raise ConversionError(f"{path}: damaged or cut short: its zip listing cannot be read ({err}); fetch it "
                              "again") from None
    with archive:
        members = archive.infolist()
        _check_listing(path, members)
        _check_crcs(path, archive, members)


def _check_listing(path: Path, members: list[zipfile.ZipInfo]) -> None:
    """What the central directory says, before any member is read."""
    for member in members:
        name = member.filename
        if name.startswith(("/", "\\")) or ".." in name.replace("\\", "/").split("/") or ":" in name.split("/")[0]:
            raise ConversionError(f"{path}: refused: the archive member {name!r} names a path outside the archive")
        if member.compress_type != zipfile.ZIP_STORED:
            raise ConversionError(f"{path}: refused: the archive member {name!r} is compressed (torch.save stores "
                                  f"its members as they are; {member.file_size} bytes would be inflated)")
    declared = sum(m.file_size for m in members)
    if declared > path.stat().st_size:
        raise ConversionError(f"{path}: refused: its members declare {declared} bytes, more than the file's "
                              f"{path.stat().st_size}")
    if all(m.CRC == 0 for m in members) and any(m.file_size for m in members):
        raise ConversionError(f"{path}: refused: its members record no CRC-32 (saved with torch's compute_crc32 "
                              "off), so a damaged copy cannot be told from a whole one; use a copy saved with them")


def _check_crcs(path: Path, archive: zipfile.ZipFile, members: list[zipfile.ZipInfo]) -> None:
    """Every member read to its end (zipfile compares the CRC-32 there, and each local header with the listing)."""
    for member in members:
        try:
            with archive.open(member) as data:
                while data.read(CRC_BLOCK):
                    pass
        except (zipfile.BadZipFile, EOFError, RuntimeError, NotImplementedError) as err:
            raise ConversionError(f"{path}: damaged or cut short: the archive member {member.filename!r} is not "
                                  f"what the archive recorded ({err}); fetch it again") from None


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The state dict in ``path``: safetensors, or a PyTorch pickle loaded with ``weights_only=True`` (anything but
    tensors, containers and numbers is refused) after its archive is checked (:func:`check_archive`). A
    ``{"state_dict": ...}`` or ``{"model": ...}`` wrapper is opened."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path}: no such file")
    if path.suffix == ".safetensors":
        from capeval_plugins.resources.tensorfile import load_file

        return dict(load_file(path))
    check_archive(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConversionError(
            f"{path}: refused: the file holds objects other than tensors, containers and numbers, and is only read "
            f"with torch.load(weights_only=True), never unpickled freely ({first})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise ConversionError(f"{path}: not a PyTorch checkpoint ({err})") from None
    if isinstance(state, Mapping):
        for wrapper in ("state_dict", "model"):
            if isinstance(state.get(wrapper), Mapping) and len(state) == 1:
                state = state[wrapper]
    if not isinstance(state, Mapping) or not state:
        raise ConversionError(f"{path}: expected a state dict (parameter name -> tensor), got {type(state).__name__}")
    bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise ConversionError(f"{path}: {len(bad)} entries are not named tensors, e.g. {bad[:3]}")
    return dict(state)


REPORT_FILE = "conversion.json"


def claim(destination: Path, overwrite: bool) -> files.Claim:
    if destination.is_dir() and any(destination.iterdir()) and not overwrite:
        raise ConversionError(f"{destination} exists and is not empty (use --overwrite)")
    try:
        return files.Claim(destination, "converted-checkpoint").open()
    except files.UnsafePath as err:
        raise ConversionError(str(err)) from None


@contextlib.contextmanager
def converted_folder(destination: Path, overwrite: bool) -> Iterator[Path]:
    """The one way every conversion writes ``destination``: into a private staging folder inside it (transformers
    writes by path), the report too (:func:`write_report`); the staged files are moved in only when none of them
    would replace a file of the user's (all are checked before any moves), so a refusal leaves the folder as it
    was and names the file at fault. With ``overwrite`` only an earlier conversion's files are replaced."""
    out = claim(destination, overwrite)
    try:
        with out.staging() as staged:
            yield staged
    except files.UnsafePath as err:
        raise ConversionError(str(err)) from None


def write_report(staged: Path, report: Mapping[str, Any]) -> None:
    """``conversion.json`` into the staging folder, to be published with the files it describes."""
    with files.Folder.open(staged)[0] as folder:
        folder.write(REPORT_FILE, (json.dumps(report, indent=2) + "\n").encode(), replace=False)


def _has_tokenizer_files(source: str) -> bool:
    """Whether a folder or hub id (from the hub or its cache, as the environment allows) has a tokenizer; loading
    one without files would quietly give an empty vocabulary."""
    from transformers.utils import cached_file

    for name in ("tokenizer.json", "vocab.txt"):
        try:
            if cached_file(source, name):
                return True
        except OSError:
            continue
    return False


def _save_tokenizer(source: str | None, destination: Path, vocab_size: int) -> tuple[str, str | None]:
    """Save the WordPiece tokenizer into ``destination``. Returns (what happened, the source to record in the
    config when nothing could be saved now)."""
    from transformers import BertTokenizerFast

    if source is None:
        return "none saved: put the tokenizer files into the folder, or set tokenizer_source in config.json", None
    path = Path(source)
    local = path.exists() or source.startswith((".", "/", "~"))
    if path.is_file():  # a bare vocab.txt: load it as a folder holding it (the one form every version reads)
        with tempfile.TemporaryDirectory() as folder:
            with files.Folder.open(folder)[0] as private:
                private.write("vocab.txt", files.read_input(path, "--tokenizer"), replace=False)
            tokenizer = BertTokenizerFast.from_pretrained(folder, do_lower_case=True)
    elif _has_tokenizer_files(source):
        from capeval_plugins.resources import loading

        try:  # checked whole, as every tokenizer the package loads
            tokenizer = loading.load_processor(BertTokenizerFast, source)
        except (OSError, ValueError) as err:
            raise ConversionError(f"--tokenizer {source}: {str(err).splitlines()[0][:400]}") from None
    elif local:
        raise ConversionError(f"--tokenizer {source}: no tokenizer.json or vocab.txt there")
    else:
        return f"{source} (not available now; loaded from the hub or its cache at scoring time)", source
    if len(tokenizer) != vocab_size:
        raise ConversionError(f"--tokenizer {source}: {len(tokenizer)} word pieces, but the model has {vocab_size} "
                              "(ViLBERT uses bert-base-uncased's 30522)")
    tokenizer.save_pretrained(destination)
    return f"{source} (saved into the folder)", None


def convert_vilbert(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    config: str | os.PathLike | Mapping[str, Any] | None = None,
    tokenizer: str | None = DEFAULT_TOKENIZER,
    allow_unknown: bool = False,
    overwrite: bool = False,
) -> ConversionReport:
    """Convert a released ViLBERT checkpoint into a folder ``ViLBertModel.from_pretrained`` (and so
    ``vilbertscore`` with ``model=destination``) loads. ``config``: the released configuration JSON (a path or
    its dict; None: ``bert_base_6layer_6conect``, checked against the weights)."""
    import torch

    from capeval_plugins.models.encoders.vilbert import (ViLBertModel, map_released_state_dict, released_backbone,
                                                         released_config)

    source, destination = Path(source), Path(destination)
    if destination.is_dir() and any(destination.iterdir()) and not overwrite:
        raise ConversionError(f"{destination} exists and is not empty (use --overwrite)")
    released = read_checkpoint(source)
    values = jsonio.loads(Path(config).read_text()) if isinstance(config, (str, os.PathLike)) else config
    try:
        model_config, config_ignored = released_config(values, released_backbone(released))
    except ValueError as err:
        raise ConversionError(f"{source}: {err}") from None
    with torch.device("meta"):
        model = ViLBertModel(model_config)
    mapping = map_released_state_dict(released, {k: v.shape for k, v in model.state_dict().items()})
    problems = []
    if mapping.missing:
        problems.append(f"{len(mapping.missing)} parameter(s) missing: {', '.join(mapping.missing)}")
    if mapping.mismatched:
        problems.append(f"{len(mapping.mismatched)} with the wrong shape: {'; '.join(mapping.mismatched)}")
    if mapping.unknown and not allow_unknown:
        problems.append(f"{len(mapping.unknown)} unknown parameter(s) (not ViLBERT's, not a known head; "
                        f"--allow-unknown drops them): {', '.join(mapping.unknown)}")
    if problems:
        raise ConversionError(f"{source}: " + "; ".join(problems))

    model.load_state_dict({k: v.detach().clone().contiguous() for k, v in mapping.state.items()}, strict=True,
                          assign=True)
    with converted_folder(destination, overwrite) as staged:
        saved, recorded = _save_tokenizer(tokenizer, staged, model_config.vocab_size)
        model_config.tokenizer_source = recorded
        model.save_pretrained(staged)
        report = ConversionReport(
            source=str(source), sha256=_sha256(source), destination=str(destination), kept=len(mapping.state),
            ignored=mapping.ignored, unknown_dropped=mapping.unknown, config_keys_ignored=config_ignored,
            task_tokens=model_config.num_task_tokens, tokenizer=saved,
        )
        write_report(staged, asdict(report))
    return report


def run_conversion(convert: Any, source: Any, as_json: bool) -> int:
    """The one boundary of every ``capeval convert`` kind: a :class:`ConversionError` is the converter's own
    line; anything else a hostile or damaged checkpoint makes a reader or a converter raise (a KeyError, a
    ZeroDivisionError, a torch error) becomes one line naming the file too (:func:`loader_boundary`)."""
    from capeval_plugins.resources.wholeness import loader_boundary
    from capeval_plugins.inputs import InputError

    try:
        with loader_boundary("checkpoint", source, passing=(ConversionError,)):
            report = convert()
    except ConversionError as err:
        raise InputError(str(err)) from None
    print(json.dumps(asdict(report)) if as_json else report.summary())
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    return run_conversion(lambda: convert_vilbert(args.source, args.destination, args.config,
                                                  None if args.no_tokenizer else args.tokenizer, args.allow_unknown,
                                                  args.overwrite), args.source, args.json)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("convert", help="convert a released checkpoint into a safetensors model folder",
                              description="Convert a released checkpoint (read safely: tensors only) into a "
                                          "safetensors model folder that the metrics load with model=FOLDER.")
    kinds = p.add_subparsers(dest="kind", required=True)
    v = kinds.add_parser("vilbert", help="ViLBERT / 12-in-1 (pretrained_model.bin, multi_task_model.bin)",
                         description=__doc__.split("\n\n")[0])
    v.add_argument("source", help="released checkpoint (.bin PyTorch state dict, or .safetensors)")
    v.add_argument("destination", help="output folder")
    v.add_argument("--config", help="the released configuration JSON (default: bert_base_6layer_6conect)")
    v.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                   help="bert-base-uncased WordPiece: a tokenizer folder, a vocab.txt, or a hub id (default "
                        f"{DEFAULT_TOKENIZER}; saved into the folder when it can be loaded now)")
    v.add_argument("--no-tokenizer", dest="no_tokenizer", action="store_true", help="save no tokenizer")
    v.add_argument("--allow-unknown", dest="allow_unknown", action="store_true",
                   help="drop (and list) parameters that are neither ViLBERT's nor a known head, instead of failing")
    v.add_argument("--overwrite", action="store_true", help="write into a non-empty destination")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.set_defaults(func=cmd_convert)
    from capeval_plugins.commands import convert_expert, convert_official  # PAC-S / PAC-S++, Polos; EXPERT

    convert_official.add_parsers(kinds)
    from capeval_plugins.commands import convert_vela  # VELA

    convert_vela.add_parsers(kinds)
    convert_expert.add_parsers(kinds)
