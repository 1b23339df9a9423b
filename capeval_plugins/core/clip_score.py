"""CLIPScore and RefCLIPScore on features (Hessel et al., EMNLP 2021), float64.

    CLIP-S(c, v)     = w * max(cos(v, c), 0)
    RefCLIP-S(c,R,v) = H-Mean(CLIP-S(c, v), max(max_{r in R} cos(c, r), 0))

Features are L2-normalised here (the official code normalises them), so any CLIP-like embeddings may be given.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from capeval_plugins.core.pooling import segment_max


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
