"""The contract's own mechanics, checked against plain re-computations."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from capeval_plugins.contract import (
    INDEX,
    Batch,
    Metric,
    MetricInfo,
    MetricResult,
    PointwiseMetric,
    StateSpec,
    canonical_state,
    finalize_state,
    full_spec,
    map_batch,
    merge_states,
)


class Length(PointwiseMetric):
    """Score = number of characters; extra = number of words. Text only."""

    info = MetricInfo(name="length", display_name="Length", description="", citation="", references="never",
                      images="never")
    extra_names = ("words",)
    mean_extras = ("words",)

    def score(self, batch: Batch):
        return {
            "score": torch.tensor([float(len(c)) for c in batch.candidates], dtype=torch.float64),
            "words": torch.tensor([float(len(c.split())) for c in batch.candidates], dtype=torch.float64),
        }


class SumOfLengths(Metric):
    """A corpus metric with a "sum" state: score = total characters / count."""

    info = MetricInfo(name="sum_of_lengths", display_name="SumOfLengths", description="", citation="",
                      references="never", images="never")

    def states(self):
        return {"total": StateSpec("sum", torch.float64, (2,)), "per": StateSpec("cat", torch.float64)}

    def map(self, batch):
        lengths = torch.tensor([float(len(c)) for c in batch.candidates], dtype=torch.float64)
        return {"total": torch.stack([lengths.sum(), torch.tensor(float(len(lengths)), dtype=torch.float64)]),
                "per": lengths}

    def finalize(self, state):
        total = state["total"]
        return MetricResult(self.info.name, float(total[0] / total[1]), state["per"], state[INDEX])


CAPS = ["a", "bb b", "ccc cc c", "dddd", "e e e e e"]


def test_pointwise_matches_plain_loop_any_batch_size():
    for batch_size in (1, 2, 5, 64):
        result = Length(batch_size=batch_size)(None, CAPS)
        assert result.scores.tolist() == [float(len(c)) for c in CAPS]
        assert result.score == pytest.approx(sum(len(c) for c in CAPS) / len(CAPS))
        assert result.corpus_extras["mean_words"] == pytest.approx(sum(len(c.split()) for c in CAPS) / len(CAPS))
        assert result.indices.tolist() == list(range(len(CAPS)))


def test_merge_sum_and_cat_across_parts():
    metric = SumOfLengths(batch_size=2)
    spec = full_spec(metric)
    parts = [map_batch(metric, Batch(candidates=CAPS[i:i + 2], indices=torch.arange(i, min(i + 2, 5))))
             for i in range(0, 5, 2)]
    merged = merge_states(spec, parts)
    assert merged["total"].tolist() == [float(sum(map(len, CAPS))), 5.0]
    assert merged["per"].tolist() == [float(len(c)) for c in CAPS]
    assert finalize_state(metric, merged).score == pytest.approx(sum(map(len, CAPS)) / 5)


def test_canonical_state_sorts_and_drops_repeats():
    spec = {INDEX: StateSpec("cat", torch.int64), "x": StateSpec("cat", torch.float64, (2,)),
            "s": StateSpec("sum", torch.float64)}
    index = torch.tensor([3, 0, 2, 0, 1, 3])
    x = torch.stack([index.double(), -index.double()], dim=1)
    state, repeats = canonical_state(spec, {INDEX: index, "x": x, "s": torch.tensor(7.0, dtype=torch.float64)})
    assert repeats == 2
    assert state[INDEX].tolist() == [0, 1, 2, 3]
    assert state["x"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert float(state["s"]) == 7.0


def test_repeats_with_sum_state_are_refused():
    """A sum cannot give back one sample's part: a number would count the repeat (it came with a warning)."""
    from capeval_plugins.contract import RepeatedSamples

    metric = SumOfLengths()
    spec = full_spec(metric)
    part = map_batch(metric, Batch(candidates=["aa", "aa"], indices=torch.tensor([0, 0])))
    with pytest.raises(RepeatedSamples, match="summed statistics count them"):
        finalize_state(metric, merge_states(spec, [part]))


def test_map_batch_rejects_misaligned_rows():
    class Dropper(Length):
        def score(self, batch):
            out = super().score(batch)
            return {k: v[:-1] for k, v in out.items()}

    with pytest.raises(RuntimeError, match="shape"):
        map_batch(Dropper(), Batch(candidates=["a", "b"], indices=torch.arange(2)))


def test_map_batch_rejects_undeclared_state():
    class Extra(Length):
        def score(self, batch):
            return {**super().score(batch), "surprise": torch.zeros(len(batch))}

    with pytest.raises(RuntimeError, match="declared"):
        map_batch(Extra(), Batch(candidates=["a"], indices=torch.arange(1)))


def test_nan_scores_are_left_out_and_counted():
    class Picky(Length):
        def score(self, batch):
            out = super().score(batch)
            out["score"] = torch.where(out["score"] > 3, out["score"], torch.nan)
            return out

    result = Picky()(None, CAPS)
    valid = [len(c) for c in CAPS if len(c) > 3]
    assert result.score == pytest.approx(sum(valid) / len(valid))
    assert result.corpus_extras["n_invalid"] == sum(len(c) <= 3 for c in CAPS)
    assert math.isnan(result.scores[0])


def test_unknown_option_lists_valid_ones():
    with pytest.raises(TypeError, match="valid options"):
        Length(no_such_option=1)


def test_result_refuses_clashing_keys():
    with pytest.raises(ValueError, match="used twice"):
        MetricResult("m", 1.0, torch.zeros(2), torch.arange(2), extras={"a": torch.zeros(2)},
                     corpus_extras={"a": 1.0})
    with pytest.raises(ValueError, match="rows"):
        MetricResult("m", 1.0, torch.zeros(2), torch.arange(2), extras={"a": torch.zeros(3)})


def test_result_dict_and_rows_shapes():
    result = Length()(None, CAPS[:2])
    d = result.to_dict()
    assert d["length"] == result.score and d["scores"] == [1.0, 4.0] and d["words"] == [1.0, 2.0]
    assert result.rows()[1] == {"index": 1, "score": 4.0, "words": 2.0}


def test_metric_info_validates_name():
    with pytest.raises(ValueError):
        MetricInfo(name="Bad-Name", display_name="x", description="", citation="")


def test_deepcopy_shares_metric():
    import copy

    metric = Length()
    assert copy.deepcopy(metric) is metric


def test_text_states_round_trip_and_merge_ragged():
    from capeval_plugins.contract import decode_texts, encode_texts

    texts = ["a", "", "ünïcödé caption", "x" * 40]
    assert decode_texts(encode_texts(texts)) == texts
    spec = StateSpec("cat", torch.uint8, (-1,))
    merged = spec.cat([encode_texts(texts[:2]), encode_texts(texts[2:])])
    assert merged.shape == (4, len("x" * 40)) and decode_texts(merged) == texts
    assert spec.empty().shape == (0, 0)
    with pytest.raises(ValueError, match="ragged"):
        StateSpec("sum", torch.float64, (-1,))


def test_text_list_states_round_trip_without_json_and_refuse_another_format():
    from capeval_plugins.contract import decode_text_lists, encode_text_lists, encode_texts

    lists = [["a dog", "ünï ||| cödé"], [], [""], ["", "x"], ["\\u2028 \" [ ] {", "y" * 50]]
    assert decode_text_lists(encode_text_lists(lists)) == lists
    spec = StateSpec("cat", torch.uint8, (-1,))
    assert decode_text_lists(spec.cat([encode_text_lists(lists[:2]), encode_text_lists(lists[2:])])) == lists
    with pytest.raises(ValueError, match="NUL"):
        encode_text_lists([["a\x00b"]])
    with pytest.raises(ValueError, match="another format"):  # e.g. a run folder saved by an older version
        decode_text_lists(encode_texts(['["a dog", "a cat"]']))


def test_ragged_merge_pads_every_ragged_axis_with_zeros():
    spec = StateSpec("cat", torch.float64, (-1, -1))
    a, b = torch.ones(2, 3, 1, dtype=torch.float64), torch.full((1, 1, 4), 2.0, dtype=torch.float64)
    merged = spec.cat([a, b])
    assert merged.shape == (3, 3, 4)
    assert torch.equal(merged[:2, :, :1], a) and merged[:2, :, 1:].abs().sum() == 0
    assert torch.equal(merged[2, :1], b[0]) and merged[2, 1:].abs().sum() == 0


def test_text_states_merge_packed_in_their_total_bytes():
    """A text state (TEXT_STATE) merges into PackedTexts: the rows' bytes back to back, so one long caption
    costs its own length, not its length times the number of rows; selecting rows (the canonical order, repeats
    dropped) and padding give what the zero-padded tensor of the same rows gives."""
    from capeval_plugins.contract import TEXT_STATE, PackedTexts, decode_text_lists, decode_texts, encode_text_lists
    from capeval_plugins.contract import encode_texts

    texts = ["a dog", "", "ünïcödé ☕", "x" * 5000, "b", "", "the end"]
    blocks = [encode_texts(texts[:2]), encode_texts([]), encode_texts(texts[2:5]), encode_texts(texts[5:])]
    merged = TEXT_STATE.cat(blocks)
    assert isinstance(merged, PackedTexts) and len(merged) == len(texts)
    assert merged.data.size == sum(len(t.encode()) for t in texts)  # not 7 x 5000
    assert decode_texts(merged) == texts
    plain = StateSpec("cat", np.uint8, (-1,)).cat(blocks)  # the zero-padded merge of the same rows
    assert np.array_equal(merged.padded(), plain)
    rows = torch.tensor([6, 3, 0, 1, 3, 2])
    assert decode_texts(merged.select(rows)) == [texts[i] for i in rows.tolist()]
    assert decode_texts(TEXT_STATE.cat([merged.select(rows[:2]), encode_texts(["z"])])) == [texts[6], texts[3], "z"]
    lists = [["a", "bb"], [], ["", "ccc" * 100]]
    assert decode_text_lists(TEXT_STATE.cat([encode_text_lists(lists[:1]), encode_text_lists(lists[1:])])) == lists
    assert decode_texts(TEXT_STATE.cat([])) == [] and decode_texts(TEXT_STATE.cat([torch.zeros(0)])) == []
    with pytest.raises(ValueError, match="text state"):
        StateSpec("cat", torch.int64, (-1,), text=True)


def test_a_corpus_metric_keeps_texts_packed_through_canonical_state():
    """Rows sorted by id and a padding sampler's repeats dropped, on packed texts as on any state."""
    from capeval_plugins.contract import DIGEST, GROUP, TEXT_STATE, PackedTexts, decode_texts, encode_texts

    spec = {"text": TEXT_STATE, INDEX: StateSpec("cat", torch.int64), GROUP: StateSpec("cat", torch.int64),
            DIGEST: StateSpec("cat", torch.int64)}
    parts = [{"text": encode_texts(["c", "a" * 300]), INDEX: torch.tensor([2, 0]), GROUP: torch.tensor([2, 0]),
              DIGEST: torch.tensor([12, 10])},
             {"text": encode_texts(["b", "c"]), INDEX: torch.tensor([1, 2]), GROUP: torch.tensor([1, 2]),
              DIGEST: torch.tensor([11, 12])}]
    state, repeats = canonical_state(spec, merge_states(spec, parts), allowed_repeats=1)
    assert repeats == 1 and isinstance(state["text"], PackedTexts)
    assert decode_texts(state["text"]) == ["a" * 300, "b", "c"] and state[INDEX].tolist() == [0, 1, 2]


class CorpusText(Metric):
    """Keeps the raw captions (ragged bytes) and scores at finalize: the shape of corpus-level metrics."""

    info = MetricInfo(name="corpus_text", display_name="CorpusText", description="", citation="",
                      references="never", images="never")

    def states(self):
        from capeval_plugins.contract import TEXT_STATE

        return {"text": TEXT_STATE}

    def map(self, batch):
        from capeval_plugins.contract import encode_texts

        return {"text": encode_texts(batch.candidates)}

    def finalize(self, state):
        from capeval_plugins.contract import decode_texts

        texts = decode_texts(state["text"])
        vocab = {w for t in texts for w in t.split()}
        scores = torch.tensor([len(set(t.split())) / len(vocab) for t in texts], dtype=torch.float64)
        return MetricResult(self.info.name, float(len(vocab)), scores, state[INDEX])


def test_ragged_text_state_through_batches_equals_one_batch():
    caps = ["a b", "c d e f g h", "a", "zz yy xx ww vv uu tt ss"]
    one = CorpusText(batch_size=64)(None, caps)
    many = CorpusText(batch_size=1)(None, caps)
    assert one.score == many.score == len({w for c in caps for w in c.split()})
    assert many.scores.tolist() == one.scores.tolist()


def _numeric_options():
    """(metric, option, kinds, bounds) of every int and float option of every registered metric."""
    import dataclasses

    from capeval_plugins import registry
    from capeval_plugins.core.bounds import field_kinds

    for name, registered in sorted(registry.metrics().items()):
        config = registered.cls.Config
        for f in dataclasses.fields(config):
            kinds = field_kinds(config)[f.name] - {"None"}
            if kinds and kinds <= {"int", "float"} and f.name != "batch_size":
                yield name, f.name, kinds, f.metadata.get("bounds", {})


NUMERIC_OPTIONS = list(_numeric_options())


@pytest.mark.parametrize("name,option,kinds,bounds", NUMERIC_OPTIONS,
                         ids=[f"{n}.{o}" for n, o, _, _ in NUMERIC_OPTIONS])
def test_every_numeric_option_refuses_nan_infinity_a_wrong_type_and_values_outside_its_bounds(name, option, kinds,
                                                                                              bounds):
    """Whatever the entry point (all build the metric through the contract), a NaN or an infinity, a string or a
    bool, a fraction for an integer, or a value just outside the option's bounds is refused naming the option:
    none can reach a score."""
    import capeval_plugins

    bad = [math.nan, math.inf, -math.inf, "3", True]
    if kinds == {"int"}:
        bad.append(2.5)
    # just outside: one unit for an integer; for a float 1e-9, or a relative 1e-12 of a large bound (1e150 + 1e-9
    # is 1e150)
    step = (lambda b: 1) if kinds == {"int"} else (lambda b: max(1e-9, abs(b) * 1e-12))
    bad += [{"ge": lambda b: b - step(b), "gt": lambda b: b, "le": lambda b: b + step(b), "lt": lambda b: b}[key](limit)
            for key, limit in bounds.items()]
    for value in bad:
        with pytest.raises((ValueError, TypeError), match=rf"\b{option}\b"):
            capeval_plugins.load(name, **{option: value})


def test_bool_options_refuse_strings_that_would_read_as_true():
    import capeval_plugins

    with pytest.raises(ValueError, match="tokenize expects true or false, got 'false'"):
        capeval_plugins.load("bleu4", tokenize="false")
    assert capeval_plugins.load("bleu4", tokenize=False).config.tokenize is False


def test_the_bounded_options_are_the_ones_with_a_stated_range():
    """The paper-facing numeric options each carry bounds (a new one without them fails here, deliberately)."""
    unbounded = {f"{n}.{o}" for n, o, _, b in NUMERIC_OPTIONS if not b}
    assert unbounded == {"vilbertscore.layer"}  # a layer index: negative counts from the last layer


def test_training_settings_refuse_what_would_reach_the_weights():
    """Training settings share the metric options' checks (core.bounds): an infinite learning rate, a NaN weight
    decay (which passed a plain ``< 0`` test), a dropout of 1, a non-finite temperature are refused by name."""
    from capeval_plugins.models.rigel import RigelSettings
    from capeval_plugins.training.msd_aligner.train import AlignerConfig
    from capeval_plugins.training.phase1 import Phase1Config
    from capeval_plugins.training.phase2 import Phase2Config

    cases = [(Phase1Config, "lr", math.inf), (Phase1Config, "weight_decay", math.nan), (Phase1Config, "epochs", 0),
             (Phase2Config, "lora_dropout", 1.0), (Phase2Config, "lr", math.nan), (Phase2Config, "lora_r", 2.0),
             (AlignerConfig, "temperature", math.nan), (AlignerConfig, "warmup_ratio", -0.1),
             (AlignerConfig, "contrastive_weight", math.inf), (RigelSettings, "temperature", math.inf),
             (RigelSettings, "video_fps", 0.0)]
    for cls, option, value in cases:
        with pytest.raises(ValueError, match=rf"\b{option}\b"):
            cls(**{option: value})
        cls()  # the defaults pass
