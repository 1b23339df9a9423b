"""Downloads a server ended early, and ``.part`` files a run left whole: through ``capeval fetch-weights`` and the
real ``huggingface_hub`` client against a loopback server (tests/helpers/file_server.py).

* A release with no pinned size (every release in this version) cut short without a Content-Length was deleted as
  "changed"; it is kept and resumed, and only a whole transfer (the server's size reached, or nothing past it: 416)
  whose digest differs is deleted.
* A ``.part`` holding the whole, correct file (the run stopped while hashing it) asked the server for more, got
  416, and was deleted as "changed"; it is finished without a request, and a 416 on a ``.part`` that differs says
  what happened.

Expected values come from the served bytes and ``hashlib``, not from the package."""
from __future__ import annotations

import dataclasses
import hashlib

import pytest

from capeval_plugins.commands.fetch_weights import WeightsError, fetch_weights
from capeval_plugins.resources import downloads
from capeval_plugins.resources.releases import RELEASES
from test_fetch_weights import capeval, pinned


FILE = "clip_ViT-B-32.pth"


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> dict:
    """A tiny PAC-S file as released (clip_ViT-B-32.pth) and its BPE."""
    from capeval_plugins.testing.official import released_pacs, write_bpe

    root = tmp_path_factory.mktemp("released")
    bpe = write_bpe(root / "bpe.txt.gz")
    return {"bpe": str(bpe), "pacs": released_pacs(root / FILE, 3, bpe).read_bytes()}


def unpinned(url: str, file: str = FILE):
    """The PAC-S release as this version has it (no size, no digest), served at ``url`` under ``file``."""
    found = dataclasses.replace(RELEASES["pacs-vit-b-32"], url=url, file=file)
    assert found.size is None and found.sha256 is None
    return found


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_download_cut_short_without_a_pinned_size_is_kept_and_resumed(server, online, released):
    """The server closes the connection a third of the way in, without a Content-Length: one line saying it ended
    early and the download is kept, the .part holds exactly the bytes served; the next run asks for the rest and
    converts. A whole file with another digest, also without a Content-Length, is still deleted: the server has
    nothing past it (416)."""
    data = released["pacs"]
    found = unpinned(server.put("/p.pth", data))
    cut = len(data) // 3
    server.cut("/p.pth", cut)
    with pytest.raises(WeightsError, match=rf"ended {FILE} early \(the server ended the file at {cut} of "
                                           rf"{len(data)} bytes\); the download is kept") as caught:
        fetch_weights(found, sha256=sha(data), progress=False)
    assert len(str(caught.value).splitlines()) == 1
    folder = online / "weights" / "pacs-vit-b-32"
    assert (folder / f"{FILE}.part").read_bytes() == data[:cut]
    server.cuts.clear()
    got = fetch_weights(found, sha256=sha(data), progress=False, convert_options={"tokenizer": released["bpe"]})
    assert ("GET", "/p.pth", f"bytes={cut}-") in server.log and got.converted
    assert sha((folder / FILE).read_bytes()) == sha(data) and not (folder / f"{FILE}.part").exists()

    changed = data[:100] + bytes([data[100] ^ 1]) + data[101:]
    server.put("/c.pth", changed)
    server.cut("/c.pth", len(changed))  # whole, but no Content-Length
    with pytest.raises(WeightsError, match=rf"served another file than other.pth \(got {len(changed)} bytes with "
                                           rf"SHA-256 {sha(changed)}; the server has no more \(416"):
        fetch_weights(unpinned(server.url + "/c.pth", "other.pth"), sha256=sha(data), progress=False)
    assert ("GET", "/c.pth", f"bytes={len(changed)}-") in server.log
    assert not (folder / "other.pth.part").exists()


def test_a_server_file_of_another_size_than_pinned_is_deleted_at_once(server, online, released):
    """A pinned size and a server that says (Content-Length) its file is shorter: another file, deleted in this run,
    not kept as if it had been cut (the next run's 416 would have said the same)."""
    data = released["pacs"]
    found = pinned("pacs-vit-b-32", server.put("/p.pth", data[:3000]), data)
    with pytest.raises(WeightsError, match=rf"served another file than {FILE} \(the server's file has 3000 bytes; "
                                           rf"expected {len(data)} bytes"):
        fetch_weights(found, progress=False)
    assert not list((online / "weights" / "pacs-vit-b-32").glob("*.part"))


def interrupted_while_hashing(monkeypatch, size: int) -> None:
    """The first check of a ``size``-byte download raises KeyboardInterrupt (Ctrl-C while it is being hashed)."""
    real = downloads.Expected.matches
    calls = []

    def matches(self, data):
        if data is not None and len(data) == size and not calls:
            calls.append(1)
            raise KeyboardInterrupt
        return real(self, data)

    monkeypatch.setattr(downloads.Expected, "matches", matches)


def test_a_whole_part_left_by_an_interrupted_check_is_finished_without_a_request(server, online, released,
                                                                                  monkeypatch):
    """Ctrl-C while the finished download is hashed leaves the whole file in the .part: the next run checks it and
    converts it with no request at all. A whole .part that differs (one byte flipped) gets the server's 416 and is
    deleted saying so, with its size and digest; the run after downloads it afresh."""
    data = released["pacs"]
    url = server.put("/p.pth", data)
    folder = online / "weights" / "pacs-vit-b-32"
    for file in (FILE, "flipped.pth"):
        with monkeypatch.context() as patched, pytest.raises(KeyboardInterrupt):
            interrupted_while_hashing(patched, len(data))
            fetch_weights(unpinned(url, file), sha256=sha(data), progress=False)
        assert (folder / f"{file}.part").read_bytes() == data
    requests = len(server.log)
    got = fetch_weights(unpinned(url), sha256=sha(data), progress=False, convert_options={"tokenizer": released["bpe"]})
    assert len(server.log) == requests and got.converted and sha((folder / FILE).read_bytes()) == sha(data)

    flipped = data[:100] + bytes([data[100] ^ 1]) + data[101:]
    (folder / "flipped.pth.part").write_bytes(flipped)
    with pytest.raises(WeightsError, match=rf"served another file than flipped.pth \(got {len(data)} bytes with "
                                           rf"SHA-256 {sha(flipped)}; the server has no more \(416"):
        fetch_weights(unpinned(url, "flipped.pth"), sha256=sha(data), progress=False)
    assert server.log[-1] == ("GET", "/p.pth", f"bytes={len(data)}-")
    assert not (folder / "flipped.pth.part").exists()
    fetch_weights(unpinned(url, "flipped.pth"), sha256=sha(data), progress=False,
                  convert_options={"tokenizer": released["bpe"]})
    assert server.log[-1] == ("GET", "/p.pth", None) and sha((folder / "flipped.pth").read_bytes()) == sha(data)


@pytest.mark.slow
def test_the_command_line_keeps_a_download_cut_short(server, released, tmp_path):
    """The auditor's run: `capeval fetch-weights pacscore --url URL --sha256 D`, the server closing at half the
    file without a Content-Length: exit 2, one line saying it is kept, the .part there with the bytes served."""
    data = released["pacs"]
    url = server.put("/clip_ViT-B-32.pth", data)
    server.cut("/clip_ViT-B-32.pth", len(data) // 2)
    cache = tmp_path / "cache"
    done = capeval(["fetch-weights", "pacscore", "--url", url, "--sha256", sha(data), "--quiet"], cache)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "early" in lines[0] and "the download is kept" in lines[0] and "deleted" not in lines[0]
    part = cache / "weights" / "pacs-vit-b-32" / f"{FILE}.part"
    assert part.read_bytes() == data[: len(data) // 2]
