"""Round-trip properties of the chunk codec: decode(base, encode(base, target)) == target, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarefit.codec import chunk as C
from deltarefit.dtypes import DTYPES, dtype
from deltarefit.errors import DecodeError, FormatError

ALL = sorted(DTYPES)

# Bit patterns that break naive float handling, per width: zeros of both signs, infinities, quiet and
# signalling NaNs with payloads, the smallest and largest subnormals, extremes.
SPECIAL = {
    1: [0x00, 0x80, 0x7F, 0xFF, 0x01, 0x81, 0x07, 0x78, 0x7C, 0xFC, 0x7E],
    2: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFFC1, 0x7F81, 0x0001, 0x8001, 0x007F, 0x7C00, 0xFC00,
        0x7E01, 0x03FF, 0x7BFF, 0xFBFF],
    4: [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x7F800001, 0xFFFFFFFF, 1, 0x807FFFFF, 0x7F7FFFFF],
    8: [0, 1 << 63, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000001, 0x7FF0000000000001, 1,
        (1 << 64) - 1, 0x000FFFFFFFFFFFFF],
}


def roundtrip(dt_name: str, base: np.ndarray, target: np.ndarray, fmt: int = 2) -> C.EncodedChunk | None:
    dt = dtype(dt_name)
    enc = C.encode_chunk(dt, base, target, fmt=fmt)
    if enc is None:
        assert np.array_equal(base, target)
        return None
    assert enc.n_changed == int(np.count_nonzero(base != target))
    patch = C.decode_chunk(dt, base, enc.encoding, enc.payload, enc.n_changed, enc.decoded_len, "test")
    out = base.copy()
    patch.apply_to(out)
    assert out.tobytes() == target.tobytes()
    return enc


@st.composite
def pairs(draw):
    name = draw(st.sampled_from(ALL))
    dt = dtype(name)
    n = draw(st.integers(0, 3000))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    hi = 1 << dt.bits
    base = rng.integers(0, hi, n, dtype=np.uint64).astype(dt.uint) if n else np.zeros(0, dt.uint)
    mode = draw(st.sampled_from(["ulp", "random", "special", "all", "one", "none"]))
    target = base.copy()
    if n:
        if mode == "special" or draw(st.booleans()):
            sp = np.array(SPECIAL[dt.itemsize], dtype=np.uint64).astype(dt.uint)
            k = min(n, 64)
            base[rng.integers(0, n, k)] = rng.choice(sp, k)
            target = base.copy()
            target[rng.integers(0, n, k)] = rng.choice(sp, k)
        frac = draw(st.floats(0, 1))
        idx = np.flatnonzero(rng.random(n) < frac) if mode not in ("all", "one", "none") else (
            np.arange(n) if mode == "all" else np.array([rng.integers(0, n)]) if mode == "one" else np.zeros(0, int))
        if mode in ("ulp", "one", "all", "special"):
            step = rng.integers(-3, 4, idx.size).astype(np.int64)
            step[step == 0] = 1
            target[idx] = (target[idx].astype(np.uint64) + step.astype(np.uint64)).astype(dt.uint)
        elif mode == "random":
            target[idx] = rng.integers(0, hi, idx.size, dtype=np.uint64).astype(dt.uint)
    return name, base, target


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs())
def test_every_dtype_round_trips_bit_for_bit(case):
    name, base, target = case
    roundtrip(name, base, target)


@pytest.mark.parametrize("name", ALL)
def test_special_values_round_trip_in_both_directions(name):
    dt = dtype(name)
    sp = np.array(SPECIAL[dt.itemsize], dtype=np.uint64).astype(dt.uint)
    # Every ordered pair of special values, as (base, target) element pairs.
    base = np.repeat(sp, sp.size)
    target = np.tile(sp, sp.size)
    roundtrip(name, base, target)
    roundtrip(name, target, base)


@pytest.mark.parametrize("name", ALL)
def test_negative_zero_and_positive_zero_are_different_bits(name):
    dt = dtype(name)
    sign = 1 << (dt.bits - 1)
    base = np.array([0, sign, 0, sign], dtype=np.uint64).astype(dt.uint)
    target = np.array([sign, 0, 0, sign], dtype=np.uint64).astype(dt.uint)
    enc = roundtrip(name, base, target)
    assert enc is not None and enc.n_changed == 2


def test_one_changed_element_in_a_full_chunk_costs_a_few_bytes():
    n = (1 << 20) // 2
    base = np.random.default_rng(1).integers(0, 1 << 16, n, dtype=np.uint64).astype(np.uint16)
    target = base.copy()
    target[123457] ^= 1
    enc = roundtrip("BF16", base, target, fmt=1)
    assert enc.encoding == C.ULP and len(enc.payload) < 40
    # Format 2's ulp class holds 64 bytes of lane states: a sparse XOR wins such a chunk.
    assert len(roundtrip("BF16", base, target).payload) < 40


def test_every_element_changed_picks_a_dense_encoding():
    rng = np.random.default_rng(2)
    base = rng.integers(0, 1 << 16, 50000, dtype=np.uint64).astype(np.uint16)
    target = rng.integers(0, 1 << 16, 50000, dtype=np.uint64).astype(np.uint16)
    target[target == base] ^= 1
    enc = roundtrip("BF16", base, target)
    assert enc.encoding in (C.DENSE_XOR, C.OVERWRITE)
    assert len(enc.payload) <= 50000 * 2 * 1.01 + 64


def test_identical_chunks_encode_to_nothing():
    base = np.arange(1000, dtype=np.uint16)
    assert C.encode_chunk(dtype("BF16"), base, base.copy()) is None


def test_realistic_ulp_changes_beat_plain_sparse_xor():
    rng = np.random.default_rng(3)
    w = (rng.standard_normal(1 << 19) * 0.02).astype(np.float32)
    base = (w.view(np.uint32) >> 16).astype(np.uint16)
    target = base.copy()
    # Small weights change more often, mostly by one ulp: the shape of real AdamW steps.
    p = np.clip(0.004 / np.abs(w), 0, 0.5)
    idx = np.flatnonzero(rng.random(base.size) < p)
    target[idx] = (target[idx].astype(np.int64) + rng.choice([-1, 1], idx.size)).astype(np.uint16)
    ulp = roundtrip("BF16", base, target, fmt=1)
    ulp2 = roundtrip("BF16", base, target)
    pos = np.flatnonzero(base != target)
    gaps = np.diff(pos, prepend=-1) - 1
    raw = bytes([2]) + gaps.astype("<u2").tobytes() + np.bitwise_xor(base[pos], target[pos]).tobytes()
    assert ulp.encoding == C.ULP and ulp2.encoding == C.ULP2
    assert len(ulp.payload) < 0.8 * len(C._zc().compress(raw))
    assert len(ulp2.payload) < 0.8 * len(C._zc().compress(raw))


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=400), st.integers(1, 500))
def test_garbage_ulp_payloads_are_refused_not_crashed(payload, n_changed):
    base = np.arange(500, dtype=np.uint16)
    try:
        patch = C.decode_chunk(dtype("BF16"), base, C.ULP, payload, n_changed, 0, "fuzz")
    except DecodeError as e:
        assert "fuzz" in str(e)
        return
    # A garbage payload that happens to decode must still describe a valid patch.
    assert patch.positions.size == n_changed
    assert np.all(np.diff(patch.positions) > 0) and patch.positions[-1] < base.size


@pytest.mark.parametrize("enc", [C.SPARSE_XOR, C.DENSE_XOR, C.OVERWRITE, 99])
def test_garbage_zstd_payloads_are_refused(enc):
    base = np.arange(500, dtype=np.uint16)
    with pytest.raises(FormatError):
        C.decode_chunk(dtype("BF16"), base, enc, b"\x28\xb5\x2f\xfd garbage", 3, 10, "fuzz")


def _scan_reference(dt, base: np.ndarray, target: np.ndarray):
    """The scan's contract written plainly: changed positions, their context, and their rank among
    all the chunk's elements of the same context (numpy, no shared code with the kernel)."""
    shift, mask, _ = C._ctx(dt)
    ctx = ((base.astype(np.uint64) >> np.uint64(shift)) & np.uint64(mask)).astype(np.int64)
    rank = np.empty(base.size, np.int64)
    for c in np.unique(ctx):
        where = np.flatnonzero(ctx == c)
        rank[where] = np.arange(where.size)
    pos = np.flatnonzero(base != target)
    return pos, ctx[pos], rank[pos], base[pos], target[pos]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["BF16", "F16", "F32", "F8_E4M3", "I64", "U8"]), n=st.integers(0, 70),
       seed=st.integers(0, 2**32 - 1), rate=st.sampled_from([0.0, 0.05, 0.3, 1.0]))
def test_scan_matches_a_plain_reference(name, n, seed, rate):
    # The kernel counts contexts in four interleaved lanes with a fast path per group of four: odd
    # lengths, changes in every lane and all-changed groups are the cases that path could get wrong.
    dt = dtype(name)
    rng = np.random.default_rng(seed)
    info = np.iinfo(dt.uint)
    base = rng.integers(0, info.max, n, dtype=dt.uint, endpoint=True)
    base[rng.random(n) < 0.5] = base[0] if n else 0  # many shared contexts
    target = base.copy()
    flip = rng.random(n) < rate
    target[flip] ^= np.array(1, dt.uint)
    got = C.scan_chunk(dt, base, target)
    for g, w in zip((got.pos, got.ectx, got.rank, got.bvals, got.tvals), _scan_reference(dt, base, target),
                    strict=True):
        np.testing.assert_array_equal(g.astype(np.int64) if g.dtype.kind == "i" else g, w)
