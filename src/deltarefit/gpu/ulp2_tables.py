"""The tables of a ``ulp2`` / ``ulp2_hist`` chunk (FORMAT.md, "Format version 2") as the device kernels
read them: parsed from a payload's header (decoder), or built from a chunk's counts and written as a
header (encoder). Pure numpy on O(contexts x bit width) numbers; the per-element work is the kernels'.

Dense forms (``Tables``): ``p[NCT]`` (0 for contexts outside the position table), ``cum[NCT, BITS + 1]``
(``cum[e, k] = f_1 + ... + f_k`` for ``k < K``, ``2^M`` from ``K`` on, so a bit length is the count of
entries ``1 .. BITS - 1`` at or below the slot, plus one), ``sp[8]`` (``ulp2_hist``'s sign
probabilities at states 1..6), ``lanes[W]``, and the stream's offset in the payload.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from ..codec.constants import STATUS

# variant -> (M probability bits, R unit bits, W lanes, log2 L)
VARIANTS = {0: (8, 8, 32, 8), 1: (12, 16, 16, 16)}
N_STATES = 7  # encoding 5's history states
STATUS2 = STATUS  # codec.constants.STATUS: format 2's codes -7..-10 and the shared -1, -4, -5, -6


class TableError(ValueError):
    """A header the format refuses; ``status`` is its ``STATUS2`` code. Internal: ``gpu.ulp2`` turns it
    into a chunk's status (and ``DecodeError``); outside the error hierarchy, which is closed."""

    def __init__(self, status: int) -> None:
        super().__init__(STATUS2[status])
        self.status = status


@dataclass
class Tables:
    variant: int
    p: np.ndarray  # int32[NCT]
    cum: np.ndarray  # int32[NCT * (BITS + 1)]
    sp: np.ndarray  # int32[8]
    lanes: np.ndarray  # int64[W]
    stream: int  # the stream's offset in the payload (decoder), or 0


@njit(inline="always")
def _varint(buf, o):
    """(value, next offset, status): unsigned LEB128 of at most 5 bytes, minimal, below 2^32."""
    v = np.int64(0)
    for i in range(5):
        if o >= buf.size:
            return 0, o, -1
        x = np.int64(buf[o])
        o += 1
        v |= (x & 127) << (7 * i)
        if x < 128:
            if (i > 0 and x == 0) or v >= np.int64(1) << 32:
                return 0, o, -8
            return v, o, 0
    return 0, o, -8


@njit(inline="always")
def _uint(buf, o, size):
    v = np.int64(0)
    for i in range(size):
        v |= np.int64(buf[o + i]) << (8 * i)
    return v


@njit(cache=True)
def _parse(buf, bits, nct, hist, p, cum, sp, lanes):
    """Fill the dense tables (see the module docstring) from a payload's header. Returns (status,
    variant, the stream's offset): status 0 or the host decoder's code, found in its order."""
    if buf.size < 1:
        return -1, 0, 0
    variant = np.int64(buf[0])
    if variant == 0:
        M, R, W, LB, ps, sb = 8, 8, 32, 8, 1, 2
    elif variant == 1:
        M, R, W, LB, ps, sb = 12, 16, 16, 16, 2, 4
    else:
        return -7, variant, 0
    one = np.int64(1) << M
    for e in range(nct):
        p[e] = 0
        cum[e * (bits + 1)] = 0
        for i in range(1, bits + 1):
            cum[e * (bits + 1) + i] = one
    for t in range(8):
        sp[t] = one >> 1
    g, o, st = _varint(buf, 1)
    if st != 0:
        return st, variant, 0
    if g < 1 or g > nct:
        return -8, variant, 0
    ctxs = np.empty(g, np.int64)
    e = -1
    for q in range(g):
        gap, o, st = _varint(buf, o)
        if st != 0:
            return st, variant, 0
        e = e + 1 + gap
        if e >= nct:
            return -8, variant, 0
        if o + ps > buf.size:
            return -1, variant, 0
        pv = _uint(buf, o, ps)
        o += ps
        if pv < 1 or pv > one - 1:
            return -8, variant, 0
        p[e] = pv
        ctxs[q] = e
    for q in range(g):
        e = ctxs[q]
        if o >= buf.size:
            return -1, variant, 0
        k = np.int64(buf[o])
        o += 1
        if k < 1 or k > bits:
            return -8, variant, 0
        if o + ps * (k - 1) > buf.size:
            return -1, variant, 0
        run = np.int64(0)
        for i in range(1, k):
            run += _uint(buf, o, ps)
            o += ps
            cum[e * (bits + 1) + i] = run
        if run >= one:
            return -8, variant, 0
    if hist:
        if o + ps * (N_STATES - 1) > buf.size:
            return -1, variant, 0
        for t in range(1, N_STATES):
            v = _uint(buf, o, ps)
            o += ps
            if v < 1 or v > one - 1:
                return -8, variant, 0
            sp[t] = v
    if o + W * sb > buf.size:
        return -1, variant, 0
    for lane in range(W):
        x = _uint(buf, o, sb)
        o += sb
        if x < np.int64(1) << LB or x >= np.int64(1) << (LB + R):
            return -9, variant, 0
        lanes[lane] = x
    return 0, variant, o


def parse(payload: bytes, bits: int, nct: int, hist: bool) -> Tables:
    """The tables of a payload (without ``ulp2_hist``'s history id); ``nct`` the contexts (7 times the
    dtype's for ``ulp2_hist``). Raises ``TableError`` for every refusal the header can meet, with the
    host decoder's status (numba: microseconds per chunk)."""
    p = np.empty(nct, np.int32)
    cum = np.empty(nct * (bits + 1), np.int32)
    sp = np.empty(8, np.int32)
    lanes = np.zeros(32, np.int64)
    st, variant, o = _parse(np.frombuffer(payload, np.uint8), bits, nct, bool(hist), p, cum, sp, lanes)
    if st:
        raise TableError(int(st))
    return Tables(int(variant), p, cum, sp, lanes[:VARIANTS[int(variant)][2]].copy(), int(o))


@dataclass
class Counts:
    """A chunk's counts, from the device: elements and changes per context, changes per (context,
    bit length ``k`` = 1..BITS), and for ``ulp2_hist`` per state its changes and those whose coded
    sign bit (``s XOR flip``) is 1."""

    n_e: np.ndarray  # int64[NCT]
    c_e: np.ndarray  # int64[NCT]
    c_ek: np.ndarray  # int64[NCT, BITS + 1]
    c_t: np.ndarray  # int64[8]
    c1_t: np.ndarray  # int64[8]


def build(counts: Counts, bits: int, variant: int, hist: bool) -> tuple[Tables, bytes] | None:
    """The encoder's tables (FORMAT.md's integer arithmetic) and the header they are written as (the
    payload up to the lane states), or None where this variant cannot code the chunk."""
    M, _, W, _ = VARIANTS[variant]
    one = 1 << M
    ps = 1 if variant == 0 else 2
    nct = counts.n_e.size
    ctxs = np.flatnonzero(counts.c_e)
    p = np.zeros(nct, np.int32)
    cum = np.full((nct, bits + 1), one, np.int32)
    cum[:, 0] = 0
    head = bytearray([variant]) + _leb(len(ctxs))
    prev = -1
    for e in ctxs:
        c, ne = int(counts.c_e[e]), int(counts.n_e[e])
        p[e] = min(max((2 * c * one + ne) // (2 * ne), 1), one - 1)
        head += _leb(int(e) - prev - 1) + int(p[e]).to_bytes(ps, "little")
        prev = int(e)
    for e in ctxs:
        ck = counts.c_ek[e, 1:]
        big = int(np.flatnonzero(ck)[-1]) + 1  # K
        total = int(ck.sum())
        f = np.array([0 if x == 0 else max(1, (int(x) * one) // total) for x in ck[:big]], np.int64)
        top = int(np.argmax(ck[:big]))  # the largest c_k, smallest k among equals
        f[top] += one - int(f.sum())
        if f[top] < 1:
            return None
        cum[e, 1:big] = np.cumsum(f[:-1])
        head += bytes([big]) + b"".join(int(x).to_bytes(ps, "little") for x in f[:-1])
    sp = np.full(8, one >> 1, np.int32)
    if hist:
        for t in range(1, N_STATES):
            c, c1 = int(counts.c_t[t]), int(counts.c1_t[t])
            sp[t] = min(max((2 * c1 * one + c) // (2 * c), 1), one - 1) if c else one >> 1
            head += int(sp[t]).to_bytes(ps, "little")
    return Tables(variant, p, cum.reshape(-1), sp, np.zeros(W, np.int64), 0), bytes(head)


def _leb(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 127
        v >>= 7
        if v:
            out.append(b | 128)
        else:
            out.append(b)
            return bytes(out)
