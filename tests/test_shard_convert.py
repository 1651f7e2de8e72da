"""The residual conversion: bit for bit what torch gives (NaN aside, by design), blockwise fp8 scales,
and the residual that stays in the masters and shows up in a later delta."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltarefit.errors import UsageError
from deltarefit.shard.convert import (
    FP8_MAX,
    convert_fp8_blocks,
    e4m3fn_bits,
    export_full,
    fp8_block_shape,
    to_bf16_bits,
    to_f16_bits,
    to_served_bits,
)

SPECIAL = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001, 0x80000001, 0x007FFFFF,
                    0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x477FE000,
                    0x477FF000, 0x477FEFFF, 0x33800000, 0x33000000, 0x33000001, 0x387FC000, 0x38800000,
                    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFA12345, 0x7FFFFFFF], np.uint32)


def torch_bits(x: np.ndarray, dt: torch.dtype) -> np.ndarray:
    t = torch.from_numpy(x.copy()).to(dt)
    return t.view(torch.uint8 if t.element_size() == 1 else torch.int16).numpy().view(
        np.uint8 if t.element_size() == 1 else np.uint16)


def is_nan32(u):
    return (u & 0x7FFFFFFF) > 0x7F800000


@pytest.mark.parametrize("fn,tdt,exp_mask", [(to_bf16_bits, torch.bfloat16, 0x7F80), (to_f16_bits, torch.float16, 0x7C00)])
def test_equals_torch_bitwise(fn, tdt, exp_mask):
    rng = np.random.default_rng(0)
    u = np.concatenate([SPECIAL, rng.integers(0, 2**32, 300_000, dtype=np.uint64).astype(np.uint32),
                        # dense around fp16/bf16 rounding and subnormal boundaries
                        (np.arange(-5000, 5000) + 0x33800000).astype(np.uint32),
                        (np.arange(-5000, 5000) + 0x387FE000).astype(np.uint32)])
    x = u.view(np.float32)
    got, want = fn(x), torch_bits(x, tdt)
    fin = ~is_nan32(u)
    np.testing.assert_array_equal(got[fin], want[fin])
    # NaN: torch's own CPU kernels disagree with themselves (see convert.py); ours is a quiet NaN with
    # the input's sign and top payload bits, and torch's is a NaN too.
    nan = ~fin
    mant = 0x7F if exp_mask == 0x7F80 else 0x3FF
    quiet = 0x40 if exp_mask == 0x7F80 else 0x200
    assert ((got[nan] & exp_mask) == exp_mask).all() and ((got[nan] & quiet) != 0).all()
    assert ((want[nan] & exp_mask) == exp_mask).all() and ((want[nan] & mant) != 0).all()
    np.testing.assert_array_equal(got[nan] >> 15, (u[nan] >> 31).astype(np.uint16))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_bf16_single_values(u):
    x = np.array([u], np.uint32).view(np.float32)
    if not is_nan32(np.uint32(u)):
        assert to_bf16_bits(x)[0] == torch_bits(x, torch.bfloat16)[0]
        assert to_f16_bits(x)[0] == torch_bits(x, torch.float16)[0]


def test_e4m3fn_equals_torch_in_range():
    rng = np.random.default_rng(1)
    x = np.concatenate([(rng.standard_normal(200_000) * 60).astype(np.float32),
                        np.float32([0, -0.0, 448, -448, 2**-6, 2**-7, 2**-9, 2**-10, 3 * 2**-10, 1.5 * 2**-9])])
    x = x[np.abs(x) <= FP8_MAX]
    np.testing.assert_array_equal(e4m3fn_bits(x), torch_bits(x, torch.float8_e4m3fn))
    nan = e4m3fn_bits(np.float32([np.nan, np.inf, -np.inf, 1e6]))
    np.testing.assert_array_equal(nan & 0x7F, [0x7F] * 4)


def test_fp8_blocks():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((300, 200)) * 0.02).astype(np.float32)
    w[:128, :128] = 0  # an all-zero block has scale 1
    q, s = convert_fp8_blocks(w)
    assert q.dtype == np.uint8 and s.shape == fp8_block_shape(w.shape) == (3, 2)
    assert s[0, 0] == 1.0
    blk = np.abs(w[128:256, 128:200]).max()
    assert s[1, 1] == np.float32(blk) / np.float32(448)
    deq = torch.from_numpy(q.copy()).view(torch.float8_e4m3fn).float().numpy() * np.repeat(
        np.repeat(s, 128, 0), 128, 1)[:300, :200]
    assert np.abs(deq - w).max() <= np.abs(w).max() / 8  # e4m3: 3 mantissa bits
    # deterministic, and a block-aligned slice converts to the same bits as the whole
    q2, s2 = convert_fp8_blocks(w[128:, :])
    np.testing.assert_array_equal(q2, q[128:]) and np.testing.assert_array_equal(s2, s[1:])
    full = export_full({"a.weight": w}, "F8_E4M3")
    assert set(full) == {"a.weight", "a.weight_scale_inv"}


def test_refuses_non_fp32():
    with pytest.raises(UsageError):
        to_served_bits(np.zeros(3, np.float64), "BF16")
    with pytest.raises(UsageError):
        to_served_bits(np.zeros(3, np.float32), "F8_E4M3")


def test_residual_stays_in_master_and_shows_up_later():
    # Updates far below one bf16 ulp round away each step; the master accumulates them and the served
    # bits change exactly when the accumulated value crosses a rounding boundary.
    rng = np.random.default_rng(3)
    m = (rng.standard_normal(50_000) * 0.02).astype(np.float32)
    served0 = to_bf16_bits(m)
    step = np.float32(1e-7)
    changed_per_step = []
    prev = served0
    for _ in range(200):
        m += step  # each step is ~1/1000 of an ulp for most elements
        cur = to_bf16_bits(m)
        changed_per_step.append(int((cur != prev).sum()))
        prev = cur
        # the served bits are always exactly the conversion of the current master (no drift)
    assert changed_per_step[0] < len(m) * 0.01
    assert sum(changed_per_step) > len(m) * 0.05  # the residual showed up in later deltas
    np.testing.assert_array_equal(prev, torch_bits(m, torch.bfloat16))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([np.uint8, np.uint16, np.uint32, np.uint64]), st.integers(0, 3000), st.integers(0, 2**32))
def test_additive_digest_kernel_and_partitions(dt, n, seed):
    # the compiled kernel equals the numpy reference, and any partition sums to the whole
    from deltarefit.integrity import additive as D

    rng = np.random.default_rng(seed)
    s = D.seeds("t", "BF16", (n,))
    bits = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
    flat = rng.permutation(n).astype(np.int64)
    whole = D.partial(s, flat, bits)
    np.testing.assert_array_equal(whole, D._partial_numpy(s, flat, bits))
    # the native kernel (where built) and the numba one give the same sums, by indices and by a run
    np.testing.assert_array_equal(D._sums(flat, 0, bits, s, force_numba=True), whole)
    start = int(rng.integers(0, 2**40))
    run = D.partial_run(s, start, bits)
    np.testing.assert_array_equal(run, D._partial_numpy(s, np.arange(start, start + n, dtype=np.int64), bits))
    np.testing.assert_array_equal(D._sums(None, start, bits, s, force_numba=True), run)
    cuts = np.sort(rng.integers(0, n + 1, 3))
    acc = D.ZERO.copy()
    for a, b in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [n]]), strict=True):
        acc = D.add(acc, D.partial(s, flat[a:b], bits[a:b]))
    np.testing.assert_array_equal(acc, whole)
    if n:
        bits2 = bits.copy()
        bits2[0] ^= 1
        assert not np.array_equal(D.partial(s, flat, bits2), whole)
        np.testing.assert_array_equal(D.from_limbs(D.to_limbs(whole)), whole)
