"""``capeval bench --labels``: another release of a benchmark's human judgments replaces the file's where it
names the same rows (FLEUR's Pascal-50S run labels, Nebula's corrected scores), checked against plain loops."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import BENCHDATA, capeval_here
from scipy.stats import kendalltau

from capeval_plugins.bench import load_benchmark, run_benchmark
from capeval_plugins.bench.labels import read_labels
from capeval_plugins.inputs import InputError

CLI = ["bench"]  # through capeval_here: cli.main in this process (no process boundary under test)
CATEGORIES = ("HC", "HI", "HM", "MM")


def pascal(n: int = 25) -> dict:
    rng = np.random.default_rng(8)
    return {cat: [{"image": f"VOC2012/JPEGImages/2008_{cat}{k:03d}.jpg",
                   "captions": ["a " * int(rng.integers(1, 8)) + cat, "b " * int(rng.integers(1, 8)) + cat],
                   "label": int(rng.integers(0, 2)), "references": ["a ref"]} for k in range(n)]
            for cat in CATEGORIES}


def fleur_run_texts(data: dict, folder: Path, flip: dict[str, set[int]]) -> None:
    """FLEUR's released result layout, one file per category, with the labels of ``flip`` changed."""
    folder.mkdir()
    for cat, pairs in data.items():
        lines = []
        for k, pair in enumerate(pairs):
            label = 1 - pair["label"] if k in flip.get(cat, set()) else pair["label"]
            lines += [f"image file : {pair['image']}", f"label : {label}", ""]
            for caption in pair["captions"]:
                lines += [f"caption : {caption}", "model score : 0.5", "our score : 0.5", ""]
        (folder / f"fleur_pascal_{cat}.txt").write_text("\n".join(lines) + "\n")


def words(caption: str) -> float:
    return float(len(caption.split()))


def test_pascal_run_labels_replace_the_public_ones(tmp_path):
    data = pascal()
    path = tmp_path / "pascal_50s.json"
    path.write_text(json.dumps(data))
    flip = {"HC": {1, 4, 9}, "MM": {0, 2}}
    fleur_run_texts(data, tmp_path / "results", flip)
    pairs = load_benchmark("pascal50s", path)
    scores = tmp_path / "s.jsonl"
    with open(scores, "w") as f:
        for image, caption in zip(pairs.captions.images, pairs.captions.candidates):
            f.write(json.dumps({"image": image, "caption": caption, "score": words(caption)}) + "\n")
    out = tmp_path / "r.json"
    capeval_here(CLI + ["pascal50s", "--data", str(path), "--scores", f"w={scores}", "--labels", str(tmp_path / "results"),
               "--bootstrap", "0", "--json", str(out), "--quiet"])
    report = json.loads(out.read_text())
    assert report["data"]["labels"] == {"path": str(tmp_path / "results"), "matched": 100, "changed": 5,
                                        "unmatched": 0}
    result = report["results"]["w"]
    for cat, rows in data.items():  # the plain loop: strictly higher is right, with the run's labels
        right = []
        for k, pair in enumerate(rows):
            label = 1 - pair["label"] if k in flip.get(cat, set()) else pair["label"]
            a, b = words(" ".join(pair["captions"][label].split())), words(pair["captions"][1 - label])
            right.append(a > b)
        assert result["categories"][cat]["accuracy"] == pytest.approx(100 * np.mean(right), abs=1e-9)
    public = run_benchmark("pascal50s", path, scores={"w": scores}, bootstrap=0, progress=False).to_dict()
    assert "labels" not in public["data"]
    assert public["results"]["w"]["categories"]["HC"]["accuracy"] != result["categories"]["HC"]["accuracy"]


def test_ratings_take_the_mean_of_a_label_file_per_image_and_caption(tmp_path):
    rng = np.random.default_rng(4)
    rows = [{"imgid": f"img{k}", "mt": "a " * int(rng.integers(1, 9)) + "dog", "refs": ["a dog"],
             "score": float(rng.random())} for k in range(40)]
    path = tmp_path / "nebula_test.json"
    path.write_text(json.dumps(rows))
    corrected = tmp_path / "spica"  # a folder of files: every corrected row of an image and caption is averaged
    corrected.mkdir()
    fixed = {k: [float(rng.random()), float(rng.random())] for k in range(0, 40, 3)}
    for split, part in (("train", 0), ("test", 1)):
        with open(corrected / f"spica_{split}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, ["imgid", "mt", "score"])
            writer.writeheader()
            for k, values in fixed.items():
                writer.writerow({"imgid": f"{rows[k]['imgid']}.jpg", "mt": "  " + rows[k]["mt"], "score": values[part]})
            writer.writerow({"imgid": "elsewhere", "mt": "not in the benchmark", "score": 0.3})
    data = load_benchmark("nebula", path)
    scores = tmp_path / "s.jsonl"
    with open(scores, "w") as f:
        for image, caption in zip(data.captions.images, data.captions.candidates):
            f.write(json.dumps({"image": image, "caption": caption, "score": words(caption)}) + "\n")
    report = run_benchmark("nebula", path, scores={"w": scores}, labels=corrected, bootstrap=0,
                           progress=False).to_dict()
    human = [np.mean(fixed[k]) if k in fixed else r["score"] for k, r in enumerate(rows)]
    expected = 100 * kendalltau([words(" ".join(r["mt"].split())) for r in rows], human, variant="c").statistic
    assert report["results"]["w"]["kendall_tau_c"] == pytest.approx(expected, abs=1e-9)
    assert report["data"]["labels"]["matched"] == len(fixed) and report["data"]["labels"]["unmatched"] == 40 - len(fixed)


def test_label_sets_that_cannot_apply_are_refused(tmp_path):
    data = pascal(3)
    path = tmp_path / "pascal_50s.json"
    path.write_text(json.dumps(data))
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"image": "x.jpg", "captions": ["p", "q"], "label": 1}) + "\n")
    with pytest.raises(InputError, match="no row of the benchmark"):
        run_benchmark("pascal50s", path, scores={}, metrics={"w": None}, labels=other, bootstrap=0, progress=False)
    ratings = tmp_path / "r.jsonl"
    ratings.write_text(json.dumps({"image": "x.jpg", "caption": "p", "score": 0.5}) + "\n")
    with pytest.raises(InputError, match="holds ratings"):
        run_benchmark("pascal50s", path, metrics={"w": None}, labels=ratings, bootstrap=0, progress=False)
    clash = tmp_path / "clash.jsonl"
    clash.write_text("".join(json.dumps({"image": "x.jpg", "captions": ["p", "q"], "label": v}) + "\n" for v in (0, 1)))
    with pytest.raises(InputError, match="two labels for one pair"):
        read_labels(clash)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"image": "x.jpg", "captions": ["p", "q"], "label": True}) + "\n")
    with pytest.raises(InputError, match="label 0 or 1"):
        read_labels(bad)


# FLEUR's released Pascal-50S run (Yebin46/FLEUR results/fleur_pascal_*.txt): its own labels reproduce FLEUR's
# published Pascal-50S row (HC 61.3, HI 99.7, HM 97.6, MM 74.2, mean 83.2; FLEUR paper, Table 3).
FLEUR_RESULTS = os.environ.get("CAPEVAL_FLEUR_RESULTS")


@pytest.mark.skipif(not (FLEUR_RESULTS and (BENCHDATA / "pascal50s").is_dir()),
                    reason="set CAPEVAL_FLEUR_RESULTS to FLEUR's results/ folder (and ../shared/benchdata)")
def test_fleur_released_pascal_run_reproduces_its_table_with_its_own_labels(tmp_path):
    results = Path(FLEUR_RESULTS)
    scores = tmp_path / "fleur.jsonl"
    with open(scores, "w") as f:
        for cat in CATEGORIES:
            image = None
            for line in (results / f"fleur_pascal_{cat}.txt").read_text().splitlines():
                head, _, value = line.partition(" : ")
                if head == "image file":
                    image = value.strip()
                elif head == "caption":
                    caption = value.strip()
                elif head == "our score":
                    f.write(json.dumps({"image": image, "caption": caption, "category": cat,
                                        "score": float(value)}) + "\n")
    bench = BENCHDATA / "pascal50s" / "pascal_50s.json"
    relabelled = run_benchmark("pascal50s", bench, scores={"fleur": scores}, labels=results, bootstrap=0,
                               progress=False).to_dict()
    assert relabelled["data"]["labels"]["changed"] == 35
    got = relabelled["results"]["fleur"]
    published = {"HC": 61.3, "HI": 99.7, "HM": 97.6, "MM": 74.2}
    for cat, value in published.items():
        assert round(got["categories"][cat]["accuracy"], 1) == value
    assert round(got["accuracy"], 1) == 83.2
