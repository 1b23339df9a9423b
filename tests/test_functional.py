"""capeval_plugins.functional against the metric classes: the same features, computed here with the metrics' own
encoders and judges, fed to the functions, give the metrics' numbers (and scipy's, for the correlations)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CAPTIONS, REFERENCES, random_image
from scipy import stats
import test_fleur_discode
from test_fleur_discode import ANSWERS, sample_images
from test_lvlm import CAPTIONS as JUDGED, sharp_llava
from test_mid import corpus as mid_corpus
from test_msd import CANDIDATES as MSD_CANDIDATES, IMAGE_OF as MSD_IMAGE_OF

import capeval_plugins
from capeval_plugins import functional as F
from capeval_plugins.models.encoders import ClipEncoder, EncoderSpec

answers = test_fleur_discode.answers  # the fixture that makes the judge write given answers


def padded_references(flat, references):
    """Per-sample references, given flat (sum R_i, D), as (N, R, D) features and their (N, R) mask."""
    width = max(len(refs) for refs in references)
    feats = torch.zeros(len(references), width, flat.shape[-1], dtype=flat.dtype)
    mask = torch.zeros(len(references), width, dtype=torch.bool)
    start = 0
    for i, refs in enumerate(references):
        feats[i, : len(refs)] = flat[start:start + len(refs)]
        mask[i, : len(refs)] = True
        start += len(refs)
    return feats, mask


def test_clip_score_and_ref_clip_score_equal_the_metrics(tiny_clip, images):
    from capeval_plugins.metrics.clipscore import with_prefix

    from capeval_plugins.models.encoders.openai_clip import OfficialClip

    enc = OfficialClip.shared(EncoderSpec(tiny_clip))  # the features CLIPScore computes (the official code's inputs)
    prefixed = lambda texts: enc.encode_texts([with_prefix("A photo depicts", t) for t in texts])  # noqa: E731
    image, text = enc.encode_images(images), prefixed(CAPTIONS)
    refs, mask = padded_references(prefixed([r for refs in REFERENCES for r in refs]), REFERENCES)
    result = capeval_plugins.load("clipscore", model=tiny_clip, reference_extras=True)(images, CAPTIONS, REFERENCES)
    torch.testing.assert_close(F.clip_score(image, text), result.scores, atol=1e-6, rtol=0)
    torch.testing.assert_close(F.ref_clip_score(image, text, refs, mask), result.extras["refclipscore"], atol=1e-6,
                               rtol=0)
    assert F.clip_score(image, text, w=1.0).tolist() == pytest.approx((result.scores / 2.5).tolist(), abs=1e-6)
    unclamped = capeval_plugins.load("clipscore", model=tiny_clip, clamp_reference=False, reference_extras=True)(
        images, CAPTIONS, REFERENCES)
    torch.testing.assert_close(F.ref_clip_score(image, text, refs, mask, clamp_reference=False),
                               unclamped.extras["refclipscore"], atol=1e-6, rtol=0)
    # unnormalised features give the same scores (the function normalises them)
    torch.testing.assert_close(F.clip_score(3 * image, 0.5 * text), F.clip_score(image, text))


@pytest.mark.parametrize("reduction", ["trace", "mean"])
def test_mid_equals_the_metric(tiny_clip, reduction):
    from capeval_plugins.models.encoders.openai_clip import fed

    images, candidates, references = mid_corpus()
    enc = fed(EncoderSpec(tiny_clip), "official")  # the features MID computes (the official code's inputs)
    # As the metric encodes one batch of N <= batch_size samples: every text in one pass (float32 features are
    # then bit-identical; a fit on few pairs amplifies any difference in them).
    flat = [r for refs in references for r in refs]
    texts = enc.encode_texts(candidates + flat)
    image, cand = enc.encode_images(images), texts[:len(candidates)]
    refs, mask = padded_references(texts[len(candidates):], references)
    result = capeval_plugins.load("mid", model=tiny_clip, corpus_reduction=reduction)(images, candidates, references)
    pmi = F.mid(image, refs, cand, reduction="none", reference_mask=mask)
    torch.testing.assert_close(pmi, result.scores, atol=1e-9, rtol=1e-9)
    assert float(F.mid(image, refs, cand, reduction=reduction, reference_mask=mask)) == pytest.approx(result.score,
                                                                                                       abs=1e-9)
    # one reference per image: (N, D) references
    first = capeval_plugins.load("mid", model=tiny_clip, fit_pairs="first_reference", covariance_eps=1e-3,
                                 corpus_reduction=reduction)(images, candidates, references)
    texts = enc.encode_texts(candidates + [refs[0] for refs in references])
    single = F.mid(image, texts[len(candidates):], texts[:len(candidates)], eps=1e-3, reduction=reduction)
    assert float(single) == pytest.approx(first.score, abs=1e-9)


def test_bert_score_match_equals_the_metric_with_and_without_idf(tiny_root):
    from test_bertscore import CANDIDATES as CANDS, REFERENCES as REFS

    from capeval_plugins.models.encoders.text import TextEncoder
    from capeval_plugins.testing import tiny_checkpoint

    path = str(tiny_checkpoint("deberta_v3", root=tiny_root))
    enc = TextEncoder.shared(EncoderSpec(path))
    owner = torch.tensor([i for i, refs in enumerate(REFS) for _ in refs])
    cand = enc.embed(CANDS).rows(owner)
    ref = enc.embed([r for refs in REFS for r in refs])
    for idf in (False, True):
        if idf:  # counted over every reference of the corpus, one document each
            weights = [F.bert_score_idf(e.input_ids, e.attention_mask, ref.input_ids, ref.attention_mask)
                       for e in (cand, ref)]
        else:  # [CLS] and [SEP] are matched but do not count
            weights = [e.attention_mask & ~e.special for e in (cand, ref)]
        p, r, f = F.bert_score_match(cand.embeddings, ref.embeddings, cand.attention_mask, ref.attention_mask,
                                     *weights)
        best = [torch.full((len(CANDS),), -torch.inf, dtype=torch.float64).scatter_reduce(0, owner, x, "amax")
                for x in (p, r, f)]  # bert_score's rule: each of P, R, F the best over the references
        result = capeval_plugins.load("bertscore", model=path, idf=idf, matching="per_pair")(None, CANDS, REFS)
        expected = [result.extras["precision"], result.extras["recall"], result.scores]
        for got, want in zip(best, expected):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_fleur_smooth_and_discode_head_equal_the_metrics(answers):
    answers.update(zip(JUDGED, ANSWERS))
    path = sharp_llava()

    def scored(metric):
        """The metric's result, in the order of the judge's output it was computed from (the features)."""
        seen = []
        ask = metric.ask
        metric.ask = lambda batch, *a, **k: seen.append((batch.indices, ask(batch, *a, **k))) or seen[-1][1]
        result = metric(sample_images(), JUDGED)
        assert len(seen) == 1  # one batch: its rows are the samples grouped by image
        order, out = seen[0]
        extras = {k: v[order] for k, v in result.extras.items()}
        return result.scores[order], extras, out

    scores, _, out = scored(capeval_plugins.load("fleur", model=path))
    smoothed = F.fleur_smooth(out.logprobs_at(1), out.logprobs_at(2), out.logprobs_at(0), out.labels[:, 0] == 1)
    torch.testing.assert_close(smoothed, scores, atol=1e-12, rtol=0)
    for scale in ("label", "unit"):
        scores, extras, out = scored(capeval_plugins.load("discode", model=path, alpha_scale=scale))
        head = F.discode_head(out.logprobs_at(1), alpha_scale=scale)
        torch.testing.assert_close(head.distribution, extras["distribution"], atol=1e-12, rtol=0)
        torch.testing.assert_close(head.alpha, extras["alpha"], atol=0, rtol=1e-12)
        from_head = extras["from_att_head"] == 1
        torch.testing.assert_close(0.1 * head.expected[from_head], scores[from_head], atol=1e-12, rtol=0)
    # the raw digit may be given (the written one): the prior moves with it
    moved = F.discode_head(out.logprobs_at(1), raw_digit=torch.full((6,), 2), alpha_scale="unit")
    assert not torch.allclose(moved.expected, F.discode_head(out.logprobs_at(1), alpha_scale="unit").expected)
    with pytest.raises(ValueError, match="closed form"):
        F.discode_head(out.logprobs_at(1), divergence="js")


@pytest.fixture(scope="module")
def msd_features(tiny_clip):
    from capeval_plugins.core.vmf import content_seeds
    from capeval_plugins.metrics.msd import pixel_seeds

    pictures = [random_image(10 + i, size=(40 + 6 * i, 36)) for i in range(3)]  # test_msd's pictures
    enc = ClipEncoder.shared(EncoderSpec(tiny_clip))
    pixels = enc.pixel_values(pictures)
    image = enc.encode_image_patches(pixels)
    text = enc.encode_text_tokens(MSD_CANDIDATES)
    return dict(pictures=pictures, image=image, text=text, index=torch.tensor(MSD_IMAGE_OF),
                image_seeds=pixel_seeds(pixels), text_seeds=content_seeds(text.ids, text.mask))


def test_msd_functions_equal_the_metrics(tiny_clip, msd_features):
    f = msd_features
    image, text, index = f["image"], f["text"], f["index"]
    samples = [f["pictures"][i] for i in MSD_IMAGE_OF]
    msd = capeval_plugins.load("msd_score", model=tiny_clip)(samples, MSD_CANDIDATES)
    soft = capeval_plugins.load("soft_msd", model=tiny_clip)(samples, MSD_CANDIDATES)
    local = F.msd_divergence(image.local, text.local, image.mask, text.mask, index,
                             image_seeds=f["image_seeds"], text_seeds=f["text_seeds"])
    for name, got in (("bi_kl", local.divergence), ("kl_image_text", local.kl_image_text),
                      ("kl_text_image", local.kl_text_image), ("beta", local.beta), ("n_tokens", local.n_tokens)):
        torch.testing.assert_close(got, msd.extras[name], atol=1e-9, rtol=0)
    cosine = torch.nn.functional.cosine_similarity(image.pooled[index].double(), text.pooled.double())
    torch.testing.assert_close(F.msd_score(cosine, local.divergence), msd.scores, atol=1e-6, rtol=0)
    torch.testing.assert_close(F.soft_msd(cosine, local.divergence, index), soft.scores, atol=1e-6, rtol=0)
    # The two mixtures behind the divergence: KL(image || text) on the patches, rebuilt from vmf_mixture.
    p = F.vmf_mixture(image.local, image.mask, k=3, seeds=f["image_seeds"])
    q = F.vmf_mixture(text.local, text.mask, k=2, seeds=f["text_seeds"])
    patches = torch.nn.functional.normalize(image.local.double(), dim=-1)[index]
    mask = image.mask[index]
    log_ratio = p.log_density(patches, mask, rows=index) - q.log_density(patches, mask)
    kl = (log_ratio * mask).sum(1) / mask.sum(1)
    # log_density multiplies in float64; the metric (em_dtype "mixed") multiplies the patches with the means in
    # float32, so each log-density differs by kappa x a float32 rounding of a dot product (~1e-7 relative).
    torch.testing.assert_close(kl, msd.extras["kl_image_text"], atol=0, rtol=1e-6)


def test_correlations_equal_scipy_and_a_plain_count():
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.integers(0, 5, 200), dtype=torch.float64)
    y = x + torch.tensor(rng.normal(0, 2, 200))
    for variant in ("b", "c"):
        assert F.kendall_tau(x, y, variant) == pytest.approx(stats.kendalltau(x, y, variant=variant)[0], abs=1e-12)
    a, b = rng.normal(size=50), rng.normal(size=50)
    b[:5] = a[:5]  # ties
    preferred = rng.integers(0, 2, 50)
    plain = np.mean([0.5 if s == t else float((t > s) == bool(p)) for s, t, p in zip(a, b, preferred)])
    assert F.pairwise_accuracy(torch.tensor(a), torch.tensor(b), torch.tensor(preferred)) == pytest.approx(plain)
    with pytest.raises(ValueError, match="variant"):
        F.kendall_tau(x, y, "a")


def test_importing_functional_imports_no_ecosystem():
    import subprocess
    import sys

    code = ("import sys, capeval_plugins.functional; "
            "print([m for m in ('evaluate', 'lm_eval', 'pycocoevalcap', 'lightning', 'pytorch_lightning') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
