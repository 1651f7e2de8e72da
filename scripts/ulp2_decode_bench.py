"""Decode speed of format 2's ulp2 (encoding 6) per positions pass, beside format 1's ulp (encoding 1).

    PYTHONPATH=src python scripts/ulp2_decode_bench.py [--reps 7] [--rates 1,3.5,5]

Chunks: 2^19 bf16 elements (one 1 MiB segment) drawn like AdamW weights (normal, sd 0.02), each element
changed with a probability that doubles per exponent step down (small weights change far more often),
scaled to the rate asked; distances mostly +-1 ulp. Each is coded by the native encoder in variant 0 and
variant 1, and by today's encoder (encoding 1). Printed per rate and path: positions ns per element (the
positions pass alone, from _native.ulp2_timing) and whole-decode ns per changed element (best of --reps,
one thread), and the payload bits per change. Variant 1 has no AVX-512 pass. numba: codec.ulp2_kernels' decoder where that module has
one. Numbers only; no assertion (tests/test_ulp2_native.py holds the paths to the same output).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import platform
import time

import numpy as np

from deltarefit.codec import _native as X
from deltarefit.codec.chunk import encode_chunk
from deltarefit.codec.encodings import ULP
from deltarefit.dtypes import DTYPES

N = 1 << 19
BF16 = DTYPES["BF16"]


def chunk(rate: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A bf16 (base, target) pair at about ``rate`` changed, exponent-dependent."""
    rng = np.random.default_rng(seed)
    base = (rng.normal(0, 0.02, N).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    e = ((base >> 7) & 0xFF).astype(np.float64)
    w = np.exp2(np.median(e) - e)
    lo, hi = 0.0, 1.0
    for _ in range(50):  # bisect the scale so that the expected rate is the one asked
        a = (lo + hi) / 2
        lo, hi = (a, hi) if np.minimum(0.9, a * w).mean() < rate else (lo, a)
    ch = rng.random(N) < np.minimum(0.9, lo * w)
    d = rng.choice(np.array([1, -1, 1, -1, 2, -2, 3, -5], np.int64), int(ch.sum()))
    key = np.where(base & 0x8000, 0xFFFF - base.astype(np.int64), base.astype(np.int64) | 0x8000)
    k2 = key[ch] + d
    tgt = base.copy()
    tgt[ch] = np.where(k2 & 0x8000, k2 ^ 0x8000, 0xFFFF - k2).astype(np.uint16)
    return base, tgt


def best(fn, reps: int) -> float:
    t = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        t.append(time.perf_counter_ns() - t0)
    return min(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rates", default="1,3.5,5")
    a = ap.parse_args()
    try:
        nk = importlib.import_module("deltarefit.codec.ulp2_kernels")
    except ImportError:
        nk = None
    dec_nb = getattr(nk, "ulp2_decode", None)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; ulp2 kernels here: "
          f"{X.ulp2_kernels()} (auto: {X.ulp2_kernel()})")
    print(f"{'rate':>6} {'changed':>8} {'coding':>10} {'path':>8} {'b/chg':>6} {'pos ns/elem':>12} {'ns/change':>10}")
    for rate in [float(r) / 100 for r in a.rates.split(",")]:
        rows(rate, a.reps, dec_nb)


def rows(rate: float, reps: int, dec_nb) -> None:
    """Print one rate's rows: each coding and positions pass, then format 1's ulp."""
    empty = np.zeros(0, np.uint8)
    base, tgt = chunk(rate, 7)
    m = int(np.count_nonzero(base != tgt))
    pos, val = np.empty(m, np.int64), np.empty(m, np.uint16)
    args = (16, 0, 7, 255, 256, 0, pos, val)
    for variant in (0, 1):
        out = np.zeros(N * 4, np.uint8)
        _, nb = X.ulp2_encode(base, tgt, empty, 16, 0, 7, 255, 256, 0, variant, np.zeros(N, np.int32), out)
        pl = out[:nb].copy()
        for ker in [*(k for k in X.ulp2_kernels() if variant == 0 or k != "avx512"), "numba"]:
            if ker == "numba":
                if dec_nb is None:
                    continue
                run = functools.partial(dec_nb, base, empty, pl, m, *args)
                run()  # compile
                t, tp = best(run, reps), float("nan")
            else:
                X.ulp2_kernel(ker)
                run = functools.partial(X.ulp2_decode, base, empty, pl, m, *args)
                tps = []
                t = best(lambda run=run, tps=tps: (run(), tps.append(X.ulp2_timing()[0])), reps)
                tp = min(tps)
            assert run() == 0 and pos.size == m and (val == tgt[pos]).all()
            print(f"{100 * rate:6.2f} {m:8d} {'ulp2 v' + str(variant):>10} {ker:>8} {8 * nb / m:6.2f} "
                  f"{tp / N:12.3f} {t / m:10.2f}")
        X.ulp2_kernel("auto")
    enc = encode_chunk(BF16, base, tgt, fmt=1)
    if enc is not None and enc.encoding == ULP:
        t = best(functools.partial(X.decode_ulp, base, enc.payload, m, 2, 16, 0, 7, 255, 256, pos, val), reps)
        print(f"{100 * rate:6.2f} {m:8d} {'ulp (v1)':>10} {X.decode_kernel():>8} "
              f"{8 * len(enc.payload) / m:6.2f} {'':>12} {t / m:10.2f}")

if __name__ == "__main__":
    main()
