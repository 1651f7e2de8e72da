"""The native kernels' one home: the compiled extension (``codec._native``, from ``_native.c``) where it
was built, and the switch that says whether the codec uses it.

Every module that can run a native kernel (``codec.chunk``, ``codec.elements``, ``codec.history``,
``integrity.additive``) asks here, at each call, so that flipping ``USE_NATIVE`` (tests and
``scripts/make_vectors.py`` do, to hold the two paths to the same bytes) switches all of them at once.
Read it as ``native.USE_NATIVE``, never ``from .native import USE_NATIVE``: a copy taken at import does
not follow the switch. This module imports nothing of the codec, so the modules that ask do not import
each other for it.

The native kernels are used when they were built, unless ``DELTAREFIT_KERNELS=numba``. Both paths write
the same bytes and decode the same patches; tests compare them, and benchmarks time one against the
other. The native scan needs AVX-512 to beat numba's (its portable path is for correctness, not speed);
the native coder and decoder are faster everywhere.
"""

from __future__ import annotations

import os

try:
    from . import _native as ext
except ImportError:  # not compiled on this machine (setup.py makes it optional): numba writes the same bytes
    ext = None

# The switch: True where the extension was built and DELTAREFIT_KERNELS is not "numba".
USE_NATIVE = ext is not None and os.environ.get("DELTAREFIT_KERNELS", "") != "numba"
# The native scan runs on AVX-512 here (elsewhere numba's scan is the faster one).
SCAN_AVX512 = ext is not None and ext.simd() == "avx512"


def kernel(name: str):
    """The extension's function ``name`` where it was built, has it and is in use (``USE_NATIVE``), else
    None (the caller's numba or numpy path)."""
    return getattr(ext, name, None) if USE_NATIVE else None


def kernels_in_use() -> str:
    """Which codec kernels run here, for reports: the encoder's scan and coder, and the decoder."""
    if not (USE_NATIVE and ext is not None):
        return "numba scan, coder and decoder"
    scan = "native scan (AVX-512)" if SCAN_AVX512 else "numba scan"
    return f"{scan}, native coder and decoder (positions: {ext.decode_kernel()})"
