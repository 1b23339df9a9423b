"""Issue 49, item 5: another user, or root acting with a user's environment, never changes what happens to a
user's files, and a refusal changes nothing on disk.

The tests run as root here: another user's file is made by giving it away (``os.chown``), which is what the
ownership checks read; where root is needed and absent they skip. The checks take the owner they compare with
from the file they protect (the cache's owner is the user running capeval), so nothing here depends on who
runs the suite but the setup."""
from __future__ import annotations

import json
import os
import sqlite3
import stat
from pathlib import Path

import pytest
from conftest import StopAfter

import capeval_plugins
from capeval_plugins import files, runner
from capeval_plugins.bench.cache import SIDECARS, CacheError, ScoreCache
from capeval_plugins.checkpoint import LOCK, RunFolderError
from capeval_plugins.cli import main

OTHER = 54321  # a user id no one on the machine has


def needs_root():
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")


def tree(folder: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file under ``folder`` with its bytes, owner and modification time (links and folders by name)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        st = path.lstat()
        content = path.read_bytes() if stat.S_ISREG(st.st_mode) else b""
        out[str(path.relative_to(folder))] = (content, st.st_uid, st.st_mtime_ns)
    return out


# ------------------------------------------------------------------------------------------ the score cache

def a_cache(folder: Path) -> Path:
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / "scores.sqlite"
    cache = ScoreCache(path)
    cache.put("metric", {"sample": 0.25})
    cache.close()
    return path


@pytest.mark.parametrize("suffix", SIDECARS)
def test_a_journal_planted_by_another_user_changes_nothing(tmp_path, suffix):
    """A ``-journal`` / ``-wal`` / ``-shm`` of another user's beside a valid cache: SQLite rolled a journal into
    the cache or failed on it (SQLITE_IOERR_DELETE: it may not remove another's file in a sticky folder), and
    capeval set the owner's valid cache aside as damaged. Now: one line naming the planted file; the cache and the
    planted file as they were, nothing set aside."""
    needs_root()
    path = a_cache(tmp_path / "cache")
    planted = path.with_name(path.name + suffix)
    planted.write_bytes(b"\xd9\xd5\x05\xf9\x20\xa1\x63\xd7" + b"\0" * 504)  # a journal's magic, then zeros
    os.chown(planted, OTHER, OTHER)
    before = tree(path.parent)
    with pytest.raises(CacheError, match=rf"{planted.name}, beside the score cache, belongs to another user \(uid "
                                         rf"{OTHER}\); SQLite would read it"):
        ScoreCache(path)
    assert tree(path.parent) == before


@pytest.mark.parametrize("how", ["link", "hard link", "writable by others"])
def test_a_journal_that_is_not_the_owners_own_file_is_refused(tmp_path, how):
    path = a_cache(tmp_path / "cache")
    planted = path.with_name(path.name + "-wal")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"")
    if how == "link":
        planted.symlink_to(elsewhere)
    elif how == "hard link":
        os.link(elsewhere, planted)
    else:
        planted.write_bytes(b"")
        planted.chmod(0o666)
    before = tree(path.parent)
    with pytest.raises(CacheError, match="beside the score cache"):
        ScoreCache(path)
    assert tree(path.parent) == before


def test_a_cache_in_a_sticky_shared_folder_is_refused_before_anything_is_made(tmp_path):
    """In /tmp-like folders anyone may create the journal names before the owner's run: such a folder is no
    place for the cache (the docs allowed it)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(CacheError, match="writable by others .* journals beside the cache"):
        ScoreCache(shared / "scores.sqlite")
    assert list(shared.iterdir()) == []


def test_an_error_of_the_machine_never_sets_the_cache_aside(tmp_path):
    """SQLite's extended codes (SQLITE_IOERR_DELETE, SQLITE_CANTOPEN_ISDIR, SQLITE_READONLY_ROLLBACK) say nothing
    about the cache's content; they were taken for damage because only the primary names were listed."""
    path = a_cache(tmp_path / "cache")
    before = tree(path.parent)
    for name in ("SQLITE_IOERR_DELETE", "SQLITE_CANTOPEN_ISDIR", "SQLITE_READONLY_ROLLBACK"):
        cache = ScoreCache(path)
        err = sqlite3.OperationalError("disk I/O error")
        err.sqlite_errorname = name
        with pytest.raises(CacheError, match="cannot use the score cache"):
            with cache._guard():
                raise err
        cache.close()
    assert tree(path.parent) == before
    assert ScoreCache(path).get("metric", ["sample"]) == {"sample": 0.25}


# -------------------------------------------------------------------------------- root with a user's variables

def test_root_with_the_users_capeval_cache_keeps_its_files_out_of_it(tmp_path, monkeypatch):
    """`sudo -E capeval bench`: HOME, XDG_CACHE_HOME and CAPEVAL_CACHE all the user's. The rule for HOME and
    XDG_* now covers CAPEVAL_CACHE: every cache is root's own, none in the user's folders (root-owned 0700
    folders there made the user's next bench fail with "Permission denied")."""
    import pwd

    from test_untrusted_files import every_cache_folder

    alice = tmp_path / "alice"
    (alice / "cache").mkdir(parents=True)
    if os.geteuid() == 0:
        for path in (alice, alice / "cache"):
            os.chown(path, OTHER, OTHER)
    else:
        monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv("HOME", str(alice))
    monkeypatch.setenv("XDG_CACHE_HOME", str(alice / ".cache"))
    monkeypatch.setenv("CAPEVAL_CACHE", str(alice / "cache"))
    root_cache = Path(pwd.getpwuid(0).pw_dir) / ".cache" / "capeval_plugins"
    for where in every_cache_folder():
        assert where.is_relative_to(root_cache) and not where.is_relative_to(alice), where
    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / "roots"))  # a folder of root's (or nobody's yet): used
    assert all(p.is_relative_to(tmp_path / "roots") for p in every_cache_folder())


# ------------------------------------------------------------------------------------ refusals change nothing

def corpus(n=24):
    captions = [f"a dog number {k} runs on the grass" for k in range(n)]
    return runner.Corpus(captions, None, [[f"a dog {k} runs", "a dog"] for k in range(n)])


def metrics(*names):
    return {name: capeval_plugins.load(name, tokenize=False, batch_size=4) for name in names}


@pytest.mark.parametrize("lock_there", [True, False])
def test_a_refused_resume_leaves_the_lock_file_as_it_was(tmp_path, lock_there):
    """A resume refused (another metric set, no --restart) rewrote capeval-run.lock, or left one it made."""
    run_dir = tmp_path / "run"
    with pytest.raises(runner.Interrupted):
        runner.run(metrics("bleu1", "bleu2"), corpus(), run_dir=run_dir, stop=StopAfter(2))
    if not lock_there:
        (run_dir / LOCK).unlink()
    before = tree(run_dir)
    with pytest.raises(RunFolderError, match="unfinished run of something else"):
        runner.run(metrics("bleu1"), corpus(), run_dir=run_dir)
    assert tree(run_dir) == before


def test_a_refused_cache_clear_makes_no_lock_file(tmp_path, monkeypatch, capsys):
    """`capeval cache clear` on a METEOR cache folder whose marker is not the user's: refused, and its build.lock
    is not made there first."""
    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / "cache"))
    meteor = tmp_path / "cache" / "meteor"
    meteor.mkdir(parents=True)
    (meteor / ".capeval-owned").write_text(json.dumps({"kind": "meteor-paraphrase-index", "files": ["x"]}))
    (meteor / "x").write_text("someone's file")
    before = tree(meteor)
    assert main(["cache", "clear"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"capeval: error: cannot clear {meteor}") and err.count("\n") == 1, err
    assert "METEOR" not in out, out  # no "removed 0.0 MB" line for what was left alone
    assert tree(meteor) == before


def test_a_refused_benchmark_cache_makes_no_lock_file(tmp_path, monkeypatch):
    from capeval_plugins.bench import fetch

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = tmp_path / "benchmarks"
    root.mkdir(mode=0o700)
    (root / ".capeval-owned").write_text("not a marker of capeval's")
    before = tree(root)
    with pytest.raises(files.FileError, match="not written by capeval for this user"):
        fetch.fetch("composite", root=root)
    assert fetch.cached("composite", root) is None
    assert tree(root) == before
