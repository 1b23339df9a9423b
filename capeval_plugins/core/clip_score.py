"""CLIPScore and RefCLIPScore on features (Hessel et al., EMNLP 2021), float64.

    CLIP-S(c, v)     = w * max(cos(v, c), 0)
    RefCLIP-S(c,R,v) = H-Mean(CLIP-S(c, v), max(max_{r in R} cos(c, r), 0))

Features are L2-normalised here (the official code normalises them), so any CLIP-like embeddings may be given.

Long captions, as CaptionEvalKit's ``--sentence-average`` scores them (CLIP-S, PAC-S, PAC-S++): the candidate is
split into sentences (:func:`split_sentences`), each sentence is scored on its own against the image, and the
candidate's score is the mean over its sentences (:func:`segment_mean`).
"""
from __future__ import annotations

import re
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from capeval_plugins.core.pooling import segment_max

# CaptionEvalKit's splitter: a break after ".", "!" or "?" followed by whitespace, or at any run of newlines.
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\n+")


def cosine(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise cosine of (N, D) features, float64."""
    return (F.normalize(a.double(), dim=-1) * F.normalize(b.double(), dim=-1)).sum(-1)


def clip_s(cos: Tensor, w: float = 2.5) -> Tensor:
    """CLIP-S from the image-text cosine: w * max(cos, 0)."""
    return w * cos.clamp_min(0)


def best_reference_similarity(text: Tensor, references: Tensor, owner: Tensor, clamp: bool = True) -> Tensor:
    """Per candidate (``text`` (N, D)), the highest cosine to one of its references: ``references`` (R, D) are
    flattened, ``owner`` (R,) gives each one's candidate. Clamped at 0 (the paper) unless ``clamp=False`` (the
    official code); -inf for a candidate without references."""
    owner = owner.to(text.device)
    best = segment_max(cosine(text[owner], references), owner, len(text))
    return best.clamp_min(0) if clamp else best


def harmonic_mean(a: Tensor, b: Tensor) -> Tensor:
    """2ab / (a + b), 0 where a + b <= 0."""
    total = a + b
    return torch.where(total > 0, 2 * a * b / total.clamp_min(1e-12), torch.zeros_like(total))


def split_sentences(caption: str) -> list[str]:
    """The caption's sentences as CaptionEvalKit splits them: cut after ``.``, ``!`` or ``?`` followed by
    whitespace, and at newlines; each piece stripped, empty pieces dropped; a caption with no non-blank piece (an
    empty or blank one) is its own single sentence, unchanged."""
    pieces = [piece.strip() for piece in _SENTENCE_BREAK.split(caption)]
    return [piece for piece in pieces if piece] or [caption]


def flatten_sentences(captions: Sequence[str]) -> tuple[list[str], Tensor]:
    """Every sentence of ``captions`` in one list, and the index of the caption each belongs to."""
    pieces = [split_sentences(c) for c in captions]
    owner = torch.tensor([i for i, sentences in enumerate(pieces) for _ in sentences], dtype=torch.long)
    return [s for sentences in pieces for s in sentences], owner


def segment_mean(values: Tensor, segments: Tensor, n_segments: int) -> Tensor:
    """Mean of ``values`` within each segment id (0..n_segments-1), vectorised; NaN for an empty segment."""
    segments = segments.to(values.device)
    total = torch.zeros(n_segments, dtype=values.dtype, device=values.device).index_add_(0, segments, values)
    count = torch.zeros(n_segments, dtype=values.dtype, device=values.device).index_add_(
        0, segments, torch.ones_like(values))
    return total / count
