"""Elements at positions of a flat unsigned array: the scatter of a patch (``put``) and the read-back of
what it wrote (``equal_at``).

Both run in the native extension, without the GIL, where it was built and is in use
(``codec.native.USE_NATIVE``), and in numpy otherwise, with the same results. numpy's fancy indexing
holds the GIL, so an apply's threads took turns at this per-chunk work while their decodes ran
in parallel. Positions are int64. A position outside the array raises ``IndexError`` with nothing
written, on either path.
"""

from __future__ import annotations

import numpy as np

from . import native


def native_for(*arrays: np.ndarray):
    """The native module when ``(view, pos, vals)`` qualify for its element calls (C-contiguous; one
    unsigned or signed item size; aligned int64 positions), else None (the numpy fallback)."""
    if not native.USE_NATIVE or native.ext is None or not hasattr(native.ext, "put"):
        return None
    view, pos, vals = arrays
    # (flags.aligned: an int64 array's address is a multiple of 8; cheaper than building .ctypes, which
    # this per-chunk call did three times a chunk)
    if (pos.dtype != np.int64 or view.dtype.itemsize != vals.dtype.itemsize or view.dtype.kind not in "ui"
            or vals.dtype.kind not in "ui" or not view.flags.c_contiguous or not pos.flags.c_contiguous
            or not vals.flags.c_contiguous or not pos.flags.aligned):
        return None
    return native.ext


def put(dst: np.ndarray, pos: np.ndarray, vals: np.ndarray) -> None:
    """``dst[pos] = vals``; every position checked before anything is written."""
    nat = native_for(dst, pos, vals)
    if nat is not None:
        nat.put(dst, pos, vals, dst.dtype.itemsize)
        return
    check_positions(pos, dst.size, "put")
    dst[pos] = vals


def equal_at(view: np.ndarray, pos: np.ndarray, vals: np.ndarray) -> bool:
    """Whether ``view[pos] == vals`` everywhere."""
    nat = native_for(view, pos, vals)
    if nat is not None:
        return bool(nat.equal_at(view, pos, vals, view.dtype.itemsize))
    check_positions(pos, view.size, "equal_at")
    return bool(np.array_equal(view[pos], vals))


def check_positions(pos: np.ndarray, n: int, what: str) -> None:
    """``IndexError`` unless every position lies in ``[0, n)`` (the numpy paths' check; numpy itself would
    wrap a negative one)."""
    if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= n):
        raise IndexError(f"{what}: a position is outside the array (nothing written)")
