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
