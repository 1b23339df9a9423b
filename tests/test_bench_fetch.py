"""Benchmarks fetched on first use (capeval_plugins.bench.fetch), through the real huggingface_hub client against
a miniature Hub on 127.0.0.1 (tests/helpers/hub_server.py) serving each repository's layout: the Hub's Parquet
conversion (<config>/<split>/0000.parquet with embedded images) and Spica's CSV files. Every fetch runs in a
child process with HF_ENDPOINT pointing at the server (the client reads it when imported), nothing patched."""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import HANG_GUARD
from PIL import Image
from scipy.stats import kendalltau

from capeval_plugins import load
from capeval_plugins.bench import fetch, get_benchmark, load_benchmark, run_benchmark

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from hub_server import Hub  # noqa: E402

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
PARQUET = "refs/convert/parquet"


def png(seed: int, size: tuple[int, int] = (24, 20)) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def parquet(rows: list[dict]) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out.getvalue()


def composite_rows() -> list[dict]:
    """12 ratings of 4 images in two subsets; row 5's candidate is one of its image's references (the protocol
    drops it)."""
    rows = []
    for i in range(12):
        image = i // 3
        refs = [f"a photo of thing {image}", f"thing {image} on a table"]
        caption = refs[0] if i == 5 else f"caption {i} about a thing {(i * 7) % 5}"
        rows.append({"img": {"bytes": png(image), "path": f"im{image}.png"}, "cand": caption, "refs": refs,
                     "human_score": float((i * 3) % 5 + 1), "dataset": ("flickr8k", "coco")[image % 2]})
    return rows


def env(hub: Hub | None, cache: Path, **extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_ENDPOINT")}
    out.update(CAPEVAL_CACHE=str(cache), HF_HOME=str(cache.parent / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DOWNLOAD_TIMEOUT="5", HF_HUB_ETAG_TIMEOUT="5")
    if hub is not None:
        out["HF_ENDPOINT"] = hub.url
    out.update(extra)
    return out


def capeval(args: list[str], environ: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "capeval_plugins.cli", *args], capture_output=True, text=True,
                          env=environ, timeout=HANG_GUARD)


FETCH = "import sys; from capeval_plugins.bench.fetch import fetch; print(fetch(sys.argv[1], progress=False).data)"


def fetch_child(benchmark: str, environ: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", FETCH, benchmark], env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_until(condition, child: subprocess.Popen) -> None:
    """Poll until ``condition()`` holds or ``child`` has ended, however long the machine takes (the hang guard
    only bounds a real hang; nothing here is about speed)."""
    give_up = time.monotonic() + HANG_GUARD
    while not condition() and child.poll() is None and time.monotonic() < give_up:
        time.sleep(0.1)


def downloading(hub: Hub, path: str) -> bool:
    """Whether a download of ``path`` has reached the Hub."""
    return any(method == "GET" and "/resolve/" in url and url.endswith("/" + path) for method, url, _ in list(hub.log))


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("capeval: error: "), proc.stderr
    return lines[0]


@pytest.fixture
def hub():
    with Hub() as server:
        yield server


@pytest.mark.slow
def test_composite_from_a_fresh_cache_then_offline(hub, tmp_path, tiny_clip):
    """`capeval bench composite` without --data: fetched, laid out for the reader with its images, scored by a
    (tiny) CLIP metric; the figures equal a run on the same rows written independently as FLEUR's composite.json
    with an image folder. A second run needs no network at all."""
    rows = composite_rows()
    data = parquet(rows)
    commit = hub.commit("yuwd/Composite", {"default/test/0000.parquet": data}, ref=PARQUET)
    cache = tmp_path / "cache"
    args = ["bench", "composite", "--metric", "clipscore", "--option", f"clipscore.model={tiny_clip}",
            "--bootstrap", "0", "--no-cache", "--quiet"]
    first = capeval([*args, "--json", str(tmp_path / "fetched.json")], env(hub, cache))
    assert first.returncode == 0, first.stderr
    assert f"yuwd/Composite at {commit[:12]}" in first.stdout

    local = tmp_path / "local"
    (local / "images").mkdir(parents=True)
    by_subset: dict[str, list] = {}
    for row in rows:
        (local / "images" / row["img"]["path"]).write_bytes(row["img"]["bytes"])
        by_subset.setdefault(row["dataset"], []).append(
            {"image": row["img"]["path"], "caption": row["cand"], "human": row["human_score"], "refs": row["refs"]})
    (local / "composite.json").write_text(json.dumps(by_subset))
    expected = run_benchmark("composite", local / "composite.json", {"clipscore": load("clipscore", model=tiny_clip)},
                             images=local / "images", bootstrap=0, cache=False, progress=False).to_dict()

    fetched = json.loads((tmp_path / "fetched.json").read_text())
    assert fetched["data"]["excluded"] == expected["data"]["excluded"] == 1
    for stat in ("kendall_tau_b", "kendall_tau_c", "pearson", "n"):
        assert fetched["results"]["clipscore"][stat] == pytest.approx(expected["results"]["clipscore"][stat])
    assert fetched["results"]["clipscore"]["categories"].keys() == {"flickr8k", "coco"}
    origin = fetched["data"]["fetched"]
    assert (origin["repository"], origin["revision"], origin["ref"]) == ("yuwd/Composite", commit, PARQUET)
    assert origin["files"] == [{"path": "default/test/0000.parquet", "size": len(data),
                                "sha256": hashlib.sha256(data).hexdigest(), "blob": origin["files"][0]["blob"]}]

    requests = len(hub.log)
    unreachable = env(None, cache, HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_OFFLINE="1")
    again = capeval([*args, "--json", str(tmp_path / "again.json")], unreachable)
    assert again.returncode == 0, again.stderr
    figures = {k: v for k, v in fetched["results"]["clipscore"].items() if k != "seconds"}
    assert json.loads((tmp_path / "again.json").read_text())["results"]["clipscore"].items() >= figures.items()
    assert len(hub.log) == requests


@pytest.mark.slow
def test_a_fetch_that_cannot_happen_is_one_line(hub, tmp_path):
    """Offline with an empty cache, a Hub that cannot be reached, a repository it does not have: exit 2, one
    line naming the repository and what to pass instead."""
    args = ["bench", "composite", "--metric", "bleu4"]
    offline = one_line_error(capeval(args, env(hub, tmp_path / "a", HF_HUB_OFFLINE="1")))
    assert "HF_HUB_OFFLINE=1" in offline and "yuwd/Composite" in offline and "--data" in offline
    down = one_line_error(capeval(args, env(None, tmp_path / "b", HF_ENDPOINT="http://127.0.0.1:9")))
    assert "cannot fetch composite from the Hugging Face dataset yuwd/Composite" in down and "--data" in down
    missing = one_line_error(capeval(args, env(hub, tmp_path / "c")))
    assert "yuwd/Composite" in missing and "--data" in missing
    assert not list((tmp_path / "c").rglob("data.json"))


@pytest.mark.slow
def test_an_interrupted_download_resumes_where_it_stopped(hub, tmp_path):
    """A fetch killed part-way (10 MB of a 12 MB file on disk) resumes with a Range request for the rest; the
    result is the whole file, checked against the listing's SHA-256."""
    blob = np.random.default_rng(0).bytes(12 << 20)  # incompressible: the Parquet file is as large
    rows = [{"img": {"bytes": b"\xff\xd8\xff" + blob, "path": "big.jpg"}, "cand": "a big picture",
             "refs": ["a picture"], "human_score": 1.0},
            {"img": {"bytes": png(1), "path": "small.png"}, "cand": "a small picture", "refs": ["a picture"],
             "human_score": 0.0}]
    data = parquet(rows)
    hub.commit("yuwd/Polaris", {"default/test/0000.parquet": data}, ref=PARQUET)
    hub.stall("default/test/0000.parquet", after=(10 << 20) + 4096)
    cache = tmp_path / "cache"
    child = fetch_child("polaris", env(hub, cache))
    part = cache / "benchmarks" / "polaris" / "raw" / "default--test--0000.parquet.part"
    wait_until(lambda: part.is_file() and part.stat().st_size >= 10 << 20, child)
    child.send_signal(signal.SIGKILL)
    child.wait(HANG_GUARD)
    hub.release()
    written = part.stat().st_size
    assert written >= 10 << 20 and not (cache / "benchmarks" / "polaris" / "data.json").exists()

    done = subprocess.run([sys.executable, "-c", FETCH, "polaris"], env=env(hub, cache), capture_output=True,
                          text=True, timeout=HANG_GUARD)
    assert done.returncode == 0, done.stderr
    assert ("GET", "/datasets/yuwd/Polaris/resolve/" + hub.refs["yuwd/Polaris"][PARQUET] + "/default/test/0000.parquet",
            f"bytes={written}-") in hub.log
    ratings = load_benchmark("polaris", done.stdout.strip())
    assert ratings.captions.candidates == ["a big picture", "a small picture"]
    assert (Path(done.stdout.strip()).parent / "images" / "big.jpg").read_bytes() == rows[0]["img"]["bytes"]
    assert not part.exists()


@pytest.mark.slow
def test_a_changed_file_is_refused_unless_refresh(hub, tmp_path):
    """A cached copy edited since it was fetched, and a file the Hub serves with other content under the
    commit a resumed fetch pinned, are refused (exit 2, naming --refresh); --refresh fetches the revision the
    Hub serves now. A ref that moved on is not looked at until --refresh."""
    rows = composite_rows()
    old = hub.commit("yuwd/Composite", {"default/test/0000.parquet": parquet(rows)}, ref=PARQUET)
    cache = tmp_path / "cache"
    scores = tmp_path / "scores.jsonl"
    scores.write_text("".join(json.dumps({"image": f"im{i // 3}.png", "caption": r["cand"], "score": i % 4}) + "\n"
                              for i, r in enumerate(rows)))
    args = ["bench", "composite", "--scores", f"s={scores}", "--bootstrap", "0", "--quiet"]
    assert capeval([*args, "--json", str(tmp_path / "b.json")], env(hub, cache)).returncode == 0
    # capeval reproduce reads the same cached copy, offline: a pair from a score file gets the same figure
    rows_out = tmp_path / "rows.json"
    done = capeval(["reproduce", "--benchmark", "composite", "--metric", "fleur", "--quiet", "--json", str(rows_out),
                    "--scores", f"fleur:composite={scores}"], env(None, cache, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr
    row = next(r for r in json.loads(rows_out.read_text())["rows"] if r["entry"] == "fleur")
    bench = json.loads((tmp_path / "b.json").read_text())["results"]["s"]
    assert row["measured"] == pytest.approx(bench[row["statistic"]], abs=1e-4)
    data = cache / "benchmarks" / "composite" / "data.json"
    data.write_bytes(data.read_bytes().replace(b"caption 1 ", b"caption 9 "))
    refused = one_line_error(capeval(args, env(hub, cache)))
    assert "changed since composite was fetched" in refused and "--refresh" in refused

    rows[0]["human_score"] = 5.0
    new = hub.commit("yuwd/Composite", {"default/test/0000.parquet": parquet(rows)}, ref=PARQUET)
    refreshed = capeval([*args, "--refresh", "--json", str(tmp_path / "r.json")], env(hub, cache))
    assert refreshed.returncode == 0, refreshed.stderr
    assert json.loads((tmp_path / "r.json").read_text())["data"]["fetched"]["revision"] == new != old

    # a fetch stopped before its file arrived, then the Hub serves other bytes under the pinned commit
    hub.commit("yuwd/Polaris", {"default/test/0000.parquet": parquet(rows)}, ref=PARQUET)
    pinned = hub.refs["yuwd/Polaris"][PARQUET]
    hub.stall("default/test/0000.parquet", after=1)
    child = fetch_child("polaris", env(hub, cache))
    manifest = cache / "benchmarks" / "polaris" / "manifest.json"
    wait_until(lambda: manifest.is_file() and downloading(hub, "default/test/0000.parquet"), child)
    child.kill()
    child.wait(HANG_GUARD)
    hub.release()
    hub.replace_content(pinned, "default/test/0000.parquet", parquet(rows[:6]))
    other = one_line_error(capeval(["bench", "polaris", "--scores", f"s={scores}", "--quiet"], env(hub, cache)))
    assert "changed under the same name" in other and "--refresh" in other
    hub.commit("yuwd/Polaris", {"default/test/0000.parquet": parquet(rows[:6])}, ref=PARQUET)
    fixed = subprocess.run([sys.executable, "-c", FETCH.replace("progress=False", "refresh=True, progress=False"),
                            "polaris"], env=env(hub, cache), capture_output=True, text=True, timeout=HANG_GUARD)
    assert fixed.returncode == 0, fixed.stderr
    assert len(get_benchmark("polaris").reader(Path(fixed.stdout.strip())).captions) == 6  # Composite's 1-5 scores


def nebula_rows() -> tuple[list[dict], dict[tuple[str, str], list[float]]]:
    rows, corrections = [], {}
    for i in range(10):
        caption = f"a  caption {i} of a scene"
        rows.append({"file_name": f"{1000 + i // 2}.jpg", "image": {"bytes": png(i // 2), "path": None},
                     "refs": json.dumps([f"a scene {i // 2}", "a view"]), "mt": caption, "human_score": (i % 5) / 4})
        if i % 3 == 0:  # two corrected ratings of this row in Spica (whitespace collapsed there)
            corrections[(str(1000 + i // 2), " ".join(caption.split()))] = [((i + 1) % 5) / 4, ((i + 2) % 5) / 4]
    return rows, corrections


@pytest.mark.slow
def test_nebula_gets_spicas_corrected_scores_by_default(hub, tmp_path):
    """Fetched Nebula: each test row whose image and caption Spica rates takes the mean of Spica's scores (the
    published corrections); --no-corrections keeps the file's own. Checked against scipy's tau-c."""
    rows, corrections = nebula_rows()
    hub.commit("Ka2ukiMatsuda/Nebula", {"default/test/0000.parquet": parquet(rows)}, ref=PARQUET)
    spica = {}
    for k, name in enumerate(("spica_train.csv", "spica_val.csv", "spica_test.csv")):
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["imgid", "mt", "refs", "score"])
        for (image, caption), scores in corrections.items():
            if k < len(scores):
                writer.writerow([image, caption, "['x']", scores[k]])
        writer.writerow(["9999", "not in the test split", "['x']", 0.5])
        spica[name] = out.getvalue().encode()
    hub.commit("hiranohachiman/Spica", {"README.md": b"# Spica", **spica}, lfs=False)
    metric = np.array([(i * 3) % 7 for i in range(10)], dtype=float)
    scores = tmp_path / "scores.jsonl"
    scores.write_text("".join(json.dumps({"image": r["file_name"], "caption": r["mt"], "score": s}) + "\n"
                              for r, s in zip(rows, metric)))
    cache = tmp_path / "cache"
    base = ["bench", "nebula", "--scores", f"s={scores}", "--bootstrap", "0", "--quiet"]
    corrected = capeval([*base, "--json", str(tmp_path / "c.json")], env(hub, cache))
    assert corrected.returncode == 0, corrected.stderr
    original = capeval([*base, "--no-corrections", "--json", str(tmp_path / "o.json")], env(hub, cache))
    assert original.returncode == 0, original.stderr

    human = np.array([r["human_score"] for r in rows])
    fixed = np.array([np.mean(corrections.get((r["file_name"][:-4], " ".join(r["mt"].split())), [h]))
                      for r, h in zip(rows, human)])
    c, o = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("c", "o"))
    assert c["results"]["s"]["kendall_tau_c"] == pytest.approx(100 * kendalltau(metric, fixed, variant="c")[0])
    assert o["results"]["s"]["kendall_tau_c"] == pytest.approx(100 * kendalltau(metric, human, variant="c")[0])
    assert c["data"]["labels"]["changed"] == int(np.sum(fixed != human)) > 0
    assert c["data"]["fetched"]["corrections"]["repository"] == "hiranohachiman/Spica"
    assert c["data"]["fetched"]["corrections"]["applied"] and not o["data"]["fetched"]["corrections"]["applied"]


def longcap_rows(aspect: str) -> list[dict]:
    """LongCap-Arena's columns (file_name, image, refs, cand, score): several long candidates per DCI image, the
    candidates' whitespace as loose as the Hub's."""
    return [{"file_name": f"sa_{154 + i // 3}.jpg", "image": {"bytes": png(i // 3), "path": None},
             "refs": [f"This is image {i // 3}.\nIt shows  a long scene with {i % 4} objects."],
             "cand": f"The image depicts a scene ({aspect} {i}).  It is long\n and detailed.",
             "score": round(((i * 5) % 9) / 8, 3)} for i in range(12)]


def test_longcap_arena_fetched_per_test_set_and_aspect(hub, tmp_path):
    """LongCap-Arena's six benchmarks (Test A = dci_val, Test B = dci_test; Descriptiveness, Relevance, Fluency)
    each fetch their own split of the conversion: `capeval bench` on per-sample scores gives scipy's tau-b and
    tau-c over the split's rows, the same Ratings as the Hub's Parquet file read with --data, and
    `capeval reproduce --dry-run` lists VELA's published figures for it."""
    splits = {f"default/{split}.{aspect}/0000.parquet": parquet(longcap_rows(f"{split}.{aspect}"))
              for split in ("dci_val", "dci_test") for aspect in ("desc", "rel", "flu")}
    commit = hub.commit("Ka2ukiMatsuda/LongCap-Arena", splits, ref=PARQUET)
    cache = tmp_path / "cache"
    rows = longcap_rows("dci_test.flu")
    metric = np.array([(i * 7) % 5 for i in range(len(rows))], dtype=float)
    scores = tmp_path / "scores.jsonl"
    scores.write_text("".join(json.dumps({"image": r["file_name"], "caption": " ".join(r["cand"].split()),
                                          "score": s}) + "\n" for r, s in zip(rows, metric)))
    done = capeval(["bench", "longcaparena-testb-flu", "--scores", f"s={scores}", "--bootstrap", "0", "--quiet",
                    "--json", str(tmp_path / "out.json")], env(hub, cache))
    assert done.returncode == 0, done.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    human = np.array([r["score"] for r in rows])
    for variant in ("b", "c"):
        want = 100 * kendalltau(metric, human, variant=variant)[0]
        assert out["results"]["s"][f"kendall_tau_{variant}"] == pytest.approx(want)
    origin = out["data"]["fetched"]
    assert (origin["repository"], origin["revision"]) == ("Ka2ukiMatsuda/LongCap-Arena", commit)
    assert [f["path"] for f in origin["files"]] == ["default/dci_test.flu/0000.parquet"]

    fetched = fetch.cached("longcaparena-testb-flu", cache / "benchmarks")
    assert fetched is not None and fetch.cached("longcaparena-testa-flu", cache / "benchmarks") is None
    local = tmp_path / "dci_test.flu-00000-of-00001.parquet"
    local.write_bytes(splits["default/dci_test.flu/0000.parquet"])
    got, want = load_benchmark("longcaparena-testb-flu", fetched.data), load_benchmark("longcaparena-testb-flu", local)
    assert got.captions.candidates == want.captions.candidates
    assert got.captions.references == want.captions.references
    np.testing.assert_array_equal(got.human, want.human)
    assert sorted(p.name for p in fetched.images.iterdir()) == [f"sa_{154 + k}.jpg" for k in range(4)]

    from capeval_plugins.cli import main  # the dry run reads no network: in this process

    assert main(["reproduce", "--dry-run", "--json", str(tmp_path / "plan.json")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())["pairs"]
    vela = {(p["setting"], v["statistic"]): v["value"] for p in plan for v in p["published"] if p["metric"] == "vela"}
    assert len(vela) == 12 and vela["longcaparena-testb-flu", "kendall_tau_b"] == 38.7


@pytest.mark.slow
def test_flickr8k_layouts_and_docent_read_as_their_public_files(hub, tmp_path):
    """Flickr8k-Expert and -CF rows (one per rating, as the Hub holds them) are written as the CLIPScore json, so
    the reader applies each protocol: the same Ratings as from a hand-written CLIPScore file. DOCENT's Parquet
    is handed to its reader as it is."""
    rows = []
    for i in range(9):
        image = i // 3
        refs = [f"dog {image} runs", f"a dog {image}", "candidate zero"]  # image 0 has its own candidate as a reference
        caption = "candidate zero" if i == 0 else f"candidate {i}"
        rows.append({"img": {"bytes": png(image), "path": f"{image}.jpg"}, "cand": caption, "refs": refs,
                     "human_score": float(i % 4 + 1)})
    docent = [{"uuid": f"u{i}", "image": {"bytes": png(i), "path": None}, "model1": "a", "model2": "b",
               "model1_generation": f"first {i}", "model2_generation": f"second {i}", "reference": f"ref {i}",
               "mistakes": "equal", "omissions": "1_much_better", "overall_quality": "2_slightly_better"}
              for i in range(3)]
    hub.commit("yuwd/Flickr8k-HumanEval", {"expert/test/0000.parquet": parquet(rows),
                                           "crowdflower/test/0000.parquet": parquet(rows)}, ref=PARQUET)
    hub.commit("amitha/docent-eval-coarse", {"default/test/0000.parquet": parquet(docent)}, ref=PARQUET)
    script = ("from capeval_plugins.bench.fetch import fetch\n"
              "for b in ('flickr8k-expert', 'flickr8k-cf', 'docent'): print(fetch(b, progress=False).data)")
    done = subprocess.run([sys.executable, "-c", script], env=env(hub, tmp_path / "cache"), capture_output=True,
                          text=True, timeout=HANG_GUARD)
    assert done.returncode == 0, done.stderr
    expert, crowd, doc = done.stdout.split()
    by_image: dict[str, dict] = {}
    for row in rows:
        entry = by_image.setdefault(row["img"]["path"], {"ground_truth": row["refs"], "human_judgement": []})
        entry["human_judgement"].append({"caption": row["cand"], "rating": row["human_score"],
                                         "image_path": row["img"]["path"]})
    (tmp_path / "flickr8k.json").write_text(json.dumps(by_image))
    for name, path in (("flickr8k-expert", expert), ("flickr8k-cf", crowd)):  # the layouts (one set of ratings)
        read = get_benchmark(name).reader
        got, want = read(Path(path)), read(tmp_path / "flickr8k.json")
        assert got.captions.candidates == want.captions.candidates
        assert got.captions.references == want.captions.references
        assert got.captions.images == want.captions.images
        np.testing.assert_array_equal(got.human, want.human)
        assert got.excluded == want.excluded
    assert load_benchmark("flickr8k-expert", expert).excluded == 1  # the candidate among its references
    pairs = load_benchmark("docent", doc)
    assert len(pairs) == 3 and pairs.graded["omissions"].tolist() == [0, 0, 0]


def test_the_cache_must_be_private_and_its_manifest_whole(tmp_path, monkeypatch):
    """A cache folder others can write, or a link in its place, is refused before anything is read; a damaged
    manifest is refused, and --refresh goes past it (here to the offline refusal: nothing cached)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(fetch.FetchError, match="can be written by other users"):
        fetch.fetch("composite", root=shared)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(fetch.files.FileError, match="symbolic link"):
        fetch.fetch("composite", root=tmp_path / "link")
    with pytest.raises(fetch.FetchError, match="no public home"):
        fetch.fetch("pascal50s", root=tmp_path / "own")
    with fetch._locked(tmp_path / "own") as claim:
        claim.write("composite/manifest.json", b"{not json")
    with pytest.raises(fetch.FetchError, match="damaged or of another version; run again with --refresh"):
        fetch.fetch("composite", root=tmp_path / "own")
    with pytest.raises(fetch.FetchError, match="downloads are off"):
        fetch.fetch("composite", root=tmp_path / "own", refresh=True)


# ---------------------------------------------------------------------------------------------------------
# Issue 49: hostile files from the Hub (bounded Parquet, human scores on the declared scale, one line each)

def repeated_rows(n: int) -> bytes:
    """A Parquet file of ``n`` identical Polaris rows: dictionary-encoded, 170 KB for a million rows."""
    index = pa.array(np.zeros(n, np.int32))

    def column(value):
        return pa.DictionaryArray.from_arrays(index, pa.array([value]))

    table = pa.table({"img": column(png(0)), "cand": column("a caption"), "refs": column('["a reference"]'),
                      "human_score": pa.array(np.full(n, 0.5))})
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()


def test_a_million_row_parquet_file_is_refused_from_its_footer(hub, tmp_path):
    """A 170 KB file of 1,000,000 rows (the issue's 230 KB file grew to 2.33 GB as it was laid out) is refused by
    its row count, read from the footer before any row is decoded: one line, exit 2, nothing laid out."""
    data = repeated_rows(1_000_000)
    assert len(data) < 250_000
    hub.commit("yuwd/Polaris", {"default/test/0000.parquet": data}, ref=PARQUET)
    scores = tmp_path / "s.jsonl"
    scores.write_text(json.dumps({"image": "x", "caption": "a caption", "score": 1}) + "\n")
    cache = tmp_path / "cache"
    refused = one_line_error(capeval(["bench", "polaris", "--scores", f"s={scores}", "--quiet"], env(hub, cache)))
    assert "1,000,000 rows, more than Polaris has by far" in refused and "--data" in refused, refused
    assert not list(cache.rglob("data.json")) and not list(cache.rglob("images/*"))


@pytest.mark.parametrize("content", [b"", b"PAR1" + b"\0" * 64 + b"PAR1", b"not parquet at all" * 10])
def test_a_malformed_hub_parquet_file_is_one_line(hub, tmp_path, content):
    """A file that is not Parquet (empty, a bare magic, text) where the conversion should be: exit 2, one line
    naming the file, for a layout capeval writes (Nebula) and for one handed to its reader as it is (DOCENT)."""
    hub.commit("Ka2ukiMatsuda/Nebula", {"default/test/0000.parquet": content}, ref=PARQUET)
    hub.commit("amitha/docent-eval-coarse", {"default/test/0000.parquet": content}, ref=PARQUET)
    hub.commit("hiranohachiman/Spica", {n: b"imgid,mt,refs,score\n" for n in fetch.SPICA.files}, lfs=False)
    scores = tmp_path / "s.jsonl"
    scores.write_text(json.dumps({"image": "x", "caption": "a caption", "score": 1}) + "\n")
    for benchmark in ("nebula", "docent"):
        line = one_line_error(capeval(["bench", benchmark, "--scores", f"s={scores}", "--quiet"],
                                      env(hub, tmp_path / benchmark)))
        assert "0000.parquet" in line and "Parquet" in line, line


def test_a_non_finite_human_score_in_a_fetched_row_is_refused(hub, tmp_path):
    """A human score of +inf in a fetched row was dropped with "excluded: 0" and the figures computed without
    it; now the row is named with the benchmark's scale, exit 2 (NaN and a score of 7 on [0, 1] too)."""
    scores = tmp_path / "s.jsonl"
    for k, bad in enumerate((float("inf"), float("nan"), 7.0)):
        rows = [dict(r) for r in longcap_rows("dci_val.desc")]
        rows[4]["score"] = bad
        hub.commit("Ka2ukiMatsuda/LongCap-Arena", {"default/dci_val.desc/0000.parquet": parquet(rows)}, ref=PARQUET)
        scores.write_text("".join(json.dumps({"image": r["file_name"], "caption": " ".join(r["cand"].split()),
                                              "score": i}) + "\n" for i, r in enumerate(rows)))
        line = one_line_error(capeval(["bench", "longcaparena-testa-desc", "--scores", f"s={scores}", "--quiet"],
                                      env(hub, tmp_path / f"cache{k}")))
        assert "row 4" in line and f"{bad!r}" in line and "scale [0, 1]" in line, line


def test_spica_corrections_outside_the_scale_are_refused_before_they_are_averaged(hub, tmp_path):
    """Corrections of -1e9 and 1e300 gave tau-c 63.0 instead of 19.2 and a Pearson of exactly 0.0 (overflow),
    exit 0. Each corrected score is checked against Nebula's scale before any is averaged (-1e9 and +1e9 would
    average to 0, inside it): one line naming the score, exit 2; --no-corrections still runs."""
    rows, _ = nebula_rows()
    hub.commit("Ka2ukiMatsuda/Nebula", {"default/test/0000.parquet": parquet(rows)}, ref=PARQUET)
    scores = tmp_path / "scores.jsonl"
    scores.write_text("".join(json.dumps({"image": r["file_name"], "caption": r["mt"], "score": (i * 3) % 7}) + "\n"
                              for i, r in enumerate(rows)))
    base = ["bench", "nebula", "--scores", f"s={scores}", "--bootstrap", "0", "--quiet"]
    for k, (low, high) in enumerate(((-1e9, 1e300), (-1e9, 1e9))):
        spica = {}
        for split, value in zip(fetch.SPICA.files, (low, high, 0.5)):
            caption = " ".join(rows[0]["mt"].split())
            spica[split] = f"imgid,mt,refs,score\n1000,{caption},['x'],{value!r}\n".encode()
        hub.commit("hiranohachiman/Spica", spica, lfs=False)
        cache = tmp_path / f"cache{k}"
        line = one_line_error(capeval(base, env(hub, cache)))
        assert f"the score {low!r}" in line and "outside Nebula's scale [0, 1]" in line, line
        assert capeval([*base, "--no-corrections"], env(hub, cache)).returncode == 0


def test_a_stalled_download_is_one_line_not_twelve(hub, tmp_path):
    """A Hub that sends nothing: huggingface_hub retries, and logged two lines a retry (12 before the error); now
    its retries are silent and the failure is the one line."""
    hub.commit("yuwd/Polaris", {"default/test/0000.parquet": parquet(composite_rows())}, ref=PARQUET)
    hub.hang("default/test/0000.parquet")
    got = capeval(["bench", "polaris", "--metric", "bleu4", "--quiet"],
                  env(hub, tmp_path / "cache", HF_HUB_DOWNLOAD_TIMEOUT="1"))
    hub.release()
    assert "cannot fetch polaris from the Hugging Face dataset yuwd/Polaris" in one_line_error(got)
    resumed = [entry for entry in hub.log if entry[1].endswith("/default/test/0000.parquet") and entry[0] == "GET"]
    assert len(resumed) > 1  # it did retry: only the lines went
