"""Benchmark data fetched on first use: ``capeval bench NAME`` without ``--data``.

A benchmark with a public home on the Hugging Face Hub (the dataset repositories CaptionEvalKit reads) is
downloaded once, through ``huggingface_hub``, into the user's cache (``$CAPEVAL_CACHE/benchmarks``, else
``$XDG_CACHE_HOME/capeval_plugins/benchmarks``), laid out as a file the benchmark's reader already reads, with
its images as files; later runs read the cache and need no network. :func:`fetch` hands back local paths
(:class:`Fetched`): the readers, the protocols and the runner are the same as with ``--data``.

What was fetched is recorded in ``<benchmark>/manifest.json``: the repository, the commit the revision resolved
to, every downloaded file's size and SHA-256, and a digest of every file written from them. A cached copy is
checked against it on every use, and a copy that changed since it was fetched is refused (``--refresh`` fetches
the benchmark anew, at the revision the Hub now serves). An interrupted download is resumed where it stopped,
at the commit first resolved; a file that the Hub now serves with other content under that commit is refused.

Each file is downloaded by :mod:`capeval_plugins.resources.downloads` (as released weights are: resumed, checked, redirects
guarded). Every file goes through :mod:`capeval_plugins.files`: the cache is a folder of the user's that no one else
can write (refused otherwise), files are listed as the package's before they are written, never through a link.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

import xxhash

from capeval_plugins import files
from capeval_plugins.resources import downloads
from capeval_plugins.bench.benchmarks import LONGCAP_ARENA_ASPECTS, LONGCAP_ARENA_SPLITS
from capeval_plugins.files import paths
from capeval_plugins.core.messages import DataError

KIND = "benchmark data"
FORMAT = 1
PARQUET = "refs/convert/parquet"  # the Hub's Parquet conversion of a dataset: <config>/<split>/NNNN.parquet
MANIFEST = "manifest.json"


class FetchError(DataError):
    """A benchmark that cannot be fetched or whose cached copy is refused: one line (exit code 2) naming the
    repository and what to pass instead."""


@dataclass(frozen=True)
class Source:
    """Where a benchmark lives on the Hub: the Parquet files of one ``folder`` (config/split) of the Parquet
    conversion, or named ``files`` of ``ref``. ``layout``: how its rows are written for the benchmark's reader
    (``"judgements"``: the CLIPScore / PAC-S json; ``"composite"``: FLEUR's ``{subset: rows}``; ``"rated_rows"``:
    EXPERT's ``[{imgid, mt, refs, score}]``; ``"raw"``: the files as they are). ``corrections``: a label set
    applied by default (Nebula: the scores corrected with Spica)."""

    repo: str
    folder: str = ""
    files: tuple[str, ...] = ()
    ref: str = PARQUET
    layout: str = "rated_rows"
    corrections: "Source | None" = None

    def describe(self) -> str:
        where = self.folder or ", ".join(self.files)
        return f"Hugging Face dataset {self.repo} ({self.ref}: {where})"


# Spica (Hirano et al., 2026) holds Nebula's rows with corrected human scores; a Nebula test row's corrected
# score is the mean over the Spica rows with its image and caption (the rule CaptionEvalKit applies).
SPICA = Source("hiranohachiman/Spica", files=("spica_train.csv", "spica_val.csv", "spica_test.csv"), ref="main",
               layout="raw")
SOURCES: dict[str, Source] = {
    "flickr8k-expert": Source("yuwd/Flickr8k-HumanEval", "expert/test", layout="judgements"),
    "flickr8k-cf": Source("yuwd/Flickr8k-HumanEval", "crowdflower/test", layout="judgements"),
    "composite": Source("yuwd/Composite", "default/test", layout="composite"),
    "nebula": Source("Ka2ukiMatsuda/Nebula", "default/test", corrections=SPICA),
    "polaris": Source("yuwd/Polaris", "default/test"),
    "docent": Source("amitha/docent-eval-coarse", "default/test", layout="raw"),
}
# LongCap-Arena: one split of the conversion per (test set, aspect), e.g. default/dci_val.desc
SOURCES.update((f"longcaparena-{test}-{aspect}", Source("Ka2ukiMatsuda/LongCap-Arena", f"default/{split}.{aspect}"))
               for test, split in LONGCAP_ARENA_SPLITS.items() for aspect in LONGCAP_ARENA_ASPECTS)

# column names of the Hub's files, first found wins (as CaptionEvalKit reads them)
IMAGE_COLUMNS = ("img", "image")
NAME_COLUMNS = ("imgid", "file_name", "image_id", "img_id")
CAPTION_COLUMNS = ("cand", "mt", "caption", "candidate")
REFERENCE_COLUMNS = ("refs", "references", "ground_truth")
SCORE_COLUMNS = ("human_score", "score", "rating", "human")
SUBSET_COLUMNS = ("subset", "dataset", "source", "category")
IMAGE_MAGIC = ((b"\xff\xd8\xff", ".jpg"), (b"\x89PNG", ".png"), (b"GIF8", ".gif"), (b"BM", ".bmp"))
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp")


@dataclass
class Fetched:
    """A fetched benchmark: what ``--data``, ``--images`` and ``--labels`` would be, and where it came from
    (``provenance``, named in the result JSON)."""

    benchmark: str
    data: Path
    images: Path | None
    labels: Path | None
    provenance: dict[str, Any]


def cache_root() -> Path:
    """``$CAPEVAL_CACHE/benchmarks``, else ``$XDG_CACHE_HOME/capeval_plugins/benchmarks`` (``~/.cache``; see
    :func:`capeval_plugins.files.paths.cache_dir`)."""
    return paths.cache_dir("benchmarks")


def fetchable(benchmark: str) -> bool:
    return benchmark in SOURCES


def endpoint() -> str:
    """The Hub ``HF_ENDPOINT`` names now (read at each call, not only when ``huggingface_hub`` was imported)."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return flag or bool(constants.HF_HUB_OFFLINE)


def cached(benchmark: str, root: str | os.PathLike | None = None) -> Fetched | None:
    """The cached copy of ``benchmark`` (checked against its manifest), or None when there is none; no network."""
    root = Path(root) if root else cache_root()
    if benchmark not in SOURCES or not (root / benchmark / MANIFEST).is_file():
        return None
    with _locked(root) as claim:
        manifest = _manifest(claim, benchmark)
        if manifest is None or not manifest.get("complete"):
            return None
        _verify(claim, benchmark, manifest)
        return _fetched(root, manifest)


def fetch(benchmark: str, *, refresh: bool = False, progress: bool = True,
          root: str | os.PathLike | None = None) -> Fetched:
    """``benchmark``'s data from the cache, fetched first when it is not there (or with ``refresh``)."""
    if benchmark not in SOURCES:
        raise FetchError(f"{benchmark} has no public home capeval can fetch from; pass its file with --data PATH")
    source = SOURCES[benchmark]
    root = Path(root) if root else cache_root()
    with _locked(root) as claim:
        try:
            manifest = _manifest(claim, benchmark)
        except FetchError:
            if not refresh:
                raise
            manifest = {"damaged": True}  # replaced below
        if manifest is not None and manifest.get("complete") and not refresh:
            _verify(claim, benchmark, manifest)
            return _fetched(root, manifest)
        if offline():
            raise FetchError(f"{benchmark} is not in the cache ({root}) and downloads are off (HF_HUB_OFFLINE=1): "
                             f"unset it to fetch {source.repo} from the Hugging Face Hub, or pass the benchmark's "
                             "file with --data PATH")
        resumed = manifest if manifest is not None and not manifest.get("complete") and not refresh else None
        with _quiet_hub():
            return _fetch(claim, root, benchmark, source, resumed, progress,
                          replace=manifest is not None and not resumed)


@contextlib.contextmanager
def _quiet_hub() -> Iterator[None]:
    """huggingface_hub's own warnings held back: a stalled download logs two lines for each of its retries (12
    before the one error). The retries stay; what failed is said once, in the :class:`FetchError`."""
    import logging

    from huggingface_hub.utils import logging as hub_logging  # sets its level when first imported: import it first

    logger = hub_logging.get_logger()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def cached_names(root: str | os.PathLike | None = None) -> list[str]:
    """The benchmarks with a copy (whole or part-fetched) in the cache, by the folders holding a manifest; no
    network, nothing verified (``capeval cache``)."""
    root = Path(root) if root else cache_root()
    return [name for name in SOURCES if (root / name / MANIFEST).is_file()]


def remove_cached(root: str | os.PathLike | None = None) -> bool:
    """Remove every fetched benchmark from the cache (``capeval cache clear``): under the cache's lock (a fetch
    going on finishes first), the files the cache's signed list names, and nothing else. False when there is no
    cache of the package's there."""
    root = Path(root) if root else cache_root()
    if not (root / ".capeval-owned").is_file():
        return False
    with _locked(root) as claim:
        claim.remove()
    return True


# ---------------------------------------------------------------------------------------------- the cache

def _locked(root: Path) -> contextlib.AbstractContextManager[files.Claim]:
    """The cache folder, claimed and locked (another process fetching meanwhile: wait for it)."""
    return downloads.locked(root, KIND, "fetched benchmarks", FetchError)


def _manifest(claim: files.Claim, benchmark: str) -> dict | None:
    name = f"{benchmark}/{MANIFEST}"
    data = claim.read(name) if claim.owns(name) else None
    if data is None:
        return None
    try:
        manifest = json.loads(data)
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("benchmark") != benchmark:
        raise FetchError(f"{claim.path / name} is damaged or of another version; run again with --refresh to fetch "
                         f"{benchmark} anew")
    return manifest


def _write_manifest(claim: files.Claim, benchmark: str, manifest: dict) -> None:
    claim.write(f"{benchmark}/{MANIFEST}", (json.dumps(manifest, indent=1) + "\n").encode())


def _verify(claim: files.Claim, benchmark: str, manifest: dict) -> None:
    """Every file written from the download is there with the digest recorded when it was written."""
    origin = manifest["source"]
    for name, expected in manifest["contents"].items():
        data = claim.map(name) if claim.owns(name) else None
        found = None if data is None else xxhash.xxh3_128_hexdigest(data)
        if found != expected:
            what = "is missing" if data is None else "changed"
            raise FetchError(f"{claim.path / name} {what} since {benchmark} was fetched from {origin['repository']} "
                             f"at {origin['revision'][:12]}; run again with --refresh to fetch it anew, or pass "
                             "the benchmark's file with --data PATH")


def _fetched(root: Path, manifest: dict) -> Fetched:
    where = {k: (root / manifest[k] if manifest.get(k) else None) for k in ("data", "images", "labels")}
    provenance = {"repository": manifest["source"]["repository"], "revision": manifest["source"]["revision"],
                  "ref": manifest["source"]["ref"], "files": manifest["source"]["files"],
                  "fetched": manifest["fetched"], "cache": str(root / manifest["benchmark"])}
    if manifest.get("corrections"):
        provenance["corrections"] = manifest["corrections"]
    return Fetched(manifest["benchmark"], where["data"], where["images"], where["labels"], provenance)


# ---------------------------------------------------------------------------------------------- fetching

def _fetch(claim: files.Claim, root: Path, benchmark: str, source: Source, resumed: dict | None,
           progress: bool, replace: bool) -> Fetched:
    """Resolve (or, ``resumed``, keep) the commit, download, lay the rows out for the reader, record it all.
    ``replace``: an earlier copy goes once the new commit is resolved (``--refresh``)."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint())
    origin = resumed["source"] if resumed else _resolve(api, benchmark, source)
    fixes = (resumed or {}).get("corrections") or (_resolve(api, benchmark, source.corrections) if source.corrections
                                                    else None)
    if replace:
        claim.remove([n for n in claim.files if n.startswith(f"{benchmark}/")])
    manifest = {"format": FORMAT, "benchmark": benchmark, "complete": False, "source": origin,
                "corrections": fixes, "layout": source.layout, "fetched": None, "contents": {}}
    _write_manifest(claim, benchmark, manifest)  # the commit is pinned: an interrupted fetch resumes at it
    size = sum(f["size"] or 0 for f in origin["files"] + (fixes["files"] if fixes else []))
    if progress:
        print(f"fetching {benchmark} from {source.describe()} at {origin['revision'][:12]} "
              f"({len(origin['files'])} files, {size / 1e6:.1f} MB) into {root / benchmark}", file=sys.stderr)
    raw = [_download(claim, benchmark, "raw", source, origin, entry, progress) for entry in origin["files"]]
    labels = [_download(claim, benchmark, "labels", source.corrections, fixes, entry, progress)
              for entry in (fixes["files"] if fixes else [])]
    if source.layout == "raw":
        contents = {name: _digest(claim, name) for name in raw}
        manifest.update(data=f"{benchmark}/raw", images=None)
    else:
        contents, rows = _materialise(claim, benchmark, source.layout, raw, progress)
        claim.remove([*raw, f"{benchmark}/raw/"])  # rows and images are kept; the manifest names the downloads
        manifest.update(data=f"{benchmark}/data.json", images=f"{benchmark}/images", rows=rows)
    contents.update({name: _digest(claim, name) for name in labels})
    manifest.update(complete=True, contents=contents, labels=f"{benchmark}/labels" if labels else None,
                    fetched=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    _write_manifest(claim, benchmark, manifest)
    return _fetched(root, manifest)


def _failed(benchmark: str, source: Source, err: BaseException) -> str:
    reason = " ".join(str(err).split())[:200] or type(err).__name__
    return (f"cannot fetch {benchmark} from the Hugging Face dataset {source.repo} at {endpoint()} ({reason}); pass "
            "the benchmark's file with --data PATH (and its images with --images DIR)")


def _resolve(api: Any, benchmark: str, source: Source) -> dict:
    """The commit ``source.ref`` points at now and the files to download from it (size, SHA-256 of LFS files,
    git blob id of the others)."""
    try:
        return _listing(api, source)
    except (FetchError, files.FileError, KeyboardInterrupt):
        raise
    except Exception as err:  # noqa: BLE001  (no network, DNS, proxy, a missing repository or revision, ...)
        raise FetchError(_failed(benchmark, source, err)) from None


def _listing(api: Any, source: Source) -> dict:
    from huggingface_hub.hf_api import RepoFile

    revision = api.dataset_info(source.repo, revision=source.ref).sha
    if source.files:
        folders = {str(PurePosixPath(f).parent) for f in source.files}
        found = {e.path: e for folder in folders
                 for e in api.list_repo_tree(source.repo, None if folder == "." else folder, revision=revision,
                                             repo_type="dataset") if isinstance(e, RepoFile)}
        missing = [f for f in source.files if f not in found]
        if missing:
            raise FetchError(f"{source.repo} at {revision[:12]} has no {', '.join(missing)}; pass the benchmark's "
                             "file with --data PATH")
        entries = [found[f] for f in source.files]
    else:
        entries = sorted((e for e in api.list_repo_tree(source.repo, source.folder, recursive=True, revision=revision,
                                                        repo_type="dataset")
                          if isinstance(e, RepoFile) and e.path.endswith(".parquet")), key=lambda e: e.path)
        if not entries:
            raise FetchError(f"{source.repo} at {source.ref} ({revision[:12]}) has no Parquet files under "
                             f"{source.folder}; pass the benchmark's file with --data PATH")
    return {"repository": source.repo, "ref": source.ref, "revision": revision,
            "files": [{"path": e.path, "size": e.size, "sha256": e.lfs.sha256 if e.lfs else None, "blob": e.blob_id}
                      for e in entries]}


def _download(claim: files.Claim, benchmark: str, kind: str, source: Source, origin: dict, entry: dict,
              progress: bool = True) -> str:
    """One file of ``origin`` into ``<benchmark>/<kind>/`` (:func:`capeval_plugins.resources.downloads.download`: resumed where
    an interrupted download stopped, checked against the digest the listing gave, then renamed into place)."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(origin["repository"], entry["path"], repo_type="dataset", revision=origin["revision"],
                     endpoint=endpoint())
    try:
        # no expected size for the transfer: a file of another size is refused below, as changed
        return downloads.download(claim, f"{benchmark}/{kind}", entry["path"].replace("/", "--"), url, _expected(entry),
                                  headers=build_hf_headers(), display=PurePosixPath(entry["path"]).name,
                                  progress=progress)
    except downloads.DownloadError as err:
        if err.kind in ("failed", "short"):  # what was downloaded is kept: the next run resumes it
            raise FetchError(_failed(benchmark, source, err)) from None
        raise FetchError(f"{origin['repository']} served {entry['path']} at {origin['revision'][:12]} with other "
                         "content than its listing gives (the file changed under the same name); run again with "
                         "--refresh to fetch the revision the Hub serves now, or pass the file with --data PATH"
                         ) from None


def _expected(entry: dict) -> downloads.Expected:
    return downloads.Expected(entry["size"], entry.get("sha256"), entry.get("blob"))


def _digest(claim: files.Claim, name: str) -> str:
    return xxhash.xxh3_128_hexdigest(claim.map(name) or b"")


# ---------------------------------------------------------------------------------------------- layouts

def _materialise(claim: files.Claim, benchmark: str, layout: str, raw: list[str],
                 progress: bool) -> tuple[dict[str, str], int]:
    """The Parquet rows written as the file the benchmark's reader reads, and their images as files, into a
    staging folder moved into the cache whole. Returns the digests of what was written and the row count."""
    from tqdm.auto import tqdm

    tables = _tables(claim, benchmark, raw)
    bar = tqdm(total=sum(t.rows for t in tables), desc=f"{benchmark}: rows and images", unit="row",
               disable=not progress, file=sys.stderr)
    contents: dict[str, str] = {}
    rows: list[dict] = []
    with claim.staging() as staged:
        with files.Folder.open(staged)[0] as out, out.sub(benchmark, create=True) as top:
            with top.sub("images", create=True) as folder:
                images = _Images(folder, f"{benchmark}/images", contents)
                for name, table in zip(raw, tables):
                    with _parquet_errors():
                        for batch in table.batches():
                            for row in batch:
                                rows.append(_row(row, images, f"{name} row {len(rows)}"))
                                bar.update()
            data = json.dumps(LAYOUTS[layout](rows), ensure_ascii=False).encode()
            top.write("data.json", data)
            contents[f"{benchmark}/data.json"] = xxhash.xxh3_128_hexdigest(data)
    bar.close()
    stale = [n for n in claim.files if n.startswith(f"{benchmark}/images/") and n not in contents and n[-1] != "/"]
    claim.remove(stale)
    return contents, len(rows)


def _tables(claim: files.Claim, benchmark: str, raw: list[str]) -> list[Any]:
    """The downloaded Parquet files, each footer read and checked (:mod:`capeval_plugins.resources.parquet`): together
    at most the rows the benchmark has by far, each decoding to a bounded size, before any row is decoded."""
    from capeval_plugins.resources import parquet
    from capeval_plugins.bench.benchmarks import get_benchmark

    bench = get_benchmark(benchmark)
    tables = []
    for name in raw:
        where = str(claim.path / name)
        with _parquet_errors():
            tables.append(parquet.ParquetTable(claim.map(name) or b"", where, max_rows=bench.max_rows,
                                               what=bench.title))
    total = sum(t.rows for t in tables)
    if total > bench.max_rows:
        raise FetchError(f"the Parquet files fetched for {benchmark} hold {total:,} rows, more than {bench.title} has "
                         f"by far (at most {bench.max_rows:,}); refused before reading them")
    return tables


@contextlib.contextmanager
def _parquet_errors() -> Iterator[None]:
    """A Parquet file that cannot be read or would decode out of bounds, as a :class:`FetchError` (one line,
    saying what to pass instead)."""
    from capeval_plugins.resources import parquet

    try:
        yield
    except parquet.ParquetError as err:
        if "needs pyarrow" in str(err):
            raise FetchError(str(err)) from None
        raise FetchError(f"{err}; run again with --refresh to fetch it anew, or pass the benchmark's file with "
                         "--data PATH") from None


class _Images:
    """Embedded images written once each into ``folder``, under a plain file name from the row (its id or file
    name), else the image's own name, else its digest; a name two different images claim gets the digest
    appended. ``contents`` gets each file's digest under ``prefix/<name>``."""

    def __init__(self, folder: files.Folder, prefix: str, contents: dict[str, str]) -> None:
        self.folder, self.prefix, self.contents = folder, prefix, contents
        self.by_digest: dict[str, str] = {}

    def add(self, value: Any, hint: Any, where: str) -> str:
        data = value.get("bytes") if isinstance(value, dict) else value if isinstance(value, bytes) else None
        if not data:
            raise FetchError(f"{where}: the image is not embedded in the file")
        digest = hashlib.sha1(data).hexdigest()
        if digest in self.by_digest:
            return self.by_digest[digest]
        path = value.get("path") if isinstance(value, dict) else None
        stem = PurePosixPath(str(hint or path or digest).replace("\\", "/")).name
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem).lstrip(".")[:120] or digest
        if not safe.lower().endswith(IMAGE_SUFFIXES):
            safe += next((suffix for magic, suffix in IMAGE_MAGIC if data.startswith(magic)),
                         ".webp" if data[8:12] == b"WEBP" else ".jpg")
        if f"{self.prefix}/{safe}" in self.contents:
            base, _, suffix = safe.rpartition(".")
            safe = f"{base}-{digest[:10]}.{suffix}"
        self.folder.write(safe, data)
        self.contents[f"{self.prefix}/{safe}"] = xxhash.xxh3_128_hexdigest(data)
        self.by_digest[digest] = safe
        return safe


def _first(row: dict, keys: tuple[str, ...], what: str, where: str, required: bool = True) -> Any:
    for key in keys:
        if row.get(key) is not None:
            return row[key]
    if required:
        raise FetchError(f"{where}: no {what} (looked for {', '.join(keys)}); the repository's layout changed: pass "
                         "the benchmark's file with --data PATH")
    return None


def _row(row: dict, images: _Images, where: str) -> dict:
    """One Hub row: its image file, caption, references, human score and subset (where there is one)."""
    image = _first(row, IMAGE_COLUMNS, "image", where)
    return {"image": images.add(image, _first(row, NAME_COLUMNS, "", where, required=False), where),
            "caption": _first(row, CAPTION_COLUMNS, "caption", where),
            "refs": _first(row, REFERENCE_COLUMNS, "references", where),
            "score": _first(row, SCORE_COLUMNS, "human score", where),
            "subset": _first(row, SUBSET_COLUMNS, "", where, required=False)}


def _judgements(rows: list[dict]) -> dict:
    """The CLIPScore / PAC-S json: per image its references (every row's, in order) and its judgements; the
    reader then applies the benchmark's protocol for candidates among the references."""
    from capeval_plugins.bench.readers import as_list

    out: dict[str, dict] = {}
    for k, row in enumerate(rows):
        entry = out.setdefault(row["image"], {"ground_truth": [], "human_judgement": []})
        refs = as_list(row["refs"], f"row {k}")
        entry["ground_truth"] += [r for r in refs if r not in entry["ground_truth"]]
        entry["human_judgement"].append({"caption": row["caption"], "rating": row["score"], "image_path": row["image"]})
    return out


def _composite(rows: list[dict]) -> dict:
    """FLEUR's / EXPERT's ``{subset: [{image, caption, human, refs}]}`` (one subset when the rows name none)."""
    out: dict[str, list] = {}
    for row in rows:
        out.setdefault(str(row["subset"] or "composite"), []).append(
            {"image": row["image"], "caption": row["caption"], "human": row["score"], "refs": row["refs"]})
    return out


def _rated_rows(rows: list[dict]) -> list:
    """EXPERT's ``[{imgid, mt, refs, score}]`` (Nebula, Polaris)."""
    return [{"imgid": row["image"], "mt": row["caption"], "refs": row["refs"], "score": row["score"]} for row in rows]


LAYOUTS = {"judgements": _judgements, "composite": _composite, "rated_rows": _rated_rows}
