"""Where one core's time goes per MiB of bf16 checkpoint: the codec's kernels, one at a time.

``python -m deltarefit.apps.bench.kernels [--rate 0.035] [--reps 50]`` builds one 1 MiB bf16 segment of
N(0, 0.02) weights with ``--rate`` of its elements moved by +-1 (80%) or +-2 (20%) ulps, and prints the
best-of-5 time of each step on one thread: the encoder's scan (contexts and ranks) and its coding of the
changes, in numba and, where it was built, in the native extension (the encoder uses the native ones),
a BLAKE3 segment hash, and the decoder: numba's parts (group section, positions, ulp distances,
target bits) and their sum, and the native decoder (all four in one call) with each of its positions
passes (the one decode_chunk uses marked "in use").
Encode is scan + code + 2 hashes; apply is decode + 3 hashes + the scatter.

Read these as lower bounds: timing one segment over and over lets the branch predictors learn part of
its data, which it cannot do over the many different segments of a real checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _best_ms(f, reps: int) -> float:
    f()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.bench.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=0.035, help="fraction of elements changed (default 0.035)")
    ap.add_argument("--reps", type=int, default=50, help="calls per timing (default 50)")
    a = ap.parse_args(argv)
    from deltarefit.codec import kernels as K
    from deltarefit.codec.chunk import _ctx, _kind, encode_changes, max_payload_len, scan_chunk
    from deltarefit.codec.native import ext as _native
    from deltarefit.dtypes import dtype
    from deltarefit.integrity import SEGMENT_BYTES, seg_hash

    dt = dtype("BF16")
    rng = np.random.default_rng(0)
    n = SEGMENT_BYTES // 2
    b = ((rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)
    t = b.copy()
    idx = np.flatnonzero(rng.random(n) < a.rate)
    t[idx] = (t[idx].astype(np.int64) + rng.choice([-1, 1, -2, 2], idx.size, p=[.4, .4, .1, .1])).astype(np.uint16)
    ch = scan_chunk(dt, b, t)
    m = ch.m
    shift, mask, nctx = _ctx(dt)
    out = np.empty(max_payload_len(dt, n) + 64, np.uint8)
    enc = encode_changes(dt, ch, lambda: (b, t), fmt=1)  # (the rows below time format 1's kernels)
    buf = np.frombuffer(enc.payload, np.uint8)
    gbeg, gend = np.zeros(nctx, np.int64), np.zeros(nctx, np.int64)
    gr, gc = np.empty(m, np.int64), np.empty(m, np.int32)
    pos, ectx = np.empty(m, np.int64), np.empty(m, np.int32)
    neg, mag, val = np.empty(m, np.uint8), np.empty(m, np.uint64), np.empty(m, np.uint16)
    state = K.ulp_decode_groups(buf, m, n, nctx, gbeg, gend, gr, gc)[1]
    bufs = [np.empty(n, np.int32) for _ in range(3)] + [np.empty(n, np.uint16) for _ in range(2)]
    rows = [
        ("encode: scan, numba", lambda: K.ulp_scan(b, t, shift, mask, nctx, *bufs)),
        ("encode: code the changes, numba", lambda: K.ulp_encode_changes(ch.ectx, ch.rank, ch.bvals, ch.tvals,
                                                                          dt.bits, _kind(dt), nctx, out)),
    ]
    if _native is not None:
        rows += [
            (f"encode: scan, native ({_native.simd()})", lambda: _native.scan16(b, t, shift, mask, nctx, *bufs)),
            ("encode: code the changes, native", lambda: _native.encode_changes(
                ch.ectx, ch.rank, ch.bvals, ch.tvals, dt.itemsize, dt.bits, _kind(dt), nctx, out)),
        ]
    rows += [
        ("BLAKE3 segment hash (one)", lambda: seg_hash(b.view(np.uint8))),
        ("decode: group section", lambda: K.ulp_decode_groups(buf, m, n, nctx, gbeg, gend, gr, gc)),
        ("decode: positions", lambda: K.ulp_positions(b, shift, mask, nctx, gbeg, gend, gr, m, pos, ectx)),
        ("decode: ulp distances", lambda: K.ulp_decode_deltas(buf, state, ectx, dt.bits, nctx, neg, mag)),
        ("decode: target bits", lambda: K.ulp_apply_deltas(b, pos, neg, mag, dt.bits, _kind(dt), val)),
        ("decode: all (ulp_decode)", lambda: K.ulp_decode(b, buf, m, dt.bits, _kind(dt), shift, mask, nctx, pos,
                                                          val)),
        ("scatter", lambda: K.scatter(b.copy(), pos, val)),
    ]
    if _native is not None:
        # The native decoder does all four parts in one call; one row per positions pass it has here
        # (the one decode_chunk uses is marked), each switched on before its timing.
        auto = _native.decode_kernel()

        def native_decode() -> int:
            return _native.decode_ulp(b, enc.payload, m, dt.itemsize, dt.bits, _kind(dt), shift, mask, nctx, pos, val)

        for kern in reversed(_native.decode_kernels()):
            mark = ", in use" if kern == auto else ""
            rows.append((f"decode: all, native ({kern}{mark})", native_decode,
                         lambda kern=kern: _native.decode_kernel(kern)))
    print(f"one 1 MiB bf16 segment, {m:,} of {n:,} elements changed ({m / n:.2%}), payload {len(enc.payload):,} B "
          f"({8 * len(enc.payload) / m:.2f} bits per change); best of 5 x {a.reps} calls, one thread")
    try:
        for name, f, *setup in rows:
            for s in setup:
                s()
            ms = _best_ms(f, a.reps)
            print(f"  {name:<38} {ms:7.3f} ms  ({1e6 * ms / m:6.1f} ns per change)")
    finally:
        if _native is not None:
            _native.decode_kernel("auto")
    return 0


if __name__ == "__main__":
    sys.exit(main())
