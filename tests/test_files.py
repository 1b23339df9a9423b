"""capeval_plugins.files on its own: the user's secret, names confined to a folder, no link followed, outputs
written whole or through a stream, inputs never blocking."""
from __future__ import annotations

import os
import stat
import threading

import pytest
from conftest import HANG_GUARD

from capeval_plugins import files


@pytest.fixture
def config(tmp_path, monkeypatch):
    folder = tmp_path / "config"
    monkeypatch.setenv("CAPEVAL_CONFIG_DIR", str(folder))
    return folder


def test_the_secret_is_made_once_private_and_refused_when_others_can_read_it(config):
    key = files.secret()
    path = config / files.SECRET_FILE
    assert len(key) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(config.stat().st_mode) == 0o700
    files._secret_cache.clear()
    assert files.secret() == key  # read back, not made again
    os.chmod(path, 0o644)
    files._secret_cache.clear()
    with pytest.raises(files.UnsafePath, match="only you can read"):
        files.secret()
    path.unlink()
    path.symlink_to(config.parent / "elsewhere")
    (config.parent / "elsewhere").write_bytes(os.urandom(32))
    os.chmod(config.parent / "elsewhere", 0o600)
    with pytest.raises(files.UnsafePath):
        files.secret()


def test_signed_json_verifies_only_under_its_kind_and_key(config):
    data = files.signed_json({"files": ["a"]}, "marker")
    assert files.read_signed_json(data, "marker") == {"files": ["a"]}
    assert files.read_signed_json(data, "run") is None  # one use's file never verifies as another's
    assert files.read_signed_json(data.replace(b'"a"', b'"b"'), "marker") is None
    assert files.read_signed_json(data, "marker", key=b"k" * 32) is None
    assert files.read_signed_json(b"not json", "marker") is None


@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "/etc/passwd", "a\0b"])
def test_a_folder_takes_plain_names_only(tmp_path, name):
    with files.Folder.open(tmp_path)[0] as folder, pytest.raises(files.UnsafePath):
        folder.write(name, b"x")


def test_a_folder_writes_whole_files_replacing_links_not_their_targets(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "x").symlink_to(target)
    with files.Folder.open(tmp_path / "f")[0] as folder:
        with pytest.raises(files.UnsafePath, match="symbolic link"):
            folder.read("x")
        with pytest.raises(files.UnsafePath, match="symbolic link"):
            folder.append("x", b"more")
        assert not folder.unlink("x")  # a link is never removed as if it were a file
        folder.write("x", b"new")  # renamed over the link itself
        with pytest.raises(FileExistsError):
            folder.write("x", b"again", replace=False)
    assert target.read_bytes() == b"keep" and (tmp_path / "f" / "x").read_bytes() == b"new"
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == ["x"]  # no scratch file left


def test_inputs_that_are_not_regular_files_are_refused_unopened(tmp_path):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    with pytest.raises(files.UnsafePath, match="FIFO"):
        files.read_input(fifo)
    with pytest.raises(files.UnsafePath, match="character device"):
        files.read_input("/dev/zero")


def test_outputs_by_kind(tmp_path):
    assert files.output_kind(tmp_path / "new.jsonl") == "file"
    assert files.output_kind("/dev/stdout") == files.output_kind("/dev/fd/2") == "stream"
    os.mkfifo(tmp_path / "pipe")
    assert files.output_kind(tmp_path / "pipe") == "stream"
    (tmp_path / "link").symlink_to(tmp_path / "new.jsonl")
    with pytest.raises(files.UnsafePath, match="symbolic link"):
        files.output_kind(tmp_path / "link")
    with pytest.raises(files.UnsafePath, match="is a folder"):
        files.check_output(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(files.UnsafePath, match="inside an input"):
        files.check_output(model / "weights.bin", [model])
    got = []
    reader = threading.Thread(target=lambda: got.append((tmp_path / "pipe").read_bytes()), daemon=True)
    reader.start()
    files.write_output(tmp_path / "pipe", b"through the pipe")
    reader.join(HANG_GUARD)
    assert got == [b"through the pipe"] and stat.S_ISFIFO(os.lstat(tmp_path / "pipe").st_mode)


def test_a_claim_lists_what_it_wrote_and_removes_only_that(tmp_path, config):
    root = tmp_path / "out"
    claim = files.Claim(root, "demo").open()
    claim.write("a.txt", b"a")
    claim.write("sub/b.txt", b"b")
    (root / "mine.txt").write_text("the user's")
    with pytest.raises(files.UnsafePath, match="not capeval's"):
        claim.write("mine.txt", b"x")
    again = files.Claim(root, "demo").open()
    assert again.found and set(again.files) == {"a.txt", "sub/", "sub/b.txt"}
    with pytest.raises(files.UnsafePath, match="another kind"):
        files.Claim(root, "other").open()
    again.remove()
    assert sorted(p.name for p in root.iterdir()) == ["mine.txt"]


def _cache_folders_named_in_the_source() -> set[str]:
    """Every ``cache_dir("<sub>")`` the package's modules name, read from their text (independent of the list
    check_output keeps)."""
    import re
    from pathlib import Path

    import capeval_plugins

    root = Path(capeval_plugins.__file__).parent
    return {m for p in root.rglob("*.py") for m in re.findall(r"""cache_dir\(["']([^"']+)["']\)""", p.read_text())}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("CAPEVAL_CACHE", str(folder))
    return folder


def test_every_cache_of_state_is_kept_from_outputs_but_evaluate_modules():
    from capeval_plugins.files.outputs import PACKAGE_CACHES

    assert set(PACKAGE_CACHES) == _cache_folders_named_in_the_source() - {"evaluate_modules"}


def test_the_secret_key_is_never_an_output_under_any_name(config, tmp_path):
    """The key replaced by ``--out`` made every resumable run refused: refused as itself, through a link to its
    folder and as a hard link, under every option name; the key keeps its bytes."""
    key = files.secret()
    path = config / files.SECRET_FILE
    (tmp_path / "via").symlink_to(config)
    os.link(path, tmp_path / "hard.key")
    for name in (path, tmp_path / "via" / files.SECRET_FILE, tmp_path / "hard.key"):
        for what in ("--out", "--json", "--cache", "save_to"):
            with pytest.raises(files.UnsafePath, match="is your secret key"):
                files.check_output(name, [], what)
        with pytest.raises(files.UnsafePath, match="is your secret key"):
            files.write_output(name, b"{}")
    assert path.read_bytes() == key and stat.S_IMODE(path.stat().st_mode) == 0o600
    files.check_output(config / "other.json")  # the folder holds outputs of yours next to it


def test_no_file_in_a_cache_of_the_package_is_an_output(config, cache):
    from capeval_plugins.files.outputs import PACKAGE_CACHES

    for sub in [*PACKAGE_CACHES, "evaluate_modules"]:
        (cache / sub).mkdir(parents=True)
    (cache / "bench" / "scores.sqlite").write_bytes(b"SQLite format 3\0")
    for sub in PACKAGE_CACHES:
        with pytest.raises(files.UnsafePath, match=f"is inside the package's cache folder {cache / sub}"):
            files.check_output(cache / sub / "out.jsonl")
    with pytest.raises(files.UnsafePath, match="cache folder"):
        files.check_output(cache / "bench" / "scores.sqlite", [], "--json")
    # the score cache is the package's own file when named as the score cache
    assert files.check_output(cache / "bench" / "scores.sqlite", what="--cache") == "file"
    assert files.check_output(cache / "evaluate_modules" / "x.py") == files.check_output(cache / "o.jsonl") == "file"


def test_a_folder_opened_with_create_lists_every_folder_it_made_and_only_those_are_removed(tmp_path):
    """``newdir/sub`` with newdir missing: both are listed (the old code said only that sub was made), removed
    innermost first while empty; a folder that was there before never is."""
    from capeval_plugins.files.folder import remove_made

    deep = tmp_path / "new" / "a" / "b"
    before = [p for p in (deep, *deep.parents) if not p.exists()][::-1]  # the missing ones, outermost first
    with files.Folder.open(deep, create=True)[0] as folder:
        assert list(folder.made) == before == [tmp_path / "new", tmp_path / "new" / "a", deep]
    with files.Folder.open(tmp_path / "new", create=True)[0] as again:
        assert again.made == ()  # there now: not made by this call
    (tmp_path / "new" / "a" / "mine.txt").write_text("the user's")
    assert remove_made(before) == [deep]  # a holds a file of the user's: the walk up stops there
    (tmp_path / "new" / "a" / "mine.txt").unlink()
    (tmp_path / "new" / "a" / "b").symlink_to(tmp_path)  # a link in place of a made folder stays
    assert remove_made(before) == [] and (tmp_path / "new" / "a" / "b").is_symlink()
    (tmp_path / "new" / "a" / "b").unlink()
    assert remove_made(before) == [tmp_path / "new" / "a", tmp_path / "new"] and tmp_path.is_dir()
