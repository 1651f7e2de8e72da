"""Helpers of the format 2 (encodings 6 and 7) tests: chunk pairs of every dtype with chosen distances,
histories, direct kernel calls (numba or native), and a reader of a payload's header layout written from
FORMAT.md (not from the code under test), so hostile tests can edit a chosen field."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deltarefit.codec.constants import KIND_FLOAT, KIND_INT, KIND_UINT
from deltarefit.codec.history import STATE_TABLE, History
from deltarefit.dtypes import DType

# (M, R, W, L, state bytes, probability bytes) per coder variant (FORMAT.md's table)
VARIANT = {0: (8, 8, 32, 1 << 8, 2, 1), 1: (12, 16, 16, 1 << 16, 4, 2)}
HIST_BYTES = sorted({int(b) for b in STATE_TABLE if b & 127})


def kind(dt: DType) -> int:
    return {"float": KIND_FLOAT, "int": KIND_INT}.get(dt.kind, KIND_UINT)


def ctx(dt: DType) -> tuple[int, int, int]:
    if dt.kind == "float":
        return dt.man_bits, (1 << dt.exp_bits) - 1, 1 << dt.exp_bits
    return 0, 0, 1


def key(dt: DType, u: np.ndarray) -> np.ndarray:
    """FORMAT.md's key, in uint64."""
    u = np.asarray(u).astype(np.uint64)
    w = dt.bits
    sign = np.uint64(1 << (w - 1))
    full = np.uint64((1 << w) - 1)
    if dt.kind == "float":
        return np.where(u & sign, full - u, u | sign).astype(np.uint64)
    if dt.kind == "int":
        return u ^ sign
    return u


def unkey(dt: DType, k: np.ndarray) -> np.ndarray:
    k = np.asarray(k).astype(np.uint64)
    w = dt.bits
    sign = np.uint64(1 << (w - 1))
    full = np.uint64((1 << w) - 1)
    if dt.kind == "float":
        out = np.where(k & sign, k ^ sign, full - k)
    elif dt.kind == "int":
        out = k ^ sign
    else:
        out = k
    return out.astype(np.uint64).astype(dt.uint)


def random_bits(dt: DType, n: int, rng: np.random.Generator) -> np.ndarray:
    """Bits of ``n`` elements: for floats, mostly values of weight-like magnitudes (a few exponents), some
    random patterns (NaNs, infinities, subnormals among them)."""
    hi = np.uint64((1 << dt.bits) - 1)
    u = rng.integers(0, hi, n, dtype=np.uint64, endpoint=True)
    if dt.kind == "float" and n:
        bias = (1 << (dt.exp_bits - 1)) - 1
        exp = np.clip(bias - 1 - rng.geometric(0.4, n), 1, (1 << dt.exp_bits) - 2).astype(np.uint64)
        man = rng.integers(0, 1 << min(dt.man_bits, 62), n, dtype=np.uint64)
        sgn = rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(dt.bits - 1)
        real = sgn | (exp << np.uint64(dt.man_bits)) | man
        u = np.where(rng.random(n) < 0.9, real, u)
    return u.astype(dt.uint)


def distances(dt: DType, m: int, rng: np.random.Generator) -> np.ndarray:
    """``m`` nonzero distances (uint64, mod 2^w): mostly +-1..3 ulps, some wide, and the extremes
    (-2^(w-1), 2^(w-1) - 1, -1) at least once each where m allows."""
    w = dt.bits
    full = (1 << w) - 1
    small = rng.integers(1, 4, m) * np.where(rng.random(m) < 0.5, -1, 1)
    d = (small.astype(np.int64).astype(np.uint64)) & np.uint64(full)
    wide = rng.random(m) < 0.1
    d[wide] = rng.integers(1, full, int(wide.sum()), dtype=np.uint64, endpoint=True)
    for i, v in enumerate((1 << (w - 1), (1 << (w - 1)) - 1, full)):
        if i < m and m >= 8:
            d[rng.integers(0, m)] = v
    return d


def make_pair(dt: DType, n: int, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A chunk of ``n`` elements and a target changing ``m`` of them."""
    rng = np.random.default_rng(seed)
    base = random_bits(dt, n, rng)
    target = base.copy()
    if m:
        idx = np.sort(rng.choice(n, m, replace=False))
        d = distances(dt, m, rng)
        full = np.uint64((1 << dt.bits) - 1)
        target[idx] = unkey(dt, (key(dt, base[idx]) + d) & full)
    assert int(np.count_nonzero(base != target)) == m
    return base, target


def make_history(n: int, seed: int, frac: float = 0.1) -> History:
    rng = np.random.default_rng(seed)
    k = max(1, int(n * frac)) if n else 0
    pos = np.sort(rng.choice(n, min(k, n), replace=False)).astype(np.int64)
    return History(n, pos, rng.choice(np.array(HIST_BYTES, np.uint8), pos.size))


def encode(kern, dt, base, target, states, variant, cap=None):
    """(m, payload bytes or None) by an ``ulp2_encode`` kernel."""
    n = base.size
    shift, mask, n_exp = ctx(dt)
    out = np.zeros(cap if cap is not None else n * dt.itemsize * 3 + 8192, np.uint8)
    pos = np.empty(max(n, 1), np.int32)
    st = np.zeros(0, np.uint8) if states is None else states
    m, nb = kern(base, target, st, dt.bits, kind(dt), shift, mask, n_exp, int(states is not None), variant, pos, out)
    return m, (bytes(out[:nb]) if nb > 0 else None)


def decode(kern, dt, base, states, payload: bytes, m: int):
    """(status, positions, target bits) by an ``ulp2_decode`` kernel."""
    shift, mask, n_exp = ctx(dt)
    pos = np.empty(m, np.int64)
    val = np.empty(m, dt.uint)
    st = np.zeros(0, np.uint8) if states is None else states
    s = kern(base, st, np.frombuffer(payload, np.uint8), m, dt.bits, kind(dt), shift, mask, n_exp,
             int(states is not None), pos, val)
    return s, pos, val


def varint(buf: bytes, o: int) -> tuple[int, int]:
    v = sh = 0
    while True:
        b = buf[o]
        o += 1
        v |= (b & 0x7F) << sh
        sh += 7
        if b < 0x80:
            return v, o


@dataclass
class Layout:
    """Offsets of a valid payload's fields (FORMAT.md, "Payload of ulp2")."""

    variant: int
    contexts: list[int]
    p_at: list[int]  # offset of each context's p
    k_at: list[int]  # offset of each value table's K
    sign_at: int  # offset of the sign probabilities (== states_at without history)
    states_at: int
    stream_at: int


def layout(payload: bytes, hist: bool) -> Layout:
    v = payload[0]
    _, _, W, _, SB, PB = VARIANT[v]
    g, o = varint(payload, 1)
    ctxs, p_at, k_at = [], [], []
    prev = -1
    for _ in range(g):
        gap, o = varint(payload, o)
        prev = prev + 1 + gap
        ctxs.append(prev)
        p_at.append(o)
        o += PB
    for _ in range(g):
        k_at.append(o)
        o += 1 + PB * (payload[o] - 1)
    sign_at = o
    if hist:
        o += 6 * PB
    return Layout(v, ctxs, p_at, k_at, sign_at, o, o + W * SB)
