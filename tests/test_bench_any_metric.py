"""Any metric on any benchmark: ``run_benchmark`` with a plain function, and ``--scores`` files keyed by
benchmark row, image path or image file name (saying which matched; a file name of two images refused)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import capeval_in_process
from scipy.stats import kendalltau

from capeval_plugins.bench import Captions, Ratings, run_benchmark
from capeval_plugins.bench.scorefiles import match_score_file
from capeval_plugins.contract import MetricInfo, PointwiseMetric
from capeval_plugins.inputs import InputError


def word_counts(candidates):
    return [float(len(c.split())) for c in candidates]


class WordCount(PointwiseMetric):
    info = MetricInfo(name="word_count", display_name="word_count", description="", citation="",
                      references="never", images="never")

    def score(self, batch):
        return {"score": torch.tensor(word_counts(batch.candidates), dtype=torch.float64)}


def data(n=40, seed=0, folders=("Flicker8k_Dataset",)):
    rng = np.random.default_rng(seed)
    words = "a dog cat man runs sits on grass red ball".split()
    cands = [" ".join(rng.choice(words, rng.integers(1, 8))) for _ in range(n)]
    images = [f"{folders[i % len(folders)]}/img{i % 9}.jpg" for i in range(n)]
    human = (np.array([len(c.split()) for c in cands]) + rng.integers(0, 3, n)) / 10.0
    return Ratings(Captions(images, cands, [["a dog on grass"]] * n), human)


def tau_c(report, name):
    return report.to_dict()["results"][name]["kendall_tau_c"]


def test_a_plain_function_equals_the_same_scores_as_a_registered_metric():
    seen = {}

    def fn(images, candidates, references):
        seen.update(images=images, references=references)
        return np.array(word_counts(candidates))

    ratings = data()
    report = run_benchmark("nebula", ratings, {"fn": fn, "metric": WordCount()}, cache=False, bootstrap=0,
                           progress=False)
    assert tau_c(report, "fn") == pytest.approx(tau_c(report, "metric"), abs=1e-12)
    expected = 100 * kendalltau(word_counts(ratings.captions.candidates), ratings.human, variant="c").statistic
    assert tau_c(report, "fn") == pytest.approx(expected, abs=1e-9)
    assert seen["images"] == ratings.captions.images and seen["references"] == ratings.captions.references
    assert list(report.to_dict()["results"]) == ["fn", "metric"]  # the order given


def test_none_is_a_row_without_a_score_and_tensors_are_read():
    def fn(images, candidates, references):
        return [None if k == 3 else float(len(c)) for k, c in enumerate(candidates)]

    result = run_benchmark("nebula", data(), {"fn": fn}, cache=False, bootstrap=0, progress=False).to_dict()
    assert result["results"]["fn"]["n_invalid"] == 1
    as_tensor = run_benchmark("nebula", data(), {"fn": lambda i, c, r: torch.tensor(word_counts(c))}, cache=False,
                              bootstrap=0, progress=False)
    assert tau_c(as_tensor, "fn") == pytest.approx(tau_c(run_benchmark(
        "nebula", data(), {"m": WordCount()}, cache=False, bootstrap=0, progress=False), "m"), abs=1e-12)


@pytest.mark.parametrize("answer, message", [
    (lambda c: word_counts(c)[:-1], "returned 39 scores for 40 rows"),
    (lambda c: [float("nan")] + word_counts(c)[1:], "row 0 is nan; return None"),
    (lambda c: [float("inf")] + word_counts(c)[1:], "row 0 is inf"),
    (lambda c: ["1.0"] + word_counts(c)[1:], "row 0 is str '1.0', not a number"),
    (lambda c: [True] + word_counts(c)[1:], "row 0 is bool"),
    (lambda c: 3.0, "returned float; expected a sequence of 40 scores"),
    (lambda c: "scores", "returned str"),
    (lambda c: np.zeros((40, 2)), r"shape \(40, 2\)"),
])
def test_a_function_that_answers_wrongly_is_refused_in_one_line(answer, message):
    with pytest.raises(InputError, match=message):
        run_benchmark("nebula", data(), {"bad": lambda i, c, r: answer(c)}, cache=False, bootstrap=0, progress=False)


def test_a_value_that_is_neither_metric_nor_function_is_refused():
    with pytest.raises(InputError, match="'x' is a str: give a metric"):
        run_benchmark("nebula", data(), {"x": "clipscore"}, cache=False, bootstrap=0, progress=False)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("key, matched_by", [("path", "image path"), ("name", "image file name"),
                                             ("absolute", "image file name"), ("stem", "image name without suffix"),
                                             ("row", "row")])
def test_score_files_match_by_row_path_or_file_name_and_say_which(tmp_path, key, matched_by):
    ratings = data()
    images, cands = ratings.captions.images, ratings.captions.candidates
    scores = word_counts(cands)
    if key == "row":
        rows = [{"row": i, "score": s} for i, s in reversed(list(enumerate(scores)))]  # no image nor caption
    else:
        name = {"path": lambda p: p, "name": lambda p: p.split("/")[-1], "absolute": lambda p: f"/home/me/{p}",
                "stem": lambda p: p.split("/")[-1].removesuffix(".jpg")}[key]
        rows = [{"image": name(im), "caption": c, "score": s} for im, c, s in zip(images, cands, scores)][::-1]
    path = write_rows(tmp_path / "theirs.jsonl", rows)
    matched = match_score_file(path, ratings)
    assert matched.matched_by == matched_by and matched.scores.tolist() == scores
    report = run_benchmark("nebula", ratings, {"m": WordCount()}, scores={"theirs": path}, cache=False,
                           bootstrap=0, progress=False).to_dict()
    assert report["results"]["theirs"]["scores_matched_by"] == matched_by
    assert report["results"]["theirs"]["kendall_tau_c"] == pytest.approx(report["results"]["m"]["kendall_tau_c"],
                                                                           abs=1e-12)


def test_a_file_name_of_two_benchmark_images_is_refused_in_one_line(tmp_path):
    ratings = data(folders=("a", "b"))  # a/img0.jpg and b/img0.jpg ...
    rows = [{"image": im.split("/")[-1], "caption": c, "score": 1.0}
            for im, c in zip(ratings.captions.images, ratings.captions.candidates)]
    path = write_rows(tmp_path / "theirs.jsonl", rows)
    with pytest.raises(InputError, match=r"image file name 'img\d.jpg' names 2 benchmark images \('a/img\d.jpg', "
                                         r"'b/img\d.jpg', ...\); key the scores by the image path or by 'row'"):
        match_score_file(path, ratings)
    # the same file with paths matches
    rows = [{"image": im, "caption": c, "score": 1.0} for im, c in zip(ratings.captions.images,
                                                                      ratings.captions.candidates)]
    assert match_score_file(write_rows(tmp_path / "ok.jsonl", rows), ratings).matched_by == "image path"


def test_unmatched_rows_name_the_key_tried(tmp_path):
    ratings = data()
    rows = [{"image": "elsewhere.jpg", "caption": c, "score": 1.0} for c in ratings.captions.candidates]
    with pytest.raises(InputError, match="40 of 40 benchmark rows have no score"):
        match_score_file(write_rows(tmp_path / "t.jsonl", rows), ratings)
    with pytest.raises(InputError, match="no image, caption column"):
        match_score_file(write_rows(tmp_path / "u.jsonl", [{"score": 1.0}]), ratings)


def test_capeval_bench_prints_which_key_matched(tmp_path):
    rows = [{"imgid": f"imgs/{k % 7:04d}.jpg", "mt": f"a dog {'runs ' * (k % 5)}on grass", "refs": ["a dog"],
             "score": (k % 5) / 4} for k in range(30)]
    (tmp_path / "nebula.json").write_text(json.dumps(rows))
    theirs = write_rows(tmp_path / "theirs.jsonl", [{"image": r["imgid"].split("/")[-1], "caption": r["mt"],
                                                     "score": len(r["mt"])} for r in rows])
    proc = capeval_in_process(["bench", "nebula", "--data", str(tmp_path / "nebula.json"), "--scores",
                               f"theirs={theirs}", "--bootstrap", "0", "--no-cache", "--quiet"])
    assert proc.returncode == 0, proc.stderr
    assert f"theirs: {theirs} matched by image file name" in proc.stderr and "| theirs | 30 |" in proc.stdout


def test_capeval_bench_function_is_evaluated_like_its_scores_file(tmp_path):
    rows = [{"imgid": f"{k % 7:04d}", "mt": f"a dog {'runs ' * (k % 5)}on grass", "refs": ["a dog"],
             "score": (k % 5) / 4} for k in range(30)]
    (tmp_path / "nebula.json").write_text(json.dumps(rows))
    (tmp_path / "mine.py").write_text("def score(images, candidates, references):\n"
                                      "    return [len(c) for c in candidates]\n")
    theirs = write_rows(tmp_path / "theirs.jsonl", [{"image": r["imgid"], "caption": r["mt"], "score": len(r["mt"])}
                                                    for r in rows])
    out = tmp_path / "out.json"
    proc = capeval_in_process(["bench", "nebula", "--data", str(tmp_path / "nebula.json"), "--function",
                               f"mine={tmp_path / 'mine.py'}:score", "--scores", f"theirs={theirs}", "--bootstrap",
                               "0", "--no-cache", "--quiet", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["results"]
    assert results["mine"]["kendall_tau_c"] == pytest.approx(results["theirs"]["kendall_tau_c"], abs=1e-12)
    for bad, message in ((["--function", "mine"], "expects NAME=MODULE:FUNCTION"),
                         (["--function", f"x={tmp_path / 'mine.py'}:nothing"], "has no function 'nothing'"),
                         (["--function", f"theirs={tmp_path / 'mine.py'}:score", "--scores", f"theirs={theirs}"],
                          "named both")):
        proc = capeval_in_process(["bench", "nebula", "--data", str(tmp_path / "nebula.json"), *bad, "--no-cache"])
        assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
            proc.stderr


def test_a_function_on_a_pairwise_benchmark_equals_its_scores_as_a_file(tmp_path):
    from capeval_plugins.bench import Pairs

    rng = np.random.default_rng(0)
    words = "a dog cat man runs sits on grass red ball".split()
    cands = [" ".join(rng.choice(words, rng.integers(1, 8))) for _ in range(24)]
    captions = Captions([f"i{k // 2}.jpg" for k in range(24)], cands, None)
    pairs = Pairs(captions, np.arange(0, 24, 2), np.arange(1, 24, 2), rng.integers(0, 2, 12),
                  ["HC", "HI", "HM", "MM"] * 3)
    rows = [{"row": i, "score": s} for i, s in enumerate(word_counts(cands))]
    path = write_rows(tmp_path / "t.jsonl", rows)
    report = run_benchmark("pascal50s", pairs, {"fn": lambda i, c, r: word_counts(c)}, scores={"file": path},
                           cache=False, bootstrap=0, progress=False).to_dict()["results"]
    assert report["fn"]["accuracy"] == pytest.approx(report["file"]["accuracy"], abs=1e-12)
    assert report["fn"]["categories"] == report["file"]["categories"]
