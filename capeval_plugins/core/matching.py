"""Greedy cosine matching of token embeddings (BERTScore, ViLBERTScore), batched with padding masks.

For a candidate x^ and a reference x with token embeddings, each token is matched to its most similar token
on the other side:

    P = sum_i w^_i max_j cos(x^_i, x_j) / sum_i w^_i        R = sum_j w_j max_i cos(x_j, x^_i) / sum_j w_j
    F = 2 P R / (P + R)

``w`` are token weights (1, or idf, and 0 for tokens that do not count). Which tokens may be matched
(``*_mask``) and how much each token counts (``*_weights``) are separate because bert_score keeps [CLS] and
[SEP] as match targets while giving them no weight. Padding and masked-out tokens are never matched (they get
-inf, not bert_score's 0; see :func:`best_similarities`).
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor


def best_similarities(cand: Tensor, cand_mask: Tensor, ref: Tensor, ref_mask: Tensor,
                      normalized: bool = False) -> tuple[Tensor, Tensor]:
    """For every candidate token the highest cosine to a reference token of the same pair, and vice versa.

    ``cand`` (B, Lc, D) and ``ref`` (B, Lr, D) are token embeddings of B candidate/reference pairs; the masks
    (B, Lc) and (B, Lr) say which tokens exist and may be matched. Returns ``(cand_best (B, Lc),
    ref_best (B, Lr))`` in float32; a position that is masked out, or has no counterpart to match, gets 0.
    ``normalized=True``: the embeddings are float32 unit vectors already (normalised once per text, not once
    per pair; normalising twice could move a cosine by an ulp).
    """
    if not normalized:
        cand = F.normalize(cand.float(), dim=-1)
        ref = F.normalize(ref.float(), dim=-1)
    sim = torch.bmm(cand, ref.transpose(1, 2))
    pair = cand_mask.bool()[:, :, None] & ref_mask.bool()[:, None, :]
    sim = sim.masked_fill(~pair, float("-inf"))
    cand_best = sim.amax(dim=2)
    ref_best = sim.amax(dim=1)
    return _finite_or_zero(cand_best), _finite_or_zero(ref_best)


def _finite_or_zero(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def weighted_mean(values: Tensor, weights: Tensor) -> Tensor:
    """Weighted mean over the last axis in float64; 0 where the weights sum to 0 (nothing to average)."""
    w = weights.to(torch.float64)
    total = w.sum(dim=-1)
    mean = (values.to(torch.float64) * w).sum(dim=-1) / torch.where(total > 0, total, torch.ones_like(total))
    return torch.where(total > 0, mean, torch.zeros_like(mean))


def f_measure(precision: Tensor, recall: Tensor) -> Tensor:
    """2PR / (P + R), with 0 where it is undefined (as bert_score)."""
    f = 2 * precision * recall / (precision + recall)
    return torch.nan_to_num(f, nan=0.0, posinf=0.0, neginf=0.0)


def greedy_prf(
    cand: Tensor,
    cand_mask: Tensor,
    ref: Tensor,
    ref_mask: Tensor,
    cand_weights: Tensor | None = None,
    ref_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Precision, recall and F of B candidate/reference pairs, float64 (B,) each.

    Weights default to the masks (every matchable token counts once); give them to weight by idf or to
    keep a token matchable without counting it.
    """
    cand_best, ref_best = best_similarities(cand, cand_mask, ref, ref_mask)
    cand_weights = cand_mask if cand_weights is None else cand_weights
    ref_weights = ref_mask if ref_weights is None else ref_weights
    precision = weighted_mean(cand_best, cand_weights)
    recall = weighted_mean(ref_best, ref_weights)
    return precision, recall, f_measure(precision, recall)


def document_frequency(token_ids: Tensor, pad_id: int = 0) -> Tensor:
    """How many rows (documents) of ``token_ids`` (D, L) contain each id; ids equal to ``pad_id`` are
    ignored. Returns a float64 vector indexed by id (length max id + 1)."""
    if token_ids.numel() == 0:
        return torch.zeros(0, dtype=torch.float64)
    ids = token_ids.reshape(token_ids.shape[0], -1).to(torch.int64)
    size = int(ids.max()) + 1
    doc = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
    keep = ids != pad_id
    # Each (document, id) pair once, then count documents per id.
    unique_pairs = torch.unique(doc[keep] * size + ids[keep])
    return torch.bincount(unique_pairs % size, minlength=size).to(torch.float64)


def idf_weights(frequency: Tensor, n_documents: int) -> Tensor:
    """bert_score's idf: log((N + 1) / (df + 1)); an id never seen gets log(N + 1)."""
    return torch.log((n_documents + 1.0) / (frequency.to(torch.float64) + 1.0))


def idf_table(documents: Tensor, pad_id: int = -1) -> tuple[Tensor, int]:
    """bert_score's idf per token id over the rows of ``documents`` (D, L) (``pad_id`` ignored), and D."""
    return idf_weights(document_frequency(documents, pad_id=pad_id), len(documents)), len(documents)


def token_idf(ids: Tensor, mask: Tensor, table: Tensor, n_documents: int) -> Tensor:
    """The idf weight of every token of ``ids`` (..., L) from :func:`idf_table` (an id never counted gets
    log(D + 1), as in bert_score); 0 where ``mask`` is False."""
    weights = lookup(table, ids, math.log(n_documents + 1.0))
    return torch.where(mask.bool(), weights, torch.zeros_like(weights))


def lookup(table: Tensor, ids: Tensor, default: float) -> Tensor:
    """``table[ids]`` with ``default`` for ids outside the table (tokens never counted)."""
    inside = (ids >= 0) & (ids < len(table))
    safe = torch.where(inside, ids, torch.zeros_like(ids))
    values = table.to(ids.device)[safe] if len(table) else torch.zeros(ids.shape, dtype=table.dtype, device=ids.device)
    return torch.where(inside, values, torch.full_like(values, default))


def reduce_references(values: Tensor, valid: Tensor, how: Literal["max", "mean"]) -> Tensor:
    """Reduce (B, J) per-reference values over each sample's valid references: ``"max"`` or ``"mean"``.
    A sample without any valid reference gets NaN."""
    valid = valid.bool()
    count = valid.sum(dim=-1)
    if how == "max":
        out = values.masked_fill(~valid, float("-inf")).amax(dim=-1) if values.shape[-1] else values.sum(-1)
    elif how == "mean":
        out = values.masked_fill(~valid, 0.0).sum(dim=-1) / count.clamp_min(1)
    else:
        raise ValueError(f"multi_reference must be 'max' or 'mean', got {how!r}")
    return torch.where(count > 0, out, torch.full_like(out, math.nan))


def to_grid(values: Tensor, owner: Tensor, slot: Tensor, n_rows: int) -> tuple[Tensor, Tensor]:
    """Scatter per-pair ``values`` (R,) into a (n_rows, max slot + 1) grid by ``owner`` and ``slot``;
    returns the grid (NaN where empty) and its validity mask."""
    width = int(slot.max()) + 1 if len(slot) else 0
    grid = torch.full((n_rows, width), math.nan, dtype=values.dtype, device=values.device)
    valid = torch.zeros((n_rows, width), dtype=torch.bool, device=values.device)
    grid[owner, slot] = values
    valid[owner, slot] = True
    return grid, valid
