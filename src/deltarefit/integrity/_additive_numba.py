"""The additive digest's numba kernels (``digest``'s module docstring defines the function): the fallback
where the native kernel (``codec._native.digest``) was not built, and the reference the tests hold the
native kernel to. Imported only when used: importing numba costs a third of a second."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, inline="always")
def _h(f, b, s):  # pragma: no cover - compiled
    # h_l(i, b) of the module docstring for one lane: f = the index, b = bits * golden, s = the lane seed
    x = f ^ s
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    x ^= b
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


@njit(cache=True, nogil=True)
def partial_kernel(flat, bits, s0, s1):  # pragma: no cover - compiled
    # The same function as additive._partial_numpy (the reference), one pass, no temporaries; uint64 wraps.
    g = np.uint64(0x9E3779B97F4A7C15)
    a0 = np.uint64(0)
    a1 = np.uint64(0)
    for i in range(flat.size):
        f = np.uint64(flat[i])
        b = np.uint64(bits[i]) * g
        a0 += _h(f, b, s0)
        a1 += _h(f, b, s1)
    return a0, a1


@njit(cache=True, nogil=True)
def run_kernel(start, bits, s0, s1):  # pragma: no cover - compiled
    # partial_kernel over the indices start, start + 1, ... (no index array to build or read).
    g = np.uint64(0x9E3779B97F4A7C15)
    a0 = np.uint64(0)
    a1 = np.uint64(0)
    for i in range(bits.size):
        f = np.uint64(start + i)
        b = np.uint64(bits[i]) * g
        a0 += _h(f, b, s0)
        a1 += _h(f, b, s1)
    return a0, a1
