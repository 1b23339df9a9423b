"""MID on a tiny random CLIP against an independent computation (plain transformers features, concatenated,
fitted with numpy, scored with scipy), in one process and across two DDP ranks with uneven shards."""
from __future__ import annotations


import numpy as np
import pytest
import torch
from conftest import flickr8k_rows, random_image
from scipy.stats import multivariate_normal
from test_gaussian import numpy_trace_mid

import capeval_plugins
from capeval_plugins.core.gaussian import TooFewSamplesError, joint_sums
from capeval_plugins.inputs import InputError
from capeval_plugins.testing import caption_corpus

N = 40  # the tiny CLIP has 16-dimensional features: the joint fit needs more than 32 pairs
# Features agree with plain transformers to ~1e-7 (float32, different padding); a fit on few pairs amplifies
# that in the Mahalanobis terms, hence 1e-4 (an n vs n - 1 covariance alone would be off by ~1e-2).
TOL = dict(rel=1e-4, abs=1e-4)


def corpus(n: int = N):
    lines = caption_corpus(3 * n + 10, seed=3)
    images = [random_image(100 + i, size=(32 + i % 5, 30)) for i in range(n)]
    candidates = [lines[i] for i in range(n)]
    references = [[lines[n + i], lines[2 * n + i]] if i % 3 else [lines[n + i]] for i in range(n)]
    return images, candidates, references


@torch.no_grad()
def plain_features(path: str, images, texts) -> tuple[np.ndarray, np.ndarray]:
    """L2-normalised CLIP image and text embeddings straight from transformers, float64, of inputs made as the
    official code makes them (clip.load's transform, written out in capeval_plugins.testing.official_code, and
    clip.tokenize's cleaning): MID's default."""
    from transformers import CLIPModel, CLIPProcessor

    from capeval_plugins.models.encoders.openai_clip import clean_text
    from capeval_plugins.testing.official_code import torchvision_transform

    model, processor = CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)
    image_processor = processor.image_processor
    transform = torchvision_transform(image_processor.crop_size["height"], image_processor.image_mean,
                                      image_processor.image_std)
    pixels = torch.stack([transform(image) for image in images])
    img = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
    texts = [clean_text(text) for text in texts]
    tokens = processor.tokenizer(texts, padding=True, truncation=True, max_length=77, return_tensors="pt")
    txt = model.text_projection(model.text_model(**tokens).pooler_output)
    norm = lambda t: (t / t.norm(dim=-1, keepdim=True)).double().numpy()  # noqa: E731
    return norm(img), norm(txt)


def plain_pairs(path: str, images, candidates, references):
    """(image, reference) pairs of the fit and (image, candidate) pairs scored, as plain float64 features."""
    image_feats, _ = plain_features(path, images, ["x"])
    pairs_x = np.stack([image_feats[i] for i, refs in enumerate(references) for _ in refs])
    _, ref_feats = plain_features(path, images[:1], [r for refs in references for r in refs])
    _, cand_feats = plain_features(path, images[:1], candidates)
    return pairs_x, ref_feats, image_feats, cand_feats


def plain_mid(path: str, images, candidates, references, eps: float = 0.0) -> np.ndarray:
    """Per-sample PMI: features of every (image, reference) pair concatenated, mean and covariance by numpy,
    PMI = log N(z) - log N(x) - log N(y) by scipy."""
    return scipy_pmi(*plain_pairs(path, images, candidates, references), eps)


def scipy_pmi(x, y, x0, y0, eps: float = 0.0) -> np.ndarray:
    """PMI of the pairs (x0, y0) under Gaussians fitted to the pairs (x, y)."""
    z = np.concatenate([x, y], axis=1)
    d = x.shape[1]
    mean, cov = z.mean(axis=0), np.cov(z, rowvar=False) + eps * np.eye(2 * d)
    z0 = np.concatenate([x0, y0], axis=1)
    return (multivariate_normal(mean, cov).logpdf(z0) - multivariate_normal(mean[:d], cov[:d, :d]).logpdf(z0[:, :d])
            - multivariate_normal(mean[d:], cov[d:, d:]).logpdf(z0[:, d:]))


@pytest.fixture(scope="module")
def expected(tiny_clip):
    return plain_mid(tiny_clip, *corpus())


@pytest.fixture(scope="module")
def expected_trace(tiny_clip):
    """The official code's corpus MID (trace form, written out in numpy) on the plain features."""
    return numpy_trace_mid(*plain_pairs(tiny_clip, *corpus()))


def test_mid_equals_an_independent_computation_on_concatenated_features(tiny_clip, expected, expected_trace):
    result = capeval_plugins.load("mid", model=tiny_clip, batch_size=5)(*corpus())
    assert result.scores.tolist() == pytest.approx(expected.tolist(), **TOL)
    assert result.score == pytest.approx(expected_trace, **TOL)
    assert abs(expected_trace - expected.mean()) > 100 * TOL["abs"]  # the two corpus forms differ here
    mean = capeval_plugins.load("mid", model=tiny_clip, batch_size=5, corpus_reduction="mean")(*corpus())
    assert mean.score == pytest.approx(expected.mean(), **TOL)
    assert mean.scores.tolist() == result.scores.tolist()
    normalized = (expected / (1 + np.abs(expected)) + 1) / 2
    # x / (1 + |x|) moves by at most half of x: the PMI's own tolerance, halved
    assert result.extras["pmi_normalized"].tolist() == pytest.approx(normalized.tolist(), abs=TOL["abs"] / 2)
    assert result.corpus_extras["fit_pairs"] == sum(len(r) for r in corpus()[2])


def test_mid_equals_the_official_form_on_flickr8k_expert_and_real_photos(tiny_clip):
    """243 Flickr8k-Expert captions of 40 crops of real photos (1,215 (image, reference) pairs fitted, several
    captions per image, many of them written for other images): the corpus MID against the official trace form
    and the per-sample PMI against scipy, both on plain transformers features. The features agree to ~1e-7
    (float32, other padding) and the fit has 1,215 pairs for 32 dimensions, so the same TOL holds."""
    pairs, images = flickr8k_rows(40)
    texts = sorted(set(pairs.candidates).union(*pairs.references))
    firsts = [images[pairs.image.index(k)] for k in range(pairs.n_images)]
    image_feats, text_feats = plain_features(tiny_clip, firsts, texts)  # each distinct image and text once
    text_row = {t: i for i, t in enumerate(texts)}
    fit_image = [k for k, refs in zip(pairs.image, pairs.references) for _ in refs]
    plain = (image_feats[fit_image], text_feats[[text_row[r] for refs in pairs.references for r in refs]],
             image_feats[pairs.image], text_feats[[text_row[c] for c in pairs.candidates]])
    result = capeval_plugins.load("mid", model=tiny_clip, batch_size=64)(images, pairs.candidates, pairs.references)
    assert result.corpus_extras["fit_pairs"] == 1215
    assert result.score == pytest.approx(numpy_trace_mid(*plain), **TOL)
    expected = scipy_pmi(*plain)
    assert result.scores.tolist() == pytest.approx(expected.tolist(), **TOL)
    assert expected.std() > 0.1  # real spread: matched and mismatched captions


def test_independent_of_batch_size_and_order(tiny_clip, expected):
    images, candidates, references = corpus()
    order = np.random.default_rng(0).permutation(N)
    for batch_size in (1, 7, 64):
        result = capeval_plugins.load("mid", model=tiny_clip, batch_size=batch_size)(
            [images[i] for i in order], [candidates[i] for i in order], [references[i] for i in order])
        assert result.scores.tolist() == pytest.approx(expected[order].tolist(), **TOL)


def test_regularised_and_first_reference_fits(tiny_clip):
    images, candidates, references = corpus()
    eps = capeval_plugins.load("mid", model=tiny_clip, covariance_eps=5e-4)(images, candidates, references)
    assert eps.scores.tolist() == pytest.approx(plain_mid(tiny_clip, images, candidates, references, 5e-4).tolist(),
                                                **TOL)
    first = capeval_plugins.load("mid", model=tiny_clip, fit_pairs="first_reference", covariance_eps=1e-3)(
        images, candidates, references)
    firsts = [refs[:1] for refs in references]
    assert first.scores.tolist() == pytest.approx(plain_mid(tiny_clip, images, candidates, firsts, 1e-3).tolist(),
                                                  **TOL)


def test_too_few_pairs_and_missing_references_are_clear_errors(tiny_clip):
    images, candidates, references = corpus(10)  # at most 20 pairs for 32 joint dimensions
    with pytest.raises(InputError, match=r"mid: .* 2D = 32 joint dimensions .* gives \d+; .*covariance_eps"):
        capeval_plugins.load("mid", model=tiny_clip)(images, candidates, references)  # found before scoring
    with pytest.raises(TooFewSamplesError, match=r"N=\d+ .* 2D=32"):  # the fit itself still says so
        capeval_plugins.load("mid", model=tiny_clip).fitted({f"fit_{k}": v for k, v in joint_sums(
            torch.randn(20, 16, dtype=torch.float64), torch.randn(20, 16, dtype=torch.float64)).items()})
    with pytest.raises(ValueError, match="needs references"):
        capeval_plugins.load("mid", model=tiny_clip)(images, candidates)


def test_a_saved_fit_scores_a_single_small_batch(tiny_clip, expected, tmp_path):
    images, candidates, references = corpus()
    path = tmp_path / "flickr_fit.npz"
    capeval_plugins.load("mid", model=tiny_clip).fit_reference(images, references, save_to=str(path))
    later = capeval_plugins.load("mid", model=tiny_clip, reference_gaussian=str(path))
    few = later(images[:3], candidates[:3])  # 3 samples, no references: the saved fit does the work
    assert few.scores.tolist() == pytest.approx(expected[:3].tolist(), **TOL)
    assert few.corpus_extras["fit_pairs"] == sum(len(r) for r in references)


@pytest.mark.parametrize("reduction", ["trace", "mean"])
def test_without_per_sample_scores_only_sums_are_kept(tiny_clip, expected, expected_trace, reduction):
    from capeval_plugins.contract import full_spec

    images, candidates, references = corpus()
    metric = capeval_plugins.load("mid", model=tiny_clip, per_sample=False, corpus_reduction=reduction)
    own = metric.states()
    assert all(spec.reduce == "sum" for spec in own.values())  # nothing per sample but the contract's index
    assert {k for k, s in full_spec(metric).items() if s.reduce == "cat"} == {"index", "group", "sample_digest"}
    result = metric(images, candidates, references)
    assert result.score == pytest.approx(expected_trace if reduction == "trace" else expected.mean(), **TOL)
    assert len(result.scores) == 0 and "mean_pmi_normalized" not in result.corpus_extras
    assert result.corpus_extras["fit_pairs"] == sum(len(r) for r in references)


def test_the_trace_form_of_a_single_candidate_is_nan_with_a_warning(tiny_clip, expected, tmp_path):
    images, candidates, references = corpus()
    path = tmp_path / "fit.npz"
    capeval_plugins.load("mid", model=tiny_clip).fit_reference(images, references, save_to=str(path))
    with pytest.warns(UserWarning, match="at least 2"):
        one = capeval_plugins.load("mid", model=tiny_clip, reference_gaussian=str(path))(images[:1], candidates[:1])
    assert np.isnan(one.score) and one.scores.tolist() == pytest.approx(expected[:1].tolist(), **TOL)
    mean = capeval_plugins.load("mid", model=tiny_clip, reference_gaussian=str(path), corpus_reduction="mean")
    assert mean(images[:1], candidates[:1]).score == pytest.approx(expected[0], **TOL)


def test_state_does_not_grow_with_the_corpus(tiny_clip):
    from capeval_plugins.torchmetrics import MID

    images, candidates, references = corpus()
    metric = MID(model=tiny_clip)
    metric.update(images[:13], candidates[:13], references[:13])
    metric.update(images[13:], candidates[13:], references[13:])
    assert tuple(metric.fit_outer.shape) == (32, 32) and metric.fit_outer.dtype == torch.float64
    assert float(metric.fit_count) == sum(len(r) for r in references)
    direct = capeval_plugins.load("mid", model=tiny_clip)(images, candidates, references)
    assert metric.compute_all().scores.tolist() == pytest.approx(direct.scores.tolist(), **TOL)


def test_a_corpus_call_adds_sums_as_batches_arrive():
    """Metric.__call__ streams batch states into merge_states: "sum" states are accumulated, not kept per batch."""
    from capeval_plugins.contract import StateSpec, merge_states

    spec = {"s": StateSpec("sum", torch.float64, (2, 2)), "r": StateSpec("cat", torch.float32, (3,))}
    parts = [{"s": torch.full((2, 2), float(i), dtype=torch.float64), "r": torch.full((i, 3), float(i))} for i in range(4)]
    consumed = []

    def stream():
        for part in parts:
            consumed.append(part)
            yield part

    merged = merge_states(spec, stream())
    assert len(consumed) == 4 and torch.equal(merged["s"], torch.full((2, 2), 6.0, dtype=torch.float64))
    assert merged["r"].shape == (6, 3) and torch.equal(parts[0]["s"], torch.zeros((2, 2), dtype=torch.float64))
    assert merge_states(spec, iter(()))["s"].shape == (2, 2)


