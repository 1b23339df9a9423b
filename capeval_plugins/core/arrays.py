"""Host arrays (numpy) and torch tensors side by side: what the contract's own bookkeeping (sample ids, groups,
digests, text states) works on, so that a metric whose states are all numpy (the classic COCO metrics) scores
without importing torch, about 1.5 CPU-s of every process (``docs/contract.md``, host states).

Nothing here imports torch before a value is a tensor (when it already is imported)."""
from __future__ import annotations

from typing import Any

import numpy as np


def is_tensor(value: Any) -> bool:
    """A torch tensor (of any subclass), known without importing torch: its class derives from torch.Tensor."""
    return any(cls.__name__ == "Tensor" and cls.__module__ == "torch" for cls in type(value).__mro__)


def is_host_dtype(dtype: Any) -> bool:
    """A numpy dtype (or scalar type), as a host state declares: not a torch dtype."""
    return isinstance(dtype, np.dtype) or isinstance(dtype, type) and issubclass(dtype, np.generic)


def host(value: Any) -> np.ndarray:
    """``value`` as a numpy array in CPU memory (a tensor's bfloat16, which numpy lacks, as float32)."""
    if is_tensor(value):
        import torch  # (imported already: value is a tensor)

        value = value.detach().cpu()
        return (value.float() if value.dtype == torch.bfloat16 else value).numpy()
    return np.asarray(value)


def on_cpu(value: Any) -> Any:
    """A tensor moved to CPU memory; an array (or packed texts) as it is."""
    return value.cpu() if is_tensor(value) else value


def torch_dtype(dtype: np.dtype) -> Any:
    """The torch dtype of a numpy one (imports torch: for adapters that hold tensors)."""
    import torch

    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


def as_tensor(value: Any, like: Any = None) -> Any:
    """``value`` (an array or tensor) as a tensor, on ``like``'s device when given (imports torch)."""
    import torch

    # (np.asarray with order "C", not np.ascontiguousarray, which makes a 0-d sum one-dimensional)
    tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value, order="C"))
    return tensor.to(like.device) if like is not None and is_tensor(like) else tensor


def kind_of(value: Any, like: Any) -> Any:
    """``value`` (an array or a tensor) as the kind of ``like``, left as it is when it is that kind already."""
    if is_tensor(value) == is_tensor(like):
        return value
    return as_tensor(value, like) if is_tensor(like) else host(value)


def same_kind(array: np.ndarray, like: Any) -> Any:
    """``array`` as the kind of ``like``: a tensor on its device for a tensor, else the array itself."""
    return as_tensor(array, like) if is_tensor(like) else array


def take(value: Any, rows: np.ndarray) -> Any:
    """``value[rows]`` for a numpy array or a tensor (rows moved to its device)."""
    return value[as_tensor(rows, value)] if is_tensor(value) else value[rows]

