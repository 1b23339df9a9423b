"""``capeval fetch-weights``: a released checkpoint downloaded from a loopback HTTP server
(tests/helpers/file_server.py) through the package's one download path (capeval_plugins/resources/downloads.py, the benchmark fetch's), checked against a
digest, converted in the same step; and every way it must refuse: no digest known, a changed file, a file served
short, an unsafe redirect, downloads off. The released files are tiny random ones in the official formats
(capeval_plugins/testing/official.py); the converted folders are compared with ``capeval convert`` run on the same
file directly."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from safetensors.torch import load_file

from capeval_plugins.resources import downloads
from capeval_plugins.commands.fetch_weights import WeightsError, fetch_weights
from capeval_plugins.resources.releases import RELEASES, release
from conftest import HANG_GUARD

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from file_server import FileServer  # noqa: E402


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> dict:
    """A tiny PAC-S file as released (clip_ViT-B-32.pth), its BPE, and Polos's reprod.zip."""
    from capeval_plugins.testing.official import released_pacs, released_polos, write_bpe
    from capeval_plugins.testing.text_encoders import build_simcse_roberta

    root = tmp_path_factory.mktemp("released")
    bpe = write_bpe(root / "bpe.txt.gz")
    pacs = released_pacs(root / "clip_ViT-B-32.pth", 3, bpe).read_bytes()
    roberta = root / "roberta"
    build_simcse_roberta(roberta, 0)
    ckpt = released_polos(root / "reprod", roberta, bpe)
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.writestr("reprod/reprod.ckpt", ckpt.read_bytes())
        zipped.writestr("reprod/hparams.yaml", (ckpt.parent / "hparams.yaml").read_bytes())
    return {"bpe": str(bpe), "pacs": pacs, "roberta": str(roberta), "polos": archive.getvalue(), "root": root}


def pinned(name: str, url: str, data: bytes) -> object:
    """The release ``name`` as if this version pinned ``data``'s size and digest, served at ``url``."""
    return dataclasses.replace(RELEASES[name], url=url, size=len(data), sha256=hashlib.sha256(data).hexdigest())


def same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(bool((x[k] == y[k]).all()) for k in x)


def test_pacs_is_fetched_checked_and_converted_in_one_step(server, online, released, tmp_path):
    """The converted folder is where pacscore looks by default and equals `capeval convert pacs` on the file;
    the metric then scores with its defaults; a second run reads the cache (no request) and keeps the folder."""
    import capeval_plugins
    from capeval_plugins.commands.convert_official import convert_pacs
    from capeval_plugins.models.encoders.openai_clip import converted_model_dir
    from conftest import random_image

    url = server.put("/pac/clip_ViT-B-32.pth", released["pacs"])
    found = pinned("pacs-vit-b-32", url, released["pacs"])
    got = fetch_weights(found, progress=False, convert_options={"tokenizer": released["bpe"]})
    assert got.converted and Path(got.destination) == converted_model_dir("pacs-vit-b-32")
    assert got.sha256 == found.sha256 and got.size == len(released["pacs"])
    (tmp_path / "direct.pth").write_bytes(released["pacs"])
    convert_pacs(tmp_path / "direct.pth", tmp_path / "direct", "vit-b-32", released["bpe"])
    assert same_weights(Path(got.destination), tmp_path / "direct")
    manifest = json.loads((online / "weights" / "pacs-vit-b-32" / "manifest.json").read_text())
    assert manifest["sha256"] == found.sha256 and manifest["url"] == url and manifest["pinned"]
    result = capeval_plugins.load("pacscore")([random_image(0)], ["a dog"])
    assert 0 <= result.score <= 2
    requests = len(server.log)
    again = fetch_weights(found, progress=False, convert_options={"tokenizer": released["bpe"]})
    assert not again.converted and len(server.log) == requests
    assert not list((online / "weights" / "pacs-vit-b-32").glob("*.part"))


def test_polos_archive_is_unpacked_and_converted(server, online, released, tmp_path, monkeypatch):
    """The archive's checkpoint and the hparams.yaml beside it are extracted by their file names only (a member
    path that climbs out of the archive lands in the cache all the same), and converted; no Hub token goes to a
    server that is not the Hub."""
    from capeval_plugins.commands.convert_official import convert_polos

    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_of_the_user")
    climbing = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(released["polos"])) as source, zipfile.ZipFile(climbing, "w") as out:
        for member in source.infolist():
            out.writestr("../../" + member.filename, source.read(member))
    url = server.put("/polos/reprod.zip", climbing.getvalue())
    released = {**released, "polos": climbing.getvalue()}
    got = fetch_weights(pinned("polos", url, released["polos"]), progress=False, destination=tmp_path / "polos",
                        convert_options={"text_tokenizer": released["roberta"], "clip_tokenizer": released["bpe"]})
    unpacked = online / "weights" / "polos" / "unpacked"
    assert sorted(p.name for p in unpacked.iterdir()) == ["hparams.yaml", "reprod.ckpt"]
    convert_polos(released["root"] / "reprod" / "reprod.ckpt", tmp_path / "direct",
                  text_tokenizer=released["roberta"], clip_tokenizer=released["bpe"])
    assert got.converted and same_weights(tmp_path / "polos", tmp_path / "direct")
    assert server.credentials and set(server.credentials) == {None}
    assert not (online.parent / "reprod").exists() and not (online / "reprod").exists()


def test_no_digest_known_is_a_refusal_before_any_request(server, online, released):
    """This version pins no digest (capeval_plugins/resources/releases.py says why): without --sha256 nothing is fetched;
    a --sha256 that contradicts a pinned digest, or that is not one, is refused too."""
    assert all(r.sha256 is None and r.size is None for r in RELEASES.values())
    url = server.put("/pac/clip_ViT-B-32.pth", released["pacs"])
    with pytest.raises(WeightsError, match="pins no SHA-256 for clip_ViT-B-32.pth.*--sha256"):
        fetch_weights(RELEASES["pacs-vit-b-32"], url=url, progress=False)
    with pytest.raises(WeightsError, match="differs from the digest capeval pins"):
        fetch_weights(pinned("pacs-vit-b-32", url, released["pacs"]), sha256="0" * 64, progress=False)
    with pytest.raises(WeightsError, match="is not a SHA-256"):
        fetch_weights(RELEASES["pacs-vit-b-32"], sha256="abc", progress=False)
    assert server.log == []
    got = fetch_weights(RELEASES["pacs-vit-b-32"], url=url, sha256=hashlib.sha256(released["pacs"]).hexdigest(),
                        progress=False, convert_options={"tokenizer": released["bpe"]})
    assert got.converted


def test_a_changed_file_is_deleted_and_refused(server, online, released):
    """Other bytes of the same size, or more bytes, than the digest says: refused naming the file, the .part
    deleted (a later run starts over), nothing converted."""
    data = released["pacs"]
    changed = data[:100] + bytes([data[100] ^ 1]) + data[101:]
    found = pinned("pacs-vit-b-32", server.put("/p.pth", changed), data)
    for served in (changed, data + b"more"):
        server.put("/p.pth", served)
        with pytest.raises(WeightsError, match="served another file than clip_ViT-B-32.pth.*deleted") as caught:
            fetch_weights(found, progress=False)
        assert len(str(caught.value).splitlines()) == 1
        assert not list((online / "weights" / "pacs-vit-b-32").glob("*.pth*"))
    assert not (online / "models" / "pacs-vit-b-32").exists()


def test_a_file_served_short_resumes_then_a_shorter_file_is_refused(server, online, released):
    """A body that ends early (no Content-Length, the connection closed): refused as short, the .part kept; the
    next run asks for the rest with a Range request and finishes. A server whose file is shorter than what was
    downloaded answers that Range with 416: the .part is deleted and the file refused as changed."""
    data = released["pacs"]
    found = pinned("pacs-vit-b-32", server.put("/p.pth", data), data)
    server.cut("/p.pth", 5000)
    with pytest.raises(WeightsError, match="ended clip_ViT-B-32.pth early.*5000 of .*run again to resume"):
        fetch_weights(found, progress=False)
    part = online / "weights" / "pacs-vit-b-32" / "clip_ViT-B-32.pth.part"
    assert part.stat().st_size == 5000
    server.cuts.clear()
    got = fetch_weights(found, progress=False, convert_options={"tokenizer": released["bpe"]})
    assert ("GET", "/p.pth", "bytes=5000-") in server.log and got.size == len(data) and not part.exists()

    shorter = dataclasses.replace(found, file="other.pth")
    server.put("/short.pth", data[:3000])
    server.cut("/short.pth", 2000)
    with pytest.raises(WeightsError, match="early"):
        fetch_weights(dataclasses.replace(shorter, url=server.url + "/short.pth"), progress=False)
    server.put("/short.pth", data[:1000])  # the server's file is now shorter than what was downloaded
    server.cuts.clear()
    with pytest.raises(WeightsError, match="served another file.*416"):
        fetch_weights(dataclasses.replace(shorter, url=server.url + "/short.pth"), progress=False)
    assert not (online / "weights" / "pacs-vit-b-32" / "other.pth.part").exists()


def test_redirects_to_another_host_are_followed_unsafe_ones_refused(server, online, released):
    """A redirect to another server (another origin) is followed and the digest decides; one to another scheme
    (file:, ftp:) is refused before it is requested, and nothing is written; one from https to http is refused
    by the same guard (checked on the guard itself: there is no https server here)."""
    data = released["pacs"]
    with FileServer() as other:
        target = other.put("/elsewhere/clip.pth", data)
        hop = server.redirect("/hop", target)
        url = server.redirect("/start", hop)
        got = fetch_weights(pinned("pacs-vit-b-32", url, data), progress=False,
                            convert_options={"tokenizer": released["bpe"]})
        assert got.size == len(data) and other.log[-1][1] == "/elsewhere/clip.pth"
    for scheme_url in ("file:///etc/passwd", "ftp://127.0.0.1/clip.pth"):
        url = server.redirect("/bad", scheme_url)
        with pytest.raises(WeightsError, match="refused to fetch .*only http and https"):
            fetch_weights(dataclasses.replace(pinned("pacs-vit-b-32", url, data), file="x.pth"), progress=False)
        assert not (online / "weights" / "pacs-vit-b-32" / "x.pth").exists()
    from huggingface_hub.utils import get_session

    class Request:
        url = "http://127.0.0.1/clip.pth"

    with downloads.guarded_redirects("https://example.org/clip.pth"):
        guard = get_session().event_hooks["request"][-1]
        with pytest.raises(downloads.DownloadError, match="from https to http"):
            guard(Request())
    assert guard not in get_session().event_hooks["request"]  # removed after the download


def test_downloads_off_is_one_line_unless_the_file_is_cached(server, online, released, monkeypatch):
    import huggingface_hub.constants

    data = released["pacs"]
    found = pinned("pacs-vit-b-32", server.put("/p.pth", data), data)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsError, match="downloads are off \\(HF_HUB_OFFLINE=1\\)"):
        fetch_weights(found, progress=False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    fetch_weights(found, progress=False, convert_options={"tokenizer": released["bpe"]})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert not fetch_weights(found, progress=False).converted  # cached and converted: nothing to fetch


def capeval(args: list[str], cache: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(CAPEVAL_CACHE=str(cache), HF_HUB_DOWNLOAD_TIMEOUT="5", **extra)
    return subprocess.run([sys.executable, "-m", "capeval_plugins.cli", *args], capture_output=True, text=True,
                          env=env, timeout=HANG_GUARD)


@pytest.mark.slow
def test_the_command_line_and_an_interrupted_download_resumed(server, released, tmp_path):
    """`capeval fetch-weights pacscore --url ... --sha256 ...`: killed part-way (10 MB of a 13.8 MB file on disk),
    run again: it asks for the rest with a Range request, checks the digest and converts. Without --sha256: exit 2,
    one line, nothing requested."""
    from capeval_plugins.testing.official import released_pacs

    data = released_pacs(tmp_path / "wide.pth", 1, released["bpe"], width=256).read_bytes()  # 13.8 MB
    digest = hashlib.sha256(data).hexdigest()
    url = server.put("/pac/clip_ViT-B-32.pth", data)
    cache = tmp_path / "cache"
    refused = capeval(["fetch-weights", "pacscore", "--url", url], cache)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "--sha256" in refused.stderr and server.log == []
    server.stall("/pac/clip_ViT-B-32.pth", after=(10 << 20) + 4096)
    args = ["fetch-weights", "pacscore", "--url", url, "--sha256", digest, "--tokenizer", released["bpe"], "--json"]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(CAPEVAL_CACHE=str(cache), HF_HUB_DOWNLOAD_TIMEOUT="30")
    child = subprocess.Popen([sys.executable, "-m", "capeval_plugins.cli", *args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    part = cache / "weights" / "pacs-vit-b-32" / "clip_ViT-B-32.pth.part"
    # the stalled server holds the rest until released: wait for the first 10 MB however slow the machine is (a
    # child that ends first has failed, and the assertions below say so)
    while not (part.is_file() and part.stat().st_size >= 10 << 20) and child.poll() is None:
        time.sleep(0.1)
    child.send_signal(signal.SIGKILL)
    child.wait(HANG_GUARD)
    server.release()
    written = part.stat().st_size
    assert written >= 10 << 20
    done = capeval(args, cache)
    assert done.returncode == 0, done.stderr
    assert ("GET", "/pac/clip_ViT-B-32.pth", f"bytes={written}-") in server.log
    out = json.loads(done.stdout)
    assert out["sha256"] == digest and out["converted"] and not part.exists()
    assert Path(out["destination"]) == cache / "models" / "pacs-vit-b-32"
    assert (cache / "models" / "pacs-vit-b-32" / "model.safetensors").is_file()


def test_names_and_aliases():
    assert release("pacscore").name == "pacs-vit-b-32" and release("pacscore_pp").name == "pacs_pp-vit-l-14"
    assert release("polos").file == "reprod.zip"
    with pytest.raises(ValueError, match="known: pacs-vit-b-32"):
        release("vela")
    for found in RELEASES.values():
        assert found.url.startswith("https://") and found.published


@pytest.mark.slow
def test_a_server_that_cannot_be_reached_is_one_line(online, released):
    """Nothing listens: one line naming the file and the URL, to be run again (what was downloaded is kept). Slow:
    huggingface_hub's client retries the connection five times, a second apart."""
    data = released["pacs"]
    found = pinned("pacs-vit-b-32", "http://127.0.0.1:9/clip_ViT-B-32.pth", data)
    with pytest.raises(WeightsError, match="cannot fetch clip_ViT-B-32.pth from http://127.0.0.1:9/.*run again") as err:
        fetch_weights(found, progress=False)
    assert len(str(err.value).splitlines()) == 1
    assert not (online / "models").exists()
