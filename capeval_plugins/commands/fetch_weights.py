"""``capeval fetch-weights NAME``: a released checkpoint downloaded from its official location, checked and
converted, in one step.

    capeval fetch-weights pacscore --sha256 HEX        # clip_ViT-B-32.pth -> the folder pacscore loads
    capeval fetch-weights polos --sha256 HEX           # reprod.zip -> reprod.ckpt -> the folder polos loads

The download (:mod:`capeval_plugins.resources.downloads`, the benchmark fetch's code) goes into the package's cache
(``$CAPEVAL_CACHE/weights/<name>/``, else ``~/.cache/capeval_plugins/weights/<name>/``) with a progress bar; an
interrupted one resumes where it stopped (an HTTP ``Range`` request) at the next run. The file must have the size
and SHA-256 pinned in :mod:`capeval_plugins.resources.releases`; where none is pinned (this version pins none: see there),
the user's ``--sha256`` is required and checked, and a pinned digest cannot be overridden. A whole file that
differs is deleted and refused; one the server ended early (short of the size it or the release gives, or with
no size said and more on the server) is kept for the next run to resume. Then ``capeval convert`` runs on it (an archive's checkpoint first extracted beside it), into
the folder the metric loads by default (or ``--destination``); a folder already converted from these very bytes
is left as it is. Redirects are followed to other hosts, never from https to http (see the downloads module).
``--url`` fetches the same file from a mirror (the digest is still checked).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from capeval_plugins import files
from capeval_plugins.resources import downloads
from capeval_plugins.files import paths
from capeval_plugins.core.messages import DataError
from capeval_plugins.resources.releases import RELEASES, Release, release

KIND = "released weights"
MANIFEST = "manifest.json"


class WeightsError(DataError):
    """A checkpoint that cannot be fetched, checked or converted: one line (exit code 2) saying what to do."""


@dataclass
class Fetched:
    name: str
    url: str
    file: str
    size: int
    sha256: str
    destination: str
    converted: bool

    def summary(self) -> str:
        done = "converted into" if self.converted else "already converted in"
        return (f"{self.name}: {self.file} ({self.size} bytes, SHA-256 {self.sha256}) from {self.url}\n"
                f"  {done} {self.destination}")


def cache_root() -> Path:
    return paths.cache_dir("weights")


def cached_names(root: str | Path | None = None) -> list[str]:
    """The releases with a download (whole or part-way) in the cache, by their folders; no network, nothing
    verified (``capeval cache``)."""
    root = Path(root) if root else cache_root()
    return [name for name in RELEASES if (root / name).is_dir() and not (root / name).is_symlink()]


def remove_cached(root: str | Path | None = None) -> bool:
    """Remove every downloaded release from the cache (``capeval cache clear``): under the cache's lock (a download
    going on finishes first), the files the cache's signed list names, and nothing else. False when there is no
    cache of the package's there."""
    root = Path(root) if root else cache_root()
    if not (root / ".capeval-owned").is_file():
        return False
    with downloads.locked(root, KIND, "downloaded weights", WeightsError) as claim:
        claim.remove()
    return True


def expected_digest(found: Release, given: str | None) -> str:
    """The SHA-256 the file must have: the pinned one, else the user's (a refusal when neither is known, or when
    the user's contradicts the pinned one)."""
    given = given.strip().lower() if given else None
    if given is not None and (len(given) != 64 or any(c not in "0123456789abcdef" for c in given)):
        raise WeightsError(f"--sha256 {given!r} is not a SHA-256 (64 hexadecimal digits)")
    if found.sha256 and given and given != found.sha256:
        raise WeightsError(f"--sha256 {given} differs from the digest capeval pins for {found.file} ({found.sha256}); "
                           "a pinned digest is not overridden: download and convert the file yourself "
                           f"(`capeval convert {found.converter} FILE`) if you trust another copy")
    digest = found.sha256 or given
    if digest is None:
        raise WeightsError(f"capeval pins no SHA-256 for {found.file} ({found.name}): none could be checked when this "
                           f"version was made. Pass --sha256 HEX, the digest of a copy you trust (from {found.url}), "
                           f"or download it yourself and run `capeval convert {found.converter} FILE`")
    return digest


def fetch_weights(found: Release, *, sha256: str | None = None, url: str | None = None,
                  destination: str | Path | None = None, overwrite: bool = False, progress: bool = True,
                  root: str | Path | None = None, convert_options: dict[str, Any] | None = None) -> Fetched:
    """Download ``found`` (from ``url`` if given), check it, convert it; see the module docstring."""
    digest = expected_digest(found, sha256)
    source = url or found.url
    root = Path(root) if root else cache_root()
    expected = downloads.Expected(found.size, digest)
    with downloads.locked(root, KIND, "downloaded weights", WeightsError) as claim:
        name = f"{found.name}/{found.file}"
        if not (claim.owns(name) and expected.matches(claim.map(name))):
            _check_online(found, root)
            if progress:
                print(f"fetching {found.file} ({found.name}) from {source} into {root / found.name}", file=sys.stderr)
            try:
                downloads.download(claim, found.name, found.file, source, expected, display=found.file,
                                   progress=progress)
            except downloads.DownloadError as err:
                raise WeightsError(_refused(found, source, err)) from None
        size = len(claim.map(name) or b"")
        claim.write(f"{found.name}/{MANIFEST}", (json.dumps({
            "name": found.name, "url": source, "official_url": found.url, "file": found.file, "sha256": digest,
            "size": size, "pinned": bool(found.sha256),
            "checked": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}, indent=1)
            + "\n").encode())
        checkpoint = _unpacked(claim, found) if found.member else root / name
        converted = _convert(found, checkpoint, None if found.member else digest, destination, overwrite,
                             convert_options or {})
    return Fetched(found.name, source, found.file, size, digest, str(converted[0]), converted[1])


def _check_online(found: Release, root: Path) -> None:
    from capeval_plugins.bench.fetch import offline

    if offline():
        raise WeightsError(f"{found.file} is not in {root / found.name} and downloads are off (HF_HUB_OFFLINE=1): "
                           f"unset it to fetch it from {found.url}")


def _refused(found: Release, source: str, err: downloads.DownloadError) -> str:
    if err.kind == "failed":
        return f"cannot fetch {found.file} from {source} ({err.detail}); run again to resume, or pass --url MIRROR"
    if err.kind == "short":
        return f"{source} ended {found.file} early ({err.detail}); the download is kept: run again to resume it"
    if err.kind == "redirect":
        return f"refused to fetch {found.file} from {source}: {err.detail}"
    size = f"{found.size} bytes" if found.size is not None else "any size"
    where = "pinned" if found.sha256 else "given with --sha256"
    return (f"{source} served another file than {found.file} ({err.detail}; expected {size} and the SHA-256 {where}); "
            "the download was deleted: the file changed upstream, or the mirror or the digest is wrong")


def _unpacked(claim: files.Claim, found: Release) -> Path:
    """The archive's checkpoint ``found.member`` and the files beside it in the archive, extracted (again) next to
    the archive, into ``<name>/unpacked/``; returns the checkpoint's path."""
    archive = claim.path / found.name / found.file
    try:
        with zipfile.ZipFile(archive) as zipped:
            members = [m for m in zipped.infolist() if not m.is_dir()]
            hits = [m for m in members if PurePosixPath(m.filename).name == found.member]
            if len(hits) != 1:
                raise WeightsError(f"{archive} holds {len(hits)} files named {found.member}; expected one")
            folder = PurePosixPath(hits[0].filename).parent
            for member in (m for m in members if PurePosixPath(m.filename).parent == folder):
                leaf = files.plain_name(PurePosixPath(member.filename).name)
                claim.write(f"{found.name}/unpacked/{leaf}", lambda handle, m=member: _copy(zipped, m, handle))
    except (zipfile.BadZipFile, OSError) as err:
        if isinstance(err, OSError) and files.is_environment_error(err):
            raise
        raise WeightsError(f"{archive}: not a readable zip archive ({err})") from None
    return claim.path / found.name / "unpacked" / found.member


def _copy(zipped: zipfile.ZipFile, member: zipfile.ZipInfo, handle) -> None:
    """A member streamed out (zipfile checks its CRC and its declared size as it goes)."""
    with zipped.open(member) as source:
        while block := source.read(1 << 20):
            handle.write(block)


def _convert(found: Release, checkpoint: Path, digest: str | None, destination: str | Path | None,
             overwrite: bool, options: dict[str, Any]) -> tuple[Path, bool]:
    """Convert ``checkpoint`` (whose SHA-256 is ``digest``, None: to be computed), unless the folder already holds
    a conversion of these very bytes; returns the folder and whether it was converted now."""
    from capeval_plugins.commands.convert import ConversionError
    from capeval_plugins.commands.convert_official import convert_pacs, convert_polos, sha256
    from capeval_plugins.models.encoders.openai_clip import converted_model_dir

    folder = Path(destination) if destination else converted_model_dir(found.name)
    recorded = None if overwrite else _recorded_source(folder)
    if recorded is not None and recorded == (digest or sha256(checkpoint)):
        return folder, False
    try:
        if found.converter == "pacs":
            convert_pacs(checkpoint, folder, found.backbone, overwrite=overwrite, **options)
        elif found.converter == "polos":
            convert_polos(checkpoint, folder, overwrite=overwrite, **options)
        else:  # pragma: no cover - a release added without its converter
            raise WeightsError(f"no converter {found.converter!r} for {found.name}")
    except ConversionError as err:
        raise WeightsError(f"{found.name}: {err}") from None
    return folder, True


def _recorded_source(folder: Path) -> str | None:
    """The SHA-256 of the checkpoint the conversion in ``folder`` was made from (its report), if any."""
    report = folder / "conversion.json"
    if not report.is_file():
        return None
    try:
        recorded = json.loads(files.read_input(report, "conversion.json")).get("sha256")
    except (OSError, ValueError, AttributeError, files.FileError):
        return None
    return recorded if isinstance(recorded, str) else None


def cmd_fetch_weights(args: argparse.Namespace) -> int:
    try:
        found = release(args.name)
    except ValueError as err:
        raise WeightsError(str(err)) from None
    options: dict[str, Any] = {}
    if found.converter == "pacs" and args.tokenizer:
        options["tokenizer"] = args.tokenizer
    if found.converter == "polos":
        options.update({k: v for k, v in (("text_tokenizer", args.text_tokenizer),
                                          ("clip_tokenizer", args.clip_tokenizer)) if v})
    fetched = fetch_weights(found, sha256=args.sha256, url=args.url, destination=args.destination,
                            overwrite=args.overwrite, progress=not args.quiet, convert_options=options)
    print(json.dumps(asdict(fetched)) if args.json else fetched.summary())
    return 0


def add_parser(subparsers) -> None:
    names = ", ".join(RELEASES)
    p = subparsers.add_parser("fetch-weights", help="download a released checkpoint, check it and convert it",
                              description=__doc__.split("\n\n")[0] + f" Names: {names} (or pacscore, pacscore_pp).",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", help=f"the release: {names}; or a metric name (pacscore, pacscore_pp, polos: the "
                                "release its defaults load)")
    p.add_argument("--sha256", help="the file's SHA-256, from a copy you trust; required where capeval pins none")
    p.add_argument("--url", help="fetch the same file from a mirror (the digest is checked all the same)")
    p.add_argument("--destination", help="the converted folder (default: the one the metric loads by default)")
    p.add_argument("--overwrite", action="store_true", help="convert again over an earlier conversion's files")
    p.add_argument("--tokenizer", help="PAC-S / PAC-S++: CLIP's BPE for the conversion (see capeval convert pacs)")
    p.add_argument("--text-tokenizer", dest="text_tokenizer",
                   help="Polos: the RoBERTa tokenizer (see capeval convert polos)")
    p.add_argument("--clip-tokenizer", dest="clip_tokenizer", help="Polos: CLIP's BPE (capeval convert polos)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_fetch_weights)
