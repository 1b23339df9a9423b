"""Human scores on each benchmark's declared scale (capeval_plugins/bench/benchmarks.py: HUMAN_SCALES), and
correlations that stay right on any finite values. Issue 49: Spica corrections of -1e9 and 1e300 gave tau-c 63.0
instead of 19.2 and a Pearson printed as exactly 0.0 (overflow), exit 0; +inf in a fetched row was dropped with
"excluded: 0". The declared scales are checked against the published files where they are on this machine."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import BENCHDATA
from scipy.stats import kendalltau, pearsonr, spearmanr

from capeval_plugins.bench import Captions, Ratings, get_benchmark, load_benchmark, run_benchmark
from capeval_plugins.cli import main
from capeval_plugins.contract import MetricInfo, PointwiseMetric
from capeval_plugins.core.correlation import pearson
from capeval_plugins.inputs import InputError

PUBLISHED = [("flickr8k-expert", "flickr8k_expert/flickr8k.json"), ("nebula", "nebula/nebula_test.json"),
             ("thumb", "thumb"), ("activitynet-fact", "factvc/activitynet"), ("youcook2-fact", "factvc/youcook2"),
             ("vatex-eval", "vatex_eval/vid_cans_score_dict.json")]


@pytest.mark.skipif(not BENCHDATA.is_dir(), reason="../shared/benchdata is not on this machine")
@pytest.mark.parametrize("name, path", PUBLISHED)
def test_every_published_file_here_is_on_its_declared_scale(name, path):
    data = load_benchmark(name, BENCHDATA / path)  # would raise on one score outside the scale
    bench = get_benchmark(name)
    for column, values in data.human_columns().items():
        low, high = bench.scale(column)
        assert low <= values.min() and values.max() <= high and len(values) <= bench.max_rows


class Length(PointwiseMetric):
    info = MetricInfo(name="length", display_name="length", description="", citation="", references="never",
                      images="never")

    def score(self, batch):
        return {"score": torch.tensor([float(len(c)) for c in batch.candidates], dtype=torch.float64)}


def nebula_file(tmp_path, scores):
    rows = [{"imgid": f"{k // 2}", "mt": "a dog " + "runs " * k, "refs": ["a dog"], "score": s}
            for k, s in enumerate(scores)]
    path = tmp_path / "nebula.json"
    path.write_text(json.dumps(rows))  # inf and NaN as Python's json writes them
    return path


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), 1e300, -1e9, 1.5])
def test_a_human_score_off_the_scale_is_refused_by_its_row(tmp_path, capsys, bad):
    scores = [0.1, 0.9, 0.4, bad, 0.7, 0.2]
    path = nebula_file(tmp_path, scores)
    with pytest.raises(InputError, match=r"row 3 .*human score .* outside Nebula's scale \[0, 1\]"):
        load_benchmark("nebula", path)
    args = ["bench", "nebula", "--data", str(path), "--metric", "bleu1", "-o", "tokenize=false", "--bootstrap", "0",
            "--no-cache", "--quiet"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("capeval: error: ") and "\n" not in err and "--human-scale" in err, err
    assert main([*args, "--human-scale=-1e301,1e301"]) == (0 if np.isfinite(bad) else 2)  # never inf or NaN
    capsys.readouterr()


def test_another_scale_is_given_by_name_and_numbers_stay_right_at_any_magnitude(tmp_path):
    """--human-scale names the scale a file is on; then even scores of -1e9 and 1e300 give scipy's figures (the
    Pearson was exactly 0.0: squares of 1e300 overflowed)."""
    human = np.array([0.3, -1e9, 1e300, 2.0, 7.5, 1e299, -3.0])
    data = Ratings(Captions([f"i{k}" for k in range(7)], ["a " * (k + 1) for k in (3, 0, 6, 2, 4, 5, 1)]), human)
    with pytest.raises(InputError, match="outside Nebula's scale"):
        run_benchmark("nebula", data, {"length": Length()}, cache=False, bootstrap=0, progress=False)
    report = run_benchmark("nebula", data, {"length": Length()}, cache=False, bootstrap=0, progress=False,
                           human_scale=(-1e301, 1e301)).to_dict()["results"]["length"]
    lengths = np.array([float(len(c)) for c in data.captions.candidates])
    assert report["pearson"] == pytest.approx(100 * pearsonr(lengths, human).statistic, abs=1e-9)
    assert report["spearman"] == pytest.approx(100 * spearmanr(lengths, human).statistic, abs=1e-9)
    assert report["kendall_tau_c"] == pytest.approx(100 * kendalltau(lengths, human, variant="c").statistic, abs=1e-9)
    with pytest.raises(InputError, match="LOW < HIGH"):
        run_benchmark("nebula", data, {"length": Length()}, cache=False, bootstrap=0, progress=False,
                      human_scale=(1.0, 1.0))


def test_each_human_column_has_its_own_scale():
    """FactVC: a paragraph score of 1-5, negated hallucination rates in [-1, 0]; a rate of +0.5 is refused."""
    captions = Captions(["v1", "v2", "v3"], ["a", "b", "c"], [["r"]] * 3)
    good = Ratings(captions, np.zeros(3), targets={"paragraph": [1, 3, 5], "sentence": [-1, -0.5, 0],
                                                    "word": [0, -0.2, -1]})
    bench = get_benchmark("activitynet-fact")
    bench.check(good)
    bad = Ratings(captions, np.zeros(3), targets={"paragraph": [1, 3, 5], "sentence": [-1, 0.5, 0],
                                                   "word": [0, -0.2, -1]})
    with pytest.raises(InputError, match=r"row 1 .*human score \(sentence\) 0.5 is outside ActivityNet-Fact's "
                                         r"scale \[-1, 0\]"):
        bench.check(bad)


@pytest.mark.parametrize("low, high", [(-1e9, 1e300), (-1e9, 1e9)])
def test_label_scores_off_the_scale_are_refused_before_they_are_averaged(tmp_path, low, high):
    """Spica-style corrections (several rows of one image and caption, averaged): -1e9 and +1e9 average to 0,
    inside Nebula's scale, so each score is checked, not the mean."""
    path = nebula_file(tmp_path, [0.1, 0.9, 0.4, 0.6])
    labels = tmp_path / "corrections.csv"
    labels.write_text(f"imgid,mt,score\n1,a dog runs runs,{low!r}\n1,a dog runs runs,{high!r}\n0,a dog,0.5\n")
    with pytest.raises(InputError, match=rf"the score {low!r} of image '1', caption 'a dog runs runs' is outside "
                                         r"Nebula's scale \[0, 1\]"):
        run_benchmark("nebula", path, {"length": Length()}, cache=False, bootstrap=0, progress=False, labels=labels)


@pytest.mark.parametrize("scale", [1e-300, 1e-150, 1.0, 1e150, 1e300])
def test_pearson_equals_scipy_at_any_magnitude(scale):
    rng = np.random.default_rng(0)
    x = rng.normal(size=40) * scale
    y = 0.3 * x / scale + rng.normal(size=40)
    assert pearson(x, y) == pytest.approx(pearsonr(x, y).statistic, abs=1e-12)
    assert pearson(y, x) == pytest.approx(pearsonr(y, x).statistic, abs=1e-12)
    spread = np.array([-1e9, 1e300, 0.5, 3.0, -2.0, 1e299])  # the extremes together
    other = np.array([1.0, 2.0, 0.0, 5.0, 4.0, 3.0])
    assert pearson(spread, other) == pytest.approx(pearsonr(spread, other).statistic, abs=1e-12)
    weights = np.array([1, 2, 0, 1, 3, 1])
    assert pearson(spread, other, weights) == pytest.approx(
        pearsonr(np.repeat(spread, weights), np.repeat(other, weights)).statistic, abs=1e-12)
    assert np.isnan(pearson([1.0, np.inf, 2.0], [1.0, 2.0, 3.0]))  # undefined, never a number
