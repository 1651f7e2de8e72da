"""The native coder of format 2's ulp class (``_native.ulp2_encode`` / ``ulp2_decode``, ``codec/_ulp2.c``):
round trips on every width, kind, coder variant and encoding; every positions pass equal to the scalar
one; hostile payloads refused with the exact status and never a crash; an input written by another thread
while it is encoded; and, where codec.ulp2_kernels (numba) is present, the same bytes and decodes as it."""

from __future__ import annotations

import importlib
import threading

import numpy as np
import pytest

from deltarefit.codec import native

X = native.ext
pytestmark = pytest.mark.skipif(X is None or not hasattr(X, "ulp2_decode"), reason="native extension not built")

U = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
FLOAT_CTX = {8: (3, 15, 16), 16: (7, 255, 256), 32: (23, 255, 256), 64: (52, 2047, 2048)}
STATUSES = {-1, -4, -5, -6, -7, -8, -9, -10}
EMPTY = np.zeros(0, np.uint8)


def ctx_args(bits: int, kind: int) -> tuple[int, int, int]:
    return FLOAT_CTX[bits] if kind == 0 else (0, 0, 1)


def make_chunk(rng, bits: int, kind: int, n: int, rate: float, hist: bool):
    """(base, target, states): bf16-like weights for 16-bit floats, random bits otherwise; distances mostly
    small; history states 0..6 with flips where hist."""
    u = U[bits]
    if bits == 16 and kind == 0:
        base = (rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        base = rng.integers(0, 2**bits, n, dtype=np.uint64).astype(u)
    ch = rng.random(n) < rate
    d = rng.choice(np.array([1, -1, 1, -1, 2, -3, 17, -300], np.int64), int(ch.sum())).astype(np.uint64)
    tgt = base.copy()
    tgt[ch] = (base[ch].astype(np.uint64) + d).astype(u)
    states = EMPTY
    if hist:
        states = (rng.integers(0, 7, n) | (rng.integers(0, 2, n) << 7)).astype(np.uint8)
        states[(states & 127) == 0] = 0
    return base, tgt, states


def encode(base, tgt, states, bits, kind, hist, variant):
    shift, mask, ne = ctx_args(bits, kind)
    out = np.zeros(base.size * bits // 8 * 2 + 8192, np.uint8)
    m, nb = X.ulp2_encode(base, tgt, states, bits, kind, shift, mask, ne, int(hist), variant,
                          np.zeros(base.size, np.int32), out)
    return m, (out[:nb].copy() if nb > 0 else None)


def decode(base, states, pl, m, bits, kind, hist, digest=None):
    shift, mask, ne = ctx_args(bits, kind)
    pos, val = np.zeros(m, np.int64), np.zeros(m, U[bits])
    args = (base, states, pl, m, bits, kind, shift, mask, ne, int(hist), pos, val)
    st = X.ulp2_decode(*args) if digest is None else X.ulp2_decode(*args, digest)
    return st, pos, val


@pytest.fixture
def each_kernel():
    """Runs the body under every positions pass this machine has, restoring 'auto'."""
    def run(fn):
        try:
            for k in X.ulp2_kernels():
                X.ulp2_kernel(k)
                fn(k)
        finally:
            X.ulp2_kernel("auto")
    return run


@pytest.mark.parametrize("bits", [8, 16, 32, 64])
@pytest.mark.parametrize("kind", [0, 1, 2])
def test_every_width_and_kind_round_trips_in_both_variants_and_encodings_on_every_kernel(bits, kind, each_kernel):
    rng = np.random.default_rng(bits * 3 + kind)
    for hist in (False, True):
        for variant in (0, 1):
            for n, rate in ((4099, 0.04), (1500, 0.05), (1000, 0.3), (70, 1.0), (31, 0.1)):
                base, tgt, states = make_chunk(rng, bits, kind, n, rate, hist)
                m, pl = encode(base, tgt, states, bits, kind, hist, variant)
                exp = np.flatnonzero(base != tgt)
                assert m == exp.size
                if m == 0 or pl is None:  # nothing changed, or a table this variant cannot normalize
                    continue

                def check(k, base=base, states=states, pl=pl, m=m, exp=exp, tgt=tgt, hist=hist, variant=variant, n=n):
                    st, pos, val = decode(base, states, pl, m, bits, kind, hist)
                    assert st == 0, (k, bits, kind, hist, variant, n)
                    assert (pos == exp).all() and (val == tgt[exp]).all(), k
                each_kernel(check)


def test_an_unchanged_chunk_codes_to_nothing_and_a_bad_item_size_is_refused():
    base = np.arange(100, dtype=np.uint16)
    assert encode(base, base.copy(), EMPTY, 16, 0, False, 0) == (0, None)
    with pytest.raises(ValueError):
        X.ulp2_encode(base, base.astype(np.uint32), EMPTY, 16, 0, 7, 255, 256, 0, 0, np.zeros(100, np.int32),
                      np.zeros(1000, np.uint8))
    with pytest.raises(ValueError):
        X.ulp2_decode(base, EMPTY, np.zeros(10, np.uint8), 1, 16, 0, 7, 255, 256, 0, np.zeros(1, np.int64),
                      np.zeros(1, np.uint32))


def test_an_output_buffer_too_small_for_the_encoder_gives_minus_one():
    rng = np.random.default_rng(5)
    base, tgt, _ = make_chunk(rng, 16, 0, 4096, 0.05, False)
    m, pl = encode(base, tgt, EMPTY, 16, 0, False, 0)
    out = np.zeros(pl.size - 1, np.uint8)
    assert X.ulp2_encode(base, tgt, EMPTY, 16, 0, 7, 255, 256, 0, 0, np.zeros(4096, np.int32), out) == (m, -1)


def test_the_digest_move_is_the_one_digest_move_takes_over_the_decoded_changes():
    rng = np.random.default_rng(9)
    base, tgt, _ = make_chunk(rng, 16, 0, 8192, 0.05, False)
    m, pl = encode(base, tgt, EMPTY, 16, 0, False, 0)
    st, a0, a1 = decode(base, EMPTY, pl, m, 16, 0, False, digest=(12345, 77, 99))[0]
    _, pos, val = decode(base, EMPTY, pl, m, 16, 0, False)
    assert st == 0
    assert (a0, a1) == X.digest_move(base, pos, val, 2, 12345, 77, 99)


def _chunk_and_payload(seed=3, n=4096, rate=0.05, variant=0, hist=False):
    rng = np.random.default_rng(seed)
    base, tgt, states = make_chunk(rng, 16, 0, n, rate, hist)
    m, pl = encode(base, tgt, states, 16, 0, hist, variant)
    return base, tgt, states, m, pl


def _header_len(pl: np.ndarray, variant: int) -> tuple[int, int]:
    """(offset of the lane states, offset of the stream) of a ulp2 payload (16-bit elements, no history)."""
    pb = 1 if variant == 0 else 2
    o = 1

    def varint():
        nonlocal o
        v, s = 0, 0
        while True:
            b = int(pl[o])
            o += 1
            v |= (b & 0x7F) << s
            s += 7
            if not b & 0x80:
                return v
    g = varint()
    for _ in range(g):
        varint()
        o += pb
    for _ in range(g):
        k = int(pl[o])
        o += 1 + pb * (k - 1)
    w, sb = (32, 2) if variant == 0 else (16, 4)
    return o, o + w * sb


def test_hostile_payloads_are_refused_with_their_exact_status(each_kernel):
    base, _, _, m, pl = _chunk_and_payload()
    so, stream = _header_len(pl, 0)

    def check(k):
        def st(p, mm=m):
            return decode(base, EMPTY, np.asarray(p, np.uint8), mm, 16, 0, False)[0]
        assert st(pl) == 0
        bad = pl.copy()
        bad[0] = 2
        assert st(bad) == -7  # unknown coder variant
        assert st(np.concatenate([[0], [0]])) == -8  # G = 0
        assert st(np.concatenate([[0], [1], [0]])) == -1  # a table past the payload
        assert st(np.array([0, 1, 0x80, 0x00, 5], np.uint8)) == -8  # a non-minimal varint
        assert st(np.array([0, 1, 0, 0], np.uint8)) == -8  # p = 0
        assert st(np.array([0, 1, 0, 200, 0], np.uint8)) == -8  # K = 0
        assert st(np.array([0, 1, 0, 200, 17], np.uint8)) == -8  # K > w
        assert st(np.array([0, 1, 255, 200, 1], np.uint8)) == -8  # a context past the dtype's
        assert st(np.array([0, 1, 0, 200, 2, 0, 1], np.uint8)) in (-1, -8)
        assert st(np.array([0, 1, 0, 200, 3, 200, 56], np.uint8)) == -8  # stated frequencies sum to 2^M
        low = pl.copy()
        low[so:so + 2] = [255, 0]
        assert st(low) == -9  # a lane state below L
        assert st(pl[:stream]) in (-1,)  # the stream cut off whole
        assert st(pl[:-1]) == -1  # truncated by a byte
        assert st(np.concatenate([pl, [0]])) == -6  # trailing bytes
        assert st(pl, m + 1) == -4 and st(pl, m - 1) == -4  # another position count than the record's
        assert st(pl, 0) == -4 and st(pl[:-1], m - 1) == -4  # too many changes: refused at the first extra one
        ends = set()
        for lane in range(32):
            moved = pl.copy()
            x = int(moved[so + 2 * lane]) | int(moved[so + 2 * lane + 1]) << 8
            x = x + 1 if x < 65535 else x - 1
            moved[so + 2 * lane:so + 2 * lane + 2] = [x & 255, x >> 8]
            ends.add(st(moved))
        assert ends <= STATUSES | {0}
        # Lane 31 holds only elements of a context without changes (p = 0: no symbol) and no value (3
        # changes): its state is never touched, so one that is not L is refused at the end, and only there.
        b2 = np.full(64, 0x3F80, np.uint16)
        b2[31::32] = 0x0800
        t2 = b2.copy()
        t2[[1, 20, 40]] += 1
        m2, p2 = encode(b2, t2, EMPTY, 16, 0, False, 0)
        so2, _ = _header_len(p2, 0)
        assert decode(b2, EMPTY, p2, m2, 16, 0, False)[0] == 0
        p2[so2 + 62:so2 + 64] = [1, 1]  # lane 31: 257
        assert decode(b2, EMPTY, p2, m2, 16, 0, False)[0] == -10
    each_kernel(check)


def test_mutated_payloads_never_crash_and_decode_only_to_sane_outputs(each_kernel):
    rng = np.random.default_rng(11)
    cases = [_chunk_and_payload(seed=s, n=2048 + 37 * s, variant=s % 2, hist=bool(s & 2)) for s in range(4)]

    def check(k):
        for base, _tgt, states, m, pl in cases:
            hist = states.size > 0
            for trial in range(150):
                p = pl.copy()
                how = trial % 4
                if how == 0:
                    for _ in range(1 + trial % 3):
                        p[rng.integers(0, p.size)] ^= np.uint8(1 << rng.integers(0, 8))
                elif how == 1:
                    p = p[: rng.integers(0, p.size)]
                elif how == 2:
                    p[rng.integers(0, min(p.size, 80))] = rng.integers(0, 256)
                else:
                    p = np.concatenate([p, rng.integers(0, 256, rng.integers(1, 40)).astype(np.uint8)])
                st, pos, _ = decode(base, states, p, m, 16, 0, hist)
                assert st == 0 or st in STATUSES, st
                if st == 0:
                    assert (np.diff(pos) > 0).all() and pos[0] >= 0 and pos[-1] < base.size
    each_kernel(check)


def test_a_history_other_than_the_encoders_decodes_without_a_crash():
    base, tgt, states, m, pl = _chunk_and_payload(hist=True)
    other = np.roll(states, 5)
    st, pos, val = decode(base, other, pl, m, 16, 0, True)
    assert st in STATUSES or (st == 0 and not ((pos == np.flatnonzero(base != tgt)).all()
                                               and (val == tgt[pos]).all()))
    assert decode(base, np.full(base.size, 9, np.uint8), pl, m, 16, 0, True)[0] == -8  # a state past 6
    assert decode(base, states[:-1], pl, m, 16, 0, True)[0] == -5  # a history shorter than the chunk


def test_a_target_written_by_another_thread_while_it_is_encoded_never_crashes_the_encoder():
    rng = np.random.default_rng(2)
    base, tgt, states = make_chunk(rng, 16, 0, 1 << 16, 0.05, True)
    stop = threading.Event()

    def scribble():
        r = np.random.default_rng(3)
        while not stop.is_set():
            idx = r.integers(0, tgt.size, 64)
            tgt[idx] ^= r.integers(0, 1 << 16, 64).astype(np.uint16)
            base[idx[:8]] ^= np.uint16(0x7F80)  # exponents jump: contexts appear and vanish
    t = threading.Thread(target=scribble)
    t.start()
    try:
        for it in range(40):
            m, nb = X.ulp2_encode(base, tgt, states, 16, 0, 7, 255, 256, it % 2, (it // 2) % 2,
                                  np.zeros(base.size, np.int32), np.zeros(1 << 18, np.uint8))
            assert 0 <= m <= base.size and -1 <= nb <= 1 << 18
    finally:
        stop.set()
        t.join()


def _numba_module():
    for name in ("deltarefit.codec.ulp2_kernels", "deltarefit.codec.ulp2_encode_kernels"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "ulp2_encode"):
            return mod
    return None


def _structured_bf16(rng, n: int, rate: float):
    """bf16 weights whose change rate doubles per exponent step down (as AdamW steps change them)."""
    base = (rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    e = ((base >> 7) & 0xFF).astype(np.float64)
    w = np.exp2(np.median(e) - e)
    ch = rng.random(n) < np.minimum(0.9, rate * w / np.minimum(0.9, w).mean())
    d = rng.choice(np.array([1, -1, 1, -1, 2, -2, 5, -40], np.int64), int(ch.sum()))
    key = np.where(base & 0x8000, 0xFFFF - base.astype(np.int64), base.astype(np.int64) | 0x8000)
    k2 = (key[ch] + d) & 0xFFFF
    tgt = base.copy()
    tgt[ch] = np.where(k2 & 0x8000, k2 ^ 0x8000, 0xFFFF - k2).astype(np.uint16)
    return base, tgt


def _equal_to_numba(cases) -> None:
    nk = _numba_module()
    if nk is None:
        pytest.skip("codec.ulp2_kernels (numba) not present in this tree")
    dec = getattr(nk, "ulp2_decode", None)
    for base, tgt, states, bits, kind, hist in cases:
        shift, mask, ne = ctx_args(bits, kind)
        for variant in (0, 1):
            outs = []
            for f in (X.ulp2_encode, nk.ulp2_encode):
                out = np.zeros(base.size * bits // 8 * 2 + 8192, np.uint8)
                pos = np.zeros(base.size, np.int32)
                m, nb = f(base, tgt, states, bits, kind, shift, mask, ne, hist, variant, pos, out)
                outs.append((m, nb, out[:max(nb, 0)].tobytes(), pos[:m].tobytes()))
            assert outs[0] == outs[1], (bits, kind, hist, variant)
            m, nb = outs[0][:2]
            if dec is None or nb <= 0:
                continue
            pl = np.frombuffer(outs[0][2], np.uint8)
            for p in (pl, pl[:-1], np.concatenate([pl, np.zeros(1, np.uint8)])):
                got = [decode(base, states, p, m, bits, kind, hist)]
                pos, val = np.zeros(m, np.int64), np.zeros(m, U[bits])
                st = dec(base, states, p, m, bits, kind, shift, mask, ne, hist, pos, val)
                got.append((st, pos, val))
                assert got[0][0] == got[1][0]
                if st == 0:
                    assert (got[0][1] == got[1][1]).all() and (got[0][2] == got[1][2]).all()


def _states(rng, n: int) -> np.ndarray:
    s = (rng.integers(0, 7, n) | (rng.integers(0, 2, n) << 7)).astype(np.uint8)
    s[(s & 127) == 0] = 0
    return s


def test_the_native_bytes_and_decodes_equal_numbas_on_bf16_chunks_with_and_without_history():
    rng = np.random.default_rng(21)
    cases = []
    for rate in (0.005, 0.035, 0.2):
        base, tgt = _structured_bf16(rng, 1 << 14, rate)
        cases += [(base, tgt, EMPTY, 16, 0, 0), (base, tgt, _states(rng, base.size), 16, 0, 1)]
    base, tgt, states = make_chunk(rng, 16, 0, 3000, 0.05, True)  # random distances, random states
    cases += [(base, tgt, states, 16, 0, 1)]
    _equal_to_numba(cases)


@pytest.mark.slow
def test_the_native_bytes_and_decodes_equal_numbas_on_every_width_and_kind():
    """Slow on a fresh numba cache: a compile of numba's kernels per element width."""
    rng = np.random.default_rng(22)
    cases = []
    for bits in (8, 16, 32, 64):
        for kind in (0, 1, 2):
            base, tgt, states = make_chunk(rng, bits, kind, 3000, 0.05, True)
            cases += [(base, tgt, EMPTY, bits, kind, 0), (base, tgt, states, bits, kind, 1)]
    _equal_to_numba(cases)
