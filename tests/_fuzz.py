"""Seeded mutations of ulp-family payloads (encodings 1 and 5) for the decoders' fuzz tests."""

from __future__ import annotations

import numpy as np

N_MUTATIONS = 6


def mutate(rng: np.random.Generator, payload: bytes, how: int) -> bytearray:
    """``payload`` changed by mutation ``how`` (0 .. N_MUTATIONS - 1): 0 one bit flip, 1 several; 2 a
    spliced random tail; 3 garbage behind a plausible rc_len; 4 one random byte; 5 the range-coded
    part kept and the raw part mostly zero bits (long unary runs and Elias gamma codes of 40 zeros or
    more, runs that reach past the end, streams that end mid-code)."""
    b = bytearray(payload)
    if how <= 1:
        for _ in range(1 + how * int(rng.integers(1, 6))):
            k = int(rng.integers(len(b) * 8))
            b[k // 8] ^= 1 << (k % 8)
    elif how == 2:
        k = int(rng.integers(4, len(b)))
        b[k:] = rng.integers(0, 256, int(rng.integers(0, 2 * (len(b) - k) + 1)), dtype=np.uint8).tobytes()
    elif how == 3:
        size = int(rng.integers(0, 300))
        rc_len = int(rng.integers(0, size + 2))
        b = bytearray(rc_len.to_bytes(4, "little") + rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    elif how == 4:
        k = int(rng.integers(len(b)))
        b[k] = int(rng.integers(256))
    else:
        rc_end = 4 + int.from_bytes(b[:4], "little")
        size = int(rng.integers(0, 2 * max(len(b) - rc_end, 1) + 8))
        raw = np.where(rng.random(size) < 0.97, 0, rng.integers(0, 256, size)).astype(np.uint8)
        b[rc_end:] = raw.tobytes()
    return b
