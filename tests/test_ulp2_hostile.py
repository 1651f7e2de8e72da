"""Hostile payloads of encodings 6 and 7: every malformed payload is refused with FORMAT.md's status (the
exact one, ``codec.constants.STATUS``), never a crash or a read out of bounds; a payload the decoder
cannot tell from a valid one decodes to changes the chunk's post hash then refuses."""

from __future__ import annotations

import numpy as np
import pytest
from _ulp2 import VARIANT, decode, encode, layout, make_history, make_pair

from deltarefit.codec import chunk as C
from deltarefit.codec import ulp2_kernels as K2
from deltarefit.codec.constants import STATUS
from deltarefit.dtypes import dtype
from deltarefit.errors import DecodeError

BF16 = dtype("BF16")
TRUNCATED, COUNT, SMALL, TRAILING, VARIANT_BAD, TABLE, STATE, END = -1, -4, -5, -6, -7, -8, -9, -10


def _case(variant: int, hist: bool, n: int = 40, m: int = 5, seed: int = 3):
    base, target = make_pair(BF16, n, m, seed=seed)
    states = make_history(n, seed=seed, frac=0.3).states().copy() if hist else None
    got_m, payload = encode(K2.ulp2_encode, BF16, base, target, states, variant)
    assert got_m == m
    return base, target, states, payload


def _status(base, states, payload: bytes, m: int) -> int:
    return decode(K2.ulp2_decode, BF16, base, states, payload, m)[0]


def _put(payload: bytes, at: int, value: int, nbytes: int) -> bytes:
    return payload[:at] + int(value).to_bytes(nbytes, "little") + payload[at + nbytes:]


@pytest.mark.parametrize("variant", [0, 1])
@pytest.mark.parametrize("hist", [False, True])
def test_a_payload_cut_anywhere_is_refused_as_truncated(variant, hist):
    base, _, states, payload = _case(variant, hist)
    for cut in range(len(payload)):
        assert _status(base, states, payload[:cut], 5) == TRUNCATED, cut


@pytest.mark.parametrize("variant", [0, 1])
def test_trailing_bytes_are_refused(variant):
    base, _, _, payload = _case(variant, False)
    for extra in (b"\0", b"\xff", b"\0\0\0"):
        assert _status(base, None, payload + extra, 5) == TRAILING


@pytest.mark.parametrize("bad", [2, 3, 0x80, 0xFF])
def test_an_unknown_coder_variant_is_refused(bad):
    base, _, _, payload = _case(0, False)
    assert _status(base, None, bytes([bad]) + payload[1:], 5) == VARIANT_BAD


@pytest.mark.parametrize("variant", [0, 1])
def test_a_change_count_other_than_the_records_is_refused(variant):
    base, _, _, payload = _case(variant, False)
    for m in (0, 4, 6, 40):
        assert _status(base, None, payload, m) == COUNT


@pytest.mark.parametrize("variant", [0, 1])
def test_position_tables_out_of_range_are_refused(variant):
    base, _, _, payload = _case(variant, False)
    M, pb = VARIANT[variant][0], VARIANT[variant][5]
    lay = layout(payload, False)
    g = len(lay.contexts)
    assert payload[1] == g < 0x80
    # G = 0, and G beyond the dtype's 256 contexts
    assert _status(base, None, payload[:1] + b"\0" + payload[2:], 5) == TABLE
    assert _status(base, None, payload[:1] + b"\x81\x02" + payload[2:], 5) == TABLE
    # a non-minimal varint G (0x80 | G, 0x00), and a 6-byte one
    assert _status(base, None, payload[:1] + bytes([0x80 | g, 0]) + payload[2:], 5) == TABLE
    assert _status(base, None, payload[:1] + b"\x80\x80\x80\x80\x80\x00" + payload[2:], 5) == TABLE
    # a context past the last: the last entry's gap made huge (a 5-byte varint below 2^32)
    last_gap_at = lay.p_at[-1] - 1
    assert payload[last_gap_at] < 0x80
    assert _status(base, None, payload[:last_gap_at] + b"\xff\xff\xff\xff\x0f" + payload[last_gap_at + 1:], 5) == TABLE
    # a varint of 2^32 or more
    assert _status(base, None, payload[:last_gap_at] + b"\x80\x80\x80\x80\x10" + payload[last_gap_at + 1:], 5) == TABLE
    # p = 0 and p = 2^M
    for p in (0, 1 << M):
        if p < 1 << (8 * pb):
            assert _status(base, None, _put(payload, lay.p_at[0], p, pb), 5) == TABLE


@pytest.mark.parametrize("variant", [0, 1])
def test_value_tables_out_of_range_are_refused(variant):
    # One context (I16) whose changes have bit lengths 1, 2 and 3: a table of K = 3, two stated frequencies.
    i16 = dtype("I16")
    base = np.zeros(12, np.uint16)
    target = base.copy()
    target[[0, 3, 5, 8, 11]] = [1, 0xFFFF, 2, 4, 0xFFFE]
    _, payload = encode(K2.ulp2_encode, i16, base, target, None, variant)
    M, pb = VARIANT[variant][0], VARIANT[variant][5]
    lay = layout(payload, False)
    k_at = lay.k_at[0]
    assert payload[k_at] == 3

    def status(p: bytes) -> int:
        return decode(K2.ulp2_decode, i16, base, None, p, 5)[0]

    assert status(payload) == 0
    assert status(_put(payload, k_at, 0, 1)) == TABLE
    assert status(_put(payload, k_at, 17, 1)) == TABLE  # K > w = 16
    # stated frequencies summing to 2^M (f_K = 0), and past it
    half = 1 << (M - 1)
    assert status(_put(_put(payload, k_at + 1, half, pb), k_at + 1 + pb, half, pb)) == TABLE
    assert status(_put(_put(payload, k_at + 1, (1 << 8 * pb) - 1, pb), k_at + 1 + pb, half, pb)) == TABLE
    # just below: a valid table, which decodes to other values (or refuses at the end)
    assert status(_put(_put(payload, k_at + 1, half, pb), k_at + 1 + pb, half - 1, pb)) in (0, END, TRUNCATED,
                                                                                            TRAILING, STATE)


@pytest.mark.parametrize("variant", [0, 1])
def test_sign_probabilities_out_of_range_are_refused(variant):
    base, _, states, payload = _case(variant, True)
    M, pb = VARIANT[variant][0], VARIANT[variant][5]
    lay = layout(payload, True)
    for t in range(6):
        for p in (0, 1 << M):
            if p < 1 << (8 * pb):
                assert _status(base, states, _put(payload, lay.sign_at + t * pb, p, pb), 5) == TABLE


@pytest.mark.parametrize("variant", [0, 1])
def test_lane_states_out_of_range_are_refused(variant):
    base, _, _, payload = _case(variant, False)
    _, _, W, L, sb, _ = VARIANT[variant]
    lay = layout(payload, False)
    for lane in (0, W - 1):
        for x in (0, 1, L >> 1, L - 1):  # (the upper bound L * 2^R is the field's own)
            assert _status(base, None, _put(payload, lay.states_at + lane * sb, x, sb), 5) == STATE


@pytest.mark.parametrize("variant", [0, 1])
def test_a_lane_not_ending_at_its_initial_state_is_refused(variant):
    # One element and one change: lane 0 codes everything, the other lanes decode nothing, so moving
    # another lane's state within its range leaves every symbol as it was and only the end check fails.
    base, _, _, payload = _case(variant, False, n=1, m=1)
    _, _, W, L, sb, _ = VARIANT[variant]
    lay = layout(payload, False)
    at = lay.states_at + (W - 1) * sb
    assert int.from_bytes(payload[at:at + sb], "little") == L
    assert _status(base, None, payload, 1) == 0
    assert _status(base, None, _put(payload, at, L + 1, sb), 1) == END


def test_the_wrong_variant_byte_never_decodes_silently_to_the_target():
    for variant in (0, 1):
        base, target, _, payload = _case(variant, False)
        s, pos, val = decode(K2.ulp2_decode, BF16, base, None, bytes([1 - variant]) + payload[1:], 5)
        assert s in STATUS
        if s == 0:
            out = base.copy()
            out[pos] = val
            assert not np.array_equal(out, target)


def test_output_arrays_too_small_are_refused():
    base, _, _, payload = _case(0, False)
    shift, mask, n_exp = C._ctx(BF16)
    args = (base, np.zeros(0, np.uint8), np.frombuffer(payload, np.uint8), 5, 16, C._kind(BF16), shift, mask, n_exp, 0)
    assert K2.ulp2_decode(*args, np.empty(4, np.int64), np.empty(5, np.uint16)) == SMALL
    assert K2.ulp2_decode(*args, np.empty(5, np.int64), np.empty(4, np.uint16)) == SMALL
    hist_args = (*args[:9], 1)
    assert K2.ulp2_decode(*hist_args, np.empty(5, np.int64), np.empty(5, np.uint16)) == SMALL  # states < n


@pytest.mark.parametrize("variant", [0, 1])
@pytest.mark.parametrize("hist", [False, True])
def test_every_single_byte_flip_is_refused_or_decodes_to_other_bits(variant, hist):
    base, target, states, payload = _case(variant, hist, n=24, m=4, seed=8)
    # The one kind of byte that carries nothing: the sign probability of a history state without changes
    # (no symbol reads it), which decodes to the target whatever it holds.
    pb = VARIANT[variant][5]
    idle: set[int] = set()
    if hist:
        used = {int(s) & 127 for s in states[np.flatnonzero(base != target)]}
        at = layout(payload, True).sign_at
        idle = {at + (t - 1) * pb + b for t in range(1, 7) if t not in used for b in range(pb)}
    for i in range(len(payload)):
        for x in (0x01, 0x80, 0xFF):
            bad = bytearray(payload)
            bad[i] ^= x
            s, pos, val = decode(K2.ulp2_decode, BF16, base, states, bytes(bad), 4)
            assert s in STATUS or s == 0, (i, x, s)
            if s == 0:
                assert np.all(np.diff(pos) > 0) and pos[0] >= 0 and pos[-1] < base.size
                assert np.all(val != base[pos])
                out = base.copy()
                out[pos] = val
                assert i in idle or not np.array_equal(out, target), (i, x)


def test_random_payloads_never_crash_the_decoder():
    rng = np.random.default_rng(0)
    base, _, states, _ = _case(0, True, n=64, m=6)
    seen = set()
    for trial in range(3000):
        n = int(rng.integers(0, 200))
        junk = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        if trial % 2:
            junk = bytes([trial % 4 // 2]) + junk  # a known variant, so the tables are parsed
        s = decode(K2.ulp2_decode, BF16, base, states if trial % 3 else None, junk, int(rng.integers(0, 8)))[0]
        assert s in STATUS or s == 0
        seen.add(s)
    assert {TRUNCATED, TABLE, VARIANT_BAD} <= seen


def test_decode_chunk_names_the_refusal_and_the_history():
    base, _, _, payload = _case(0, False)
    with pytest.raises(DecodeError, match="where: payload ends early"):
        C.decode_chunk(BF16, base, C.ULP2, payload[:-1], 5, 0, "where")
    with pytest.raises(DecodeError, match="lane does not end"):
        b1, _, _, p1 = _case(0, False, n=1, m=1)
        lay = layout(p1, False)
        C.decode_chunk(BF16, b1, C.ULP2, _put(p1, lay.states_at + 2, 257, 2), 1, 0, "where")
    with pytest.raises(DecodeError, match="decoded length"):
        C.decode_chunk(BF16, base, C.ULP2, payload, 5, 7, "where")
    hist = make_history(40, seed=3, frac=0.3)
    h_payload = hist.id + _case(0, True)[3]
    with pytest.raises(DecodeError, match="none is held here"):
        C.decode_chunk(BF16, base, C.ULP2_HIST, h_payload, 5, 0, "where")
    with pytest.raises(DecodeError, match="this decoder holds"):
        C.decode_chunk(BF16, base, C.ULP2_HIST, h_payload, 5, 0, "where", make_history(40, seed=4))
    with pytest.raises(DecodeError, match="too short"):
        C.decode_chunk(BF16, base, C.ULP2_HIST, h_payload[:10], 5, 0, "where", hist)
    C.decode_chunk(BF16, base, C.ULP2_HIST, h_payload, 5, 0, "where", hist)
