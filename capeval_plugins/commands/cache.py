"""``capeval cache``: every cache capeval keeps on disk between runs, how large, and (``clear``) remove them.

    capeval cache                      # every cache, its size and what each entry is
    capeval cache clear                # remove what the package wrote in them
    capeval cache clear --only models  # one kind: meteor, benchmarks, weights, models, scores

The caches: METEOR's paraphrase index (and the tables of killed METEOR runs in TMPDIR), the benchmarks fetched
on first use, the released files ``capeval fetch-weights`` downloaded, the checkpoints ``capeval convert`` (and
``fetch-weights``) converted into the folder the metrics load by default, the score cache of ``capeval bench`` / ``reproduce``, the images Redemption Score generates, the
evaluate modules ``capeval evaluate-module`` wrote. All live under ``$CAPEVAL_CACHE`` (else
``$XDG_CACHE_HOME/capeval_plugins``, else ``~/.cache/capeval_plugins``).

Only what the package provably wrote is removed, through :mod:`capeval_plugins.files`: the files listed in a
folder's signed marker (``.capeval-owned``: METEOR's index, the fetched benchmarks, the downloaded weights, each
converted model), the
``capeval-meteor-*`` folders of TMPDIR whose marker verifies and whose run is over, and the score cache when it
is an SQLite database of capeval's. The generated images and evaluate modules keep no such list: they are
shown, with where they are, and left to remove by hand.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

# What each file of METEOR's paraphrase index holds (capeval_plugins/resources/meteor_table.py).
METEOR_FILES = {
    "meta.json": "the index's metadata: format, sizes, each file's digest (signed with your key)",
    "group_start": "where each run of entries with the same phrase A starts",
    "a_hash": "hashes of the phrases A (sorted), to find a corpus's runs",
    "a_group": "the run of each hash in a_hash",
    "a_offsets": "where each run's phrase A starts in a_text",
    "a_text": "the phrases A, one per run",
    "b_offsets": "where each block starts in b_blocks",
    "b_blocks": "the paraphrases B, zlib blocks of 1,024 entries",
    "b_hash": "hashes of the paraphrases B (made for validation loops)",
}


def _size(path: Path) -> int:
    """Bytes of the regular files under ``path`` (links not followed)."""
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if not os.path.islink(os.path.join(root, name)):
                total += st.st_size
    return total


def meteor_entries() -> list[dict[str, Any]]:
    """The METEOR index's files as the marker lists them, with sizes and descriptions."""
    from capeval_plugins import files
    from capeval_plugins.resources import meteor_table as mt

    root = mt.cache_dir()
    if not (root / ".capeval-owned").is_file():
        return []
    try:
        claim = files.Claim(root, mt.INDEX_KIND).open(create=False)
    except (OSError, files.FileError) as err:
        return [{"name": str(root), "bytes": _size(root), "what": f"not usable: {err}"}]
    try:
        out = []
        for name in claim.files:
            if name.endswith("/"):
                continue
            path = root / name
            leaf = name.rsplit("/", 1)[-1]
            what = METEOR_FILES.get(leaf, "a partial file of a killed build" if leaf.endswith(mt.SCRATCH) else "")
            source = name.split("/", 1)[0]
            if not source.endswith(f"-v{mt.FORMAT}"):
                what = f"{what} (an older format: replaced at the next METEOR run)"
            try:
                size = os.lstat(path).st_size
            except OSError:
                continue
            out.append({"name": name, "bytes": size, "what": what})
        return out
    finally:
        claim.folder.close()


def stale_tables() -> list[Path]:
    """``capeval-meteor-*`` folders of TMPDIR (some may belong to runs still going)."""
    from capeval_plugins.resources import meteor_table as mt

    root = Path(tempfile.gettempdir())
    try:
        return sorted(root / n for n in os.listdir(root) if n.startswith(mt.TEMP_PREFIX))
    except OSError:
        return []


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size if path.is_file() and not path.is_symlink() else 0
    except OSError:
        return 0


def benchmark_entries() -> list[dict[str, Any]]:
    """The fetched benchmarks, each folder with its size."""
    from capeval_plugins.bench import fetch

    root = fetch.cache_root()
    return [{"name": name, "bytes": _size(root / name), "what": f"fetched from {fetch.SOURCES[name].repo}"}
            for name in fetch.cached_names(root)]


def weight_entries() -> list[dict[str, Any]]:
    """The released files ``capeval fetch-weights`` downloaded, each release's folder with its size."""
    from capeval_plugins.commands import fetch_weights
    from capeval_plugins.resources.releases import RELEASES

    root = fetch_weights.cache_root()
    return [{"name": name, "bytes": _size(root / name), "what": f"{RELEASES[name].file} from {RELEASES[name].url}"}
            for name in fetch_weights.cached_names(root)]


def model_entries() -> list[dict[str, Any]]:
    """The converted checkpoints in the folder the metrics load by default, each with its size and source."""
    root = _models_root()
    out = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()) if root.is_dir() else []:
        ours = _converted(folder)
        what = "not capeval's: no .capeval-owned marker of yours (left as it is)"
        if ours:
            what = "converted by capeval convert"
            report = folder / "conversion.json"
            if report.is_file():
                try:
                    what += f" from {json.loads(report.read_text(encoding='utf-8')).get('source')}"
                except (OSError, ValueError, AttributeError):
                    pass
        out.append({"name": folder.name, "bytes": _size(folder), "what": what, "ours": ours})
    return out


def _converted(folder: Path) -> bool:
    """Whether ``folder`` holds a marker this user's capeval signed, as ``clear`` checks it before removing."""
    from capeval_plugins import files

    try:
        claim = files.Claim(folder, "converted-checkpoint").open(create=False)
    except (OSError, files.FileError):
        return False
    try:
        return bool(claim.found)
    finally:
        if claim.folder is not None:
            claim.folder.close()


def _models_root() -> Path:
    from capeval_plugins.files import paths

    return paths.cache_dir("models")  # where capeval convert pacs|polos writes by default


def other_caches() -> list[dict[str, Any]]:
    """Caches that keep no list of what the package wrote: shown, never removed."""
    from capeval_plugins.files import paths
    from capeval_plugins.models.generation import default_cache_dir

    found = []
    for what, path in (("images generated by Redemption Score / DINO-cycle (cache_dir)", default_cache_dir()),
                       ("evaluate modules written by capeval evaluate-module", paths.cache_dir("evaluate_modules"))):
        if path.exists():
            found.append({"path": str(path), "bytes": _size(path) if path.is_dir() else path.stat().st_size,
                          "what": what})
    return found


def report() -> dict[str, Any]:
    from capeval_plugins.bench import fetch
    from capeval_plugins.bench.cache import default_cache_path
    from capeval_plugins.commands import fetch_weights
    from capeval_plugins.resources import meteor_table as mt

    entries = meteor_entries()
    tables = stale_tables()
    benchmarks, weights, models = benchmark_entries(), weight_entries(), model_entries()
    scores = default_cache_path()
    return {
        "meteor": {"path": str(mt.cache_dir()), "bytes": sum(e["bytes"] for e in entries), "files": entries},
        "meteor_tables": {"path": tempfile.gettempdir(), "folders": [str(p) for p in tables],
                          "bytes": sum(_size(p) for p in tables)},
        "benchmarks": {"path": str(fetch.cache_root()), "bytes": sum(e["bytes"] for e in benchmarks),
                       "entries": benchmarks},
        "weights": {"path": str(fetch_weights.cache_root()), "bytes": sum(e["bytes"] for e in weights),
                    "entries": weights},
        "models": {"path": str(_models_root()), "bytes": sum(e["bytes"] for e in models if e["ours"]), "entries": models},
        "scores": {"path": str(scores), "bytes": sum(_file_size(Path(f"{scores}{end}"))
                                                     for end in ("", "-journal", "-wal", "-shm"))},
        "other": other_caches(),
    }


def _mb(n: int) -> str:
    return f"{n / 1e6:8.1f} MB"


def cmd_cache(args: argparse.Namespace) -> int:
    if args.action == "clear":
        return clear(args)
    if args.only:
        print("capeval: error: --only goes with `capeval cache clear`", file=sys.stderr)
        return 2
    info = report()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    meteor = info["meteor"]
    print(f"{_mb(meteor['bytes'])}  METEOR's paraphrase index (built once, used by every METEOR run): {meteor['path']}")
    for entry in meteor["files"]:
        print(f"  {_mb(entry['bytes'])}  {entry['name']}: {entry['what']}")
    tables = info["meteor_tables"]
    if tables["folders"]:
        print(f"{_mb(tables['bytes'])}  METEOR tables in {tables['path']} ({len(tables['folders'])} capeval-meteor-* "
              "folders: runs going on, or killed runs' left for the next run to remove)")
    for key, title in (("benchmarks", "benchmarks fetched on first use (capeval bench / reproduce without --data)"),
                       ("weights", "released files downloaded by capeval fetch-weights"),
                       ("models", "released checkpoints converted by capeval convert (and fetch-weights)")):
        print(f"{_mb(info[key]['bytes'])}  {title}: {info[key]['path']}")
        for entry in info[key]["entries"]:
            print(f"  {_mb(entry['bytes'])}  {entry['name']}: {entry['what']}")
    scores = info["scores"]
    print(f"{_mb(scores['bytes'])}  score cache of capeval bench / reproduce (--cache, --no-cache): {scores['path']}")
    for other in info["other"]:
        print(f"{_mb(other['bytes'])}  {other['what']}: {other['path']} (not removed by `capeval cache clear`: "
              "it keeps no list of what capeval wrote; remove it yourself when no run uses it)")
    total = sum(info[k]["bytes"] for k in ("meteor", "meteor_tables", "benchmarks", "weights", "models", "scores"))
    print(f"{_mb(total)}  in all that `capeval cache clear` removes (what capeval wrote; --only KIND for one kind)")
    return 0


KINDS = ("meteor", "benchmarks", "weights", "models", "scores")


def clear(args: argparse.Namespace) -> int:
    from capeval_plugins import files
    from capeval_plugins.bench import fetch
    from capeval_plugins.bench.cache import default_cache_path, remove_cache
    from capeval_plugins.commands import fetch_weights
    from capeval_plugins.resources import meteor_table as mt

    kinds = args.only or list(KINDS)
    before = report()
    kept, problems, swept = [], [], []
    if "meteor" in kinds:
        swept = mt.sweep_temp_tables()
        root = mt.cache_dir()
        if (root / ".capeval-owned").is_file():
            try:
                mt.clear_cache()
            except (OSError, files.FileError) as err:
                problems.append(("meteor", f"cannot clear {root}: {err}"))
    if "benchmarks" in kinds:
        try:
            fetch.remove_cached()
        except (OSError, files.FileError, fetch.FetchError) as err:
            problems.append(("benchmarks", f"cannot clear {fetch.cache_root()}: {err}"))
    if "weights" in kinds:
        try:
            fetch_weights.remove_cached()
        except (OSError, files.FileError, fetch_weights.WeightsError) as err:
            problems.append(("weights", f"cannot clear {fetch_weights.cache_root()}: {err}"))
    if "models" in kinds:
        for entry in before["models"]["entries"]:
            folder = _models_root() / entry["name"]
            try:
                claim = files.Claim(folder, "converted-checkpoint").open(create=False)
            except (OSError, files.FileError) as err:
                kept.append(f"{folder} ({err})")
                continue
            try:
                if claim.found:
                    claim.remove()
                else:
                    kept.append(f"{folder} (no .capeval-owned marker: not capeval's)")
            finally:
                if claim.folder is not None:
                    claim.folder.close()
    if "scores" in kinds:
        try:
            if not remove_cache(default_cache_path()) and default_cache_path().exists():
                kept.append(f"{default_cache_path()} (not a capeval score cache of yours)")
        except (OSError, files.FileError) as err:
            problems.append(("scores", f"cannot remove {default_cache_path()}: {err}"))
    after = report()
    refused = {kind for kind, _ in problems}
    for kind, label in zip(KINDS, LABELS):
        if kind in kinds and kind not in refused:  # a refused kind was left as it was: its error says so
            freed = before[kind]["bytes"] - after[kind]["bytes"]
            if kind == "meteor":
                freed += before["meteor_tables"]["bytes"] - after["meteor_tables"]["bytes"]
                label = label.format(tables=len(swept))
            print(f"removed {_mb(max(freed, 0)).strip()}: {label}")
    if after["meteor_tables"]["folders"] and "meteor" in kinds:
        kept.append(f"{len(after['meteor_tables']['folders'])} capeval-meteor-* folder(s) in TMPDIR (in use by a "
                    "running capeval, or not provably capeval's)")
    for line in kept:
        print(f"kept {line}")
    for _, line in problems:
        print(f"capeval: error: {line}", file=sys.stderr)
    return 2 if problems else 0


LABELS = ("METEOR's paraphrase index and {tables} table folder(s) of killed runs", "fetched benchmarks",
          "downloaded weights", "converted models", "the bench score cache")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("cache", help="show capeval's caches (sizes, what each entry is) or clear them",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("action", nargs="?", choices=("show", "clear"), default="show",
                   help="show (default) or clear: remove what the package wrote in its caches")
    p.add_argument("--only", action="append", choices=KINDS, metavar="KIND",
                   help=f"clear only this kind of cache (repeatable): {', '.join(KINDS)}")
    p.add_argument("--json", action="store_true", help="show as JSON")
    p.set_defaults(func=cmd_cache)
