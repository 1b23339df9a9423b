"""Score heads on an LVLM's label distribution: small pure functions on tensors, float64 throughout.

* FLEUR score smoothing (Lee et al., ACL 2024): the expected digit under the full-vocabulary distribution at
  each decimal position of "0.xy", and 0.9 P('0') + P('1') at the integer digit of "1.0".
* DISCODE's ATT head (Inoue et al., AAAI 2026): the score distribution psi minimising
  ``H(psi, p_LVLM) + D(psi || q)`` for a Gaussian prior q around the raw score. For the weighted KL
  ``D_alpha = (1 - alpha) H(psi, q) - alpha H(psi)`` the minimiser is (paper Eq. 6)
  ``psi = softmax((z + (1 - alpha) log q) / alpha)``, z the label logits; as alpha -> 0 it tends to the
  one-hot of ``argmax(z + log q)`` (ties shared), which is taken explicitly where alpha underflows. The other
  divergences of the paper's Table 8 have no closed form: :func:`att_solve` minimises the loss numerically,
  as in the paper (Adam on the linear head ``softmax(W h + b)``) or to convergence.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

Divergence = Literal["weighted_kl", "kl", "renyi", "beta", "js"]
DIVERGENCES: tuple[str, ...] = ("weighted_kl", "kl", "renyi", "beta", "js")
CLOSED_FORM: tuple[str, ...] = ("weighted_kl", "kl")


def expected_value(probs: Tensor, values: Tensor) -> Tensor:
    """sum_k probs[..., k] * values[k] (probabilities as given: not renormalised)."""
    return (probs.double() * values.to(probs.device, torch.float64)).sum(-1)


def fleur_smooth(first: Tensor, second: Tensor, integer: Tensor, has_second: Tensor, is_one: Tensor) -> Tensor:
    """FLEUR's smoothed score from full-vocabulary digit log-probabilities (B, 10) at the first decimal,
    the second decimal and the integer digit of "0.xy" / "1.0":

    ``0.1 * E_first[d] + 0.01 * E_second[d]`` (the second term only where a second decimal was written), and
    ``0.9 * P_integer('0') + P_integer('1')`` where the answer is "1.0". Rows that use no value of an input
    may hold NaN there."""
    # One pass over the three positions: (3, ..., 10) probabilities, their expected digits (3, ...).
    probs = torch.stack([first, second, integer]).double().exp().nan_to_num()
    expected = probs @ torch.arange(10, dtype=torch.float64, device=probs.device)
    decimal = 0.1 * expected[0] + 0.01 * expected[1] * has_second
    one = 0.9 * probs[2, ..., 0] + probs[2, ..., 1]
    return torch.where(is_one, one, decimal)


def gaussian_log_prior(center: Tensor, values: Tensor) -> Tensor:
    """log q over the labels for q(x) proportional to exp(-(x - center)^2 / 2): (B,) centers -> (B, K)."""
    values = values.to(center.device, torch.float64)
    energy = -0.5 * (values[None, :] - center.double()[:, None]) ** 2
    return energy - torch.logsumexp(energy, dim=-1, keepdim=True)


def att_alpha(center: Tensor, values: Tensor, sigma2: float = 0.1, form: str = "density") -> Tensor:
    """DISCODE Eq. 4: alpha = N(center; mu, sigma2), mu the mean of ``values`` (the label values on the scale
    alpha is read on). ``form="density"`` is the equation as printed (a density: it exceeds 1 near mu when
    2 pi sigma2 < 1, and underflows towards 0 far from mu); ``"kernel"`` drops the normalising constant
    (exp(-(center - mu)^2 / (2 sigma2)): 1 at mu, in (0, 1] everywhere)."""
    if sigma2 <= 0:
        raise ValueError(f"sigma2 must be positive, got {sigma2}")
    if form not in ALPHA_FORMS:
        raise ValueError(f"alpha form must be one of {ALPHA_FORMS}, got {form!r}")
    mu = values.to(torch.float64).mean()
    kernel = torch.exp(-((center.double() - mu) ** 2) / (2 * sigma2))
    return kernel if form == "kernel" else kernel / math.sqrt(2 * math.pi * sigma2)


ALPHA_SCALES: tuple[str, ...] = ("label", "unit")
ALPHA_FORMS: tuple[str, ...] = ("density", "kernel")


def att_prior(raw: Tensor, values: Tensor, sigma2: float = 0.1, alpha_scale: str = "label",
              divergence: str = "weighted_kl", clip: bool = False, form: str = "density") -> tuple[Tensor, Tensor]:
    """DISCODE's prior for raw scores given as label indices ``raw`` (B,) on a scale whose K labels have
    ``values``: ``(log q (B, K), alpha (B,))``, q a unit-variance Gaussian around the raw label's value and
    alpha Eq. 4 (:func:`att_alpha`, ``form``), read on the label values (``alpha_scale="label"``, the paper's
    literal reading: mu = 4.5 for the digits) or with label k of K read as k / K (``"unit"``: mu = 0.45).
    ``clip`` caps alpha at 1 (the paper's "alpha in [0, 1]"). The ``"kl"`` divergence fixes alpha at 0.5."""
    if alpha_scale not in ALPHA_SCALES:
        raise ValueError(f"alpha_scale must be one of {ALPHA_SCALES}, got {alpha_scale!r}")
    values = values.to(torch.float64)
    raw = raw.to(values.device)
    log_q = gaussian_log_prior(values[raw], values)
    on = values if alpha_scale == "label" else torch.arange(len(values), dtype=torch.float64, device=values.device) / len(values)
    alpha = att_alpha(on[raw], on, sigma2, form)
    if clip:
        alpha = alpha.clamp(max=1.0)
    if divergence == "kl":
        alpha = torch.full_like(alpha, 0.5)
    return log_q, alpha


def att_closed_form(logits: Tensor, log_prior: Tensor, alpha: Tensor) -> Tensor:
    """The weighted-KL ATT minimiser (B, K): softmax((z + (1 - alpha) log q) / alpha), float64.

    ``logits`` may be any per-row shift of the label logits (e.g. full-vocabulary log-probabilities).
    Where alpha is 0 (underflow) the limit is returned: the one-hot of argmax(z + log q), ties shared. For
    alpha > 0 float64 already reaches that limit without overflow (a max-shifted softmax of differences of
    order 1/alpha, shifted to be <= 0), so the result is continuous in alpha."""
    z = logits.double()
    log_q = log_prior.double()
    alpha = alpha.double()[:, None]
    tiny = alpha <= 0
    safe = torch.where(tiny, torch.ones_like(alpha), alpha)
    tempered = z + (1 - safe) * log_q
    # Shift before dividing: entries <= 0 divided by a tiny alpha go to -inf at worst, never inf - inf.
    adapted = torch.softmax((tempered - tempered.amax(-1, keepdim=True)) / safe, dim=-1)
    score = z + log_q
    top = (score == score.amax(-1, keepdim=True)).double()
    limit = top / top.sum(-1, keepdim=True)
    return torch.where(tiny, limit, adapted)


ABLATIONS: tuple[str, ...] = ("none", "no_cross_entropy", "no_divergence", "fixed_alpha")


def att_ablation(logits: Tensor, log_prior: Tensor, alpha: Tensor, ablation: str = "none") -> Tensor:
    """The minimiser psi (B, K) of the ATT loss or of one of the paper's ablations (Table 10), float64:

    ``"none"``: H(psi, p) + D_alpha(psi || q), :func:`att_closed_form`; ``"no_cross_entropy"``: D_alpha alone,
    (1 - alpha) H(psi, q) - alpha H(psi), minimised by psi proportional to q^((1 - alpha) / alpha) (the one-hot
    of argmax q where alpha underflows); ``"no_divergence"``: H(psi, p) alone, linear in psi, minimised by the
    one-hot of argmax z (ties shared); ``"fixed_alpha"``: the full loss at alpha = 0.5 (the vanilla KL up to a
    factor), softmax(2 z + log q)."""
    if ablation == "none":
        return att_closed_form(logits, log_prior, alpha)
    if ablation == "fixed_alpha":
        return att_closed_form(logits, log_prior, torch.full_like(alpha.double(), 0.5))
    if ablation == "no_cross_entropy":
        # D_alpha alone is the weighted-KL minimiser with a flat p: z = 0 leaves only the prior's term.
        return att_closed_form(torch.zeros_like(log_prior.double()), log_prior, alpha)
    if ablation == "no_divergence":
        z = logits.double()
        top = (z == z.amax(-1, keepdim=True)).double()
        return top / top.sum(-1, keepdim=True)
    raise ValueError(f"ablation must be one of {ABLATIONS}, got {ablation!r}")


# --- the ATT loss and its numeric minimiser ------------------------------------------------------------------


def divergence(log_p: Tensor, log_q: Tensor, kind: str, alpha: Tensor, order: float = 0.5) -> Tensor:
    """D(p || q) per row from log-probabilities (B, K), in log space.

    ``weighted_kl``: (1 - alpha) H(p, q) - alpha H(p) (paper Eq. 3); ``kl``: the same with alpha = 0.5, which
    is half the KL divergence (the paper's "vanilla KL"); ``renyi``: 1 / (a - 1) log sum p^a q^(1 - a);
    ``beta``: sum (p^b + (b - 1) q^b - b p q^(b - 1)) / (b (b - 1)); ``js``: Jensen-Shannon. ``order`` is
    a (Renyi) or b (beta)."""
    p = log_p.exp()
    if kind in ("weighted_kl", "kl"):
        a = torch.full_like(alpha.double(), 0.5) if kind == "kl" else alpha.double()
        return -(1 - a) * (p * log_q).sum(-1) + a * (p * log_p).sum(-1)
    if kind == "renyi":
        if order == 1:
            return (p * (log_p - log_q)).sum(-1)
        return torch.logsumexp(order * log_p + (1 - order) * log_q, dim=-1) / (order - 1)
    if kind == "beta":
        if order in (0, 1):
            raise ValueError("the beta divergence needs an order other than 0 and 1")
        cross = (log_p + (order - 1) * log_q).exp()
        terms = (order * log_p).exp() + (order - 1) * (order * log_q).exp() - order * cross
        return terms.sum(-1) / (order * (order - 1))
    if kind == "js":
        log_m = torch.logaddexp(log_p, log_q) - math.log(2)
        q = log_q.exp()
        return 0.5 * (p * (log_p - log_m)).sum(-1) + 0.5 * (q * (log_q - log_m)).sum(-1)
    raise ValueError(f"unknown divergence {kind!r}; choose one of {DIVERGENCES}")


def att_loss(head_logits: Tensor, lvlm_logits: Tensor, log_prior: Tensor, kind: str, alpha: Tensor,
             order: float = 0.5, ablation: str = "none") -> Tensor:
    """ATT loss per row (paper Eq. 2): H(psi, p_LVLM) + D(psi || q), psi = softmax(head_logits) and p_LVLM the
    LVLM's label distribution (softmax of its label logits); ``ablation`` (Table 10) drops the cross-entropy
    or the divergence term, or fixes alpha at 0.5."""
    if ablation not in ABLATIONS:
        raise ValueError(f"ablation must be one of {ABLATIONS}, got {ablation!r}")
    if ablation == "fixed_alpha":
        alpha = torch.full_like(alpha.double(), 0.5)
    log_psi = torch.log_softmax(head_logits, dim=-1)
    log_lvlm = torch.log_softmax(lvlm_logits, dim=-1)
    cross = -(log_psi.exp() * log_lvlm).sum(-1)
    div = divergence(log_psi, log_prior, kind, alpha, order)
    if ablation == "no_cross_entropy":
        return div
    if ablation == "no_divergence":
        return cross
    return cross + div


def att_solve(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    log_prior: Tensor,
    alpha: Tensor,
    kind: str = "weighted_kl",
    *,
    order: float = 0.5,
    steps: int = 10,
    lr: float = 1e-3,
    converge: bool = False,
    tol: float = 1e-12,
    ablation: str = "none",
) -> Tensor:
    """Minimise the ATT loss numerically; returns psi (B, K), float64.

    ``hidden`` (B, d) final hidden states, ``weight`` (B, K, d) or (K, d) and ``bias`` (B, K), (K,) or None
    the LM-head rows of the labels: p_LVLM = softmax(weight h + bias).

    As in the paper (``converge=False``): the head softmax(W h + b) starts at the LM head (W = weight,
    b = bias) and Adam takes ``steps`` steps of learning rate ``lr`` on (W, b), every sample its own head.
    With ``converge=True`` the loss is minimised to convergence over the head's logits u = W h + b, which
    reach every distribution (b is free), by saddle-free Newton from the LM head's logits; for the weighted
    KL this reproduces :func:`att_closed_form`."""
    # Copies: the inputs may be inference-mode tensors, which autograd cannot save.
    h = hidden.double().clone()
    w = weight.double().expand(h.shape[0], *weight.shape[-2:]).clone()
    b = torch.zeros(w.shape[:2], dtype=torch.float64, device=h.device) if bias is None else \
        bias.double().expand(w.shape[:2]).clone()
    lvlm = torch.einsum("bkd,bd->bk", w, h) + b
    log_q, alpha = log_prior.double().clone(), alpha.double().clone()
    with torch.enable_grad():
        if converge:
            return _solve_to_convergence(lvlm, log_q, alpha, kind, order, tol, ablation=ablation)
        w_head = w.clone().requires_grad_(True)
        b_head = b.clone().requires_grad_(True)
        opt = torch.optim.Adam([w_head, b_head], lr=lr)
        for _ in range(steps):
            opt.zero_grad()
            logits = torch.einsum("bkd,bd->bk", w_head, h) + b_head
            att_loss(logits, lvlm, log_q, kind, alpha, order, ablation).sum().backward()
            opt.step()
        logits = torch.einsum("bkd,bd->bk", w_head, h) + b_head
    return torch.softmax(logits.detach(), dim=-1)


def _solve_to_convergence(lvlm: Tensor, log_q: Tensor, alpha: Tensor, kind: str, order: float, tol: float,
                          max_iter: int = 200, radius: float = 2.0, ablation: str = "none") -> Tensor:
    """Saddle-free Newton per row on the head logits, the last one fixed at 0 (softmax is shift-invariant).

    The loss is convex in psi but not in the logits, whose only stationary points with psi inside the simplex
    are its minimisers; Newton steps on |Hessian| (eigenvalues made positive) head downhill everywhere and
    converge quadratically near the minimum. Steps move no logit by more than ``radius`` and backtrack until
    the row's loss does not increase (beyond rounding); a row stops when its gradient is below ``tol`` or its
    steps fall below rounding."""
    def losses(v: Tensor) -> Tensor:
        return att_loss(torch.cat([v, v.new_zeros(len(v), 1)], dim=-1), lvlm, log_q, kind, alpha, order, ablation)

    def derivatives(v: Tensor) -> tuple[Tensor, Tensor]:
        # Rows are independent: the gradient of the summed loss is each row's gradient, and each row's
        # Hessian column j is the gradient of its gradient's entry j.
        v = v.detach().requires_grad_(True)
        g = torch.autograd.grad(losses(v).sum(), v, create_graph=True)[0]
        columns = [torch.autograd.grad(g[:, j].sum(), v, retain_graph=True)[0] for j in range(v.shape[1])]
        return g.detach(), torch.stack(columns, dim=-1)

    lvlm = lvlm.detach()
    v = (lvlm - lvlm[:, -1:])[:, :-1]
    loss = losses(v).detach()
    active = torch.ones_like(loss, dtype=torch.bool)
    for _ in range(max_iter):
        g, hess = derivatives(v)
        active &= g.abs().amax(-1) > tol
        if not bool(active.any()):
            break
        eigval, eigvec = torch.linalg.eigh(hess)
        # Directions of almost no curvature (labels of almost no mass) get a bounded step.
        floor = 1e-9 * eigval.abs().amax(-1, keepdim=True).clamp_min(1e-300)
        inverse = 1.0 / torch.maximum(eigval.abs(), floor)
        step = -torch.einsum("bij,bj,bkj,bk->bi", eigvec, inverse, eigvec, g)
        # A trust region: a long step into a saturated softmax lands on a plateau it leaves only slowly.
        step = step * (radius / step.abs().amax(-1, keepdim=True).clamp_min(radius))
        scale = torch.where(active, 1.0, 0.0).to(v.dtype)
        slack = 8 * torch.finfo(v.dtype).eps * (loss.abs() + 1)  # rounding, not a real increase
        pending = active.clone()
        for _ in range(50):  # backtracking on the rows still moving
            trial = v + scale[:, None] * step
            trial_loss = losses(trial).detach()
            pending &= ~(torch.isfinite(trial_loss) & (trial_loss <= loss + slack))
            if not bool(pending.any()):
                break
            scale = torch.where(pending, scale / 2, scale)
        moved = active & ~pending
        v = torch.where(moved[:, None], trial, v)
        loss = torch.where(moved, trial_loss, loss)
        # A row that cannot descend any more, or only by steps below rounding, has converged.
        active &= moved & ((scale[:, None] * step).abs().amax(-1) > 1e-13)
    return torch.softmax(torch.cat([v, v.new_zeros(len(v), 1)], dim=-1), dim=-1)


# --- Rigel: the scoring head and its ordinal distillation loss -----------------------------------------------
#
# Rigel (Koyama et al., 2026) reads a small MLP g on the LVLM's final hidden state h at the score position
# instead of the LM head's rows of the score tokens "1".."5". Phase 1 distils g from the frozen LVLM:
# q = softmax(z_score / tau) (Eq. 1), loss tau * EMD(q, softmax(g(h) / tau)) (Eq. 2) with the 1-D EMD of
# Appendix E (Eq. 4). Phase 2 trains the backbone against the one-hot of the averaged human score through
# the frozen g (cross-entropy, Eq. 3). Inference: y = sum_k k p_k, p = softmax(g(h)), normalised to [0, 1].

RIGEL_ACTIVATIONS: tuple[str, ...] = ("relu", "gelu", "tanh")


def emd_1d(p: Tensor, q: Tensor) -> Tensor:
    """One-dimensional Earth Mover's Distance between distributions over K ordered, unit-spaced labels
    (Rigel, Appendix E, Eq. 4): ``sum_{i < K} |P_i - Q_i|`` with P, Q the cumulative sums, per row (..., K) ->
    (...). In the inputs' dtype (pass float64 where it matters); differentiable."""
    if p.shape[-1] != q.shape[-1]:
        raise ValueError(f"distributions over {p.shape[-1]} and {q.shape[-1]} labels")
    return (p.cumsum(-1) - q.cumsum(-1))[..., :-1].abs().sum(-1)


def tempered_softmax(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """softmax(logits / tau) in float64 (Rigel Eq. 1). Any per-row shift of the logits (e.g. full-vocabulary
    log-probabilities) gives the same distribution."""
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return torch.softmax(logits.double() / temperature, dim=-1)


RIGEL_OBJECTIVES: tuple[str, ...] = ("emd", "kl")


def distillation_loss(head_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0,
                      objective: str = "emd") -> Tensor:
    """Rigel's phase-1 loss per row (Eq. 2): ``tau * EMD(softmax(z_score / tau), softmax(z_hat / tau))``,
    float64; the factor tau keeps the gradient's scale as tau changes. ``objective="kl"`` is the paper's
    Table 5 ablation, ``tau * KL(teacher || student)`` (the same factor: the paper gives none)."""
    if objective not in RIGEL_OBJECTIVES:
        raise ValueError(f"objective must be one of {RIGEL_OBJECTIVES}, got {objective!r}")
    teacher = tempered_softmax(teacher_logits, temperature)
    if objective == "kl":
        log_student = torch.log_softmax(head_logits.double() / temperature, dim=-1)
        log_teacher = torch.log_softmax(teacher_logits.double() / temperature, dim=-1)
        return temperature * (teacher * (log_teacher - log_student)).sum(-1)
    student = tempered_softmax(head_logits, temperature)
    return temperature * emd_1d(teacher, student)


def label_expectation(probs: Tensor, num_labels: int | None = None) -> Tensor:
    """``sum_k k p_k`` over the labels 1..K (float64)."""
    k = probs.shape[-1] if num_labels is None else num_labels
    return expected_value(probs, torch.arange(1, k + 1, dtype=torch.float64))


def unit_score(expected: Tensor, num_labels: int) -> Tensor:
    """An expected label in [1, K] mapped linearly to [0, 1] (Rigel, Section 3.3)."""
    return (expected.double() - 1.0) / (num_labels - 1)


def gold_labels(scores: Tensor, num_labels: int, ties: str = "up") -> Tensor:
    """Index (0..K-1) of the label nearest to each averaged human score given on [0, 1] (label k of 1..K sits
    at (k - 1) / (K - 1)): the class of Rigel's phase-2 one-hot. ``ties``: a score half-way between two labels
    (e.g. the mean of a 3 and a 4) goes ``"up"`` or ``"down"``."""
    if ties not in ("up", "down"):
        raise ValueError(f"ties must be 'up' or 'down', got {ties!r}")
    position = scores.double() * (num_labels - 1)
    if bool(((position < -1e-9) | (position > num_labels - 1 + 1e-9) | torch.isnan(position)).any()):
        raise ValueError("human scores must lie in [0, 1] (normalise them first)")
    # Rounded on a grid of 1e-9 so that 0.625 * 4 = 2.5000000000000004 still counts as a tie.
    position = torch.round(position * 1e9) / 1e9
    label = torch.floor(position + 0.5) if ties == "up" else torch.ceil(position - 0.5)
    return label.clamp(0, num_labels - 1).long()


class ScoringHead(torch.nn.Module):
    """Rigel's scoring head g: an MLP from the final hidden state (d) to K label logits, ``hidden`` the widths
    of its hidden layers. (1024, 512) on Qwen3-VL-2B (d = 2048) has the paper's 2.63M parameters."""

    def __init__(self, input_dim: int, hidden: tuple[int, ...] = (1024, 512), num_labels: int = 5,
                 activation: str = "relu") -> None:
        super().__init__()
        if activation not in RIGEL_ACTIVATIONS:
            raise ValueError(f"activation must be one of {RIGEL_ACTIVATIONS}, got {activation!r}")
        if input_dim < 1 or num_labels < 2 or any(h < 1 for h in hidden):
            raise ValueError("the head needs a positive input size and layer widths, and at least two labels")
        act = {"relu": torch.nn.ReLU, "gelu": torch.nn.GELU, "tanh": torch.nn.Tanh}[activation]
        widths = [input_dim, *hidden]
        layers: list[torch.nn.Module] = []
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [torch.nn.Linear(a, b), act()]
        layers.append(torch.nn.Linear(widths[-1], num_labels))
        self.net = torch.nn.Sequential(*layers)
        self.input_dim, self.hidden, self.num_labels, self.activation = input_dim, tuple(hidden), num_labels, activation

    def forward(self, hidden_state: Tensor) -> Tensor:
        weight = self.net[0].weight
        return self.net(hidden_state.to(weight.device, weight.dtype))
