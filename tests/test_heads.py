"""FLEUR smoothing and the DISCODE ATT head against independent computations: plain numpy formulas, scipy's
divergences and distributions, scipy's constrained optimiser, and per-sample Adam loops."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import optimize, special, stats
from scipy.spatial.distance import jensenshannon

from capeval_plugins.core import heads

DIGITS = torch.arange(10, dtype=torch.float64)


def random_problem(seed: int, rows: int = 8, k: int = 10, d: int = 24, spread: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, d, generator=g, dtype=torch.float64)
    weight = spread * torch.randn(k, d, generator=g, dtype=torch.float64) / math.sqrt(d) * 3
    logits = hidden @ weight.T
    raw = logits.argmax(-1)
    log_q = heads.gaussian_log_prior(DIGITS[raw], DIGITS)
    return hidden, weight, logits, raw, log_q


def numpy_closed_form(z: np.ndarray, log_q: np.ndarray, alpha: float) -> np.ndarray:
    x = (z + (1 - alpha) * log_q) / alpha
    x = x - x.max()
    return np.exp(x) / np.exp(x).sum()


def test_gaussian_prior_and_alpha_follow_their_formulas():
    center = torch.tensor([0.0, 3.0, 9.0], dtype=torch.float64)
    log_q = heads.gaussian_log_prior(center, DIGITS).numpy()
    for row, c in zip(log_q, center.tolist()):
        q = np.exp(-((np.arange(10) - c) ** 2) / 2)
        np.testing.assert_allclose(np.exp(row), q / q.sum(), rtol=1e-12)
    # Eq. 4 read literally on the digits: mu = 4.5, sigma^2 = 0.1
    alpha = heads.att_alpha(DIGITS, DIGITS, 0.1).numpy()
    np.testing.assert_allclose(alpha, stats.norm.pdf(np.arange(10), 4.5, math.sqrt(0.1)), rtol=1e-10)
    assert 0 < alpha[0] < 1e-40 and alpha[0] == alpha[9]  # the underflow the head must survive
    # the digits read on the 0-1 scale: mu = 0.45, alpha in [0.46, 1.25] (methods.md)
    unit = heads.att_alpha(DIGITS / 10, DIGITS / 10, 0.1).numpy()
    assert unit.min() == pytest.approx(0.458, abs=1e-3) and unit.max() == pytest.approx(1.246, abs=1e-3)


def test_closed_form_equals_the_numpy_formula():
    _, _, logits, raw, log_q = random_problem(0)
    alpha = heads.att_alpha(DIGITS[raw] / 10, DIGITS / 10)
    psi = heads.att_closed_form(logits, log_q, alpha).numpy()
    for i in range(len(psi)):
        np.testing.assert_allclose(psi[i], numpy_closed_form(logits[i].numpy(), log_q[i].numpy(), float(alpha[i])),
                                   rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("alphas", ["unit", "small", "literal"])
def test_closed_form_equals_the_converged_numeric_minimiser(alphas):
    hidden, weight, logits, raw, log_q = random_problem(1, rows=12)
    alpha = {"unit": heads.att_alpha(DIGITS[raw] / 10, DIGITS / 10),
             "small": torch.full((12,), 0.05, dtype=torch.float64),
             "literal": heads.att_alpha(DIGITS[raw], DIGITS)}[alphas]
    closed = heads.att_closed_form(logits, log_q, alpha)
    numeric = heads.att_solve(hidden, weight, None, log_q, alpha, "weighted_kl", converge=True)
    tolerance = 1e-9 if alphas != "literal" else 1e-6  # near-one-hot optima are reached to ~1e-7
    assert (closed - numeric).abs().max().item() < tolerance


def test_kl_divergence_is_the_weighted_kl_at_one_half():
    hidden, weight, logits, _, log_q = random_problem(2)
    half = torch.full((8,), 0.5, dtype=torch.float64)
    numeric = heads.att_solve(hidden, weight, None, log_q, half, "kl", converge=True)
    assert (numeric - heads.att_closed_form(logits, log_q, half)).abs().max().item() < 1e-9
    p = torch.softmax(torch.randn(8, 10, dtype=torch.float64), -1)
    kl = special.rel_entr(p.numpy(), log_q.exp().numpy()).sum(-1)
    assert heads.divergence(p.log(), log_q, "kl", half).numpy() == pytest.approx(0.5 * kl, rel=1e-10)


def test_the_limit_alpha_to_zero_is_explicit_and_finite_for_every_raw_score():
    # float32 logits as the model gives them; every raw score 0..9 with the paper's literal alpha
    g = torch.Generator().manual_seed(3)
    for s in range(10):
        logits = torch.randn(4, 10, generator=g)
        logits[:, s] += 8.0
        raw = logits.argmax(-1)
        log_q = heads.gaussian_log_prior(DIGITS[raw], DIGITS)
        alpha = heads.att_alpha(DIGITS[raw], DIGITS, 0.1)
        psi = heads.att_closed_form(logits, log_q, alpha)
        assert torch.isfinite(psi).all() and torch.allclose(psi.sum(-1), torch.ones(4, dtype=torch.float64))
        # a naive float32 evaluation overflows exactly here
        naive = torch.softmax((logits + (1 - alpha.float()[:, None]) * log_q.float()) / alpha.float()[:, None], -1)
        if s in (0, 9):
            assert torch.isnan(naive).any()
        # alpha below 1e-30: the one-hot of argmax(z + log q)
        tiny = alpha < 1e-30
        top = (logits.double() + log_q).argmax(-1)
        assert torch.equal(psi[tiny].argmax(-1), top[tiny]) and torch.all(psi[tiny].max(-1).values == 1.0)
    # alpha that underflows to exactly 0 (sigma^2 = 0.001) takes the same limit, ties shared
    alpha = heads.att_alpha(torch.tensor([0.0, 0.0], dtype=torch.float64), DIGITS, 0.001)
    assert torch.all(alpha == 0)
    logits = torch.zeros(2, 10)
    logits[1, [2, 5]] = 3.0
    flat = torch.zeros(2, 10, dtype=torch.float64)
    psi = heads.att_closed_form(logits, flat, alpha)
    assert torch.allclose(psi[0], torch.full((10,), 0.1, dtype=torch.float64))
    assert psi[1, 2].item() == 0.5 and psi[1, 5].item() == 0.5


def test_closed_form_is_continuous_down_to_the_limit():
    _, _, logits, raw, log_q = random_problem(4)
    limit = heads.att_closed_form(logits, log_q, torch.zeros(8, dtype=torch.float64))
    for a in (1e-3, 1e-30, 1e-300):
        psi = heads.att_closed_form(logits, log_q, torch.full((8,), a, dtype=torch.float64))
        assert (psi - limit).abs().max().item() < 1e-6 if a == 1e-3 else torch.equal(psi, limit)


def numpy_divergence(p: np.ndarray, q: np.ndarray, kind: str, alpha: float, order: float) -> float:
    if kind == "weighted_kl":
        return float(-(1 - alpha) * (p * np.log(q)).sum() + alpha * (p * np.log(p)).sum())
    if kind == "renyi":
        return float(np.log((p ** order * q ** (1 - order)).sum()) / (order - 1))
    if kind == "beta":
        b = order
        return float(((p ** b + (b - 1) * q ** b - b * p * q ** (b - 1)) / (b * (b - 1))).sum())
    return float(jensenshannon(p, q) ** 2)  # natural log: the JS divergence itself


@pytest.mark.parametrize("kind", ["weighted_kl", "renyi", "beta", "js"])
def test_divergences_equal_direct_formulas(kind):
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(6, 10, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(6, 10, generator=g, dtype=torch.float64), -1)
    alpha = torch.rand(6, generator=g, dtype=torch.float64)
    ours = heads.divergence(p.log(), q.log(), kind, alpha, order=0.7).numpy()
    expected = [numpy_divergence(p[i].numpy(), q[i].numpy(), kind, float(alpha[i]), 0.7) for i in range(6)]
    np.testing.assert_allclose(ours, expected, rtol=1e-9)
    if kind == "renyi":  # order 1 is the KL divergence
        kl = special.rel_entr(p.numpy(), q.numpy()).sum(-1)
        np.testing.assert_allclose(heads.divergence(p.log(), q.log(), "renyi", alpha, 1.0).numpy(), kl, rtol=1e-10)


@pytest.mark.parametrize("kind", ["renyi", "beta", "js"])
def test_converged_solver_is_a_minimum_no_worse_than_scipys(kind):
    hidden, weight, logits, raw, log_q = random_problem(6, rows=2)
    alpha = heads.att_alpha(DIGITS[raw] / 10, DIGITS / 10)
    ours = heads.att_solve(hidden, weight, None, log_q, alpha, kind, converge=True)
    # stationary on the simplex: the gradient in logit space, psi * (g - <psi, g>), vanishes
    u = ours.log().requires_grad_(True)
    heads.att_loss(u, logits, log_q, kind, alpha).sum().backward()
    assert u.grad.abs().max().item() < 1e-8
    for i in range(2):
        def loss(p: np.ndarray, i=i) -> float:
            lp = torch.log(torch.as_tensor(np.clip(p, 1e-300, None)))[None]
            return float(heads.att_loss(lp, logits[i:i + 1], log_q[i:i + 1], kind, alpha[i:i + 1]))

        best = optimize.minimize(loss, torch.softmax(logits[i], -1).numpy(), method="SLSQP", bounds=[(0, 1)] * 10,
                                 constraints=[{"type": "eq", "fun": lambda p: p.sum() - 1}],
                                 options={"ftol": 1e-12, "maxiter": 300})
        assert loss(ours[i].numpy()) <= best.fun + 1e-9


def test_paper_adam_solver_equals_one_adam_per_sample_and_lowers_the_loss():
    hidden, weight, logits, raw, log_q = random_problem(7, rows=4)
    alpha = heads.att_alpha(DIGITS[raw] / 10, DIGITS / 10)
    batched = heads.att_solve(hidden, weight, None, log_q, alpha, "js", steps=10, lr=1e-3)
    for i in range(4):
        w = weight.clone().requires_grad_(True)
        b = torch.zeros(10, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.Adam([w, b], lr=1e-3)
        for _ in range(10):
            opt.zero_grad()
            loss = heads.att_loss((w @ hidden[i] + b)[None], logits[i:i + 1], log_q[i:i + 1], "js", alpha[i:i + 1])
            loss.sum().backward()
            opt.step()
        alone = torch.softmax(w.detach() @ hidden[i] + b.detach(), -1)
        assert (alone - batched[i]).abs().max().item() < 1e-12
    before = heads.att_loss(logits, logits, log_q, "js", alpha)
    after = heads.att_loss(batched.log(), logits, log_q, "js", alpha)
    assert torch.all(after < before)


def test_fleur_smoothing_equals_a_plain_recomputation():
    g = torch.Generator().manual_seed(8)
    logp = torch.log_softmax(torch.randn(4, 3, 40, generator=g), -1)[..., :10]  # full-vocabulary log-probs
    has_second = torch.tensor([True, False, True, False])
    is_one = torch.tensor([False, False, False, True])
    ours = heads.fleur_smooth(logp[:, 1], logp[:, 2], logp[:, 0], has_second, is_one)
    p = logp.double().exp().numpy()
    for i in range(4):
        if is_one[i]:
            expected = 0.9 * p[i, 0, 0] + p[i, 0, 1]
        else:
            expected = sum(0.1 * d * p[i, 1, d] for d in range(10))
            if has_second[i]:
                expected += sum(0.01 * d * p[i, 2, d] for d in range(10))
        assert ours[i].item() == pytest.approx(expected, rel=1e-12)
    # the digit mass is not renormalised: a sample with little digit mass scores low
    assert ours[0].item() < 0.1


@pytest.mark.parametrize("alpha_scale", ["label", "unit"])
def test_att_prior_is_the_gaussian_prior_and_eq4_on_the_chosen_scale(alpha_scale):
    raw = torch.tensor([0, 3, 4, 5, 9])
    log_q, alpha = heads.att_prior(raw, DIGITS, 0.1, alpha_scale)
    assert torch.equal(log_q, heads.gaussian_log_prior(DIGITS[raw], DIGITS))
    on = np.arange(10.0) / (10 if alpha_scale == "unit" else 1)
    np.testing.assert_allclose(alpha.numpy(), stats.norm.pdf(on[raw.numpy()], on.mean(), math.sqrt(0.1)), rtol=1e-12)
    assert heads.att_prior(raw, DIGITS, 0.1, alpha_scale, "kl")[1].tolist() == [0.5] * 5
    with pytest.raises(ValueError, match="alpha_scale"):
        heads.att_prior(raw, DIGITS, 0.1, "digits")


def test_the_literal_reading_returns_the_written_digit_for_every_raw_digit_but_4_and_5():
    """With alpha = N(s_raw; 4.5, 0.1) < 2e-5 the prior leaves psi exactly one-hot at the raw digit, whatever
    the LVLM's distribution (the DISCODE card's claim); at 4 and 5 the expectation moves."""
    g = torch.Generator().manual_seed(7)
    logits = 2.0 * torch.randn(4000, 10, generator=g, dtype=torch.float64)
    raw = logits.argmax(-1)
    log_q, alpha = heads.att_prior(raw, DIGITS, 0.1, "label")
    psi = heads.att_closed_form(logits, log_q, alpha)
    s_hat = heads.expected_value(psi, DIGITS)
    outer = (raw != 4) & (raw != 5)
    assert bool((alpha[outer] < 2e-5).all()) and bool((alpha[~outer] > 0.36).all())
    assert torch.equal(psi[outer], torch.nn.functional.one_hot(raw[outer], 10).double())
    assert torch.equal(s_hat[outer], raw[outer].double())
    assert (s_hat[~outer] - raw[~outer]).abs().max() > 0.1


# --- DISCODE's ablations (Table 10) against scipy's constrained optimiser ------------------------------------


def scipy_minimise_on_simplex(loss, k: int = 10) -> np.ndarray:
    """argmin of a function of a distribution over k labels by SLSQP on the simplex."""
    result = optimize.minimize(loss, np.full(k, 1.0 / k), method="SLSQP", bounds=[(1e-12, 1.0)] * k,
                               constraints=[{"type": "eq", "fun": lambda p: p.sum() - 1.0}],
                               options={"ftol": 1e-14, "maxiter": 500})
    return result.x / result.x.sum()


@pytest.mark.parametrize("ablation", ["no_cross_entropy", "fixed_alpha", "none"])
def test_att_ablations_are_the_minimisers_of_their_losses(ablation):
    _, _, logits, raw, log_q = random_problem(7, rows=4, spread=0.4)
    alpha = torch.tensor([0.46, 0.7, 0.92, 0.8], dtype=torch.float64)
    psi = heads.att_ablation(logits, log_q, alpha, ablation).numpy()
    for i in range(4):
        log_p = logits[i].numpy() - special.logsumexp(logits[i].numpy())
        a = 0.5 if ablation == "fixed_alpha" else float(alpha[i])
        lq = log_q[i].numpy()

        def loss(p):
            cross = 0.0 if ablation == "no_cross_entropy" else -(p * log_p).sum()
            return cross - (1 - a) * (p * lq).sum() + a * (p * np.log(p)).sum()

        expected = scipy_minimise_on_simplex(loss)
        # SLSQP stops at ftol 1e-14 on a strongly convex loss: the minimiser agrees to ~1e-5.
        np.testing.assert_allclose(psi[i], expected, atol=2e-5)
        assert loss(psi[i]) <= loss(expected) + 1e-10


def test_att_ablation_without_the_divergence_is_the_one_hot_of_the_written_digit():
    logits = torch.tensor([[0.1, 2.0, 0.3, -1.0], [1.0, 1.0, 0.0, 0.5]], dtype=torch.float64)
    psi = heads.att_ablation(logits, torch.zeros(2, 4, dtype=torch.float64), torch.tensor([0.5, 0.5]), "no_divergence")
    # H(psi, p) = -sum psi log p is linear in psi: every minimiser sits on the labels of largest p (plain loop).
    for row, z in zip(psi.tolist(), logits.tolist()):
        top = [j for j, v in enumerate(z) if v == max(z)]
        assert row == pytest.approx([1 / len(top) if j in top else 0.0 for j in range(4)], abs=1e-15)
    with pytest.raises(ValueError, match="ablation"):
        heads.att_ablation(logits, torch.zeros(2, 4, dtype=torch.float64), torch.tensor([0.5, 0.5]), "no_prior")


@pytest.mark.parametrize("ablation", ["no_cross_entropy", "fixed_alpha"])
def test_att_solve_to_convergence_reaches_the_ablations_closed_forms(ablation):
    hidden, weight, logits, raw, log_q = random_problem(11, rows=3, spread=0.4)
    alpha = torch.tensor([0.46, 0.7, 0.92], dtype=torch.float64)
    numeric = heads.att_solve(hidden, weight, None, log_q, alpha, converge=True, ablation=ablation)
    torch.testing.assert_close(numeric, heads.att_ablation(logits, log_q, alpha, ablation), atol=1e-7, rtol=0)


def test_clipped_alpha_is_capped_at_one():
    raw = torch.arange(10)
    _, alpha = heads.att_prior(raw, DIGITS, 0.1, "unit")
    _, clipped = heads.att_prior(raw, DIGITS, 0.1, "unit", clip=True)
    torch.testing.assert_close(clipped, alpha.clamp(max=1.0))
    assert alpha.max() > 1.2 and clipped.max() == 1.0


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_rigel_kl_objective_is_tau_times_scipy_kl(temperature):
    g = torch.Generator().manual_seed(3)
    head_logits, teacher_logits = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g) * 2
    loss = heads.distillation_loss(head_logits, teacher_logits, temperature, objective="kl")
    for row, (h, t) in enumerate(zip(head_logits.double().numpy(), teacher_logits.double().numpy())):
        teacher, student = special.softmax(t / temperature), special.softmax(h / temperature)
        assert loss[row].item() == pytest.approx(temperature * stats.entropy(teacher, student), rel=1e-10)
    with pytest.raises(ValueError, match="objective"):
        heads.distillation_loss(head_logits, teacher_logits, objective="js")


# --- issue 30: DISCODE's default alpha lies in the paper's [0, 1] -------------------------------------------------


def random_digit_logits(rng: np.random.Generator, argmax: int) -> np.ndarray:
    """Logits of a random digit distribution whose argmax is ``argmax``: sharp or flat, unimodal or not."""
    z = rng.normal(0.0, rng.uniform(0.05, 6.0), 10)
    z[argmax] = z.max() + rng.exponential(rng.uniform(0.01, 3.0))
    return z


@pytest.mark.parametrize("sigma2", [1.0, 0.5, 0.1, 0.05, 0.01])
def test_default_alpha_is_in_0_1_largest_near_mu_and_the_head_is_the_closed_form(sigma2):
    """Over random distributions with every digit written: the default reading (Eq. 4 on the digits as tenths,
    capped at 1) gives alpha in [0, 1], symmetric and non-increasing away from mu; psi and the score equal an
    independent numpy closed form with scipy's density."""
    from capeval_plugins import functional as F

    rng = np.random.default_rng(int(sigma2 * 1e4))
    for trial in range(300):
        d = trial % 10
        z = random_digit_logits(rng, d)
        head = F.discode_head(torch.tensor(z)[None], sigma2=sigma2)
        alpha = float(head.alpha[0])
        expected = min(1.0, stats.norm.pdf(d / 10, 0.45, math.sqrt(sigma2)))
        assert 0.0 <= alpha <= 1.0
        assert alpha == pytest.approx(expected, rel=1e-12, abs=1e-300)
        log_q = -0.5 * (np.arange(10) - d) ** 2
        log_q -= special.logsumexp(log_q)
        psi = numpy_closed_form(z, log_q, expected) if expected > 0 else np.eye(10)[d]
        np.testing.assert_allclose(head.distribution[0].numpy(), psi, rtol=0, atol=1e-12)
        assert float(head.expected[0]) == pytest.approx(float(psi @ np.arange(10)), abs=1e-10)
    alphas = F.discode_head(torch.eye(10) * 50, sigma2=sigma2).alpha.numpy()  # one row per written digit
    np.testing.assert_allclose(alphas, alphas[::-1], rtol=1e-12)
    assert np.all(np.diff(alphas[:5]) >= -1e-15) and alphas.min() == alphas[0] and alphas.max() <= 1.0
    # at alpha = 1 the prior has no weight: psi is the LVLM's distribution itself
    if np.isclose(alphas.max(), 1.0):
        z = random_digit_logits(rng, int(np.argmax(alphas)))
        np.testing.assert_allclose(F.discode_head(torch.tensor(z)[None], sigma2=sigma2).distribution[0].numpy(),
                                   special.softmax(z), rtol=0, atol=1e-12)


def test_other_readings_of_eq4_stay_available():
    from capeval_plugins import functional as F

    rows = torch.eye(10, dtype=torch.float64) * 50
    uncapped = F.discode_head(rows, alpha_clip=False).alpha.numpy()
    np.testing.assert_allclose(uncapped, stats.norm.pdf(np.arange(10) / 10, 0.45, math.sqrt(0.1)), rtol=1e-12)
    assert uncapped.max() > 1.2  # Eq. 4 as printed exceeds the stated range at 4 and 5
    kernel = F.discode_head(rows, alpha_form="kernel", alpha_clip=False).alpha.numpy()
    np.testing.assert_allclose(kernel, np.exp(-(np.arange(10) / 10 - 0.45) ** 2 / 0.2), rtol=1e-12)
    literal = F.discode_head(rows, alpha_scale="label", alpha_clip=False).alpha.numpy()
    np.testing.assert_allclose(literal, stats.norm.pdf(np.arange(10), 4.5, math.sqrt(0.1)), rtol=1e-12)
    with pytest.raises(ValueError, match="alpha form"):
        heads.att_alpha(DIGITS, DIGITS, 0.1, "peak")
