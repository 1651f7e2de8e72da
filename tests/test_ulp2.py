"""Format 2's ulp class (encodings 6 ``ulp2`` and 7 ``ulp2_hist``): every dtype, both coder variants,
with and without history, round trips bit for bit through the numba kernels and the chunk codec, and
the native kernels (where built with them) write the same bytes and decode the same patches."""

from __future__ import annotations

import numpy as np
import pytest
from _ulp2 import VARIANT, ctx, decode, encode, kind, layout, make_history, make_pair

from deltarefit.codec import chunk as C
from deltarefit.codec import native, ulp2
from deltarefit.codec import ulp2_kernels as K2
from deltarefit.dtypes import DTYPES, dtype

ALL = sorted(DTYPES)


def _check_kernel_round_trip(dt, base, target, states, variant) -> bytes | None:
    m, payload = encode(K2.ulp2_encode, dt, base, target, states, variant)
    want = np.flatnonzero(base != target)
    assert m == want.size
    if m == 0:
        assert payload is None
        return None
    assert payload is not None and payload[0] == variant
    s, pos, val = decode(K2.ulp2_decode, dt, base, states, payload, m)
    assert s == 0
    assert np.array_equal(pos, want)
    assert np.array_equal(val, target[want])
    return payload


@pytest.mark.parametrize("name", ALL)
def test_every_dtype_round_trips_in_both_variants_with_and_without_history(name):
    dt = dtype(name)
    for n, m in ((1, 1), (5, 2), (31, 31), (33, 7), (47, 0), (100, 100), (1000, 35), (1000, 1)):
        base, target = make_pair(dt, n, m, seed=n * 7 + m)
        states = make_history(n, seed=n).states().copy()
        for variant in (0, 1):
            for st in (None, states):
                _check_kernel_round_trip(dt, base, target, st, variant)


@pytest.mark.parametrize("name", ["BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2"])
def test_nan_payloads_signed_zeros_and_the_widest_distance_round_trip(name):
    dt = dtype(name)
    w = dt.bits
    sign = 1 << (w - 1)
    exp_all = ((1 << dt.exp_bits) - 1) << dt.man_bits
    pairs = [(0, sign), (sign, 0), (exp_all | 1, exp_all | 2), (sign | exp_all | 1, exp_all | 1),
             (0, (1 << w) - 1), ((1 << w) - 1, 0), (sign - 1, sign), (1, sign | 1)]
    base = np.array([p[0] for p in pairs], np.uint64).astype(dt.uint)
    target = np.array([p[1] for p in pairs], np.uint64).astype(dt.uint)
    for variant in (0, 1):
        _check_kernel_round_trip(dt, base, target, None, variant)
        _check_kernel_round_trip(dt, target, base, None, variant)


def test_the_widest_distance_codes_with_its_sign_set():
    # D = -2^(w-1): key(target) = key(base) + 2^(w-1); a 64-bit dtype, both variants.
    dt = dtype("I64")
    base = np.array([5, 0, 1 << 63, (1 << 63) - 1], np.uint64)
    target = base ^ np.uint64(1 << 63)
    for variant in (0, 1):
        _check_kernel_round_trip(dt, base, target, None, variant)


def test_lengths_around_the_lane_count_round_trip():
    dt = dtype("BF16")
    for variant, (_, _, W, _, _, _) in VARIANT.items():
        for n in (1, W - 1, W, W + 1, 2 * W - 1, 3 * W + 5):
            for m in sorted({1, n // 2, n}):
                if m:
                    base, target = make_pair(dt, n, m, seed=n + m)
                    _check_kernel_round_trip(dt, base, target, None, variant)


def test_an_unchanged_chunk_codes_to_nothing():
    dt = dtype("BF16")
    base, _ = make_pair(dt, 100, 0, seed=1)
    for variant in (0, 1):
        assert encode(K2.ulp2_encode, dt, base, base.copy(), None, variant) == (0, None)
    assert ulp2.encode_ulp2(dt, base, base.copy()) is None


def test_encode_ulp2_keeps_the_smaller_variant_and_variant_0_on_a_tie():
    dt = dtype("BF16")
    for n, m in ((4096, 40), (4096, 1500), (200, 3)):
        base, target = make_pair(dt, n, m, seed=n + m)
        sizes = [len(encode(K2.ulp2_encode, dt, base, target, None, v)[1]) for v in (0, 1)]
        got = ulp2.encode_ulp2(dt, base, target)
        assert got.encoding == C.ULP2 and len(got.payload) == min(sizes)
        assert got.payload[0] == (0 if sizes[0] <= sizes[1] else 1)


def test_with_history_the_smaller_of_ulp2_and_ulp2_hist_is_kept_and_decodes():
    dt = dtype("BF16")
    n = 8192
    base, target = make_pair(dt, n, 300, seed=5)
    # A history that predicts the changes and their directions: encoding 7 must win.
    pos = np.flatnonzero(base != target)
    from deltarefit.codec.history import History, directions

    down = directions(dt, base[pos], target[pos])
    hist = History(n, pos, np.where(down, 129, 1).astype(np.uint8))
    got = ulp2.encode_ulp2(dt, base, target, hist)
    plain = ulp2.encode_ulp2(dt, base, target)
    assert got.encoding == C.ULP2_HIST and len(got.payload) < len(plain.payload)
    assert got.payload[:16] == hist.id
    patch = C.decode_chunk(dt, base, got.encoding, got.payload, got.n_changed, 0, "t", hist)
    out = base.copy()
    patch.apply_to(out)
    assert np.array_equal(out, target)
    # A history that says nothing useful: encoding 6 is kept.
    other = make_history(n, seed=9, frac=0.001)
    assert ulp2.encode_ulp2(dt, base, target, other).encoding == C.ULP2


def test_the_value_tables_follow_the_encoders_integer_rules():
    # One context (an int dtype), 3 changes of length 1 and 1 of length 3, of 10 elements: p and f as
    # FORMAT.md's encoder rules give them, read back from the payload's layout.
    dt = dtype("I16")
    base = np.zeros(10, np.uint16)
    target = base.copy()
    target[[1, 4, 6, 9]] = [1, 0xFFFF, 1, 5]
    for variant in (0, 1):
        M = VARIANT[variant][0]
        _, payload = encode(K2.ulp2_encode, dt, base, target, None, variant)
        lay = layout(payload, False)
        pb = VARIANT[variant][5]
        assert lay.contexts == [0]
        p = int.from_bytes(payload[lay.p_at[0]:lay.p_at[0] + pb], "little")
        assert p == (2 * 4 * (1 << M) + 10) // 20
        k_at = lay.k_at[0]
        assert payload[k_at] == 3
        f = [int.from_bytes(payload[k_at + 1 + i * pb:k_at + 1 + (i + 1) * pb], "little") for i in range(2)]
        # c_1 = 3, c_2 = 0, c_3 = 1 of C = 4: f_1 = 3/4 of 2^M, f_2 = 0 (f_3 the rest)
        assert f == [3 * (1 << M) // 4, 0]


@pytest.mark.parametrize("name", ["BF16", "F32", "I8", "U64", "BOOL"])
def test_the_chunk_codec_round_trips_format_2_and_keeps_format_1_encodings(name):
    dt = dtype(name)
    base, target = make_pair(dt, 30000, C.ULP1_MAX_CHANGES + 100, seed=11)
    enc2 = C.encode_chunk(dt, base, target)
    enc1 = C.encode_chunk(dt, base, target, fmt=1)
    assert enc1.encoding in (C.ULP, C.SPARSE_XOR, C.DENSE_XOR, C.OVERWRITE)
    assert enc2.encoding in (C.ULP2, C.SPARSE_XOR, C.DENSE_XOR, C.OVERWRITE)
    for enc in (enc1, enc2):
        patch = C.decode_chunk(dt, base, enc.encoding, enc.payload, enc.n_changed, enc.decoded_len, "t")
        out = base.copy()
        patch.apply_to(out)
        assert np.array_equal(out, target)
    raw = C.encode_raw(dt, base.view(np.uint8), target.view(np.uint8))
    assert raw == enc2
    assert C.encode_raw(dt, base.view(np.uint8), target.view(np.uint8), fmt=1) == enc1
    got, pos, old, new = C.encode_with_changes(dt, base, target)
    assert got == enc2 and np.array_equal(pos, np.flatnonzero(base != target))
    assert np.array_equal(old, base[pos]) and np.array_equal(new, target[pos])
    with pytest.raises(ValueError, match="format version 3"):
        C.encode_chunk(dt, base, target, fmt=3)


def test_format_2_keeps_format_1s_coding_of_a_chunk_with_few_changes_where_smaller():
    dt = dtype("BF16")
    base, target = make_pair(dt, 2000, 10, seed=4)
    got = C.encode_chunk(dt, base, target)
    ulp1 = C.encode_chunk(dt, base, target, fmt=1)
    assert len(got.payload) <= len(ulp1.payload) and len(got.payload) <= len(ulp2.encode_ulp2(dt, base, target).payload)
    big_base, big_target = make_pair(dt, 30000, C.ULP1_MAX_CHANGES + 1, seed=4)
    assert C.encode_chunk(dt, big_base, big_target).encoding != C.ULP


def test_moves_of_a_format_2_chunk_feed_the_next_versions_history():
    dt = dtype("BF16")
    n = 20000
    b0, b1 = make_pair(dt, n, C.ULP1_MAX_CHANGES + 300, seed=1)
    enc, moves = C.encode_with_moves(dt, b0, b1, None)
    assert enc.encoding == C.ULP2
    patch = C.decode_chunk(dt, b0, enc.encoding, enc.payload, enc.n_changed, 0, "t")
    back = C.moves_of_patch(dt, b0, patch)
    assert np.array_equal(back.pos, moves.pos) and np.array_equal(back.down, moves.down)
    hist = C.History.from_moves(n, [moves])
    b2 = b1.copy()
    b2[moves.pos] = np.where(moves.down, b1[moves.pos] - 1, b1[moves.pos] + 1)  # the same directions again
    enc2, _ = C.encode_with_moves(dt, b1, b2, hist)
    assert enc2.encoding == C.ULP2_HIST
    patch = C.decode_chunk(dt, b1, enc2.encoding, enc2.payload, enc2.n_changed, 0, "t", hist)
    out = b1.copy()
    patch.apply_to(out)
    assert np.array_equal(out, b2)
    assert C.encode_with_moves(dt, b1, b2, hist, fmt=1)[0].encoding in (C.ULP, C.ULP_HIST)


NATIVE = native.kernel("ulp2_encode") is not None and native.kernel("ulp2_decode") is not None


@pytest.mark.skipif(not NATIVE, reason="the native extension here has no ulp2_encode/ulp2_decode (built by _ulp2.c)")
@pytest.mark.parametrize("name", ALL)
def test_native_kernels_write_numbas_bytes_and_decode_the_same_patches(name):
    dt = dtype(name)
    nenc, ndec = native.kernel("ulp2_encode"), native.kernel("ulp2_decode")
    for n, m in ((1, 1), (33, 7), (1000, 35), (600, 600)):
        base, target = make_pair(dt, n, m, seed=n + m)
        states = make_history(n, seed=n).states().copy()
        for variant in (0, 1):
            for st in (None, states):
                want = encode(K2.ulp2_encode, dt, base, target, st, variant)
                assert encode(nenc, dt, base, target, st, variant) == want
                got = decode(ndec, dt, base, st, want[1], m)
                ref = decode(K2.ulp2_decode, dt, base, st, want[1], m)
                assert got[0] == ref[0] == 0
                assert np.array_equal(got[1], ref[1]) and np.array_equal(got[2], ref[2])
                for cut in (0, 1, len(want[1]) // 2, len(want[1]) - 1):
                    assert decode(ndec, dt, base, st, want[1][:cut], m)[0] == decode(
                        K2.ulp2_decode, dt, base, st, want[1][:cut], m)[0]


def test_kernel_arguments_match_the_chunk_codecs_context():
    dt = dtype("BF16")
    assert ctx(dt) == C._ctx(dt) and kind(dt) == C._kind(dt)
