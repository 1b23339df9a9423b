"""Streaming joint Gaussian fit, point-wise mutual information (PMI) and MID (Kim et al., NeurIPS 2022).

The fit is kept as sufficient statistics of z = [x, y] in float64: the pair count, sum z and sum z z^T.
They merge by addition (across batches, DDP ranks, saved fits), so the state is O(D^2) whatever the corpus
size, and a DDP sync all-reduces ``1 + 2D + 4D^2`` numbers instead of gathering every feature.

Under Gaussians fitted to (x, y) pairs, the PMI of one pair is

    PMI(x, y) = log N(z; mu, S) - log N(x; mu_x, S_x) - log N(y; mu_y, S_y)
              = 0.5 (logdet S_x + logdet S_y - logdet S) + 0.5 (d2_x + d2_y - d2_z),

d2 the squared Mahalanobis distance to the fitted mean. Covariances are unbiased (divided by n - 1), as in the
official MID code.

The corpus MID of M scored pairs z0_i = [x0_i, y0_i] comes in two forms (:func:`corpus_mid`), both computed from
the scored pairs' own sums, so they too stream and merge by addition:

* ``"trace"``, the official code's reduced output (``naver-ai/mid.metric``, ``_compute_pmi(reduction=True)``),
  with x the conditioning modality (the image, in captioning) and y the scored one (the caption)::

      MID = I(X; Y) + 0.5 (tr(S_x^-1 S_x') + tr(S_y^-1 A_y) / (M - 1) - tr(S^-1 A) / (M - 1))

  A = sum_i (z0_i - mu)(z0_i - mu)^T, the scored pairs' scatter about the *fitted* mean, A_y its y block, and
  S_x' the fitted x covariance before ``covariance_eps`` (so the first term is D_x exactly when eps = 0);
* ``"mean"``: the mean of the per-pair PMI, ``I(X; Y) + 0.5 (tr(S_x^-1 A_x) + tr(S_y^-1 A_y) - tr(S^-1 A)) / M``.

They differ by O(D / M): the official code divides the scatter by M - 1 and takes the conditioning term at its
expectation under the fit, D_x, instead of the scored pairs' own.
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping

import numpy as np
import torch
from torch import Tensor

from capeval_plugins.core.messages import DataError
from capeval_plugins.core.npy import npy_header

SUM_KEYS = ("count", "sum", "outer")
REDUCTIONS = ("trace", "mean")
_FORMAT = "capeval-joint-gaussian-sums"


def joint_sums(x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """Sufficient statistics of the pairs ``(x[i], y[i])``: count, sum z and sum z z^T, float64."""
    if x.ndim != 2 or y.ndim != 2 or len(x) != len(y):
        raise ValueError(f"x and y must be (N, D) with the same N, got {tuple(x.shape)} and {tuple(y.shape)}")
    z = torch.cat([x, y], dim=1).to(torch.float64)
    return {"count": torch.tensor(float(len(z)), dtype=torch.float64, device=z.device),
            "sum": z.sum(dim=0), "outer": z.T @ z}


def empty_sums(dim: int, device: torch.device | str | None = None) -> dict[str, Tensor]:
    """Sums of no pairs, for a joint dimension ``dim`` (= D_x + D_y)."""
    return {"count": torch.zeros((), dtype=torch.float64, device=device),
            "sum": torch.zeros(dim, dtype=torch.float64, device=device),
            "outer": torch.zeros(dim, dim, dtype=torch.float64, device=device)}


def merge_sums(*parts: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The reduce step of the fit: statistics of the union of the parts' pairs."""
    if not parts:
        raise ValueError("nothing to merge")
    merged = {k: parts[0][k].to(torch.float64).clone() for k in SUM_KEYS}
    for part in parts[1:]:
        for k in SUM_KEYS:
            merged[k] += part[k]
    return merged


def scatter_about(sums: Mapping[str, Tensor], center: Tensor) -> Tensor:
    """sum_i (z_i - c)(z_i - c)^T of the pairs summed in ``sums``, about a given center ``c`` (float64)."""
    count, total, outer = float(sums["count"]), sums["sum"].to(torch.float64), sums["outer"].to(torch.float64)
    c = center.to(total.device, torch.float64)
    cross = torch.outer(c, total)
    scatter = outer - cross - cross.T + count * torch.outer(c, c)
    return (scatter + scatter.T) / 2.0


def normalize_pmi(pmi: Tensor) -> Tensor:
    """Redemption Score's map of a PMI onto (0, 1) (Dahal et al., Eq. 9): (PMI / (1 + |PMI|) + 1) / 2.
    Monotonic, 0 -> 0.5, +-inf -> 1 and 0."""
    return (pmi / (1.0 + pmi.abs()) + 1.0) / 2.0


class TooFewSamplesError(ValueError):
    """The fit has too few pairs for a non-singular joint covariance."""


def check_sample_count(count: int, dim: int, covariance_eps: float = 0.0) -> None:
    """The unbiased joint covariance of ``count`` pairs in ``dim`` dimensions has rank at most count - 1,
    so it is invertible only when count > dim (= 2D for two D-dimensional features). A positive
    ``covariance_eps`` makes any covariance invertible; at least two pairs are still needed."""
    if count < 2:
        raise TooFewSamplesError(f"the Gaussian fit needs at least 2 (image, reference) pairs, got {count}")
    if count <= dim and covariance_eps <= 0:
        raise TooFewSamplesError(
            f"the joint Gaussian is fitted on N={count} (image, reference) pairs, but its covariance has "
            f"2D={dim} dimensions and is singular unless N > 2D; score a larger corpus, pass a reference "
            f"Gaussian fitted on more pairs, or add eps > 0 to the covariance's diagonal (the metric's covariance_eps, "
            f"functional.mid's eps)"
        )


def _cholesky(cov: Tensor, what: str) -> Tensor:
    chol, info = torch.linalg.cholesky_ex(cov)
    # Rounding can let an exactly singular covariance through with a tiny pivot: apply a rank tolerance
    # (the scale of numpy's matrix_rank) to the squared pivots.
    pivots = torch.diagonal(chol) ** 2
    tolerance = len(cov) * torch.finfo(cov.dtype).eps * float(torch.diagonal(cov).abs().max())
    if int(info) != 0 or not bool((pivots > tolerance).all()):
        raise DataError(
            f"the {what} covariance of the Gaussian fit is not positive definite (singular: fewer distinct "
            f"{'features' if what == 'joint' else what + 's'} than dimensions, or degenerate features); fit on "
            "more pairs or add eps > 0 to its diagonal (the metric's covariance_eps, functional.mid's eps)"
        )
    return chol


def _logdet(chol: Tensor) -> Tensor:
    return 2.0 * torch.log(torch.diagonal(chol)).sum()


def _trace_solve(chol: Tensor, matrix: Tensor) -> Tensor:
    """tr(S^-1 M) for S = L L^T and a symmetric M."""
    return (torch.cholesky_inverse(chol) * matrix).sum()


def _mahalanobis2(chol: Tensor, centred: Tensor) -> Tensor:
    """Squared Mahalanobis norms of the rows of ``centred`` under L L^T (one triangular solve)."""
    solved = torch.linalg.solve_triangular(chol, centred.T, upper=False)
    return (solved * solved).sum(dim=0)


@dataclass
class JointGaussian:
    """A Gaussian fitted to pairs z = [x, y], with its x, y and joint blocks factorised once."""

    mean: Tensor
    cov: Tensor
    dim_x: int
    count: int
    covariance_eps: float = 0.0

    def __post_init__(self) -> None:
        dx = self.dim_x
        self._chol_x = _cholesky(self.cov[:dx, :dx], "image")
        self._chol_y = _cholesky(self.cov[dx:, dx:], "text")
        self._chol = _cholesky(self.cov, "joint")
        self._logdets = tuple(_logdet(c) for c in (self._chol_x, self._chol_y, self._chol))

    @classmethod
    def from_sums(cls, sums: Mapping[str, Tensor], dim_x: int, covariance_eps: float = 0.0) -> "JointGaussian":
        """Mean and unbiased covariance (+ ``covariance_eps`` on the diagonal) from :func:`joint_sums`."""
        count = float(sums["count"])
        if count != round(count):
            raise ValueError(f"the pair count must be a whole number, got {count}")
        total, outer = sums["sum"].to(torch.float64), sums["outer"].to(torch.float64)
        check_sample_count(int(count), len(total), covariance_eps)
        mean = total / count
        cov = (outer - count * torch.outer(mean, mean)) / (count - 1.0)
        cov = (cov + cov.T) / 2.0  # exact symmetry for the Cholesky factorisation
        if covariance_eps:
            cov = cov + covariance_eps * torch.eye(len(cov), dtype=cov.dtype, device=cov.device)
        return cls(mean, cov, dim_x, int(count), covariance_eps)

    @property
    def dim(self) -> int:
        return len(self.mean)

    def mutual_information(self) -> float:
        """I(X; Y) of the fitted Gaussian: 0.5 (logdet S_x + logdet S_y - logdet S)."""
        ld_x, ld_y, ld_z = self._logdets
        return float(0.5 * (ld_x + ld_y - ld_z))

    def pmi(self, x: Tensor, y: Tensor) -> Tensor:
        """Per-pair PMI (float64) of the rows of ``x`` and ``y`` under this fit."""
        if x.shape[-1] != self.dim_x or x.shape[-1] + y.shape[-1] != self.dim or len(x) != len(y):
            raise ValueError(
                f"features of shape {tuple(x.shape)} and {tuple(y.shape)} do not match a fit of "
                f"{self.dim_x} + {self.dim - self.dim_x} dimensions"
            )
        device = self.mean.device
        z = torch.cat([x, y], dim=1).to(device=device, dtype=torch.float64) - self.mean
        dx = self.dim_x
        d2_x = _mahalanobis2(self._chol_x, z[:, :dx])
        d2_y = _mahalanobis2(self._chol_y, z[:, dx:])
        d2_z = _mahalanobis2(self._chol, z)
        return self.mutual_information() + 0.5 * (d2_x + d2_y - d2_z)


    def expected_pmi(self, scored: Mapping[str, Tensor], reduction: Literal["trace", "mean"] = "trace") -> float:
        """The corpus MID of the pairs summed in ``scored`` (:func:`joint_sums` of the scored pairs), in the
        official code's trace form or as the mean PMI (see the module docstring). NaN for no pairs."""
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        m = float(scored["count"])
        if m == 0:
            return math.nan
        if reduction == "trace" and m < 2:
            raise TooFewSamplesError(
                "the trace form of MID divides the scored pairs' scatter by M - 1 and needs at least 2 of them, "
                "got 1; use the mean PMI (corpus_reduction='mean') for a single pair")
        if tuple(scored["outer"].shape) != (self.dim, self.dim):
            raise ValueError(f"sums of {len(scored['sum'])}-dimensional pairs do not match a fit of {self.dim}")
        dx = self.dim_x
        scatter = scatter_about({k: v.to(self.mean.device) for k, v in scored.items()}, self.mean)
        term_y = _trace_solve(self._chol_y, scatter[dx:, dx:])
        term_z = _trace_solve(self._chol, scatter)
        if reduction == "mean":
            term_x = _trace_solve(self._chol_x, scatter[:dx, :dx])
            return self.mutual_information() + float(0.5 * (term_x + term_y - term_z) / m)
        # The conditioning term at its expectation under the fit: tr(S_x^-1 S_x') = D_x when covariance_eps = 0.
        fitted_x = self.cov[:dx, :dx] - self.covariance_eps * torch.eye(dx, dtype=self.cov.dtype, device=self.cov.device)
        term_x = _trace_solve(self._chol_x, fitted_x)
        return self.mutual_information() + float(0.5 * (term_x + (term_y - term_z) / (m - 1.0)))


def corpus_mid(gaussian: JointGaussian, scored: Mapping[str, Tensor],
               reduction: Literal["trace", "mean"] = "trace") -> float:
    """The corpus MID of the scored pairs summed in ``scored`` under the fitted Gaussian: ``"trace"`` (the
    official code's reduced output, the default) or ``"mean"`` (the mean PMI, Eq. 2 of Dahal et al.)."""
    return gaussian.expected_pmi(scored, reduction)


def mid(gaussian: JointGaussian, x: Tensor, y: Tensor, reduction: Literal["trace", "mean"] = "trace") -> float:
    """MID of the scored pairs ``(x[i], y[i])`` under the fitted Gaussian (see :func:`corpus_mid`); the mean
    form is the mean of their PMI as :meth:`JointGaussian.pmi` gives it."""
    if reduction == "mean":
        pmi = gaussian.pmi(x, y)
        return float(pmi.mean()) if len(pmi) else math.nan
    if x.shape[-1] != gaussian.dim_x or x.shape[-1] + y.shape[-1] != gaussian.dim:
        raise ValueError(f"features of shape {tuple(x.shape)} and {tuple(y.shape)} do not match a fit of "
                         f"{gaussian.dim_x} + {gaussian.dim - gaussian.dim_x} dimensions")
    return corpus_mid(gaussian, joint_sums(x, y), reduction)


@dataclass
class SavedSums:
    """Statistics of a fitted reference Gaussian as stored on disk, with what produced them."""

    sums: dict[str, Tensor]
    dim_x: int
    metadata: dict[str, Any]


def sums_to_bytes(sums: Mapping[str, Tensor], dim_x: int, **metadata: Any) -> bytes:
    """The statistics of a fit as an ``.npz`` file's bytes (no pickle), so later runs can score against it or
    add to it; writing them is the caller's (the core reads and writes no file). ``metadata`` (e.g. the
    feature model) must be JSON-serialisable."""
    header = json.dumps({"format": _FORMAT, "dim_x": int(dim_x), **metadata}, sort_keys=True)
    arrays = {k: sums[k].detach().to("cpu", torch.float64).numpy() for k in SUM_KEYS}
    buffer = io.BytesIO()
    np.savez(buffer, header=np.array(header), **arrays)
    return buffer.getvalue()


MAX_JOINT_DIM = 16384  # 2 x 8192 feature dimensions: the outer-product sums alone are then 2 GiB of float64
_MAX_HEADER_BYTES = 1 << 20


def _member_shapes(npz: Any, path: Any) -> dict[str, tuple[tuple[int, ...], np.dtype, int]]:
    """Each member's declared shape, dtype and stored size, read from the .npy headers alone."""
    found = {}
    for info in npz.zip.infolist():
        key = info.filename[: -len(".npy")] if info.filename.endswith(".npy") else info.filename
        with npz.zip.open(info) as member:
            shape, dtype = npy_header(member)
            found[key] = (shape, dtype, info.file_size - member.tell())
    return found


def _check_declared(shapes: Mapping[str, tuple[tuple[int, ...], np.dtype, int]], path: Any) -> None:
    """The members a fit has, of the shapes a D-dimensional fit has (D bounded), each as large as its header
    says: checked before any array is read, so a small crafted file cannot allocate gigabytes."""
    missing = [k for k in ("header", *SUM_KEYS) if k not in shapes]
    if missing:
        raise DataError(f"{path} is not a saved reference Gaussian (missing {missing[0]!r})")
    (sum_shape, _, _), (outer_shape, _, _) = shapes["sum"], shapes["outer"]
    dim = sum_shape[0] if len(sum_shape) == 1 else -1
    if not 2 <= dim <= MAX_JOINT_DIM or outer_shape != (dim, dim) or shapes["count"][0] not in ((), (1,)):
        raise DataError(f"{path}: inconsistent saved statistics (sum {sum_shape}, outer {outer_shape}; at most "
                        f"{MAX_JOINT_DIM} joint dimensions)")
    header_shape, header_dtype, header_bytes = shapes["header"]
    if header_shape != () or header_dtype.kind != "U" or header_dtype.itemsize > _MAX_HEADER_BYTES:
        raise DataError(f"{path} is not a saved reference Gaussian (its header is not a short string)")
    for key, (shape, dtype, stored) in shapes.items():
        if key in SUM_KEYS and (dtype.kind != "f" or stored != math.prod(shape) * dtype.itemsize):
            raise DataError(f"{path}: {key} holds {stored} bytes, not the {math.prod(shape)} {dtype} numbers its "
                            "header declares")


def sums_from_bytes(data: bytes, name: str = "the data") -> SavedSums:
    """Statistics written by :func:`sums_to_bytes`; data that is not such a file (damaged, truncated, another
    format) is a :class:`DataError` naming ``name``."""
    path = name
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            _check_declared(_member_shapes(npz, path), path)
            header = json.loads(str(npz["header"]))
            sums = {k: torch.from_numpy(np.array(npz[k], dtype=np.float64)) for k in SUM_KEYS}
    except DataError:
        raise
    except Exception as err:  # zipfile.BadZipFile, a damaged member (zlib, CRC), not an .npz at all
        raise DataError(f"{path} is not a saved reference Gaussian, or it is damaged ({type(err).__name__}: "
                        f"{err}); fit it again") from None
    if not isinstance(header, dict) or header.pop("format", None) != _FORMAT:
        raise DataError(f"{path} is not a saved reference Gaussian")
    dim_x = header.pop("dim_x", None)
    dim = len(sums["sum"])
    if (not isinstance(dim_x, int) or isinstance(dim_x, bool) or not 0 < dim_x < dim
            or not math.isfinite(float(sums["count"].sum())) or not torch.isfinite(sums["sum"]).all()
            or not torch.isfinite(sums["outer"]).all()):
        raise DataError(f"{path}: inconsistent saved statistics")
    return SavedSums(sums, dim_x, header)
