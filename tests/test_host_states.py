"""Host states: a metric whose states are numpy (the classic COCO metrics) scores without importing torch, and
every adapter gives the numbers it gave when those states were tensors (docs/contract.md, host states)."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from conftest import PYTHON, run

from capeval_plugins import registry, runner
from capeval_plugins.contract import (GROUP, INDEX, TEXT_STATE, Batch, Metric, MetricInfo, MetricResult, PackedTexts,
                                      StateSpec, full_spec, map_batch, merge_states)
from capeval_plugins.core.arrays import host

CAPTIONS = [("a dog runs on the grass .", ["a dog is running on grass", "the brown dog runs"]),
            ("two men play football", ["men playing soccer", "two people kick a ball", "a football game"]),
            ("a cat", ["a cat sleeps on a sofa"]),
            ("a dog runs on the grass .", ["a dog is running on grass", "the brown dog runs"])]

# A `capeval score` run in a fresh process, reporting which modules it imported.
SCORE_AND_SHOW_MODULES = """
import json, sys
from capeval_plugins import cli
code = cli.main(sys.argv[1:])
print(json.dumps({"code": code, "modules": sorted(sys.modules)}), file=sys.stderr)
"""


def _score_modules(tmp_path, metrics: list[str], options: list[str]) -> tuple[dict, list[dict]]:
    captions = tmp_path / "captions.jsonl"
    captions.write_text("".join(json.dumps({"caption": c, "references": r}) + "\n" for c, r in CAPTIONS))
    out = tmp_path / "scores.jsonl"
    argv = ["score", *[a for m in metrics for a in ("-m", m)], *[a for o in options for a in ("-o", o)],
            "--captions", str(captions), "--out", str(out), "--quiet"]
    proc = run([PYTHON, "-c", SCORE_AND_SHOW_MODULES, *argv], cwd=str(tmp_path))
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    assert report["code"] == 0, proc.stderr
    return report, [json.loads(line) for line in out.read_text().splitlines()]


def _heavy(modules: list[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in ("torch", "transformers", "scipy") or m == "safetensors.torch"
                  or m.startswith("capeval_plugins.metrics.") and m != "capeval_plugins.metrics.coco")


def test_a_classic_run_imports_no_torch_and_no_other_metric(tmp_path):
    """The claim of the contract's host states, measured where a user stands: a whole `capeval score` process
    (with its resume records written every batch) imports neither torch nor any metric module but the one it
    runs; its scores equal a direct call's in this process (which has torch)."""
    metrics = ["bleu4", "rouge_l", "cider"]
    report, rows = _score_modules(tmp_path, metrics, [f"{m}.tokenize=false" for m in metrics])
    assert _heavy(report["modules"]) == []
    for name in metrics:
        direct = registry.load(name, tokenize=False)(None, [c for c, _ in CAPTIONS], [r for _, r in CAPTIONS])
        assert [row[name] for row in rows] == pytest.approx(direct.scores.tolist(), rel=1e-12, abs=0)


@pytest.mark.skipif(shutil.which("java") is None, reason="PTB tokenisation and METEOR need Java")
def test_the_four_coco_metrics_with_their_jars_import_no_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / "cache"))  # METEOR's index built here, in the process
    report, rows = _score_modules(tmp_path, ["bleu4", "meteor", "rouge_l", "cider"], [])
    assert _heavy(report["modules"]) == []
    assert len(rows) == len(CAPTIONS) and rows[0]["meteor"] == rows[3]["meteor"] > 0


def test_looking_one_metric_up_imports_its_module_only():
    code = ("import sys; from capeval_plugins import registry; registry.get('cider'); "
            "print(sorted(m for m in sys.modules if m.startswith('capeval_plugins.metrics.') or m == 'torch'))")
    out = run([PYTHON, "-c", code])
    assert out.stdout.split("\n")[-2] == "['capeval_plugins.metrics.coco']"


def test_the_python_api_scores_a_classic_metric_without_torch():
    code = ("import sys, capeval_plugins; "
            "r = capeval_plugins.load('bleu4', tokenize=False)(None, ['a dog runs'], [['a dog runs fast']]); "
            "print(type(r.scores).__name__, r.score > 0, 'torch' in sys.modules)")
    out = run([PYTHON, "-c", code])
    assert out.stdout.split("\n")[-2] == "ndarray True False"


def test_a_host_metric_maps_and_finalizes_numpy_and_its_contract_states_are_numpy():
    metric = registry.load("cider", tokenize=False)
    spec = full_spec(metric)
    assert all(s.host for s in spec.values())
    batch = Batch([c for c, _ in CAPTIONS], np.arange(4) + 10, references=[r for _, r in CAPTIONS],
                  group_ids=[1, 2, 3, 1])
    state = map_batch(metric, batch)
    assert all(isinstance(v, (np.ndarray, PackedTexts)) for v in state.values())
    assert host(state[GROUP]).tolist() == [1, 2, 3, 1]
    result = metric.finalize(merge_states(spec, [state]))
    assert isinstance(result.scores, np.ndarray) and result.indices.tolist() == [10, 11, 12, 13]
    # a model metric's batch reads the same fields as tensors, made on the first read
    assert torch.equal(batch.indices, torch.arange(4) + 10) and isinstance(batch.group_ids, torch.Tensor)


def test_a_metric_with_a_torch_state_keeps_tensor_contract_states():
    class Mixed(registry.get("cider").cls):
        def states(self):
            return {**super().states(), "length": StateSpec("cat", torch.float64)}

    spec = full_spec(Mixed(tokenize=False))
    assert not spec[INDEX].host and spec[INDEX].dtype == torch.int64 and spec["candidate"].host


def test_text_states_are_host_whichever_uint8_is_written():
    assert StateSpec("cat", torch.uint8, (-1,), text=True) == TEXT_STATE
    assert TEXT_STATE.host and TEXT_STATE.dtype == np.uint8
    with pytest.raises(ValueError, match="text state"):
        StateSpec("cat", np.int64, (-1,), text=True)
    assert StateSpec("cat").dtype == torch.float64  # the default stays torch's


@pytest.mark.parametrize("spec", [TEXT_STATE, StateSpec("cat", np.int64), StateSpec("cat", np.float64, (-1,)),
                                  StateSpec("sum", np.float64, (2,))])
def test_a_host_state_held_as_tensors_comes_back_as_it_was(spec):
    """What the torchmetrics adapter does: hold a host state as the tensor of its rows (StateSpec.on_torch), merge
    by the one reduce, and hand finalize its own kind (StateSpec.own_kind), equal to the numpy merge."""
    rng = np.random.default_rng(0)
    if spec.text:
        parts = [PackedTexts.join([np.array([[97, 98, 0], [99, 0, 0]], np.uint8)]), np.array([[100, 101]], np.uint8)]
    elif spec.reduce == "sum":
        parts = [rng.normal(size=2), rng.normal(size=2)]
    else:
        parts = [rng.integers(0, 9, size=(3, *[2 + k for k in range(len(spec.shape))])).astype(spec.dtype),
                 rng.integers(0, 9, size=(2, *[4 for _ in spec.shape])).astype(spec.dtype)]
    want = merge_states({"s": spec}, [{"s": p} for p in parts])["s"]
    held = [torch.as_tensor(p.padded() if isinstance(p, PackedTexts) else p) for p in parts]
    merged = merge_states({"s": spec.on_torch()}, [{"s": h} for h in held])["s"]
    assert isinstance(merged, torch.Tensor)
    back = spec.own_kind(merged)
    if spec.text:
        assert isinstance(back, PackedTexts) and back.rows() == want.rows() == [b"ab", b"c", b"de"]
    else:
        assert isinstance(back, np.ndarray) and back.dtype == want.dtype
        np.testing.assert_allclose(back, want, rtol=1e-15)


def test_a_torch_state_read_back_as_arrays_merges_as_tensors():
    """Resume records are read as numpy where numpy holds their dtypes: a torch state's rows and sums come back
    to finalize as tensors all the same."""
    rows, sums = StateSpec("cat", torch.float32, (2,)), StateSpec("sum", torch.float64)
    merged = merge_states({"r": rows, "t": sums}, [{"r": np.ones((1, 2), np.float32), "t": np.array(2.0)},
                                                   {"r": torch.zeros(2, 2), "t": torch.tensor(3.0, dtype=torch.float64)}])
    assert isinstance(merged["r"], torch.Tensor) and merged["r"].shape == (3, 2)
    assert isinstance(merged["t"], torch.Tensor) and float(merged["t"]) == 5.0


def test_the_pycocoevalcap_drop_in_loop_imports_no_torch():
    """The drop-in's classes are named from the listing: importing them, and scoring stock's scorer API with
    them, imports no other metric's module and no torch."""
    code = ("import sys; from capeval_plugins.pycocoevalcap import Bleu, Cider, Rouge; "
            "gts = {1: ['a dog runs on grass', 'the dog runs'], 2: ['two men play']}; "
            "res = {1: ['a dog runs'], 2: ['men play football']}; "
            "print(Cider().compute_score(gts, res)[0] > 0, Rouge().compute_score(gts, res)[0] > 0, "
            "Bleu(4).compute_score(gts, res)[0][0] > 0); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') or "
            "m.startswith('capeval_plugins.metrics.') and m != 'capeval_plugins.metrics.coco'))")
    out = run([PYTHON, "-c", code])
    assert out.stdout.split("\n")[-3:-1] == ["True True True", "[]"]


def test_torchmetrics_holds_host_states_as_tensors_and_merges_texts_packed():
    """A classic metric under torchmetrics: its states held as tensors (torchmetrics moves and gathers them),
    its texts merged packed at compute() (one long caption costs its own bytes, not its length times every row),
    and its result the direct call's."""
    from capeval_plugins.torchmetrics import CIDEr

    captions = [c for c, _ in CAPTIONS] * 25 + ["a dog " * 2000]
    references = [r for _, r in CAPTIONS] * 25 + [["a dog runs"]]
    metric = CIDEr(tokenize=False)
    for start in range(0, len(captions), 16):
        metric.update(captions=captions[start:start + 16], references=references[start:start + 16])
    assert all(isinstance(block, torch.Tensor) for block in metric.candidate)
    merged = metric._merged_state()
    assert isinstance(merged["candidate"], PackedTexts)
    assert merged["candidate"].data.size == sum(len(c.encode()) for c in captions)  # not 101 x 12,000 bytes
    value = metric.compute()
    direct = registry.load("cider", tokenize=False)(None, captions, references)
    assert float(value) == pytest.approx(direct.score, rel=1e-12)
    assert metric.compute_all().scores.tolist() == pytest.approx(direct.scores.tolist(), rel=1e-12, abs=0)


class MeanWords(Metric):
    """A host metric with every state kind: per-sample rows, a float sum and an integer count, 0-d both."""

    info = MetricInfo(name="mean_words_host", display_name="MeanWordsHost", description="", citation="",
                      references="never", images="never")

    def states(self):
        return {"words": StateSpec("cat", np.float64), "total": StateSpec("sum", np.float64),
                "count": StateSpec("sum", np.int64)}

    def map(self, batch):
        words = np.array([float(len(c.split())) for c in batch.candidates])
        return {"words": words, "total": np.array(words.sum()), "count": np.array(len(words), dtype=np.int64)}

    def finalize(self, state):
        assert state["total"].shape == () and state["count"].shape == (), (state["total"].shape, state["count"].shape)
        mean = float(state["total"] / state["count"]) if int(state["count"]) else math.nan
        return MetricResult(self.info.name, mean, state["words"] - mean, state[INDEX])


def test_a_host_metric_with_scalar_sums_passes_every_check_of_the_kit():
    """0-d sums stay 0-d through resume records (safetensors.numpy), the torchmetrics adapter's tensors and the
    DDP merge: np.ascontiguousarray had made them one-dimensional."""
    from capeval_plugins.testing import kit

    corpus = runner.Corpus(candidates=[f"a caption of {'many ' * (i % 5)}words" for i in range(9)])
    report = kit.check_metric(MeanWords, corpus, checks=["batch_split", "ddp_merge", "resume", "torchmetrics"])
    assert set(report.values()) == {"passed"}, report


def test_a_composite_of_a_host_and_a_torch_metric_combines_one_kind():
    """CIDEr (host states) beside a torch metric in a composite: the composite's contract states are tensors, and
    every component's result reaches combine as tensors (CIDEr's numpy scores converted), as before."""
    from capeval_plugins.contract import CompositeMetric, PointwiseMetric

    class Words(PointwiseMetric):
        info = MetricInfo(name="words_t", display_name="WordsT", description="", citation="", references="never",
                          images="never")

        def score(self, batch):
            return {"score": torch.tensor([float(len(c.split())) for c in batch.candidates], dtype=torch.float64)}

    class Both(CompositeMetric):
        info = MetricInfo(name="both_t", display_name="BothT", description="", citation="", references="always",
                          images="never")

        def components(self):
            if not hasattr(self, "_parts"):
                self._parts = {"cider": registry.load("cider", tokenize=False), "words": Words()}
            return self._parts

        def combine(self, results, state):
            kinds = {type(r.scores).__name__ for r in results.values()} | {type(r.indices).__name__ for r in results.values()}
            assert kinds == {"Tensor"}, kinds
            total = results["cider"].scores + results["words"].scores
            return MetricResult(self.info.name, float(total.mean()), total, state[INDEX])

    captions, references = [c for c, _ in CAPTIONS], [r for _, r in CAPTIONS]
    got = Both()(None, captions, references)
    cider = registry.load("cider", tokenize=False)(None, captions, references)
    words = [len(c.split()) for c in captions]
    assert got.scores.tolist() == pytest.approx([c + w for c, w in zip(cider.scores.tolist(), words)], rel=1e-12)


def test_a_text_only_metric_keeps_tensor_contract_states_unless_it_says_otherwise():
    """Its finalize read the index and groups as tensors before text states were numpy: it still can (the
    suite's CorpusText passes its index through as the result's)."""
    from test_contract import CorpusText

    result = CorpusText()(None, ["a dog runs", "two cats", "a dog"])
    assert isinstance(result.indices, torch.Tensor) and result.indices.tolist() == [0, 1, 2]
    assert not full_spec(CorpusText())[INDEX].host and full_spec(registry.load("cider"))[INDEX].host


def test_a_host_component_of_a_mixed_composite_gets_numpy_contract_states():
    from capeval_plugins.contract import CompositeMetric, PointwiseMetric

    class Rank(Metric):
        info = MetricInfo(name="rank_h", display_name="RankH", description="", citation="", references="never",
                          images="never")

        def states(self):
            return {"s": StateSpec("cat", np.float64)}

        def map(self, batch):
            return {"s": np.array([float(len(c)) for c in batch.candidates])}

        def finalize(self, state):
            ids = state[INDEX].astype(np.int64)  # numpy, as the contract says
            return MetricResult(self.info.name, float(state["s"].mean()), state["s"], ids)

    class Ones(PointwiseMetric):
        info = MetricInfo(name="ones_t", display_name="OnesT", description="", citation="", references="never",
                          images="never")

        def score(self, batch):
            return {"score": torch.ones(len(batch), dtype=torch.float64)}

    class Fusion(CompositeMetric):
        info = MetricInfo(name="fusion_t", display_name="FusionT", description="", citation="", references="never",
                          images="never")

        def components(self):
            if not hasattr(self, "_parts"):
                self._parts = {"rank": Rank(), "ones": Ones()}
            return self._parts

        def combine(self, results, state):
            total = results["rank"].scores + results["ones"].scores
            return MetricResult(self.info.name, float(total.mean()), total, state[INDEX])

    assert Fusion()(None, ["a dog", "two cats"]).scores.tolist() == [6.0, 9.0]


def test_unsigned_sums_are_added_as_int64_by_torchmetrics_and_uint64_sums_are_refused():
    from capeval_plugins.adapters.torchmetrics import CapevalMetric

    class Words(Metric):
        info = MetricInfo(name="words_u", display_name="WordsU", description="", citation="", references="never",
                          images="never")

        def states(self):
            return {"words": StateSpec("sum", np.uint32), "n": StateSpec("cat", np.float64)}

        def map(self, batch):
            n = np.array([float(len(c.split())) for c in batch.candidates])
            return {"words": np.array(n.sum(), dtype=np.uint32), "n": n}

        def finalize(self, state):
            assert state["words"].dtype == np.uint32
            return MetricResult(self.info.name, float(state["words"]), state["n"], state[INDEX])

    captions = ["a dog runs", "two cats", "one"]
    metric = CapevalMetric(metric=Words())
    metric.update(captions=captions[:1])
    metric.update(captions=captions[1:])
    assert float(metric.compute()) == Words()(None, captions).score == 6.0
    with pytest.raises(ValueError, match="uint64"):
        StateSpec("sum", np.uint64)


def _named(name: str) -> type:
    class Named(Metric):
        info = MetricInfo(name=name, display_name=name.title(), description="", citation="", references="never",
                          images="never")

        def states(self):
            return {"s": StateSpec("cat", np.float64)}

        def map(self, batch):
            return {"s": np.zeros(len(batch))}

        def finalize(self, state):
            return MetricResult(self.info.name, 0.0, state["s"], state[INDEX])

    return Named


def test_a_later_plugin_never_takes_a_name_the_first_to_register_it_holds():
    """Whatever a plugin's capeval_metric_class answers (a wrong class, an error), a name is its first
    registrant's, in every order of lookups."""
    first, impostor = _named("shared_name_h"), _named("shared_name_h")

    class Lister:
        @staticmethod
        @registry.hookimpl
        def capeval_metrics():
            return [first]

        @staticmethod
        @registry.hookimpl
        def capeval_metric_class(name):
            return None  # wrongly: it lists the name

    class Claimer:
        @staticmethod
        @registry.hookimpl
        def capeval_metrics():
            return []

        @staticmethod
        @registry.hookimpl
        def capeval_metric_class(name):
            if name == "shared_name_h":
                return impostor
            raise RuntimeError("a plugin's bug")

    registry.register_plugin(Lister, name="test-lister")
    registry.register_plugin(Claimer, name="test-claimer")
    try:
        assert registry.get("shared_name_h").cls is first
        registry.metrics()
        assert registry.get("shared_name_h").cls is first
        registry.refresh()
        assert registry.get("shared_name_h").cls is first and registry.get("cider").plugin == "builtin"
    finally:
        for name in ("test-lister", "test-claimer"):
            registry.plugin_manager().unregister(name=name)
        registry.refresh()


def test_the_builtin_lookup_failing_falls_back_to_every_class(monkeypatch):
    from capeval_plugins import metrics

    def broken(name):
        raise RuntimeError("catalog unreadable")

    monkeypatch.setattr(metrics, "capeval_metric_class", broken)
    registry.refresh()
    try:
        with pytest.warns(UserWarning, match="capeval_metric_class"):
            assert registry.get("cider").cls.info.name == "cider"
    finally:
        registry.refresh()
