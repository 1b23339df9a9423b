"""The benchmark runner and protocols: correlations and accuracies equal scipy / plain loops on the rows the
protocol defines, corpus metrics run once on all rows, the score cache never recomputes nor goes stale, the
paired bootstrap is what it says, and ``capeval bench`` prints and writes the documented shapes."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import BENCHDATA, PYTHON, capeval_here, capeval_in_process, has_java, random_image, run
from scipy.stats import kendalltau, pearsonr

import capeval_plugins
from capeval_plugins.bench import Captions, Pairs, Ratings, get_benchmark, run_benchmark
from capeval_plugins.bench.protocols import Resampler, evaluate
from capeval_plugins.contract import INDEX, Metric, MetricInfo, MetricResult, PointwiseMetric, StateSpec
from capeval_plugins.contract import decode_texts, encode_texts
from capeval_plugins.core.correlation import KendallPlan, kendall_tau, pairwise_accuracy, pearson
from capeval_plugins.inputs import InputError

CAPEVAL = str(Path(PYTHON).parent / "capeval")
real = pytest.mark.skipif(not BENCHDATA.is_dir(), reason="../shared/benchdata is not on this machine")
EXPERT = BENCHDATA / "flickr8k_expert" / "flickr8k.json"


def info(name: str, references: str = "never", images: str = "never") -> MetricInfo:
    return MetricInfo(name=name, display_name=name, description="", citation="", references=references, images=images)


class WordCount(PointwiseMetric):
    """Words in the candidate (many ties); counts the samples it maps."""

    info = info("word_count")
    mapped = 0

    def score(self, batch):
        type(self).mapped += len(batch)
        return {"score": torch.tensor([float(len(c.split())) for c in batch.candidates], dtype=torch.float64)}


class Lookup(PointwiseMetric):
    """Scores from a table (NaN for unknown captions); fails once it has mapped ``fail_after`` samples."""

    info = info("lookup")
    table: dict[str, float] = {}
    mapped = 0
    fail_after: int | None = None

    def score(self, batch):
        if self.fail_after is not None and type(self).mapped >= self.fail_after:
            raise KeyboardInterrupt("interrupted")
        type(self).mapped += len(batch)
        return {"score": torch.tensor([self.table.get(c, float("nan")) for c in batch.candidates], dtype=torch.float64)}


class CorpusSpy(Metric):
    """A corpus metric: score = candidate length / corpus size, known only at finalize. Records each finalize."""

    info = info("corpus_spy", references="always")
    calls: list[int] = []

    def states(self):
        return {"text": StateSpec("cat", torch.uint8, (-1,))}

    def map(self, batch):
        return {"text": encode_texts(batch.candidates)}

    def finalize(self, state):
        texts = decode_texts(state["text"])
        type(self).calls.append(len(texts))
        scores = torch.tensor([len(t) / len(texts) for t in texts], dtype=torch.float64)
        return MetricResult("corpus_spy", float(scores.mean()), scores, state[INDEX])


def ratings_data(n=60, seed=0) -> Ratings:
    rng = np.random.default_rng(seed)
    words = "a dog cat man runs sits on grass red ball".split()
    cands = [" ".join(rng.choice(words, rng.integers(1, 8))) for _ in range(n)]
    refs = [[" ".join(rng.choice(words, 5))] for _ in range(n)]
    images = [f"img{i % 13}.png" for i in range(n)]
    human = np.array([len(c.split()) for c in cands]) + rng.integers(0, 3, n)
    return Ratings(Captions(images, cands, refs), human / 10.0)  # within Nebula's scale [0, 1]


# ------------------------------------------------------------------------------------------ the core

@pytest.mark.parametrize("seed", range(8))
def test_weighted_kendall_and_pearson_equal_scipy_on_repeated_rows(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 400))
    x = rng.integers(0, int(rng.integers(2, 6)), n).astype(float)      # human ratings: heavy ties
    y = np.round(x + rng.normal(0, 1.5, n), int(rng.integers(0, 2)))   # metric: some ties
    w = rng.integers(0, 4, n)                                          # a bootstrap replicate's multiplicities
    plan = KendallPlan(x, y)
    xs, ys = np.repeat(x, w), np.repeat(y, w)
    got = plan.statistics(w)
    for variant in "bc":
        np.testing.assert_allclose(got[variant], kendalltau(xs, ys, variant=variant).statistic, atol=1e-12)
        np.testing.assert_allclose(plan.statistics()[variant], kendall_tau(x, y, variant), atol=1e-12)
    np.testing.assert_allclose(pearson(x, y, w), pearsonr(xs, ys).statistic, atol=1e-12)


# ---------------------------------------------------------------------------------- protocol layer

@real
def test_flickr8k_expert_protocol_equals_scipy_on_a_plain_loop_over_the_file(no_order_probe):
    """One row per expert rating, all 16,992 of them; tau-b / tau-c / Pearson equal scipy's on those rows."""
    raw = json.loads(EXPERT.read_text())
    words, ratings = [], []
    for entry in raw.values():
        refs = {" ".join(r.split()) for r in entry["ground_truth"]}
        for j in entry["human_judgement"]:
            if " ".join(j["caption"].split()) not in refs:
                words.append(len(j["caption"].split()))
                ratings.append(j["rating"])
    WordCount.mapped = 0
    report = run_benchmark("flickr8k-expert", EXPERT, {"words": WordCount()}, cache=False, bootstrap=0, progress=False)
    got = report.to_dict()["results"]["words"]
    assert got["n"] == len(ratings) == 16992
    for key, variant in (("kendall_tau_b", "b"), ("kendall_tau_c", "c")):
        assert got[key] == pytest.approx(100 * kendalltau(words, ratings, variant=variant).statistic, abs=1e-9)
    assert got["pearson"] == pytest.approx(100 * pearsonr(words, ratings).statistic, abs=1e-9)
    # a pointwise metric scores each distinct input once: here (text only) each distinct caption, not each rating
    assert WordCount.mapped == len(set(report.data.captions.candidates)) < 5664


@real
def test_corpus_metrics_are_scored_on_all_rows_in_one_call():
    CorpusSpy.calls = []
    report = run_benchmark("flickr8k-expert", EXPERT, {"spy": CorpusSpy()}, cache=False, bootstrap=0, progress=False)
    assert CorpusSpy.calls == [16992]
    cands = report.data.captions.candidates
    assert report.runs["spy"].scores.tolist() == pytest.approx([len(c) / 16992 for c in cands])


@pytest.mark.skipif(not has_java(), reason="PTB tokenisation needs Java")
def test_cider_in_the_harness_equals_pycocoevalcap_on_all_rows_at_once():
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    data = ratings_data(50, seed=1)
    cands, refs = data.captions.candidates + data.captions.candidates[:10], data.captions.references * 2
    data = Ratings(Captions(data.captions.images + data.captions.images[:10], cands, refs[:60]),
                   np.concatenate([data.human, data.human[:10]]))  # repeated rows, as Flickr8k-Expert has
    report = run_benchmark("nebula", data, {"cider": capeval_plugins.load("cider", batch_size=7)}, cache=False,
                           bootstrap=0, progress=False)
    gts = PTBTokenizer().tokenize({i: [{"caption": r} for r in rs] for i, rs in enumerate(data.captions.references)})
    res = PTBTokenizer().tokenize({i: [{"caption": c}] for i, c in enumerate(cands)})
    _, direct = Cider().compute_score(gts, res)
    assert report.runs["cider"].scores.tolist() == pytest.approx(list(direct), rel=1e-12)
    got = report.to_dict()["results"]["cider"]
    assert got["kendall_tau_c"] == pytest.approx(100 * kendalltau(direct, data.human, variant="c").statistic, abs=1e-9)


def pairs_data() -> Pairs:
    """Two categories; scores from Lookup.table: right, wrong, tied and unknown (NaN) pairs."""
    cands = ["a1", "b1", "a2", "b2", "a3", "b3", "a4", "b4", "a5", "b5", "a6", "b6"]
    Lookup.table = {"a1": 2, "b1": 1, "a2": 1, "b2": 3, "a3": 5, "b3": 5, "a4": 0, "b4": 1, "a5": 1, "b5": 9, "a6": 4}
    captions = Captions([f"i{k // 2}" for k in range(12)], cands, None)
    return Pairs(captions, np.arange(0, 12, 2), np.arange(1, 12, 2), np.array([0, 1, 0, 0, 1, 0]),
                 ["X", "X", "X", "Y", "Y", "Y"])


@pytest.mark.parametrize("ties", ["wrong", "half"])
def test_pairwise_accuracy_per_category_and_mean_equal_plain_loops(ties):
    data = pairs_data()
    report = run_benchmark("mceval", data, {"lookup": Lookup()}, cache=False, bootstrap=0, ties=ties, progress=False)
    got = report.to_dict()["results"]["lookup"]
    s = report.runs["lookup"].scores
    expected = {}
    for cat in ("X", "Y"):
        idx = [k for k, c in enumerate(data.categories)
               if c == cat and np.isfinite(s[data.first[k]] + s[data.second[k]])]
        expected[cat] = 100 * pairwise_accuracy(s[data.first[idx]], s[data.second[idx]], data.label[idx], ties=ties)
    assert {c: v["accuracy"] for c, v in got["categories"].items()} == pytest.approx(expected)
    assert got["accuracy"] == pytest.approx(np.mean(list(expected.values())))
    assert got["n"] == 5 and got["n_invalid"] == 1 and got["n_ties"] == 1  # the NaN pair is left out, counted


# --------------------------------------------------------------------------------------------- cache

def test_repeated_run_reads_the_cache_and_a_changed_config_does_not(tmp_path):
    data, cache = ratings_data(), tmp_path / "scores.sqlite"
    WordCount.mapped = 0
    first = run_benchmark("nebula", data, {"w": WordCount()}, cache=cache, bootstrap=0, progress=False)
    distinct = WordCount.mapped
    second = run_benchmark("nebula", data, {"w": WordCount()}, cache=cache, bootstrap=0, progress=False)
    assert WordCount.mapped == distinct and second.runs["w"].computed == 0
    assert second.to_dict()["results"]["w"]["kendall_tau_c"] == first.to_dict()["results"]["w"]["kendall_tau_c"]
    third = run_benchmark("nebula", data, {"w": WordCount(batch_size=3)}, cache=cache, bootstrap=0, progress=False)
    assert third.runs["w"].computed == 0  # batch size does not change scores, so it is not part of the key

    CorpusSpy.calls = []
    for _ in range(2):
        run_benchmark("nebula", data, {"spy": CorpusSpy()}, cache=cache, bootstrap=0, progress=False)
    assert CorpusSpy.calls == [60]  # corpus metrics are cached per corpus
    sub = Ratings(Captions(data.captions.images[:30], data.captions.candidates[:30], data.captions.references[:30]),
                  data.human[:30])
    run_benchmark("nebula", sub, {"spy": CorpusSpy()}, cache=cache, bootstrap=0, progress=False)
    assert CorpusSpy.calls == [60, 30]  # another corpus: its scores differ, so they are recomputed

    from capeval_plugins.metrics.coco import Cider

    assert _key(Cider(sigma=6.0)) != _key(Cider(sigma=5.0)) != _key(Cider(sigma=5.0, tokenize=False))
    assert _key(Cider()) == _key(Cider(batch_size=2))


def _key(metric):
    from capeval_plugins.bench.cache import metric_key

    return metric_key(metric, images=False, references=True)


def test_a_local_model_folder_is_part_of_the_key(tmp_path):
    from capeval_plugins.bench.cache import metric_key
    from capeval_plugins.metrics.clipscore import CLIPScore

    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"1")
    before = metric_key(CLIPScore(model=str(model)), True, False)
    (model / "model.safetensors").write_bytes(b"22")
    assert metric_key(CLIPScore(model=str(model)), True, False) != before


def test_an_interrupted_run_resumes_without_recomputing(tmp_path, no_order_probe):
    cache = tmp_path / "scores.sqlite"
    cands = [f"caption {k}" for k in range(700)]
    Lookup.table = {c: float(k % 17) for k, c in enumerate(cands)}
    data = Ratings(Captions(["i"] * 700, cands, None), np.arange(700, dtype=float) / 700)
    Lookup.mapped, Lookup.fail_after = 0, 256  # each finished batch is cached: the run stops after 256 samples
    with pytest.raises(KeyboardInterrupt):
        run_benchmark("nebula", data, {"lookup": Lookup()}, cache=cache, bootstrap=0, progress=False)
    assert Lookup.mapped == 256
    Lookup.mapped, Lookup.fail_after = 0, None
    report = run_benchmark("nebula", data, {"lookup": Lookup()}, cache=cache, bootstrap=0, progress=False)
    assert Lookup.mapped == 700 - 256 and report.runs["lookup"].from_cache == 256
    assert report.runs["lookup"].scores.tolist() == [float(k % 17) for k in range(700)]


# ----------------------------------------------------------------------------------------- bootstrap

def test_bootstrap_replicates_are_resampled_images_and_paired():
    data = ratings_data(80, seed=2)
    rng = np.random.default_rng(0)
    good = data.human + rng.normal(0, 0.05, 80)  # human scores are tenths here
    noise = rng.normal(0, 1, 80)
    protocol = get_benchmark("nebula").protocol
    scores = {"good": good, "noise": noise, "good_again": good.copy()}
    evals, comparisons = evaluate(data, protocol, scores, replicates=200, seed=3)
    again, _ = evaluate(data, protocol, scores, replicates=200, seed=3)
    assert np.array_equal(evals["good"].replicates["kendall_tau_c"], again["good"].replicates["kendall_tau_c"])
    # replicate 0 is the data with each image's rows repeated as often as the image was drawn
    w = next(iter(Resampler(data.units("image"), None, 1, 3)))
    units = data.units("image")
    assert all(len(set(w[units == u])) == 1 for u in np.unique(units))
    expected = 100 * kendall_tau(np.repeat(good, w), np.repeat(data.human, w), "c")
    assert evals["good"].replicates["kendall_tau_c"][0] == pytest.approx(expected, abs=1e-9)
    lo, hi = (np.percentile(evals["good"].replicates["kendall_tau_c"], q) for q in (2.5, 97.5))
    assert lo <= evals["good"].stats["kendall_tau_c"] <= hi
    by_pair = {tuple(c["metrics"]): c for c in comparisons}
    assert by_pair[("good", "noise")]["p_value"] < 0.01 and by_pair[("good", "noise")]["ci95"][0] > 0
    assert by_pair[("good", "good_again")]["difference"] == 0 and by_pair[("good", "good_again")]["p_value"] == 1.0


def test_a_comparison_uses_the_rows_both_metrics_scored():
    data = ratings_data(60, seed=4)
    rng = np.random.default_rng(1)
    a, b = data.human + rng.normal(0, 1, 60), rng.normal(0, 1, 60)
    a[:7] = np.nan
    evals, comparisons = evaluate(data, get_benchmark("nebula").protocol, {"a": a, "b": b}, replicates=50)
    assert evals["a"].n == 53 and evals["a"].n_invalid == 7 and evals["b"].n == 60
    expected = 100 * (kendall_tau(a[7:], data.human[7:], "c") - kendall_tau(b[7:], data.human[7:], "c"))
    assert comparisons[0]["difference"] == pytest.approx(expected, abs=1e-9)


def test_pairwise_bootstrap_keeps_category_sizes():
    data = pairs_data()
    cats = np.asarray(data.categories)
    for w in Resampler(data.units("image"), cats, 20, 0):
        assert w[cats == "X"].sum() == 3 and w[cats == "Y"].sum() == 3


# ------------------------------------------------------------------------------------ images, errors

def test_image_metrics_resolve_the_folder_and_text_metrics_need_none(tiny_clip, tmp_path):
    data = ratings_data(12)
    for name in sorted(set(data.captions.images)):
        random_image(len(name), size=(32, 32)).save(tmp_path / name)
    with pytest.raises(InputError, match="pass the image folder"):
        run_benchmark("nebula", data, {"clip": capeval_plugins.load("clipscore", model=tiny_clip)}, cache=False,
                      bootstrap=0, progress=False)
    report = run_benchmark("nebula", data, {"clip": capeval_plugins.load("clipscore", model=tiny_clip),
                                            "words": WordCount()}, images=tmp_path, cache=False, bootstrap=0,
                           progress=False)
    paths = [str(tmp_path / name) for name in data.captions.images]
    direct = capeval_plugins.load("clipscore", model=tiny_clip)(paths, data.captions.candidates)
    assert report.runs["clip"].scores.tolist() == pytest.approx(direct.scores.tolist(), abs=1e-6)


class Brightness(PointwiseMetric):
    """Mean pixel value of each sample's image (times a factor): a metric that reads pixels."""

    info = info("brightness", images="always")
    factor = 1.0

    def score(self, batch):
        means = [float(np.asarray(img, dtype=np.float64).mean()) * self.factor for img in batch.images]
        return {"score": torch.tensor([means[i] for i in batch.image_index.tolist()], dtype=torch.float64)}


class Darkness(Brightness):
    info = info("darkness", images="always")
    factor = -1.0


@pytest.mark.parametrize("prefetch", ["0", "1"])
def test_several_metrics_are_one_pass_each_image_decoded_once(tmp_path, monkeypatch, prefetch):
    """``capeval bench -m a -m b`` is one pass over the images, as ``capeval score`` is: 13 images, 60 rows, two
    metrics with different batch sizes, with and without the prefetch thread: each image is decoded once (the
    prefetch thread leaves the images of the batch being scored to the cache; the row-order probe reads them
    there), and each metric's scores are its scores alone."""
    from capeval_plugins.image_sources import ImageSource

    monkeypatch.setenv("CAPEVAL_PREFETCH", prefetch)
    data = ratings_data(60)
    for name in sorted(set(data.captions.images)):
        random_image(len(name) + ord(name[3]), size=(40, 30)).save(tmp_path / name)
    decoded = []
    real = ImageSource.load
    monkeypatch.setattr(ImageSource, "load", lambda self: decoded.append(self.key) or real(self))
    metrics = {"bright": Brightness(batch_size=4), "dark": Darkness(batch_size=7)}
    report = run_benchmark("nebula", data, metrics, images=tmp_path, cache=False, bootstrap=0, progress=False)
    assert len(decoded) == len(set(decoded)) == 13, sorted(decoded)
    paths = [str(tmp_path / name) for name in data.captions.images]
    alone = Brightness()(paths, data.captions.candidates).scores.tolist()
    assert report.runs["bright"].scores.tolist() == alone
    assert report.runs["dark"].scores.tolist() == [-v for v in alone]
    decoded.clear()  # capeval score: the same loop
    from capeval_plugins.runner import score_many

    results = score_many({"bright": Brightness(batch_size=4), "dark": Darkness(batch_size=7)}, paths,
                         data.captions.candidates)
    assert len(decoded) == len(set(decoded)) == 13 and results["bright"].scores.tolist() == alone


def test_a_reference_metric_on_a_reference_free_file_is_a_clear_error():
    data = Ratings(Captions(["i"], ["a dog"], None), np.array([1.0]))
    with pytest.raises(InputError, match="corpus_spy needs references"):
        run_benchmark("composite", data, {"corpus_spy": CorpusSpy()}, cache=False, bootstrap=0, progress=False)


def test_options_go_to_the_metric_they_name():
    from capeval_plugins.commands.bench import build_metrics
    from capeval_plugins.options import OptionError

    metrics = build_metrics(["bleu4", "cider"], ["cider.sigma=5", "bleu4.tokenize=false"])
    assert metrics["cider"].config.sigma == 5.0 and metrics["bleu4"].config.tokenize is False
    assert metrics["cider"].config.tokenize is True
    both = build_metrics(["bleu4", "cider"], ["tokenize=false"])  # a bare option: every metric that takes it
    assert both["bleu4"].config.tokenize is False and both["cider"].config.tokenize is False
    with pytest.raises(OptionError, match="names metric 'meteor', which is not selected"):
        build_metrics(["bleu4"], ["meteor.tokenize=false"])
    with pytest.raises(OptionError, match="no selected metric takes option 'w'"):
        build_metrics(["bleu4"], ["w=2"])


# ------------------------------------------------------------------------------------- command line

@pytest.mark.slow
def test_capeval_bench_prints_the_table_writes_json_and_a_plot(tmp_path):
    rows = [{"imgid": f"{k % 7:04d}", "mt": f"a dog {'runs ' * (k % 5)}on grass", "refs": ["a dog runs", "a dog"],
             "score": (k % 5) / 4} for k in range(30)]
    (tmp_path / "nebula.json").write_text(json.dumps(rows))
    cmd = ["bench", "nebula", "--data", str(tmp_path / "nebula.json"), "--metric", "rouge_l", "--metric",
           "cider", "-o", "rouge_l.tokenize=false", "-o", "cider.tokenize=false", "--bootstrap", "50", "--cache",
           str(tmp_path / "c.sqlite"), "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "plots"),
           "--quiet"]
    out = capeval_here(cmd).stdout  # cli.main in this process: no process boundary under test
    assert "| metric | n | Kendall τb | Kendall τc | Pearson | Spearman | 95% CI (Kendall τc) | time (s) |" in out
    assert "| rouge_l | 30 |" in out and "| cider | 30 |" in out and "rouge_l vs cider" in out and "wall time:" in out
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["benchmark"] == "nebula" and doc["protocol"]["statistic"] == "kendall_tau_c"
    assert set(doc["results"]) == {"rouge_l", "cider"}
    result = doc["results"]["cider"]
    assert {"kendall_tau_b", "kendall_tau_c", "pearson", "n", "ci95"} <= set(result) and result["n"] == 30
    assert (tmp_path / "plots" / "nebula.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "(cached)" in capeval_here(cmd).stdout

    pairs = {c: [{"image": f"{c}{k}.jpg", "captions": ["a dog runs", f"a {c} thing {k}"], "label": k % 2,
                  "references": ["a dog runs fast"]} for k in range(6)] for c in ("HC", "HI", "HM", "MM")}
    (tmp_path / "pascal.json").write_text(json.dumps(pairs))
    out = capeval_here(["bench", "pascal50s", "--data", str(tmp_path / "pascal.json"), "--metric", "bleu1", "-o",
               "bleu1.tokenize=false", "--no-cache", "--json", str(tmp_path / "p.json"), "--quiet"]).stdout
    assert "| metric | n | HC | HI | HM | MM | mean | 95% CI (mean) | ties | time (s) |" in out
    result = json.loads((tmp_path / "p.json").read_text())["results"]["bleu1"]
    assert set(result["categories"]) == {"HC", "HI", "HM", "MM"} and result["accuracy"] == pytest.approx(50.0)


@pytest.mark.slow
def test_bad_benchmark_input_is_one_line_with_exit_code_2(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps([{"mt": "x", "refs": ["y"], "imgid": "3"}]))
    proc = capeval_in_process(["bench", "nebula", "--data", str(tmp_path / "bad.json"), "--metric", "bleu4",
                               "--no-cache"])
    assert proc.returncode == 2 and "row 0: no human score" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_importing_the_harness_imports_neither_matplotlib_nor_pycocoevalcap():
    code = ("import sys, capeval_plugins.bench, capeval_plugins.commands.bench, capeval_plugins.metrics.coco; "
            "print(sorted(m for m in ('matplotlib', 'pycocoevalcap', 'scipy') if m in sys.modules))")
    assert run([PYTHON, "-c", code]).stdout.strip() == "[]"
    # the `capeval` parser lists the benchmarks without importing torch
    code = ("import argparse, sys; from capeval_plugins.commands.bench import add_parser; "
            "add_parser(argparse.ArgumentParser().add_subparsers()); print('torch' in sys.modules)")
    assert run([PYTHON, "-c", code]).stdout.strip() == "False"


@pytest.mark.skipif(not has_java(), reason="the PTB tokenizer needs Java")
def test_quiet_silences_the_java_tools_in_every_command(tmp_path, capfd):
    """``--quiet`` means the same for every command: the PTB tokenizer's line was printed by ``capeval bench``.
    Each call has texts of its own (a process tokenizes a text once)."""
    from conftest import cli

    def commands(word: str) -> list[list]:
        entries = {f"{i}.jpg": {"image_path": f"{i}.jpg", "ground_truth": [f"a {word} number {i}", f"the {word} {i}"],
                                "human_judgement": [{"caption": f"a {word} {i} {w}", "rating": 1 + (i + k) % 4}
                                                    for k, w in enumerate(("runs", "sits"))]} for i in range(6)}
        (tmp_path / f"{word}.json").write_text(json.dumps(entries))
        (tmp_path / f"{word}.jsonl").write_text("".join(json.dumps({"caption": f"a {word} {i}", "references": [
            f"the {word} {i}"]}) + "\n" for i in range(3)))
        return [["bench", "flickr8k-expert", "--data", tmp_path / f"{word}.json", "--metric", "bleu4", "--bootstrap",
                 "0", "--no-cache"],
                ["score", "-m", "bleu4", "--captions", tmp_path / f"{word}.jsonl", "--out", tmp_path / f"{word}.out.jsonl"]]

    for quiet, word in ((False, "dog"), (True, "cat")):
        for args in commands(word):
            code, _, err = cli(args + ["--quiet"] * quiet, capfd)
            assert code == 0 and ("PTBTokenizer" in err) is not quiet, err


def test_a_default_model_folder_in_the_users_cache_is_part_of_the_key(tmp_path, monkeypatch):
    """PAC-S, Polos, VELA and EXPERT load a folder of the user's cache when ``model`` is empty: its content keys
    the scores (and a resumed run) as a folder given by name does; a rebuilt folder was read from the cache."""
    from capeval_plugins import runner
    from capeval_plugins.bench.cache import metric_key
    from capeval_plugins.metrics.pacscore import PACScore
    from capeval_plugins.metrics.polos import Polos
    from capeval_plugins.models.encoders.openai_clip import converted_model_dir

    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / "cache"))
    for metric_class, name in ((PACScore, "pacs-vit-b-32"), (Polos, "polos")):
        folder = converted_model_dir(name)
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"1")
        metric = metric_class()
        assert metric.default_sources() == {"model": str(folder)}
        before = (metric_key(metric, True, True), runner.fingerprint({"m": metric}, runner.Corpus(["a"]), 1, None))
        (folder / "model.safetensors").write_bytes(b"22")
        after = (metric_key(metric, True, True), runner.fingerprint({"m": metric}, runner.Corpus(["a"]), 1, None))
        assert before[0] != after[0] and before[1] != after[1]
        assert metric_class(model=str(folder)).default_sources() == {}


def test_an_upgraded_scoring_dependency_is_part_of_the_key(monkeypatch):
    """bert_score's bundled baselines (or pycocoevalcap's jars) change with its version: scores cached before
    an upgrade were read back after it."""
    from capeval_plugins.bench import cache
    from capeval_plugins.metrics.coco import Cider

    installed = cache.dependency_versions()
    assert installed["torch"] and "bert_score" in installed
    before = _key(Cider())
    monkeypatch.setattr(cache, "dependency_versions", lambda: {**installed, "bert_score": "99.0"})
    assert _key(Cider()) != before


class SeededById(PointwiseMetric):
    """A score that depends on the sample's id (a draw seeded by it), as MSD's coco-cf draws do."""

    info = info("seeded_by_id")

    def seeded_by_ids(self):
        return "seeded by the sample's id"

    def score(self, batch):
        return {"score": batch.indices.to(torch.float64)}


def test_a_metric_seeded_by_ids_is_cached_per_row(tmp_path):
    """The same caption at another row has another id, so another score: keyed by content alone, the cache
    gave it the other row's."""
    cache = tmp_path / "scores.sqlite"
    first = Ratings(Captions(["i"] * 4, ["a", "b", "c", "d"], None), np.arange(4, dtype=float) / 4)
    run_benchmark("nebula", first, {"seeded": SeededById()}, cache=cache, bootstrap=0, progress=False)
    moved = Ratings(Captions(["i"] * 4, ["c", "d", "a", "b"], None), np.arange(4, dtype=float) / 4)
    report = run_benchmark("nebula", moved, {"seeded": SeededById()}, cache=cache, bootstrap=0, progress=False)
    assert report.runs["seeded"].scores.tolist() == [0.0, 1.0, 2.0, 3.0]
    again = run_benchmark("nebula", moved, {"seeded": SeededById()}, cache=cache, bootstrap=0, progress=False)
    assert again.runs["seeded"].from_cache == 4 and again.runs["seeded"].scores.tolist() == [0.0, 1.0, 2.0, 3.0]
