"""Elements at positions of a flat unsigned array: the scatter of a patch (``put``) and the read-back of
what it wrote (``equal_at``).

Both run in the native extension, without the GIL, where it was built and is in use
(``codec.chunk.USE_NATIVE``), and in numpy otherwise, with the same results. numpy's fancy indexing
holds the GIL, so an apply's threads took turns at this per-chunk work while their decodes ran
in parallel. Positions are int64. A position outside the array raises ``IndexError`` with nothing
written, on either path.
"""

from __future__ import annotations

import numpy as np


def _native_for(*arrays: np.ndarray):
    """The native module when every array qualifies (C-contiguous; one item size; int64 positions at
    index 1, aligned), else None."""
    from .codec import chunk

    if not chunk.USE_NATIVE or chunk._native is None or not hasattr(chunk._native, "put"):
        return None
    view, pos, vals = arrays
    if (pos.dtype != np.int64 or view.dtype.itemsize != vals.dtype.itemsize or view.dtype.kind not in "ui"
            or vals.dtype.kind not in "ui" or not all(a.flags.c_contiguous for a in arrays)
            or pos.ctypes.data % 8):
        return None
    return chunk._native


def put(dst: np.ndarray, pos: np.ndarray, vals: np.ndarray) -> None:
    """``dst[pos] = vals``; every position checked before anything is written."""
    nat = _native_for(dst, pos, vals)
    if nat is not None:
        nat.put(dst, pos, vals, dst.dtype.itemsize)
        return
    _check(pos, dst.size, "put")
    dst[pos] = vals


def equal_at(view: np.ndarray, pos: np.ndarray, vals: np.ndarray) -> bool:
    """Whether ``view[pos] == vals`` everywhere."""
    nat = _native_for(view, pos, vals)
    if nat is not None:
        return bool(nat.equal_at(view, pos, vals, view.dtype.itemsize))
    _check(pos, view.size, "equal_at")
    return bool(np.array_equal(view[pos], vals))


def _check(pos: np.ndarray, n: int, what: str) -> None:
    if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= n):  # (numpy would wrap a negative one)
        raise IndexError(f"{what}: a position is outside the array (nothing written)")
