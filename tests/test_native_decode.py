"""The native ulp decoder (``_native.decode_ulp``) against numba's (``kernels.ulp_decode``): the same
positions, values and status for every payload, valid or hostile, on every positions pass this machine
runs (numba's countdown, the block pass with its SSE2 and AVX2 kernels, and the AVX-512 passes, one of
them with GFNI), and no read or write outside the buffers it is given."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest
from _fuzz import mutate

from deltarefit.codec import chunk as C
from deltarefit.codec import kernels as K
from deltarefit.codec import native as NAT
from deltarefit.dtypes import DTYPES, dtype
from deltarefit.errors import DecodeError

if NAT.ext is None:
    if os.environ.get("CI"):  # CI installs with a compiler: a missing extension there is a broken build
        raise RuntimeError("deltarefit.codec._native was not built")
    pytest.skip("the native kernels were not built here (pip install -e . builds them where a C compiler is)",
                allow_module_level=True)

N = NAT.ext
KERNELS = N.decode_kernels()


@pytest.fixture(params=KERNELS)
def kernel(request):
    was = N.decode_kernel(request.param)
    yield request.param
    N.decode_kernel(was)


def _both(dt, base, payload, n_changed, out=None):
    """(status, positions, values) from numba and from native. Outputs are compared only on success
    (on failure both leave them partly written, as the contract allows)."""
    shift, mask, nctx = C._ctx(dt)
    size = n_changed if out is None else out
    res = []
    for native in (False, True):
        pos, val = np.zeros(max(size, 0), np.int64), np.zeros(max(size, 0), dt.uint)
        if native:
            st = N.decode_ulp(base, payload, n_changed, dt.itemsize, dt.bits, C._kind(dt), shift, mask, nctx, pos, val)
        else:
            st = K.ulp_decode(base, np.frombuffer(payload, np.uint8), n_changed, dt.bits, C._kind(dt), shift, mask,
                              nctx, pos, val)
        res.append((st, pos, val))
    return res


def _agree(dt, base, payload, n_changed, out=None) -> int:
    (sk, pk, vk), (sn, pn, vn) = _both(dt, base, payload, n_changed, out)
    assert sn == sk, (sn, sk)
    if sk == 0:
        np.testing.assert_array_equal(pn, pk)
        np.testing.assert_array_equal(vn, vk)
    return sk


def _ulp_payload(dt, base, target) -> tuple[bytes, int]:
    """The ulp coding of a chunk (whatever encoding encode_chunk would pick)."""
    ch = C.scan_chunk(dt, base, target)
    _, _, nctx = C._ctx(dt)
    out = np.zeros(base.size * 24 + (1 << 17), np.uint8)  # room past the encoder's limit: dense random steps
    nb = K.ulp_encode_changes(ch.ectx, ch.rank, ch.bvals, ch.tvals, dt.bits, C._kind(dt), nctx, out)
    assert nb > 0
    return out[:nb].tobytes(), ch.m


def _base(dt, n: int, rng, kind: str) -> np.ndarray:
    info = np.iinfo(dt.uint)
    if kind == "weights" and dt.kind == "float" and dt.itemsize >= 2:
        w = rng.standard_normal(n) * 0.02
        if dt.name == "BF16":
            return (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return w.astype({2: np.float16, 4: np.float32, 8: np.float64}[dt.itemsize]).view(dt.uint)
    return rng.integers(0, info.max, n, dtype=dt.uint, endpoint=True)


def _target(dt, base, rng, rate: float, steps: str) -> np.ndarray:
    n = base.size
    target = base.copy()
    idx = np.flatnonzero(rng.random(n) < rate)
    if idx.size == 0:
        idx = np.array([rng.integers(n)])
    if steps == "random":
        info = np.iinfo(dt.uint)
        target[idx] = rng.integers(0, info.max, idx.size, dtype=dt.uint, endpoint=True)
    else:
        d = rng.choice(np.array([1, -1, 2, -2, 5, -300, 70000], np.int64), idx.size,
                       p=[.4, .4, .06, .06, .04, .03, .01])
        target[idx] = (target[idx].astype(np.int64) + d).astype(np.uint64).astype(dt.uint)
    same = target[idx] == base[idx]
    target[idx[same]] ^= dt.uint.type(1)  # a step that wrapped to itself
    return target


def _roundtrip(dt, base, target):
    payload, m = _ulp_payload(dt, base, target)
    assert _agree(dt, base, payload, m) == 0
    pos = np.zeros(m, np.int64)
    val = np.zeros(m, dt.uint)
    shift, mask, nctx = C._ctx(dt)
    assert N.decode_ulp(base, payload, m, dt.itemsize, dt.bits, C._kind(dt), shift, mask, nctx, pos, val) == 0
    np.testing.assert_array_equal(pos, np.flatnonzero(base != target))  # and both are right
    np.testing.assert_array_equal(val, target[pos])
    return payload, m


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_round_trips_match_numba_for_every_dtype(kernel, name):
    # Densities from one element to every element; chunk lengths around the 64-element block (short
    # last chunks), small-step and random changes, weight-like and uniform bases.
    dt = dtype(name)
    rng = np.random.default_rng(sum(map(ord, name)))
    for n in (1, 2, 63, 64, 65, 127, 1000, 4097):
        for rate in (0.0, 0.005, 0.05, 0.4, 1.0):
            for kind in ("weights", "uniform"):
                base = _base(dt, n, rng, kind)
                _roundtrip(dt, base, _target(dt, base, rng, rate, "random" if kind == "uniform" else "small"))


@pytest.mark.parametrize("name", ["BF16", "F16"])
@pytest.mark.parametrize("rate", [0.005, 0.035, 0.3])
def test_full_segments_of_16_bit_floats(kernel, name, rate):
    dt = dtype(name)
    rng = np.random.default_rng(7)
    base = _base(dt, (1 << 19) - 13, rng, "weights")
    _roundtrip(dt, base, _target(dt, base, rng, rate, "small"))


def test_many_contexts_then_few_switches_to_blocks(kernel):
    # More than the block pass takes (32) of contexts with changes at first, most of them exhausted
    # early: the countdown hands over to the block pass mid-chunk. And the reverse shape: every context
    # active to the end (the countdown throughout).
    dt = dtype("BF16")
    rng = np.random.default_rng(3)
    n = 200_000
    base = _base(dt, n, rng, "uniform")
    target = base.copy()
    first = {}
    for i in range(n):  # the first element of each context changes ...
        first.setdefault(int(base[i]) >> 7 & 0xFF, i)
    idx = np.array(sorted(first.values()))
    target[idx] ^= np.uint16(1)
    hot = np.flatnonzero(((base >> 7) & 0xFF) < 4)  # ... and four contexts change throughout
    target[hot[::7]] ^= np.uint16(1)
    _roundtrip(dt, base, target)
    base2 = _base(dt, 5000, rng, "uniform")
    _roundtrip(dt, base2, _target(dt, base2, rng, 1.0, "random"))


@pytest.mark.parametrize("hot", [200, 240])
def test_a_window_of_contexts_and_those_outside_it(kernel, hot):
    # The GFNI pass counts 16 consecutive contexts at once and the others with changes one compare each:
    # 16 hot contexts (at the top of bf16's exponents too, NaN and infinity's 255 among them), four rare
    # ones far below them changing throughout, groups exhausted early and late, and runs of changes of
    # one context inside one block (the slot's loop) and of more than 8 changes in a block.
    dt = dtype("BF16")
    rng = np.random.default_rng(hot)
    n = 40_000
    exps = np.where(rng.random(n) < 0.995, hot + rng.integers(0, 16, n), rng.integers(1, 5, n))
    base = (exps.astype(np.uint16) << 7) | rng.integers(0, 128, n).astype(np.uint16)
    base |= (rng.random(n) < 0.5).astype(np.uint16) << 15
    target = base.copy()
    idx = np.flatnonzero(rng.random(n) < 0.04)
    idx = np.union1d(idx, np.flatnonzero(exps < 5))  # every rare element changes
    idx = np.union1d(idx, np.arange(20_000, 20_000 + 64))  # one dense block
    first = np.flatnonzero(exps == hot + 3)[:5]
    target[idx] ^= np.uint16(1)
    target[np.flatnonzero(exps == hot + 3)] = base[np.flatnonzero(exps == hot + 3)]  # a group that ends early:
    target[first] ^= np.uint16(1)  # its first five elements only
    _roundtrip(dt, base, target)


def _edge_values(dt) -> np.ndarray:
    """Bit patterns at the key mapping's edges: zeros of both signs, subnormals, the largest finite
    values, infinities and NaN payloads (for floats), the extremes of the integer range."""
    w = dt.bits
    top = (1 << w) - 1
    vals = {0, 1, 2, top, top - 1, 1 << (w - 1), (1 << (w - 1)) - 1, (1 << (w - 1)) + 1}
    if dt.kind == "float":
        e, mnt = dt.exp_bits, dt.man_bits
        exp_all = ((1 << e) - 1) << mnt
        for s in (0, 1 << (w - 1)):
            vals |= {s, s | 1, s | ((1 << mnt) - 1), s | exp_all, s | exp_all | 1, s | exp_all | ((1 << mnt) - 1),
                     s | (exp_all - (1 << mnt)), s | (1 << mnt)}
    return np.array(sorted(v & top for v in vals), dtype=np.uint64).astype(dt.uint)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_edge_values_and_the_longest_distances(kernel, name):
    # Every edge pattern to every other: NaN payloads, -0.0 to +0.0 (one ulp), subnormals, infinities,
    # fp8's E4M3 and E5M2, and the distances of 2^(w-1) (the longest a w-bit distance codes).
    dt = dtype(name)
    ev = _edge_values(dt)
    base = np.repeat(ev, ev.size)
    target = np.tile(ev, ev.size)
    keep = base != target
    if keep.any():
        _roundtrip(dt, base[keep].copy(), target[keep].copy())
    half = dt.uint.type(1 << (dt.bits - 1))
    base = ev.copy()
    _roundtrip(dt, base, base ^ half)  # key distance 2^(w-1) for every pattern
    _roundtrip(dt, base, base + dt.uint.type(1))


def _payloads():
    """A few valid payloads to damage: (dtype, base, payload, n_changed)."""
    rng = np.random.default_rng(11)
    out = []
    for name, n, rate, kind in (("BF16", 3000, 0.02, "weights"), ("BF16", 700, 0.3, "uniform"),
                                ("F16", 1500, 0.05, "weights"), ("F32", 900, 0.05, "weights"),
                                ("F8_E4M3", 800, 0.1, "uniform"), ("I32", 600, 0.05, "uniform"),
                                ("F64", 300, 0.1, "weights"), ("U8", 400, 0.2, "uniform")):
        dt = dtype(name)
        base = _base(dt, n, rng, kind)
        payload, m = _ulp_payload(dt, base, _target(dt, base, rng, rate, "small"))
        out.append((dt, base, payload, m))
    return out


PAYLOADS = _payloads()


def test_every_truncation_is_refused_alike(kernel):
    seen = set()
    for dt, base, payload, m in PAYLOADS:
        for cut in range(len(payload)):
            st = _agree(dt, base, payload[:cut], m)
            assert st != 0
            seen.add(st)
        # Appended bytes, and a count that is off by one either way.
        assert _agree(dt, base, payload + b"\x00", m) == -6
        seen.add(_agree(dt, base, payload, m + 1))
        seen.add(_agree(dt, base, payload, m - 1))
    assert {-1, -2} <= seen


def test_bit_flips_and_garbage_get_the_same_status_and_output(kernel):
    # A seeded fuzz loop: single and multiple bit flips of valid payloads (most get past the header,
    # many decode to something, some to a valid-looking patch), spliced tails, and random garbage
    # behind a plausible rc_len. Every status numba can return turns up.
    rng = np.random.default_rng(2026)
    seen = {}
    for it in range(4000):
        dt, base, payload, m = PAYLOADS[it % len(PAYLOADS)]
        b = mutate(rng, payload, it % 6)
        nc = m if it % 7 else int(rng.integers(-1, base.size + 2))
        st = _agree(dt, base, bytes(b), nc)
        seen[st] = seen.get(st, 0) + 1
    assert {0, -1, -2, -3, -4, -6} <= set(seen), seen


def test_output_arrays_too_small_and_bad_parameters():
    dt, base, payload, m = PAYLOADS[0]
    assert _agree(dt, base, payload, m, out=m - 1) == -4
    shift, mask, nctx = C._ctx(dt)
    args = (base, payload, m, 2, 16, 0, shift, mask)
    with pytest.raises(ValueError, match="out of range"):
        N.decode_ulp(*args, mask, np.zeros(m, np.int64), np.zeros(m, np.uint16))  # a context id past n_ctx
    with pytest.raises(ValueError, match="out of range"):
        N.decode_ulp(base, payload, m, 3, 16, 0, shift, mask, nctx, np.zeros(m, np.int64), np.zeros(m, np.uint16))
    with pytest.raises(ValueError, match="whole number"):
        N.decode_ulp(base.view(np.uint8)[:-1], payload, m, 2, 16, 0, shift, mask, nctx, np.zeros(m, np.int64),
                     np.zeros(m, np.uint16))
    with pytest.raises(BufferError):
        N.decode_ulp(base, payload, m, 2, 16, 0, shift, mask, nctx, np.zeros(m + 1, np.int64).view(np.uint8)[4:],
                     np.zeros(m, np.uint16))
    with pytest.raises(ValueError, match="not a kernel"):
        N.decode_kernel("avx9000")


def _guarded(nbytes: int):
    """An anonymous map whose last ``nbytes`` bytes end exactly at a PROT_NONE page: (map, offset,
    release). Any access past the end faults."""
    page = mmap.PAGESIZE
    body = (nbytes + page - 1) // page * page
    mm = mmap.mmap(-1, body + page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    anchor = ctypes.c_char.from_buffer(mm)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(ctypes.addressof(anchor) + body, page, 0) == 0, os.strerror(ctypes.get_errno())
    del anchor
    return mm, body - nbytes


def test_nothing_is_read_or_written_past_the_buffers(kernel):
    # Base, payload and both outputs each end at a guard page: a read or write past any of them would
    # kill the process. Valid payloads, every truncation of one, and flipped ones; a base whose length
    # is no multiple of the 64-element block; a base at an odd address (unaligned loads).
    rng = np.random.default_rng(5)
    maps = []
    for dt, base, payload, m in PAYLOADS[:3] + PAYLOADS[4:5]:
        for odd in (0, 1):
            mb, ob = _guarded(base.nbytes + odd)
            maps.append(mb)
            gbase = np.frombuffer(mb, np.uint8, base.nbytes, ob + odd).view(dt.uint)
            gbase[:] = base
            mo, oo = _guarded(m * 8)
            mv, ov = _guarded(m * dt.itemsize)
            maps += [mo, mv]
            pos = np.frombuffer(mo, np.int64, m, oo)
            val = np.frombuffer(mv, dt.uint, m, ov)
            shift, mask, nctx = C._ctx(dt)
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
                st = N.decode_ulp(gbase, gp, m, dt.itemsize, dt.bits, C._kind(dt), shift, mask, nctx, pos, val)
                (sk, pk, vk), _ = _both(dt, base, case, m)
                assert st == sk
                if st == 0:
                    np.testing.assert_array_equal(pos, pk)
                    np.testing.assert_array_equal(val, vk)
                del gp
    del gbase, pos, val


def test_decode_chunk_uses_native_and_raises_numba_messages(monkeypatch):
    # decode_chunk through either decoder: the same patch for a valid payload, and the same DecodeError
    # (message for message) for damaged ones.
    for dt, base, payload, m in PAYLOADS:
        for case in (payload, payload[:-1], payload + b"\x01", payload[:5]):
            got = {}
            for native in (True, False):
                monkeypatch.setattr(NAT, "USE_NATIVE", native)
                try:
                    p = C.decode_chunk(dt, base, C.ULP, case, m, 0, "t.w chunk 0")
                    got[native] = (p.positions.tolist(), p.values.tolist())
                except DecodeError as e:
                    got[native] = str(e)
            assert got[True] == got[False]
    monkeypatch.setattr(NAT, "USE_NATIVE", True)
    assert "native coder and decoder" in C.kernels_in_use()


def test_numba_is_forced_by_the_environment():
    code = ("from deltarefit.codec import chunk as C; from deltarefit.codec import native as NAT; "
            "print(NAT.USE_NATIVE, C.kernels_in_use())")
    env = dict(os.environ, DELTAREFIT_KERNELS="numba")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False numba scan, coder and decoder"


def test_the_guard_page_faults():
    # The guard above is real: reading one byte past a guarded buffer kills the process (SIGSEGV).
    code = (f"import ctypes, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_native_decode as T; "
            "mm, off = T._guarded(100); a = ctypes.addressof(ctypes.c_char.from_buffer(mm)); "
            "ctypes.string_at(a + off + 99, 1); print('inside ok', flush=True); ctypes.string_at(a + off + 100, 1)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "inside ok" and out.returncode == -11, (out.returncode, out.stderr[-500:])


def _bits(spec: list[tuple[int, int]]) -> bytes:
    """A raw stream: (value, nbits) pairs, least significant bit first (FORMAT.md's put)."""
    acc, n = 0, 0
    for v, k in spec:
        acc |= (v & ((1 << k) - 1)) << n
        n += k
    return acc.to_bytes((n + 7) // 8, "little")


@pytest.mark.parametrize("name", ["I16", "BF16"])
def test_crafted_unary_runs_and_gamma_codes_at_their_limits(kernel, name):
    # Hand-made streams at the readers' edges: a range-coded part that decodes to ones (so every gap
    # quotient is "q > 1" and its unary code is raw), unary runs ending just below, at and past the
    # chunk size, runs cut off by the end of the stream, and Elias gamma codes of 38 to 42 zeros (the
    # 40th zero refuses), complete or cut short, in each place a gamma code is read.
    dt = dtype(name)
    rc = (5).to_bytes(4, "little") + b"\x00\xff\xff\xff\xff"
    base = np.full(100, 0x3F80, np.uint16)  # one context (127 for BF16)
    ctx = [(1, 1)] if name == "I16" else [(1 << 7, 8), (0, 7)]  # gamma(1) or gamma(128): context 0 or 127
    seen = set()
    for k in (0, 3):
        for z in range(0, 30 if k else 110):
            head = [(1, 1), *ctx, (1, 1), (k, 5)]  # one group, its context, count 1, rice parameter
            for tail in ([(1, 1), (0, k), (0, 64)], [(1, 1)], []):
                raw = _bits([*head, (0, z), *tail])
                for cut in (len(raw), len(raw) - 1):
                    seen.add(_agree(dt, base, rc + raw[:max(cut, 0)], 1))
    for z in range(36, 44):
        for where in range(3):  # the group count, the context step, the change count
            codes = [[(1, 1)], ctx, [(1, 1)]]
            codes[where] = [(1 << z, z + 1), (0, z)]
            for extra in ([(0, 5), (0, 80)], []):
                raw = _bits(codes[0] + codes[1] + codes[2] + extra)
                for cut in (len(raw), len(raw) - 2):
                    seen.add(_agree(dt, base, rc + raw[:max(cut, 0)], 1))
    assert {-1, -2, -3} <= seen, seen


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_the_digest_move_taken_in_the_decode_is_digest_moves(name):
    """``decode_ulp(..., digest)``: the same positions, values and status, and the additive digest's move
    that ``digest_move`` gives over the base, for change counts on both sides of its blocks of 256."""
    dt = dtype(name)
    rng = np.random.default_rng(3 + sum(map(ord, name)))
    shift, mask, nctx = C._ctx(dt)
    for n, rate in ((1, 1.0), (300, 0.9), (4097, 0.07), (1 << 16, 0.035)):
        base = _base(dt, n, rng, "weights")
        payload, m = _ulp_payload(dt, base, _target(dt, base, rng, rate, "small"))
        pos, val = np.zeros(m, np.int64), np.zeros(m, dt.uint)
        args = (base, payload, m, dt.itemsize, dt.bits, C._kind(dt), shift, mask, nctx, pos, val)
        assert N.decode_ulp(*args) == 0
        plain = pos.copy(), val.copy()
        start, s0, s1 = int(rng.integers(0, 1 << 40)), int(rng.integers(0, 1 << 63)), int(rng.integers(0, 1 << 63))
        st, a0, a1 = N.decode_ulp(*args, (start, s0, s1))
        assert st == 0
        np.testing.assert_array_equal(pos, plain[0])
        np.testing.assert_array_equal(val, plain[1])
        assert (a0, a1) == N.digest_move(base, pos, val, dt.itemsize, start, s0, s1)
        assert N.decode_ulp(*args, None) == 0  # None: the status alone
        bad = payload[: len(payload) // 2]
        assert N.decode_ulp(base, bad, *args[2:], (start, s0, s1))[0] == N.decode_ulp(base, bad, *args[2:]) != 0
    with pytest.raises(TypeError, match="digest must be"):
        N.decode_ulp(*args, (1, 2))


def test_decode_chunk_gives_the_digest_move_of_its_changes():
    from deltarefit.integrity import additive

    dt = dtype("BF16")
    rng = np.random.default_rng(11)
    base = _base(dt, 1 << 15, rng, "weights")
    target = _target(dt, base, rng, 0.035, "small")
    payload, m = _ulp_payload(dt, base, target)
    seed = additive.seeds("w", "BF16", (base.size,))
    p = C.decode_chunk(dt, base, C.ULP, payload, m, 0, "w", digest=(5 << 15, int(seed[0]), int(seed[1])))
    np.testing.assert_array_equal(p.moved, additive.move(seed, 5 << 15, base, p.positions, p.values))
    assert C.decode_chunk(dt, base, C.ULP, payload, m, 0, "w").moved is None
