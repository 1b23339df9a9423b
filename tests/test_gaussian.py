"""The streaming Gaussian fit, PMI and MID against plain numpy / scipy computations on concatenated features."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import multivariate_normal

from capeval_plugins.core import gaussian


def correlated_pairs(n: int, d: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Unit-norm x and y with a shared latent (so their mutual information is well above 0)."""
    rng = np.random.default_rng(seed)
    latent = rng.normal(size=(n, d))
    x = latent @ rng.normal(size=(d, d)) + 0.5 * rng.normal(size=(n, d)) + 2.0
    y = latent @ rng.normal(size=(d, d)) + 0.5 * rng.normal(size=(n, d)) - 1.0
    return x / np.linalg.norm(x, axis=1, keepdims=True), y / np.linalg.norm(y, axis=1, keepdims=True)


def scipy_pmi(x, y, x0, y0, eps: float = 0.0) -> np.ndarray:
    """log N(z0) - log N(x0) - log N(y0), each Gaussian fitted with np.cov on the concatenated features."""
    d = x.shape[1]
    z = np.concatenate([x, y], axis=1)
    mean, cov = z.mean(axis=0), np.cov(z, rowvar=False) + eps * np.eye(2 * d)
    z0 = np.concatenate([x0, y0], axis=1)
    return (multivariate_normal(mean, cov).logpdf(z0)
            - multivariate_normal(mean[:d], cov[:d, :d]).logpdf(x0)
            - multivariate_normal(mean[d:], cov[d:, d:]).logpdf(y0))


def fit_in_chunks(x, y, bounds, eps=0.0) -> gaussian.JointGaussian:
    parts = [gaussian.joint_sums(torch.from_numpy(x[a:b]), torch.from_numpy(y[a:b]))
             for a, b in zip(bounds[:-1], bounds[1:])]
    return gaussian.JointGaussian.from_sums(gaussian.merge_sums(*reversed(parts)), x.shape[1], eps)


def test_sums_of_uneven_chunks_give_the_mean_and_covariance_of_all_features():
    x, y = correlated_pairs(300, 6)
    x, y = x.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64)
    fit = fit_in_chunks(x, y, [0, 1, 7, 150, 151, 300])
    z = np.concatenate([x, y], axis=1)
    np.testing.assert_allclose(fit.mean.numpy(), z.mean(axis=0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(fit.cov.numpy(), np.cov(z, rowvar=False), rtol=1e-9, atol=1e-13)
    assert fit.count == 300 and fit.dim == 12


@pytest.mark.parametrize("eps", [0.0, 5e-4])
def test_per_sample_pmi_equals_the_gaussian_log_density_formula_in_scipy(eps):
    x, y = correlated_pairs(400, 5, seed=1)
    x, y = x.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64)
    x0, y0 = correlated_pairs(37, 5, seed=2)
    fit = fit_in_chunks(x, y, [0, 123, 400], eps)
    ours = fit.pmi(torch.from_numpy(x0), torch.from_numpy(y0)).numpy()
    np.testing.assert_allclose(ours, scipy_pmi(x, y, x0, y0, eps), rtol=1e-8, atol=1e-8)
    mean = gaussian.mid(fit, torch.from_numpy(x0), torch.from_numpy(y0), reduction="mean")
    assert mean == pytest.approx(ours.mean(), abs=1e-10)  # from the scored pairs' sums: rounding only


def numpy_trace_mid(x, y, x0, y0, eps: float = 0.0) -> float:
    """The official code's reduced MID, written out in numpy after ``_compute_pmi(reduction=True)``: the scored
    modality first (the caption, y here), the conditioning one second (the image, x, whose term is
    tr(S^-1 S) = D); covariances of the fit over N - 1, the scored pairs' scatter about the fitted means over
    M - 1, solves by numpy. ``eps`` is added to the fitted covariances (the package's ``covariance_eps``)."""
    n, m = len(x), len(x0)
    gen, cond, gen0 = y, x, y0
    z, z0 = np.concatenate([gen, cond], 1), np.concatenate([gen0, x0], 1)
    cov = lambda a, c, k: (a - c).T @ (a - c) / (k - 1)  # noqa: E731
    s_gen, s_cond, s_z = cov(gen, gen.mean(0), n), cov(cond, cond.mean(0), n), cov(z, z.mean(0), n)
    s_gen0, s_z0 = cov(gen0, gen.mean(0), m), cov(z0, z.mean(0), m)
    reg = [a + eps * np.eye(len(a)) for a in (s_gen, s_cond, s_z)]
    logdet = lambda a: np.linalg.slogdet(a)[1]  # noqa: E731
    mi = 0.5 * (logdet(reg[0]) + logdet(reg[1]) - logdet(reg[2]))
    trace = lambda a, b: np.trace(np.linalg.solve(a, b))  # noqa: E731
    return mi + 0.5 * (trace(reg[0], s_gen0) + trace(reg[1], s_cond) - trace(reg[2], s_z0))


@pytest.mark.parametrize("eps", [0.0, 5e-4])
@pytest.mark.parametrize("shared_images", [True, False])
def test_corpus_mid_is_the_official_trace_form(eps, shared_images):
    x, y = correlated_pairs(400, 16, seed=1)
    y0 = correlated_pairs(400 if shared_images else 57, 16, seed=2)[1]
    x0 = x if shared_images else correlated_pairs(57, 16, seed=3)[0]  # the official code pairs them with x
    fit = fit_in_chunks(x, y, [0, 150, 400], eps)
    trace = gaussian.mid(fit, torch.from_numpy(x0), torch.from_numpy(y0))
    assert trace == pytest.approx(numpy_trace_mid(x, y, x0, y0, eps), rel=1e-10, abs=1e-10)
    # The same scored pairs summed in uneven chunks give the same value.
    bounds = [0, 1, 20, len(x0)]
    parts = [gaussian.joint_sums(torch.from_numpy(x0[a:b]), torch.from_numpy(y0[a:b]))
             for a, b in zip(bounds[:-1], bounds[1:])]
    assert gaussian.corpus_mid(fit, gaussian.merge_sums(*parts)) == pytest.approx(trace, abs=1e-9)
    mean = fit.pmi(torch.from_numpy(x0), torch.from_numpy(y0)).mean().item()
    assert abs(trace - mean) > 1e-3  # the two forms differ: the test tells them apart


def test_the_trace_form_needs_two_scored_pairs_and_refuses_unknown_reductions():
    x, y = correlated_pairs(100, 3, seed=9)
    fit = fit_in_chunks(x, y, [0, 100])
    one = gaussian.joint_sums(torch.from_numpy(x[:1]), torch.from_numpy(y[:1]))
    with pytest.raises(gaussian.TooFewSamplesError, match="at least 2"):
        gaussian.corpus_mid(fit, one)
    assert gaussian.corpus_mid(fit, one, "mean") == pytest.approx(fit.pmi(torch.from_numpy(x[:1]),
                                                                          torch.from_numpy(y[:1])).item(), abs=1e-9)
    assert np.isnan(gaussian.corpus_mid(fit, gaussian.empty_sums(6)))
    with pytest.raises(ValueError, match="reduction"):
        gaussian.corpus_mid(fit, one, "median")


def test_mutual_information_is_the_log_determinant_formula():
    x, y = correlated_pairs(500, 4, seed=3)
    fit = fit_in_chunks(x, y, [0, 250, 500])
    cov = np.cov(np.concatenate([x, y], axis=1), rowvar=False)
    logdet = lambda m: np.linalg.slogdet(m)[1]  # noqa: E731
    expected = 0.5 * (logdet(cov[:4, :4]) + logdet(cov[4:, 4:]) - logdet(cov))
    assert fit.mutual_information() == pytest.approx(expected, rel=1e-10)
    assert expected > 0.1  # the pairs share a latent: the test is not comparing zeros


def test_mid_of_the_fitted_pairs_is_their_mutual_information_and_mismatched_pairs_score_lower():
    x, y = correlated_pairs(4000, 3, seed=4)
    fit = fit_in_chunks(x, y, [0, 4000])
    d, mi = 3, fit.mutual_information()
    # On the pairs it was fitted to, the Mahalanobis terms average to exactly (n - 1) / n * (d + d - 2d) = 0
    # (mean form), and the trace form's to d + d - 2d = 0.
    for reduction in ("mean", "trace"):
        assert gaussian.mid(fit, torch.from_numpy(x), torch.from_numpy(y), reduction) == pytest.approx(mi, abs=1e-9)
    # On mismatched pairs, E[PMI] = -KL(p(x) p(y) || p(x, y)) = d + I - tr(S^-1 S_independent) / 2.
    shuffled = gaussian.mid(fit, torch.from_numpy(x), torch.from_numpy(np.roll(y, 1, axis=0)))
    independent = fit.cov.clone()
    independent[:d, d:] = independent[d:, :d] = 0
    expected = d + mi - 0.5 * float(torch.trace(torch.linalg.solve(fit.cov, independent)))
    assert shuffled < 0 < mi and shuffled == pytest.approx(expected, rel=0.05)


def test_eq9_normalisation():
    p = torch.tensor([-3.0, -1.0, 0.0, 1.0, 3.0, 1e6, -1e6], dtype=torch.float64)
    got = gaussian.normalize_pmi(p)
    assert got.tolist() == pytest.approx([0.125, 0.25, 0.5, 0.75, 0.875, 1.0, 0.0], abs=1e-6)
    dense = gaussian.normalize_pmi(torch.linspace(-50, 50, 1001, dtype=torch.float64))
    assert bool((dense.diff() > 0).all()) and bool(((dense > 0) & (dense < 1)).all())


def test_too_few_pairs_for_the_joint_covariance_is_a_clear_error():
    x, y = correlated_pairs(12, 6, seed=5)  # N = 12 = 2D
    with pytest.raises(gaussian.TooFewSamplesError, match=r"N=12 .* 2D=12 .* N > 2D"):
        fit_in_chunks(x, y, [0, 12])
    x, y = correlated_pairs(13, 6, seed=5)
    fit_in_chunks(x, y, [0, 13])  # N = 2D + 1 is enough
    small = fit_in_chunks(x[:5], y[:5], [0, 5], eps=1e-3)  # a regulariser makes any fit invertible
    assert np.isfinite(small.pmi(torch.from_numpy(x), torch.from_numpy(y)).numpy()).all()
    with pytest.raises(gaussian.TooFewSamplesError, match="at least 2"):
        fit_in_chunks(x[:1], y[:1], [0, 1], eps=1e-3)


def test_degenerate_features_name_the_singular_block():
    x, y = correlated_pairs(50, 4, seed=6)
    x[:, 1] = x[:, 0]  # a repeated image dimension: singular image covariance
    with pytest.raises(ValueError, match="image covariance .* not positive definite"):
        fit_in_chunks(x, y, [0, 50])


def test_saved_sums_round_trip_exactly(tmp_path):
    from capeval_plugins.metrics.mid import load_fit

    x, y = correlated_pairs(40, 3, seed=7)
    sums = gaussian.joint_sums(torch.from_numpy(x), torch.from_numpy(y))
    path = tmp_path / "fit.npz"
    path.write_bytes(gaussian.sums_to_bytes(sums, 3, model="some/model"))
    saved = load_fit(str(path))
    assert saved.dim_x == 3 and saved.metadata == {"model": "some/model"}
    for key in gaussian.SUM_KEYS:
        assert torch.equal(saved.sums[key], sums[key])
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    with pytest.raises(ValueError, match="not a saved reference Gaussian"):
        load_fit(str(tmp_path / "other.npz"))
    with pytest.raises(FileNotFoundError):
        load_fit(str(tmp_path / "missing.npz"))


def test_mismatched_feature_sizes_are_refused():
    x, y = correlated_pairs(40, 3, seed=8)
    fit = fit_in_chunks(x, y, [0, 40])
    with pytest.raises(ValueError, match="do not match"):
        fit.pmi(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64))
