"""The numpy internals a pickled dict of arrays refers to, in one place (region files written with ``np.save`` of a
dict). A pickle names the functions that rebuild an array by their module, and numpy 2 moved those modules from
``numpy.core`` to ``numpy._core``: both spellings are accepted, and each resolves to the function of the numpy
installed."""
from __future__ import annotations

from typing import Any

import numpy as np

# (module as a pickle names it, name) -> (module under numpy's core, name); numpy 1 and 2 spellings
_REBUILDERS = {
    (f"{package}.{module}", name): (module, name)
    for package in ("numpy.core", "numpy._core")
    for module, name in (("multiarray", "_reconstruct"), ("multiarray", "scalar"), ("numeric", "_frombuffer"))
}


def pickled_numpy_global(module: str, name: str) -> Any:
    """The numpy function a pickle refers to as ``module.name`` when it is one that rebuilds arrays and scalars,
    else None."""
    if (module, name) not in _REBUILDERS:
        return None
    where, attribute = _REBUILDERS[(module, name)]
    core = getattr(np, "_core", None) or np.core
    return getattr(getattr(core, where), attribute)
