"""Batched fixed-kappa vMF mixture EM and Monte Carlo KL against a plain per-sample implementation."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import logsumexp

from capeval_plugins.core import vmf

# ---------------------------------------------------------------------------------------------------------
# An independent, per-sample EM in numpy, written from the formulas (Algorithm 1 of the paper, the methods
# notes). It shares only the random source with the batched code: which point starts (or restarts) which
# component comes from the same seeded keys, as two runs of one algorithm would share a seed.


def draw_order(seed: int, stream: int, n: int) -> np.ndarray:
    keys = vmf.random_keys(torch.tensor(seed), stream, torch.arange(n)).numpy()
    return np.argsort(keys, kind="stable")


def plain_fit(points: np.ndarray, k: int, kappa: float, iterations: int, seed: int, threshold: float = 1e-6):
    """Returns means (k', D), weights (k',), the mean log-likelihood at every E-step, reinit count."""
    x = points / np.linalg.norm(points, axis=1, keepdims=True)
    n = len(x)
    k = min(k, n)
    means = x[draw_order(seed, vmf.INIT_STREAM, n)[:k]]
    weights = np.full(k, 1.0 / k)
    trace, restarts = [], 0
    for step in range(iterations):
        logits = kappa * x @ means.T + np.log(weights)
        log_norm = logsumexp(logits, axis=1)
        trace.append(log_norm.mean())
        resp = np.exp(logits - log_norm[:, None])
        mass = resp.sum(0)
        weights = mass / n
        sums = resp.T @ x
        for j in range(k):
            if mass[j] < threshold * n:
                sums[j] = x[int(vmf.random_draws(torch.tensor(seed), vmf.reinit_stream(step, j))) % n]
                weights[j] = 1.0 / n
                restarts += 1
        weights = weights / weights.sum()
        means = sums / np.linalg.norm(sums, axis=1, keepdims=True)
    return means, weights, np.array(trace), restarts


def plain_log_density(points: np.ndarray, means: np.ndarray, weights: np.ndarray, kappa: float) -> np.ndarray:
    x = points / np.linalg.norm(points, axis=1, keepdims=True)
    return logsumexp(kappa * x @ means.T + np.log(weights), axis=1)


# ---------------------------------------------------------------------------------------------------------


def clustered(rng: np.random.Generator, n: int, dim: int = 12, clusters: int = 3, spread: float = 0.6) -> np.ndarray:
    centres = rng.normal(size=(clusters, dim))
    return centres[rng.integers(0, clusters, n)] + spread * rng.normal(size=(n, dim))


def padded(rows: list[np.ndarray], width: int | None = None, fill: float = np.nan, rng=None):
    """Rows scattered into a (B, width, D) tensor at random positions, the rest filled with ``fill``."""
    rng = rng or np.random.default_rng(0)
    width = width or max(len(r) for r in rows)
    dim = rows[0].shape[1]
    x = np.full((len(rows), width, dim), fill)
    mask = np.zeros((len(rows), width), dtype=bool)
    for b, r in enumerate(rows):
        slots = np.sort(rng.choice(width, size=len(r), replace=False))
        x[b, slots] = r
        mask[b, slots] = True
    return torch.tensor(x), torch.tensor(mask)


def active(mixture: vmf.VMFMixture, b: int) -> tuple[np.ndarray, np.ndarray]:
    k = int(mixture.n_components[b])
    return mixture.means[b, :k].numpy(), np.exp(mixture.log_weights[b, :k].numpy())


LENGTHS = [1, 2, 5, 17, 40]
SEEDS = [3, 14, 15, 92, 65]


@pytest.mark.parametrize("threshold", [1e-6, 0.3])
@pytest.mark.parametrize("kappa", [1.0, 20.0])
def test_batched_em_equals_a_plain_per_sample_em(kappa, threshold):
    rng = np.random.default_rng(1)
    rows = [clustered(rng, n) for n in LENGTHS]
    x, mask = padded(rows, width=48, rng=rng)
    fit = vmf.fit_vmf_mixture(x, mask, n_components=3, kappa=kappa, iterations=20, seeds=torch.tensor(SEEDS),
                              reinit_threshold=threshold, track=True)
    restarts = 0
    for b, (points, seed) in enumerate(zip(rows, SEEDS)):
        means, weights, trace, r = plain_fit(points, 3, kappa, 20, seed, threshold)
        got_means, got_weights = active(fit, b)
        assert int(fit.n_components[b]) == min(3, len(points))
        np.testing.assert_allclose(got_means, means, atol=1e-10)
        np.testing.assert_allclose(got_weights, weights, atol=1e-10)
        np.testing.assert_allclose(fit.log_likelihood[b].numpy(), trace, atol=1e-10)
        assert int(fit.reinitialised[b].sum()) == r
        assert torch.isinf(fit.log_weights[b, len(weights):]).all()
        restarts += r
    if threshold > 0.1:
        assert restarts > 0  # the re-initialisation path was exercised


@pytest.mark.parametrize("kappa", [0.5, 20.0, 80.0])
@pytest.mark.parametrize("k", [2, 3, 5])
def test_log_likelihood_never_decreases(kappa, k):
    rng = np.random.default_rng(k)
    rows = [clustered(rng, n, clusters=4) for n in (12, 30, 64)]
    x, mask = padded(rows, rng=rng, fill=0.0)
    fit = vmf.fit_vmf_mixture(x, mask, n_components=k, kappa=kappa, iterations=30, seeds=torch.tensor([1, 2, 3]),
                              reinit_threshold=0.0, track=True)
    steps = fit.log_likelihood.diff(dim=1)
    assert (steps >= -1e-10).all(), steps.min()
    final = fit.log_density(x, mask).sum(1) / mask.sum(1)
    assert (final >= fit.log_likelihood[:, -1] - 1e-10).all()
    # With the default threshold, every step without a re-initialisation is an EM step and cannot go down.
    fit = vmf.fit_vmf_mixture(x, mask, n_components=k, kappa=kappa, iterations=30, seeds=torch.tensor([1, 2, 3]),
                              track=True)
    plain_steps = fit.log_likelihood.diff(dim=1)[fit.reinitialised[:, :-1] == 0]
    assert (plain_steps >= -1e-10).all()


def test_padding_position_content_and_batch_change_nothing():
    rng = np.random.default_rng(2)
    rows = [clustered(rng, n) for n in (4, 9, 23)]
    seeds = torch.tensor([7, 8, 9])
    compact = [vmf.fit_vmf_mixture(torch.tensor(r)[None], n_components=3, seeds=seeds[b:b + 1])
               for b, r in enumerate(rows)]
    for fill in (np.nan, 1e6, 0.0):
        x, mask = padded(rows, width=31, fill=fill, rng=rng)
        fit = vmf.fit_vmf_mixture(x, mask, n_components=3, seeds=seeds)
        for b, alone in enumerate(compact):
            np.testing.assert_allclose(fit.means[b].numpy(), alone.means[0].numpy(), atol=1e-12)
            np.testing.assert_allclose(fit.log_weights[b].numpy(), alone.log_weights[0].numpy(), atol=1e-12)
            assert torch.isfinite(fit.means[b]).all()
    # batch order: reversed rows give the same fits
    x, mask = padded(rows[::-1], width=31, rng=rng)
    fit = vmf.fit_vmf_mixture(x, mask, n_components=3, seeds=seeds.flip(0))
    for b, alone in enumerate(compact[::-1]):
        np.testing.assert_allclose(fit.means[b].numpy(), alone.means[0].numpy(), atol=1e-12)


def test_default_seeds_come_from_the_row_itself():
    rng = np.random.default_rng(3)
    rows = [clustered(rng, 20) for _ in range(3)]
    x, mask = padded(rows, width=25, rng=rng)
    batched = vmf.fit_vmf_mixture(x, mask, n_components=3)
    for b, r in enumerate(rows):
        alone = vmf.fit_vmf_mixture(torch.tensor(r)[None], n_components=3)
        np.testing.assert_allclose(batched.means[b].numpy(), alone.means[0].numpy(), atol=1e-12)


def test_default_seeds_hash_a_strided_sample_of_the_valid_points():
    """point_seeds reads every 61st coordinate of each valid point: the same seed wherever the padding is, another
    one when a sampled value changes."""
    x = torch.randn(1, 12, 768, dtype=torch.float64)
    padded_x = torch.cat([torch.full((1, 3, 768), 7.0, dtype=torch.float64), x], 1)
    mask = torch.ones(1, 12, dtype=torch.bool)
    padded_mask = torch.cat([torch.zeros(1, 3, dtype=torch.bool), mask], 1)
    seed = vmf.point_seeds(x, mask)
    assert seed == vmf.point_seeds(padded_x, padded_mask)
    assert seed == vmf.content_seeds(x[..., ::61], mask[..., None].expand(1, 12, 13))
    changed = x.clone()
    changed[0, 5, 122] += 1.0  # coordinate 122 = 2 * 61 is sampled
    assert vmf.point_seeds(changed, mask) != seed


def test_content_seeds_depend_on_content_only():
    ids = torch.tensor([[5, 6, 7, 0, 0], [0, 5, 6, 7, 0], [5, 6, 8, 0, 0], [6, 5, 7, 0, 0]])
    mask = ids > 0
    seeds = vmf.content_seeds(ids, mask)
    assert seeds[0] == seeds[1]  # same tokens, padded elsewhere
    assert len({int(s) for s in seeds[[0, 2, 3]]}) == 3  # another token, another order
    assert vmf.content_seeds(ids[:1], mask[:1]) == seeds[0]  # batch composition
    assert vmf.content_seeds(ids, mask, seed=1)[0] != seeds[0]
    pixels = torch.rand(2, 3, 4, 4)
    assert vmf.content_seeds(pixels)[1] == vmf.content_seeds(pixels[1:])[0]


@pytest.mark.parametrize("kappa", [1e-3, 20.0, 500.0])
def test_edge_cases_stay_finite(kappa):
    rng = np.random.default_rng(4)
    one = rng.normal(size=(1, 8))
    same = np.repeat(rng.normal(size=(1, 8)), 6, axis=0)
    two = rng.normal(size=(2, 8))
    x, mask = padded([one, same, two], width=6, fill=0.0, rng=rng)
    fit = vmf.fit_vmf_mixture(x, mask, n_components=5, kappa=kappa, seeds=torch.tensor([1, 2, 3]))
    assert fit.n_components.tolist() == [1, 5, 2]  # K capped at the number of points
    for b in range(3):
        means, weights = active(fit, b)
        assert np.isfinite(means).all() and np.isfinite(weights).all()
        assert weights.sum() == pytest.approx(1.0)
    # one point: the mean is the point; identical points: every component sits on them
    np.testing.assert_allclose(fit.means[0, 0].numpy(), one[0] / np.linalg.norm(one[0]), atol=1e-12)
    np.testing.assert_allclose(fit.means[1].numpy(), np.repeat(same[:1] / np.linalg.norm(same[0]), 5, 0), atol=1e-12)
    density = fit.log_density(x, mask)
    assert torch.isfinite(density).all()
    kl = vmf.bi_kl(x, mask, fit, x, mask, fit)
    assert torch.isfinite(kl.image_to_text).all() and torch.isfinite(kl.text_to_image).all()


def test_a_row_without_points_is_refused():
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        vmf.fit_vmf_mixture(torch.ones(2, 3, 4), torch.tensor([[True, False, False], [False, False, False]]),
                            n_components=2)


def test_bi_kl_equals_a_direct_computation():
    """Two images, three pairs (pair 2 reuses image 0): both KL directions and per-point contributions."""
    rng = np.random.default_rng(5)
    images = [clustered(rng, 16, clusters=3), clustered(rng, 16, clusters=2)]
    texts = [clustered(rng, n, clusters=2) for n in (3, 7, 11)]
    image_index = [0, 1, 0]
    px, pmask = padded(images, rng=rng)
    tx, tmask = padded(texts, rng=rng)
    image_fit = vmf.fit_vmf_mixture(px, pmask, n_components=3, seeds=torch.tensor([1, 2]))
    text_fit = vmf.fit_vmf_mixture(tx, tmask, n_components=2, seeds=torch.tensor([3, 4, 5]))
    kl = vmf.bi_kl(px, pmask, image_fit, tx, tmask, text_fit, torch.tensor(image_index))
    for b, i in enumerate(image_index):
        p = active(image_fit, i)
        q = active(text_fit, b)
        patches, tokens = images[i], texts[b]
        it_terms = plain_log_density(patches, *p, 20.0) - plain_log_density(patches, *q, 20.0)
        ti_terms = plain_log_density(tokens, *q, 20.0) - plain_log_density(tokens, *p, 20.0)
        assert kl.image_to_text[b].item() == pytest.approx(it_terms.mean(), abs=1e-10)
        assert kl.text_to_image[b].item() == pytest.approx(ti_terms.mean(), abs=1e-10)
        np.testing.assert_allclose(kl.patch_contributions[b][pmask[i]].numpy(), it_terms / len(patches), atol=1e-12)
        np.testing.assert_allclose(kl.token_contributions[b][tmask[b]].numpy(), ti_terms / len(tokens), atol=1e-12)
        assert (kl.token_contributions[b][~tmask[b]] == 0).all()


def test_kl_of_a_set_with_itself_is_zero():
    rng = np.random.default_rng(6)
    x, mask = padded([clustered(rng, 9), clustered(rng, 14)], rng=rng)
    fit = vmf.fit_vmf_mixture(x, mask, n_components=3, seeds=torch.tensor([1, 2]))
    kl = vmf.bi_kl(x, mask, fit, x, mask, fit)
    # Mathematically 0; in float64 the two sides are the same log-densities (of order 1-100) reduced in other
    # orders by other BLAS kernels, so each may differ by a few ulps of those terms (3.9e-16 seen on an AMD
    # EPYC): 1e-12 is ~1e4 ulps of the largest term, far below any real divergence in this test (> 1e-3).
    assert kl.image_to_text.abs().max() < 1e-12 and kl.text_to_image.abs().max() < 1e-12


def test_float32_fit_is_close_to_float64():
    rng = np.random.default_rng(7)
    x, mask = padded([clustered(rng, 30), clustered(rng, 12)], rng=rng, fill=0.0)
    a = vmf.fit_vmf_mixture(x, mask, n_components=3, seeds=torch.tensor([1, 2]))
    b = vmf.fit_vmf_mixture(x.float(), mask, n_components=3, seeds=torch.tensor([1, 2]), dtype=torch.float32)
    assert b.means.dtype == torch.float32
    np.testing.assert_allclose(b.means.double().numpy(), a.means.numpy(), atol=1e-4)


def test_fitting_in_chunks_of_rows_changes_nothing():
    rng = np.random.default_rng(8)
    rows = [clustered(rng, n) for n in (5, 30, 17, 40, 2)]
    x, mask = padded(rows, width=40, rng=rng)
    seeds = torch.tensor([4, 5, 6, 7, 8])
    whole = vmf.fit_vmf_mixture(x, mask, n_components=3, seeds=seeds, reinit_threshold=0.3, chunk_bytes=0,
                                track=True)
    assert int(whole.reinitialised.sum()) > 0
    for rows_per_chunk in (1, 2, 3):
        chunked = vmf.fit_vmf_mixture(x, mask, n_components=3, seeds=seeds, reinit_threshold=0.3,
                                      chunk_bytes=rows_per_chunk * x[0].numel() * 8, track=True)
        np.testing.assert_allclose(chunked.means.numpy(), whole.means.numpy(), atol=1e-12)
        np.testing.assert_allclose(chunked.log_weights.numpy(), whole.log_weights.numpy(), atol=1e-12)
        np.testing.assert_allclose(chunked.log_likelihood.numpy(), whole.log_likelihood.numpy(), atol=1e-12)
        assert torch.equal(chunked.reinitialised, whole.reinitialised)


# ---------------------------------------------------------------------------------------------------------
# MSD-Score's precisions side by side with the plain float64 per-pair EM above, on realistic inputs: ViT-L/14
# shapes (256 patches of 768 dimensions, captions of 8-40 tokens), the metric's K, kappa and iterations, and a
# CLIP-like geometry (a common direction per modality, patch-token cosines ~0.1-0.3, a few concepts per image that
# most caption tokens are about), so the mixtures and the KLs (about 5-10 here) are of a real size.


def clip_like_pairs(rng: np.random.Generator, pairs: int, patches: int = 256, dim: int = 768):
    def unit(*shape):
        v = rng.normal(size=(*shape, dim))
        return v / np.linalg.norm(v, axis=-1, keepdims=True)

    image_axis = unit()
    text_axis = unit() + 0.4 * image_axis
    out = []
    for _ in range(pairs):
        concepts = unit(6)
        local = 0.6 * image_axis + 0.6 * concepts[rng.integers(0, 6, patches)] + 0.55 * unit(patches)
        n = int(rng.integers(8, 41))
        said = np.where(rng.random((n, 1)) < 0.8, concepts[rng.integers(0, 6, n)], unit(n))
        out.append((local.astype(np.float32), (0.6 * text_axis + 0.45 * said + 0.6 * unit(n)).astype(np.float32)))
    return out


def plain_kls(patches: np.ndarray, tokens: np.ndarray, image_seed: int, text_seed: int) -> tuple[float, float]:
    patches, tokens = patches.astype(np.float64), tokens.astype(np.float64)
    p = plain_fit(patches, 3, 20.0, 20, image_seed)[:2]
    q = plain_fit(tokens, 2, 20.0, 20, text_seed)[:2]
    kl_it = np.mean(plain_log_density(patches, *p, 20.0) - plain_log_density(patches, *q, 20.0))
    kl_ti = np.mean(plain_log_density(tokens, *q, 20.0) - plain_log_density(tokens, *p, 20.0))
    return float(kl_it), float(kl_ti)


def msd_kls(pairs: list, image_seeds: torch.Tensor, text_seeds: torch.Tensor, em_dtype: str) -> np.ndarray:
    """(B, 2): KL_img->txt and KL_txt->img of every pair in one batch, at MSD-Score's ``em_dtype``."""
    from capeval_plugins.metrics.msd import msd_components

    patches = torch.tensor(np.stack([p for p, _ in pairs]))
    tokens, token_mask = padded([t for _, t in pairs], fill=0.0)
    unit = torch.nn.functional.normalize(torch.ones(len(pairs), patches.shape[-1]), dim=-1)
    dtype, product_dtype = vmf.PRECISIONS[em_dtype]
    out = msd_components(unit, patches, torch.ones(patches.shape[:2], dtype=torch.bool), unit, tokens.float(),
                         token_mask, torch.arange(len(pairs)), image_seeds=image_seeds, text_seeds=text_seeds,
                         dtype=dtype, product_dtype=product_dtype)
    return torch.stack([out["kl_image_text"], out["kl_text_image"]], 1).double().numpy()


def test_msd_precisions_against_a_plain_float64_per_pair_computation():
    rng = np.random.default_rng(9)
    pairs = clip_like_pairs(rng, 12)
    image_seeds, text_seeds = torch.arange(100, 112), torch.arange(200, 212)
    plain = np.array([plain_kls(p, t, int(a), int(b)) for (p, t), a, b in zip(pairs, image_seeds, text_seeds)])
    error = {name: np.abs(msd_kls(pairs, image_seeds, text_seeds, name) - plain)
             for name in ("float64", "mixed", "float32")}
    assert error["float64"].max() < 1e-11
    # float32 keeps ~7 digits of a dot product of unit vectors (|<x, mu>| <= 1), so a logit kappa <x, mu> moves by
    # ~kappa x 1e-7 = 2e-6; a KL is a mean of differences of log-sum-exps of such logits, each 1-Lipschitz in
    # them: within ~4e-6, under 1e-6 of KLs this size. The float64 sums and normalisation of "mixed" keep it
    # well inside that; float32 throughout adds its own roundings of the log-weights, sums and means.
    assert plain.min() > 1.0
    assert error["mixed"].max() < 4e-6 and error["float32"].max() < 4e-5
    assert error["mixed"].mean() <= error["float32"].mean()
    assert error["mixed"].max() <= error["float32"].max()


@pytest.mark.parametrize("em_dtype", ["mixed", "float64"])
def test_msd_precisions_leave_a_pair_independent_of_its_batch(em_dtype):
    """The tokens, padded to the batch's longest caption, are multiplied in float64 at every precision but
    "float32", so one pair alone and in a batch agree to float64 rounding."""
    rng = np.random.default_rng(10)
    pairs = clip_like_pairs(rng, 6, patches=64, dim=96)
    image_seeds, text_seeds = torch.arange(6), torch.arange(6, 12)
    together = msd_kls(pairs, image_seeds, text_seeds, em_dtype)
    for b in range(6):
        alone = msd_kls(pairs[b:b + 1], image_seeds[b:b + 1], text_seeds[b:b + 1], em_dtype)
        np.testing.assert_allclose(alone[0], together[b], rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# The other EMs, each re-derived per sample in numpy from its definition: the official COCO-CF script's EM
# (coco_eval_cf.py), isotropic Gaussians (Table II's GMM), adaptive kappa (Table II, Eq. 12, with the exact
# Bessel function from scipy). Same shared random source as plain_fit.


def plain_fit_coco_cf(points: np.ndarray, k: int, kappa: float, iterations: int, seed: int):
    """coco_eval_cf.py's VMFMixtureFixedKappa.fit: no re-initialisation, N_k + 1e-8, w = N_k / N, log(w + 1e-9)
    in the E-step (normalisation exact here, as in ours). Returns means and weights w."""
    x = points / np.linalg.norm(points, axis=1, keepdims=True)
    n = len(x)
    k = min(k, n)
    means = x[draw_order(seed, vmf.INIT_STREAM, n)[:k]]
    weights = np.full(k, 1.0 / k)
    for _ in range(iterations):
        logits = kappa * x @ means.T + np.log(weights + 1e-9)
        post = np.exp(logits - logsumexp(logits, axis=1, keepdims=True))
        mass = post.sum(0) + 1e-8
        sums = post.T @ x
        means = sums / np.linalg.norm(sums, axis=1, keepdims=True)
        weights = mass / n
    return means, weights


def coco_cf_log_density(points: np.ndarray, means: np.ndarray, weights: np.ndarray, kappa: float) -> np.ndarray:
    """coco_eval_cf.py's score_samples."""
    x = points / np.linalg.norm(points, axis=1, keepdims=True)
    return logsumexp(kappa * x @ means.T + np.log(weights + 1e-9), axis=1)


def plain_fit_gaussian(points: np.ndarray, k: int, sigma: float, iterations: int, seed: int, threshold: float = 1e-6):
    """EM of a mixture of isotropic Gaussians N(mu_k, sigma^2 I) on the unit points, with plain_fit's restarts."""
    x = points / np.linalg.norm(points, axis=1, keepdims=True)
    n = len(x)
    k = min(k, n)
    means = x[draw_order(seed, vmf.INIT_STREAM, n)[:k]]
    weights = np.full(k, 1.0 / k)
    for step in range(iterations):
        logits = np.log(weights) - ((x[:, None, :] - means[None]) ** 2).sum(-1) / (2 * sigma ** 2)
        resp = np.exp(logits - logsumexp(logits, axis=1, keepdims=True))
        mass = resp.sum(0)
        sums = resp.T @ x
        for j in range(k):
            if mass[j] < threshold * n:
                sums[j] = x[int(vmf.random_draws(torch.tensor(seed), vmf.reinit_stream(step, j))) % n]
                mass[j] = 1.0
        weights = mass / mass.sum()
        means = sums / mass[:, None]
    return means, weights


def gaussian_log_density(points: np.ndarray, means: np.ndarray, weights: np.ndarray, sigma: float) -> np.ndarray:
    """log sum_k w_k exp(-|x - mu_k|^2 / (2 sigma^2)), the Gaussians' shared normaliser dropped."""
    x = points / np.linalg.norm(points, axis=1, keepdims=True)
    return logsumexp(np.log(weights) - ((x[:, None, :] - means[None]) ** 2).sum(-1) / (2 * sigma ** 2), axis=1)


def exact_log_normaliser(kappa: np.ndarray, dim: int) -> np.ndarray:
    """log C_D(kappa) from scipy's exponentially scaled Bessel function (fine where it does not underflow)."""
    from scipy.special import ive

    v = dim / 2 - 1
    return v * np.log(kappa) - dim / 2 * np.log(2 * np.pi) - (np.log(ive(v, kappa)) + kappa)


def plain_fit_adaptive(points: np.ndarray, k: int, kappa: float, iterations: int, seed: int, threshold: float = 1e-6):
    """EM with one kappa per component re-estimated by Eq. 12 from the mean resultant length (kept <= 1 - 1e-6),
    the full vMF normaliser in the E-step; a restarted component takes the starting kappa again."""
    x = points / np.linalg.norm(points, axis=1, keepdims=True)
    n, dim = x.shape
    k = min(k, n)
    means = x[draw_order(seed, vmf.INIT_STREAM, n)[:k]]
    weights, kappas = np.full(k, 1.0 / k), np.full(k, kappa)
    for step in range(iterations):
        logits = np.log(weights) + exact_log_normaliser(kappas, dim) + kappas * (x @ means.T)
        resp = np.exp(logits - logsumexp(logits, axis=1, keepdims=True))
        mass = resp.sum(0)
        sums = resp.T @ x
        r = np.minimum(np.linalg.norm(sums, axis=1) / mass, 1 - 1e-6)
        kappas = r * (dim - r ** 2) / (1 - r ** 2)
        for j in range(k):
            if mass[j] < threshold * n:
                sums[j] = x[int(vmf.random_draws(torch.tensor(seed), vmf.reinit_stream(step, j))) % n]
                mass[j], kappas[j] = 1.0, kappa
        weights = mass / mass.sum()
        means = sums / np.linalg.norm(sums, axis=1, keepdims=True)
    return means, weights, kappas


def adaptive_log_density(points, means, weights, kappas) -> np.ndarray:
    x = points / np.linalg.norm(points, axis=1, keepdims=True)
    logits = np.log(weights) + exact_log_normaliser(kappas, x.shape[1]) + kappas * (x @ means.T)
    return logsumexp(logits, axis=1)


def test_log_vmf_normaliser_equals_the_bessel_function():
    # where scipy's ive does not underflow (for larger D it does at small kappa)
    for dim, kappa in ((64, [0.05, 0.5, 5.0, 20.0, 150.0, 1e3, 1e4]), (256, [20.0, 150.0, 1e3, 1e4])):
        kappa = np.array(kappa)
        got = vmf.log_vmf_normaliser(torch.tensor(kappa), dim).numpy()
        np.testing.assert_allclose(got, exact_log_normaliser(kappa, dim), rtol=1e-10)
    # kappa = 0: the uniform density, 1 / |S^(D-1)| = Gamma(D/2) / (2 pi^(D/2)) (scipy's ive underflows here)
    from scipy.special import gammaln

    for dim in (64, 768):
        uniform = gammaln(dim / 2) - np.log(2) - dim / 2 * np.log(np.pi)
        assert vmf.log_vmf_normaliser(torch.tensor([0.0], dtype=torch.float64), dim).item() == pytest.approx(uniform, rel=1e-12)
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    for value in (20.0, 700.0, 3e8):  # D = 768: I_v(20) ~ 1e-443, below any float; mpmath has it
        v = mpmath.mpf(383)
        exact = v * mpmath.log(value) - 384 * mpmath.log(2 * mpmath.pi) - mpmath.log(mpmath.besseli(v, value))
        assert vmf.log_vmf_normaliser(torch.tensor([value], dtype=torch.float64), 768).item() == pytest.approx(float(exact), rel=1e-12)


def test_coco_cf_em_equals_its_script_re_derived():
    rng = np.random.default_rng(11)
    rows = [clustered(rng, n) for n in (1, 2, 6, 17, 40)]
    x, mask = padded(rows, width=44, rng=rng)
    for kappa in (1.0, 20.0, 80.0):  # 80: components collapse, and the script keeps them with weight ~1e-8 / N
        fit = vmf.fit_mixture(x, mask, n_components=3, kappa=kappa, seeds=torch.tensor(SEEDS), update="coco-cf")
        for b, (points, seed) in enumerate(zip(rows, SEEDS)):
            means, weights = plain_fit_coco_cf(points, 3, kappa, 20, seed)
            k = len(weights)
            np.testing.assert_allclose(fit.means[b, :k].numpy(), means, atol=1e-10)
            np.testing.assert_allclose(fit.log_weights[b, :k].numpy(), np.log(weights + 1e-9), rtol=1e-10)
            assert torch.isinf(fit.log_weights[b, k:]).all()
            np.testing.assert_allclose(fit.log_density(torch.tensor(points / np.linalg.norm(points, axis=1,
                                                                                             keepdims=True))[None],
                                                       rows=torch.tensor([b]))[0].numpy(),
                                       coco_cf_log_density(points, means, weights, kappa), atol=1e-9)
    # no re-initialisation, whatever the threshold; the restarting EM re-initialises at this one
    kept = vmf.fit_mixture(x, mask, n_components=3, kappa=80.0, seeds=torch.tensor(SEEDS), update="coco-cf",
                           reinit_threshold=0.3)
    assert torch.equal(kept.means, fit.means) and torch.equal(kept.log_weights, fit.log_weights)
    restart = vmf.fit_mixture(x, mask, n_components=3, kappa=80.0, seeds=torch.tensor(SEEDS), reinit_threshold=0.3,
                              track=True)
    assert int(restart.reinitialised.sum()) > 0
    assert not torch.allclose(restart.means, fit.means)


@pytest.mark.parametrize("sigma", [0.1, 0.3])
def test_gaussian_mixture_equals_a_plain_em(sigma):
    rng = np.random.default_rng(12)
    rows = [clustered(rng, n) for n in (2, 9, 30)]
    x, mask = padded(rows, width=32, rng=rng)
    fit = vmf.fit_mixture(x, mask, n_components=3, family="gaussian", sigma=sigma, seeds=torch.tensor([4, 5, 6]),
                          reinit_threshold=0.05)
    other = vmf.fit_mixture(x, mask, n_components=2, family="gaussian", sigma=sigma, seeds=torch.tensor([7, 8, 9]))
    g = 0.5 / sigma ** 2
    for b, (points, seed) in enumerate(zip(rows, (4, 5, 6))):
        means, weights = plain_fit_gaussian(points, 3, sigma, 20, seed, threshold=0.05)
        k = len(weights)
        np.testing.assert_allclose(fit.means[b, :k].numpy(), means, atol=1e-10)
        np.testing.assert_allclose(np.exp(fit.log_weights[b, :k].numpy()), weights, atol=1e-10)
        # log-densities up to the constant -g |x|^2 = -g shared by every component of every mixture
        unit_points = torch.tensor(points / np.linalg.norm(points, axis=1, keepdims=True))[None]
        np.testing.assert_allclose(fit.log_density(unit_points, rows=torch.tensor([b]))[0].numpy() - g,
                                   gaussian_log_density(points, means, weights, sigma), atol=1e-8)
    # the KL between two Gaussian mixtures: the constants cancel
    kl = vmf.bi_kl(x, mask, fit, x, mask, other)
    for b, points in enumerate(rows):
        p = plain_fit_gaussian(points, 3, sigma, 20, (4, 5, 6)[b], threshold=0.05)
        q = plain_fit_gaussian(points, 2, sigma, 20, (7, 8, 9)[b])
        direct = np.mean(gaussian_log_density(points, *p, sigma) - gaussian_log_density(points, *q, sigma))
        assert kl.image_to_text[b].item() == pytest.approx(direct, abs=1e-8)


def test_adaptive_kappa_equals_a_plain_em():
    rng = np.random.default_rng(13)
    dim = 64
    rows = [clustered(rng, n, dim=dim, spread=1.5) for n in (1, 3, 12, 40)]
    x, mask = padded(rows, width=40, rng=rng)
    seeds = torch.tensor([21, 22, 23, 24])
    fit = vmf.fit_mixture(x, mask, n_components=3, kappa=20.0, adaptive_kappa=True, seeds=seeds, iterations=10)
    for b, (points, seed) in enumerate(zip(rows, seeds.tolist())):
        means, weights, kappas = plain_fit_adaptive(points, 3, 20.0, 10, seed)
        k = len(weights)
        np.testing.assert_allclose(fit.kappas[b, :k].numpy(), kappas, rtol=1e-7)
        np.testing.assert_allclose(fit.means[b, :k].numpy(), means, atol=1e-8)
        np.testing.assert_allclose(np.exp(fit.log_weights[b, :k].numpy()), weights, atol=1e-8)
        unit_points = torch.tensor(points / np.linalg.norm(points, axis=1, keepdims=True))[None]
        np.testing.assert_allclose(fit.log_density(unit_points, rows=torch.tensor([b]))[0].numpy(),
                                   adaptive_log_density(points, means, weights, kappas), rtol=1e-8)
    assert float(fit.kappas[3, 0]) != 20.0  # re-estimated
    assert fit.kappas[0, 0].item() == pytest.approx(vmf.adaptive_kappa(torch.tensor(1.0, dtype=torch.float64), dim).item())  # one point
