"""A ``.npy`` header read from a stream the caller opened (a file, a member of an ``.npz`` held in memory): the shape
and dtype an array declares, checked before numpy allocates it."""
from __future__ import annotations

import struct
import tokenize
from typing import Any


# What numpy raises on a damaged ``.npy`` header besides ValueError: the header is a Python literal it parses
# with ast / tokenize (a flipped byte gives "EOF in multi-line statement"), behind a struct-packed length.
NPY_HEADER_ERRORS = (ValueError, SyntaxError, tokenize.TokenError, struct.error, RecursionError, TypeError)


def npy_header(stream: Any) -> tuple[tuple[int, ...], Any]:
    """The shape and dtype a ``.npy`` stream (a file, or a member of an ``.npz``) declares, read from its header
    alone (ValueError when it is not one, whatever numpy's parser raised): what a reader checks before numpy
    allocates the array."""
    import numpy as np

    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except NPY_HEADER_ERRORS as err:
        raise ValueError(f"{type(err).__name__}: {err}" if not isinstance(err, ValueError) else str(err)) from None
    return tuple(shape), dtype
