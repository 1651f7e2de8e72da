"""The native kernels of encoding 5 (``ulp_hist``) against numba's: ``_native.encode_hist16`` writes the
bytes of ``kernels.hist_scan`` + ``kernels.ulp_encode_core``, and ``_native.decode_hist`` gives the
positions, values and status of ``kernels.hist_decode`` for every payload, history and table, valid or
hostile, without a read or write outside its buffers. Encoding 1's bytes stay pinned by test_native.py
and test_vectors.py (the coder is shared)."""

from __future__ import annotations

import numpy as np
import pytest
from _fuzz import N_MUTATIONS, mutate
from test_native import simd  # noqa: F401 (the fixture: the native scan element by element, or with AVX-512)
from test_native_decode import _base, _guarded, _target  # (skips this module too where native is missing)

from deltarefit.codec import chunk as C
from deltarefit.codec import kernels as K
from deltarefit.codec import native as NAT
from deltarefit.codec.history import (
    N_STATES,
    QDEPTH,
    STATE_TABLE,
    History,
    Moves,
    context_map,
    moves_of_changes,
    moves_of_images,
)
from deltarefit.dtypes import dtype
from deltarefit.errors import DecodeError

N = NAT.ext
FLOATS = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
WIDTH16 = ("BF16", "F16", "I16", "U16")


def _hist(n: int, rng, rate: float) -> np.ndarray:
    """A history byte per element: state 0 for most, the others (flip bits included) at ``rate``."""
    h = np.zeros(n, np.uint8)
    idx = np.flatnonzero(rng.random(n) < rate)
    h[idx] = STATE_TABLE[rng.integers(0, 27, idx.size)]
    return h


def _model(dt):
    shift, mask, n_exp = C._ctx(dt)
    cmap, cstate = context_map(n_exp)
    return shift, mask, n_exp, cmap, cstate


def _encode_numba(dt, base, target, hist, room: int = 0):
    """(m, nbytes, payload) of numba's encoding-5 coder (payload without the history id)."""
    n = base.size
    shift, mask, n_exp, cmap, cstate = _model(dt)
    bufs = C._scan_buffers(n, base.dtype, False)
    flip = np.zeros(n, np.uint8)
    m = K.hist_scan(base, target, hist, cmap, shift, mask, n_exp, cstate.size, *bufs, flip)
    out = np.zeros(room or C.max_payload_len(dt, n) + 64, np.uint8)
    nb = 0
    if m:
        nb = K.ulp_encode_core(bufs[1][:m], bufs[2][:m], bufs[3][:m], bufs[4][:m], dt.bits, C._kind(dt), cstate.size,
                               cstate, N_STATES, QDEPTH, flip[:m], out)
    return m, nb, out[:max(nb, 0)].tobytes()


def _encode_native(dt, base, target, hist, room: int = 0):
    n = base.size
    shift, mask, n_exp, cmap, cstate = _model(dt)
    bufs = C._scan_buffers(n, base.dtype, False)
    flip = np.zeros(n, np.uint8)
    out = np.zeros(room or C.max_payload_len(dt, n) + 64, np.uint8)
    m, nb = N.encode_hist16(base, target, hist, cmap, shift, mask, n_exp, cstate.size, *bufs, flip, dt.bits,
                            C._kind(dt), cstate, N_STATES, QDEPTH, out)
    return m, nb, out[:max(nb, 0)].tobytes()


def _both(dt, base, hist, payload, n_changed, cmap=None, cstate=None, n_states=N_STATES, qdepth=QDEPTH, out=None):
    """(status, positions, values) from numba and from native."""
    shift, mask, n_exp, cm0, cs0 = _model(dt)
    cmap = cm0 if cmap is None else cmap
    cstate = cs0 if cstate is None else cstate
    size = max(n_changed if out is None else out, 0)
    res = []
    for native in (False, True):
        pos, val = np.zeros(size, np.int64), np.zeros(size, dt.uint)
        if native:
            st = N.decode_hist(base, hist, payload, n_changed, dt.itemsize, dt.bits, C._kind(dt), shift, mask, n_exp,
                               cmap, cstate, n_states, qdepth, pos, val)
        else:
            st = K.hist_decode(base, hist, np.frombuffer(payload, np.uint8), n_changed, dt.bits, C._kind(dt), shift,
                               mask, n_exp, cmap, cstate, n_states, qdepth, pos, val)
        res.append((st, pos, val))
    return res


def _agree(dt, base, hist, payload, n_changed, **kw) -> int:
    (sk, pk, vk), (sn, pn, vn) = _both(dt, base, hist, payload, n_changed, **kw)
    assert sn == sk, (sn, sk)
    if sk == 0:
        np.testing.assert_array_equal(pn, pk)
        np.testing.assert_array_equal(vn, vk)
    return sk


def _case(name: str, n: int, rate: float, hrate: float, seed: int, kind: str = "weights", steps: str = "small"):
    rng = np.random.default_rng(seed)
    dt = dtype(name)
    base = _base(dt, n, rng, kind)
    return dt, base, _target(dt, base, rng, rate, steps), _hist(n, rng, hrate)


@pytest.mark.usefixtures("simd")
@pytest.mark.parametrize("name", WIDTH16)
def test_native_encoder_writes_numbas_bytes(name):
    rng = np.random.default_rng(7)
    for trial in range(40):
        n = int(rng.integers(1, 6000))
        dt, base, target, hist = _case(name, n, float(rng.choice([0.001, 0.03, 0.3, 1.0])),
                                       float(rng.choice([0.0, 0.1, 0.5, 1.0])), 100 + trial,
                                       "weights" if trial % 3 else "uniform", "small" if trial % 4 else "random")
        want = _encode_numba(dt, base, target, hist)
        assert want[1] > 0
        assert _encode_native(dt, base, target, hist) == want


@pytest.mark.usefixtures("simd")
@pytest.mark.parametrize("name", ["BF16", "F16"])
def test_native_encoder_on_whole_chunks_with_a_realistic_history(name):
    """Whole 1 MiB chunks, most elements in state 0 and a tenth with a recent move (the vector scan's
    window holds state 0's contexts, the rest is counted one by one), exponents outside the window too."""
    rng = np.random.default_rng(11)
    for trial, (rate, hrate) in enumerate([(0.035, 0.1), (0.005, 0.3), (0.3, 0.05)]):
        dt, base, target, hist = _case(name, (1 << 19) + 17 * trial, rate, hrate, 200 + trial)
        base[:: 97] = _base(dt, base[:: 97].size, rng, "uniform")  # exponents far from the window
        want = _encode_numba(dt, base, target, hist)
        assert want[1] > 0
        assert _encode_native(dt, base, target, hist) == want


def test_native_encoder_nothing_changed_and_out_too_small():
    dt, base, target, hist = _case("BF16", 3000, 0.05, 0.2, 3)
    assert _encode_native(dt, base, base.copy(), hist) == (0, 0, b"")
    m, nb, _ = _encode_numba(dt, base, target, hist)
    for room in (9, nb // 2, nb - 1):
        assert _encode_native(dt, base, target, hist, room)[:2] == _encode_numba(dt, base, target, hist, room)[:2] \
            == (m, -5)
    assert _encode_native(dt, base, target, hist, nb)[1] == nb


def test_native_encoder_refuses_bad_tables_and_histories():
    dt, base, target, hist = _case("BF16", 500, 0.05, 0.2, 4)
    shift, mask, n_exp, cmap, cstate = _model(dt)
    bufs = C._scan_buffers(base.size, base.dtype, False)
    flip = np.zeros(base.size, np.uint8)
    out = np.zeros(1 << 16, np.uint8)

    def enc(h=hist, cm=cmap, cs=cstate, nctx=cstate.size, b=base):
        return N.encode_hist16(b, target, h, cm, shift, mask, n_exp, nctx, *bufs, flip, 16, 0, cs, N_STATES, QDEPTH,
                               out)

    bad_h = hist.copy()
    bad_h[17] = N_STATES
    bad_cm = cmap.copy()
    bad_cm[5] = cstate.size
    bad_cs = cstate.copy()
    bad_cs[9] = N_STATES
    for kw in ({"h": bad_h}, {"cm": bad_cm}, {"cs": bad_cs}):
        with pytest.raises(ValueError, match="out of range"):
            enc(**kw)
    with pytest.raises(ValueError, match="hist holds"):
        enc(h=hist[:-1])
    with pytest.raises(ValueError, match="differ in length"):
        enc(h=np.concatenate([hist, hist[:1]]))
    with pytest.raises(ValueError, match="holds"):
        enc(cm=cmap[:-1])
    with pytest.raises(BufferError):
        enc(b=np.zeros(base.size + 1, np.uint16).view(np.uint8)[1:-1].view(np.uint16))
    assert enc()[0] == int(np.count_nonzero(base != target))


@pytest.mark.parametrize("name", (*FLOATS, "I32", "U8", "I16"))
def test_decoders_agree_and_are_right_on_every_width(name):
    rng = np.random.default_rng(8)
    for trial in range(12):
        n = int(rng.integers(1, 4000))
        dt, base, target, hist = _case(name, n, float(rng.choice([0.002, 0.05, 0.4])),
                                       float(rng.choice([0.0, 0.1, 0.6])), 200 + trial,
                                       "weights" if trial % 3 else "uniform", "small" if trial % 4 else "random")
        m, nb, payload = _encode_numba(dt, base, target, hist, room=base.size * 24 + (1 << 17))
        assert nb > 0
        assert _agree(dt, base, hist, payload, m) == 0
        pos, val = _both(dt, base, hist, payload, m)[1][1:]
        np.testing.assert_array_equal(pos, np.flatnonzero(base != target))  # and both are right
        np.testing.assert_array_equal(val, target[pos])


def _payloads():
    out = []
    for i, (name, n, rate, hrate, kind) in enumerate((
            ("BF16", 3000, 0.03, 0.1, "weights"), ("BF16", 700, 0.3, 0.5, "uniform"), ("F16", 1500, 0.05, 0.2, "weights"),
            ("F32", 900, 0.05, 0.3, "weights"), ("F8_E4M3", 800, 0.1, 0.3, "uniform"), ("F64", 300, 0.1, 0.5, "weights"),
            ("I32", 600, 0.05, 0.3, "uniform"))):
        dt, base, target, hist = _case(name, n, rate, hrate, 300 + i, kind)
        m, nb, payload = _encode_numba(dt, base, target, hist)
        assert nb > 0
        out.append((dt, base, hist, payload, m))
    return out


PAYLOADS = _payloads()


def test_every_truncation_is_refused_alike():
    seen = set()
    for dt, base, hist, payload, m in PAYLOADS:
        for cut in range(len(payload)):
            st = _agree(dt, base, hist, payload[:cut], m)
            assert st != 0
            seen.add(st)
        assert _agree(dt, base, hist, payload + b"\x00", m) == -6
        seen.add(_agree(dt, base, hist, payload, m + 1))
        seen.add(_agree(dt, base, hist, payload, m - 1))
    assert {-1, -2} <= seen, seen


def test_bit_flips_and_garbage_get_the_same_status_and_output():
    # Seeded: single and multiple bit flips, spliced tails, garbage behind a plausible rc_len, raw parts
    # of mostly zero bits (long unary runs past the qdepth decisions), wrong change counts, and
    # histories other than the one coded against (a flip in one element's state).
    rng = np.random.default_rng(2027)
    seen: dict[int, int] = {}
    for it in range(3000):
        dt, base, hist, payload, m = PAYLOADS[it % len(PAYLOADS)]
        how = it % 7
        if how < N_MUTATIONS:
            b = mutate(rng, payload, how)
        else:  # the payload kept, the history other than the one coded against (one element's state)
            b = bytearray(payload)
            hist = hist.copy()
            k = int(rng.integers(hist.size))
            hist[k] = STATE_TABLE[int(rng.integers(27))]
        nc = m if it % 5 else int(rng.integers(-1, base.size + 2))
        st = _agree(dt, base, hist, bytes(b), nc)
        seen[st] = seen.get(st, 0) + 1
    assert {0, -1, -2, -3, -4, -6} <= set(seen), seen


def test_hostile_histories_and_tables_get_the_same_status():
    dt, base, hist, payload, m = PAYLOADS[0]
    _, _, _, cmap, cstate = _model(dt)
    rng = np.random.default_rng(9)
    for _ in range(50):  # a state at or past n_states, anywhere, flip bit or not
        h = hist.copy()
        h[int(rng.integers(h.size))] = int(rng.integers(N_STATES, 128)) | (128 * int(rng.integers(2)))
        assert _agree(dt, base, h, payload, m) == -2
    assert _agree(dt, base, hist[:-1], payload, m) == -4  # a history of another length
    assert _agree(dt, base, np.concatenate([hist, hist[:1]]), payload, m) == -4
    for bad in (-1, cstate.size, 1 << 30):
        cm = cmap.copy()
        cm[int(rng.integers(cm.size))] = bad
        assert _agree(dt, base, hist, payload, m, cmap=cm) == -2
    for bad in (-1, N_STATES):
        cs = cstate.copy()
        cs[int(rng.integers(cs.size))] = bad
        assert _agree(dt, base, hist, payload, m, cstate=cs) == -2
    assert _agree(dt, base, hist, payload, m, cmap=cmap[:-1]) == -2  # too short for n_states * n_exp
    assert _agree(dt, base, hist, payload, m, cstate=cstate[:0]) == -2
    assert _agree(dt, base, hist, payload, m, n_states=0) == -2
    assert _agree(dt, base, hist, payload, m, qdepth=0) == -2
    # Tables that are in range but not the ones coded against: a different model, same status.
    for qd in (1, 2, 3, QDEPTH + 5):
        _agree(dt, base, hist, payload, m, qdepth=qd)
    cs = np.zeros_like(cstate)
    _agree(dt, base, hist, payload, m, cstate=cs)
    cm = rng.integers(0, cstate.size, cmap.size).astype(np.int32)
    _agree(dt, base, hist, payload, m, cmap=cm)
    assert _agree(dt, base, hist, payload, m, out=m - 1) == -4


def test_nothing_is_read_or_written_past_the_buffers():
    # Base, history, payload and both outputs each end at a guard page (test_native_decode's, whose
    # faulting is tested there): valid payloads, truncations and flips; a base at an odd address.
    rng = np.random.default_rng(6)
    maps = []
    for dt, base, hist, payload, m in PAYLOADS[:3] + PAYLOADS[4:5]:
        shift, mask, n_exp, cmap, cstate = _model(dt)
        for odd in (0, 1):
            mb, ob = _guarded(base.nbytes + odd)
            mh, oh = _guarded(hist.size)
            mo, oo = _guarded(m * 8)
            mv, ov = _guarded(m * dt.itemsize)
            maps += [mb, mh, mo, mv]
            gbase = np.frombuffer(mb, np.uint8, base.nbytes, ob + odd).view(dt.uint)
            gbase[:] = base
            ghist = np.frombuffer(mh, np.uint8, hist.size, oh)
            ghist[:] = hist
            pos = np.frombuffer(mo, np.int64, m, oo)
            val = np.frombuffer(mv, dt.uint, m, ov)
            cases = [payload] + [payload[:k] for k in range(0, len(payload), max(1, len(payload) // 40))]
            for _ in range(40):
                b = bytearray(payload)
                b[int(rng.integers(len(b)))] ^= 1 << int(rng.integers(8))
                cases.append(bytes(b))
            for case in cases:
                mp, op = _guarded(len(case))
                maps.append(mp)
                mp[op:op + len(case)] = case
                gp = np.frombuffer(mp, np.uint8, len(case), op)
                st = N.decode_hist(gbase, ghist, gp, m, dt.itemsize, dt.bits, C._kind(dt), shift, mask, n_exp, cmap,
                                   cstate, N_STATES, QDEPTH, pos, val)
                (sk, pk, vk), _ = _both(dt, base, hist, case, m)
                assert st == sk
                if st == 0:
                    np.testing.assert_array_equal(pos, pk)
                    np.testing.assert_array_equal(val, vk)
                del gp
            del gbase, ghist, pos, val


def test_bad_parameters_raise():
    dt, base, hist, payload, m = PAYLOADS[0]
    shift, mask, n_exp, cmap, cstate = _model(dt)
    pos, val = np.zeros(m, np.int64), np.zeros(m, np.uint16)
    with pytest.raises(ValueError, match="out of range"):
        N.decode_hist(base, hist, payload, m, 3, 16, 0, shift, mask, n_exp, cmap, cstate, N_STATES, QDEPTH, pos, val)
    with pytest.raises(ValueError, match="out of range"):
        N.decode_hist(base, hist, payload, m, 2, 16, 0, 16, mask, n_exp, cmap, cstate, N_STATES, QDEPTH, pos, val)
    with pytest.raises(BufferError):
        N.decode_hist(base, hist, payload, m, 2, 16, 0, shift, mask, n_exp, cmap, cstate, N_STATES, QDEPTH,
                      np.zeros(m + 1, np.int64).view(np.uint8)[4:-4], val)


def _chunk_history(dt, base, rng, rate: float) -> History:
    """A history from three random earlier versions' moves over the chunk."""
    moves = []
    for _ in range(3):
        pos = np.flatnonzero(rng.random(base.size) < rate)
        moves.append(Moves(base.size, pos, rng.random(pos.size) < 0.5))
    return History.from_moves(base.size, moves)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("name", (*FLOATS, "I16"))
def test_chunk_round_trip_with_history(monkeypatch, name, native):
    monkeypatch.setattr(NAT, "USE_NATIVE", native)
    rng = np.random.default_rng(10)
    dt = dtype(name)
    kinds = set()
    for trial in range(6):
        n = int(rng.integers(50, 5000))
        base = _base(dt, n, rng, "weights")
        target = _target(dt, base, rng, 0.03, "small")
        # The history predicts this version's moves: the elements it moved are mostly the ones that
        # move now, in the same direction (the case ulp_hist is for).
        moved = np.flatnonzero(base != target)
        keep = moved[rng.random(moved.size) < 0.8]
        hist = History.from_moves(n, [moves_of_changes(dt, n, keep, base[keep], target[keep])] * 2) if trial % 2 \
            else _chunk_history(dt, base, rng, 0.03)
        enc = C.encode_chunk(dt, base, target, hist)
        assert enc is not None
        kinds.add(enc.encoding)
        patch = C.decode_chunk(dt, base, enc.encoding, enc.payload, enc.n_changed, enc.decoded_len, "t", hist)
        out = base.copy()
        patch.apply_to(out)
        np.testing.assert_array_equal(out, target)
        h = C.encode_hist(dt, base, target, hist)
        patch = C.decode_chunk(dt, base, C.ULP_HIST, h.payload, h.n_changed, 0, "t", hist)
        out = base.copy()
        patch.apply_to(out)
        np.testing.assert_array_equal(out, target)
        other = _chunk_history(dt, base, rng, 0.05)
        with pytest.raises(DecodeError, match="coded against history"):
            C.decode_chunk(dt, base, C.ULP_HIST, h.payload, h.n_changed, 0, "t", other)
    assert C.ULP_HIST in kinds


@pytest.mark.parametrize("name", ("BF16", "F32"))
def test_chunk_paths_write_the_same_bytes_and_messages(monkeypatch, name):
    rng = np.random.default_rng(12)
    dt = dtype(name)
    base = _base(dt, 4096, rng, "weights")
    target = _target(dt, base, rng, 0.03, "small")
    hist = _chunk_history(dt, base, rng, 0.03)
    got = {}
    for native in (True, False):
        monkeypatch.setattr(NAT, "USE_NATIVE", native)
        h = C.encode_hist(dt, base, target, hist)
        bad = bytearray(h.payload)
        bad[len(bad) // 2] ^= 0x10
        try:
            C.decode_chunk(dt, base, C.ULP_HIST, bytes(bad), h.n_changed, 0, "t", hist)
            msg = None
        except DecodeError as e:
            msg = str(e)
        got[native] = (h, msg)
    assert got[True] == got[False]


def test_misaligned_views_fall_back_to_numba():
    rng = np.random.default_rng(13)
    dt = dtype("BF16")
    base = _base(dt, 3000, rng, "weights")
    target = _target(dt, base, rng, 0.03, "small")
    hist = _chunk_history(dt, base, rng, 0.03)
    want = C.encode_hist(dt, base, target, hist)
    raw = np.zeros(base.nbytes * 2 + 2, np.uint8)
    mb = raw[1:1 + base.nbytes].view(np.uint16)  # odd address: numpy allows the view, native refuses it
    mb[:] = base
    assert mb.ctypes.data % 2
    assert C.encode_hist(dt, mb, target, hist) == want


# decode_hist's split positions pass for 16-bit floats (state 0 through decode_ulp's block passes over a
# copy of the base, the other states one by one) and its fallbacks, on every positions pass this
# machine runs ("scalar" is numba's countdown over every element).
KERNELS = N.decode_kernels()


@pytest.fixture(params=KERNELS)
def kernel(request):
    was = N.decode_kernel(request.param)
    yield request.param
    N.decode_kernel(was)


def _versions(dt, n: int, rng):
    """(base, target, states) of a chunk from a chain of five versions in which about 30% of the
    elements moved by a version move again in the next (the benchmark's shape): a real history."""
    versions = [_base(dt, n, rng, "weights")]
    prev = np.flatnonzero(rng.random(n) < 0.03)
    for _ in range(4):
        idx = np.union1d(prev[rng.random(prev.size) < 0.3], np.flatnonzero(rng.random(n) < 0.022))
        t = versions[-1].copy()
        t[idx] = (t[idx].astype(np.int64) + rng.choice(np.array([1, -1, 2, -2]), idx.size, p=[.45, .45, .05, .05])
                  ).astype(dt.uint)
        versions.append(t)
        prev = idx
    hist = History.from_moves(n, [moves_of_images(dt, versions[k], versions[k + 1]) for k in (2, 1, 0)])
    return versions[3], versions[4], hist.states().copy()


def _right(dt, base, target, hist, payload, m):
    """Both decoders agree, succeed, and give the chunk's changes."""
    assert _agree(dt, base, hist, payload, m) == 0
    pos, val = _both(dt, base, hist, payload, m)[1][1:]
    np.testing.assert_array_equal(pos, np.flatnonzero(base != target))
    np.testing.assert_array_equal(val, target[pos])


def _state0_exponents_changed(dt, base, target, hist) -> set[int]:
    shift, mask, _, _, _ = _model(dt)
    moved = (base != target) & ((hist & 127) == 0)
    return set(((base[moved] >> shift) & mask).tolist())


@pytest.mark.parametrize("name", ("BF16", "F16"))
@pytest.mark.parametrize("n", ((1 << 19) - 13, 1 << 18))
def test_split_pass_on_realistic_chunks(kernel, name, n):
    # Half-MiB and 1-MiB chunks (one of them not a whole number of 64-element blocks) with a history
    # from a chain of versions: a state-0 exponent group is empty (the split applies), states 1..6
    # hold a fair share of the changes, and every flip bit is exercised.
    dt = dtype(name)
    rng = np.random.default_rng(n + len(name))
    base, target, hist = _versions(dt, n, rng)
    _, mask, _, _, _ = _model(dt)
    assert len(_state0_exponents_changed(dt, base, target, hist)) <= mask  # an empty state-0 group
    moved = np.flatnonzero(base != target)
    other = np.count_nonzero(hist[moved] & 127)
    assert 0.1 * moved.size < other < 0.9 * moved.size
    assert np.count_nonzero(hist[moved] >> 7) > 0
    m, nb, payload = _encode_numba(dt, base, target, hist)
    assert nb > 0 and m == moved.size
    _right(dt, base, target, hist, payload, m)
    # Refusals: flips (ranks beyond their context among them), wrong counts and a history other than
    # the one coded against, status for status.
    seen = set()
    for it in range(60):
        b = bytearray(payload)
        h, nc = hist, m
        if it % 3 == 0:
            k = int(rng.integers(len(b) * 8))
            b[k // 8] ^= 1 << (k % 8)
        elif it % 3 == 1:
            h = hist.copy()
            h[rng.integers(n, size=int(rng.integers(1, 40)))] = STATE_TABLE[int(rng.integers(27))]
        else:
            nc = m + int(rng.choice([-2, -1, 1, 2]))
        seen.add(_agree(dt, base, h, bytes(b), nc))
    assert -3 in seen or -4 in seen, seen


@pytest.mark.parametrize("name", ("BF16", "F16"))
def test_every_state0_group_with_changes_falls_back(kernel, name):
    # Exponents uniform: every one of the state-0 exponent groups holds changes, so no exponent is free
    # to park the other states' elements on and the countdown over every element runs. Then the same
    # chunk with one group emptied (its changes undone): the split runs, with that exponent as e*,
    # whose state-0 elements are still there, now among the other states' parked ones.
    dt = dtype(name)
    rng = np.random.default_rng(31)
    n = 60000 if name == "BF16" else 9000
    base = _base(dt, n, rng, "uniform")
    target = _target(dt, base, rng, 0.1, "small")
    hist = _hist(n, rng, 0.1)
    _, mask, _, _, _ = _model(dt)
    assert _state0_exponents_changed(dt, base, target, hist) == set(range(mask + 1))
    m, _, payload = _encode_numba(dt, base, target, hist)
    _right(dt, base, target, hist, payload, m)
    for _ in range(30):
        b = bytearray(payload)
        k = int(rng.integers(len(b) * 8))
        b[k // 8] ^= 1 << (k % 8)
        _agree(dt, base, hist, bytes(b), m)
    shift = _model(dt)[0]
    free = 7
    undo = ((base >> shift) & mask == free) & ((hist & 127) == 0)
    assert np.count_nonzero(undo & (base == target)) > 0
    target = np.where(undo, base, target)
    assert _state0_exponents_changed(dt, base, target, hist) == set(range(mask + 1)) - {free}
    m, _, payload = _encode_numba(dt, base, target, hist)
    _right(dt, base, target, hist, payload, m)


def test_tables_the_split_cannot_take_and_ones_it_can():
    # cmap in range but not context_map's: state 0 not the identity, or another state's contexts among
    # state 0's (both: the countdown over every element), or another state's contexts permuted above
    # state 0's (the split, with contexts it was not coded with). Numba's status, and its output.
    dt = dtype("BF16")
    rng = np.random.default_rng(41)
    base, target, hist = _versions(dt, 1 << 16, rng)
    _, _, n_exp, cmap, _ = _model(dt)
    m, _, payload = _encode_numba(dt, base, target, hist)
    for kern in KERNELS:
        was = N.decode_kernel(kern)
        try:
            _right(dt, base, target, hist, payload, m)
            swap0 = cmap.copy()
            swap0[[120, 121]] = swap0[[121, 120]]
            into0 = cmap.copy()
            into0[2 * n_exp + 119] = 119
            perm = cmap.copy()
            perm[n_exp:] = n_exp + rng.permutation(cmap.size - n_exp)
            for cm in (swap0, into0, perm):
                _agree(dt, base, hist, payload, m, cmap=cm.astype(np.int32))
        finally:
            N.decode_kernel(was)


def test_split_pass_reads_and_writes_nothing_past_the_buffers(kernel):
    # A realistic chunk of a length that leaves a partial last block, base (at an odd address too),
    # history, payload and outputs each ending at a guard page.
    rng = np.random.default_rng(43)
    for name in ("BF16", "F16"):
        dt = dtype(name)
        base, target, hist = _versions(dt, 40000 + 37, rng)
        shift, mask, n_exp, cmap, cstate = _model(dt)
        m, _, payload = _encode_numba(dt, base, target, hist)
        maps = []
        for odd in (0, 1):
            mb, ob = _guarded(base.nbytes + odd)
            mh, oh = _guarded(hist.size)
            mo, oo = _guarded(m * 8)
            mv, ov = _guarded(m * dt.itemsize)
            mp, op = _guarded(len(payload))
            maps += [mb, mh, mo, mv, mp]
            gbase = np.frombuffer(mb, np.uint8, base.nbytes, ob + odd).view(dt.uint)
            gbase[:] = base
            ghist = np.frombuffer(mh, np.uint8, hist.size, oh)
            ghist[:] = hist
            mp[op:op + len(payload)] = payload
            gp = np.frombuffer(mp, np.uint8, len(payload), op)
            pos = np.frombuffer(mo, np.int64, m, oo)
            val = np.frombuffer(mv, dt.uint, m, ov)
            st = N.decode_hist(gbase, ghist, gp, m, dt.itemsize, dt.bits, C._kind(dt), shift, mask, n_exp, cmap,
                               cstate, N_STATES, QDEPTH, pos, val)
            assert st == 0
            np.testing.assert_array_equal(pos, np.flatnonzero(base != target))
            np.testing.assert_array_equal(val, target[pos])
            del gbase, ghist, gp, pos, val


def _merge_sets(rng, n: int, rates: tuple[float, float, float]):
    """Three change sets of a chunk of ``n`` elements as records hold them (uint32 positions, packed down
    flags of at least one byte), at ``rates`` (0: no move)."""
    from deltarefit.codec.history import _NO_MOVE

    sets = []
    for r in rates:
        if r == 0:
            sets += list(_NO_MOVE)
            continue
        pos = np.flatnonzero(rng.random(n) < r).astype("<u4")
        down = np.packbits(rng.random(pos.size) < 0.5, bitorder="little")
        sets += [pos, down if down.size else np.zeros(1, np.uint8)]
    return sets


def _merged(kern, sets, n):
    total = sum(p.size for p in sets[::2]) + 1
    outs = np.empty(total, np.int64), np.empty(total, np.uint32), np.empty(total, np.uint8)
    k = kern(*sets, n, STATE_TABLE, *outs)
    return k, tuple(o[:max(k, 0)] for o in outs)


@pytest.mark.parametrize("rates", [(0.03, 0.03, 0.03), (0.3, 0.0, 0.1), (0.0, 0.0, 0.0), (0.9, 0.9, 0.9),
                                   (0.001, 0.5, 0.0)])
def test_native_merge_of_records_gives_numbas_histories(rates):
    from deltarefit.codec.history_kernels import merge_records

    rng = np.random.default_rng(11)
    for n in (1, 7, 1000, 1 << 17):
        sets = _merge_sets(rng, n, rates)
        k, got = _merged(N.merge_records, sets, n)
        kn, want = _merged(merge_records, sets, n)
        assert k == kn >= 0
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


def test_native_merge_refuses_what_numba_refuses_and_bad_buffers():
    from deltarefit.codec.history_kernels import merge_records

    rng = np.random.default_rng(12)
    n = 5000
    for d in range(3):
        for bad in ("repeat", "descend", "past the end"):
            sets = _merge_sets(rng, n, (0.05, 0.05, 0.05))
            p = sets[2 * d].copy()
            if bad == "repeat":
                p[3] = p[2]
            elif bad == "descend":
                p[[4, 5]] = p[[5, 4]]
            else:
                p[-1] = n
            sets[2 * d] = p
            assert _merged(N.merge_records, sets, n)[0] == _merged(merge_records, sets, n)[0] == -(1 + d)
    sets = _merge_sets(rng, n, (0.05, 0.05, 0.05))
    total = sum(p.size for p in sets[::2])
    with pytest.raises(ValueError, match="too short"):  # outputs with no room for every change
        N.merge_records(*sets, n, STATE_TABLE, np.empty(total - 1, np.int64), np.empty(total, np.uint32),
                        np.empty(total, np.uint8))
    short = list(sets)
    short[1] = short[1][:-1]  # fewer flag bytes than the positions need
    with pytest.raises(ValueError, match="change set 0"):
        N.merge_records(*short, n, STATE_TABLE, np.empty(total, np.int64), np.empty(total, np.uint32),
                        np.empty(total, np.uint8))
    with pytest.raises(ValueError, match="change set 1"):  # a position array of a partial uint32
        bad = list(sets)
        bad[2] = np.frombuffer(bad[2].tobytes()[:-1], np.uint8)
        N.merge_records(*bad, n, STATE_TABLE, np.empty(total, np.int64), np.empty(total, np.uint32),
                        np.empty(total, np.uint8))


def test_histories_from_records_are_the_same_on_both_kernels(monkeypatch):
    rng = np.random.default_rng(13)
    n = 1 << 16
    moves = [Moves(n, np.flatnonzero(rng.random(n) < 0.04), None) for _ in range(3)]
    moves = [Moves(n, mv.pos, rng.random(mv.pos.size) < 0.5) for mv in moves]
    native = History.from_moves(n, moves)
    monkeypatch.setattr(NAT, "USE_NATIVE", False)
    numba = History.from_moves(n, moves)
    assert native.id == numba.id and native.m == numba.m
    np.testing.assert_array_equal(native.pos, numba.pos)
    np.testing.assert_array_equal(native.state, numba.state)


def test_native_merge_reads_and_writes_nothing_past_its_buffers():
    # every input set and every output ends at a guard page (outputs sized to the changes exactly)
    rng = np.random.default_rng(14)
    n = 20_000
    maps = []

    def guarded(a: np.ndarray) -> np.ndarray:
        mm, off = _guarded(max(a.nbytes, 1))
        maps.append(mm)
        g = np.frombuffer(mm, a.dtype, a.size, off + max(a.nbytes, 1) - a.nbytes)
        g[:] = a
        return g

    for rates in ((0.05, 0.05, 0.05), (0.5, 0.0, 0.2), (0.0, 0.0, 0.01)):
        sets = [guarded(np.ascontiguousarray(x)) for x in _merge_sets(rng, n, rates)]
        total = sum(p.size for p in sets[::2])
        outs = [guarded(np.zeros(total, t)) for t in (np.int64, np.uint32, np.uint8)]
        k = N.merge_records(*sets, n, STATE_TABLE, *outs)
        assert 0 <= k <= total


@pytest.mark.parametrize("name", ("BF16", "F32", "I16"))
def test_the_digest_move_taken_in_the_decode_is_digest_moves(name):
    """``decode_hist(..., digest)``: the same status and outputs, and ``digest_move``'s sums over the base."""
    for trial, (n, rate) in enumerate(((1, 1.0), (700, 0.5), (1 << 16, 0.035))):
        dt, base, target, hist = _case(name, n, rate, 0.3, 900 + trial)
        m, nb, payload = _encode_numba(dt, base, target, hist, room=base.size * 24 + (1 << 17))
        assert nb > 0
        shift, mask, n_exp, cmap, cstate = _model(dt)
        pos, val = np.zeros(m, np.int64), np.zeros(m, dt.uint)
        args = (base, hist, payload, m, dt.itemsize, dt.bits, C._kind(dt), shift, mask, n_exp, cmap, cstate, N_STATES,
                QDEPTH, pos, val)
        st, a0, a1 = N.decode_hist(*args, (77, 1 << 62, 12345))
        assert st == 0
        np.testing.assert_array_equal(pos, np.flatnonzero(base != target))
        np.testing.assert_array_equal(val, target[pos])
        assert (a0, a1) == N.digest_move(base, pos, val, dt.itemsize, 77, 1 << 62, 12345)
