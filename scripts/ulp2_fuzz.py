"""Fuzz the native ulp2 decoder (``_native.ulp2_decode``) with mutated payloads, on every positions pass.

    PYTHONPATH=src python scripts/ulp2_fuzz.py [--seed 1] [--trials 700]

Meant for the sanitizer build (``make test-sanitize`` builds one; run this under its PYTHONPATH and
LD_PRELOAD): chunks of every width, kind, coder variant and encoding, plus bf16 chunks shaped like AdamW
steps, each payload mutated (bit flips, truncation, a header byte replaced, bytes appended, the record's
count off by a little) and decoded. Every status must be 0 or one of codec.constants.STATUS's; ASan or
UBSan end the run at the first bad access. Prints the count of each status.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_ulp2_native as T  # (the tests' chunk makers and wrappers)


def mutate(rng, pl: np.ndarray, trial: int) -> np.ndarray:
    p = pl.copy()
    how = trial % 5
    if how == 0:
        for _ in range(1 + trial % 4):
            p[rng.integers(0, p.size)] ^= np.uint8(1 << rng.integers(0, 8))
    elif how == 1:
        p = p[: rng.integers(0, p.size)]
    elif how == 2:
        p[rng.integers(0, min(p.size, 140))] = rng.integers(0, 256)
    elif how == 3:
        p = np.concatenate([p, rng.integers(0, 256, rng.integers(1, 40)).astype(np.uint8)])
    else:
        p = rng.integers(0, 256, rng.integers(1, 300)).astype(np.uint8)
        p[0] = rng.integers(0, 2)
    return p


def cases(rng):
    for s in range(24):
        bits, kind, hist, variant = [8, 16, 32, 64][s % 4], (s // 4) % 3, bool(s & 4), (s // 2) % 2
        base, tgt, states = T.make_chunk(rng, bits, kind, 1500 + 91 * s, [0.01, 0.05, 0.3][s % 3], hist)
        yield base, tgt, states, bits, kind, hist, variant
    for s in range(6):
        base, tgt = T._structured_bf16(rng, 1 << 13, [0.01, 0.05, 0.2][s % 3])
        yield base, tgt, T.EMPTY, 16, 0, False, s % 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trials", type=int, default=700)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    X = T.X
    counts: dict[int, int] = {}
    try:
        for base, tgt, states, bits, kind, hist, variant in cases(rng):
            m, pl = T.encode(base, tgt, states, bits, kind, hist, variant)
            if pl is None:
                continue
            for ker in X.ulp2_kernels():
                X.ulp2_kernel(ker)
                for trial in range(a.trials):
                    p = mutate(rng, pl, trial)
                    mm = m + int(rng.integers(-2, 3)) if trial % 7 == 0 else m
                    dg = (5, 1, 2) if trial % 3 == 0 else None
                    st = T.decode(base, states, p, max(mm, 0), bits, kind, hist, digest=dg)[0]
                    st = st[0] if isinstance(st, tuple) else st
                    if not (st == 0 or st in T.STATUSES):
                        raise SystemExit(f"status {st} is not one of codec.constants.STATUS")
                    counts[st] = counts.get(st, 0) + 1
    finally:
        X.ulp2_kernel("auto")
    print(f"{sum(counts.values())} mutated payloads decoded; statuses: {dict(sorted(counts.items()))}")


if __name__ == "__main__":
    main()
