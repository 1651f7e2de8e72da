"""The native kernels (codec/_native.c) against the numba kernels they stand in for: the same scan
outputs and the same payload bytes, on both of the scan's paths (AVX-512 and portable), for every dtype
the coder takes. CI builds the extension and fails here if it did not; elsewhere a machine without a C
compiler skips (the codec then runs numba alone)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarefit.codec import chunk as C
from deltarefit.codec import kernels as K
from deltarefit.codec import native as NAT
from deltarefit.dtypes import DTYPES, dtype

if NAT.ext is None:
    if os.environ.get("CI"):  # CI installs with a compiler: a missing extension there is a broken build
        raise RuntimeError("deltarefit.codec._native was not built")
    pytest.skip("the native kernels were not built here (pip install -e . builds them where a C compiler is)",
                allow_module_level=True)

N = NAT.ext
SIMD = ["portable", "avx512"] if N.simd() == "avx512" else ["portable"]


@pytest.fixture(params=SIMD)
def simd(request):
    was = N.use_simd(request.param == "avx512")
    yield request.param
    N.use_simd(was)


def _pair(dt, n: int, seed: int, rate: float, steps: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    info = np.iinfo(dt.uint)
    if steps == "weights" and dt.kind == "float" and dt.itemsize >= 2:
        f = (rng.standard_normal(n) * 0.02).astype(np.float32).view(np.uint32).astype(np.uint64)
        base = (f >> np.uint64(32 - dt.bits)).astype(dt.uint) if dt.itemsize <= 4 else \
            (rng.standard_normal(n) * 0.02).view(np.uint64)
    else:
        base = rng.integers(0, info.max, n, dtype=dt.uint, endpoint=True)
        base[rng.random(n) < 0.5] = base[0] if n else 0  # many shared contexts
    target = base.copy()
    idx = np.flatnonzero(rng.random(n) < rate)
    if steps == "random":
        target[idx] = rng.integers(0, info.max, idx.size, dtype=dt.uint, endpoint=True)
    else:  # small steps, as training makes them: mostly one ulp, some far
        d = rng.choice(np.array([1, -1, 2, -2, 5, -300, 70000], np.int64), idx.size, p=[.4, .4, .06, .06, .04, .03, .01])
        target[idx] = (target[idx].astype(np.int64) + d).astype(np.uint64).astype(dt.uint)
    return base, target


def _scan_bufs(n: int, udt) -> list[np.ndarray]:
    return [np.empty(n, np.int32) for _ in range(3)] + [np.empty(n, udt) for _ in range(2)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["BF16", "F16", "I16", "U16"]), n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1),
       rate=st.sampled_from([0.0, 0.01, 0.05, 0.3, 1.0]), steps=st.sampled_from(["weights", "random", "small"]))
def test_scan16_matches_numba(simd, name, n, seed, rate, steps):
    # Lengths around the 32-element block (and its 4 lanes), changes in any lane, whole blocks changed.
    dt = dtype(name)
    base, target = _pair(dt, n, seed, rate, steps)
    shift, mask, nctx = C._ctx(dt)
    want, got = _scan_bufs(n, dt.uint), _scan_bufs(n, dt.uint)
    m = K.ulp_scan(base, target, shift, mask, nctx, *want)
    assert N.scan16(base, target, shift, mask, nctx, *got) == m
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g[:m], w[:m])


CODER_DTYPES = sorted(DTYPES)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(CODER_DTYPES), n=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1),
       rate=st.sampled_from([0.001, 0.02, 0.1, 0.5, 1.0]), steps=st.sampled_from(["weights", "random", "small"]))
def test_encode_changes_matches_numba(name, n, seed, rate, steps):
    # Every item size and kind; gap quotients past the coder's fast paths (sparse changes), lengths past
    # three bits (the far steps), and the raw stream's 32-bit splits (64-bit dtypes).
    dt = dtype(name)
    base, target = _pair(dt, n, seed, rate, steps)
    ch = C.scan_chunk(dt, base, target)
    if ch.m == 0:
        return
    _, _, nctx = C._ctx(dt)
    cap = C.max_payload_len(dt, n) + 64
    want, got = np.zeros(cap, np.uint8), np.zeros(cap, np.uint8)
    nw = K.ulp_encode_changes(ch.ectx, ch.rank, ch.bvals, ch.tvals, dt.bits, C._kind(dt), nctx, want)
    ng = N.encode_changes(ch.ectx, ch.rank, ch.bvals, ch.tvals, dt.itemsize, dt.bits, C._kind(dt), nctx, got)
    assert ng == nw
    assert got[:ng].tobytes() == want[:nw].tobytes()
    # An output too small for the payload: both say so (-5) rather than write past it.
    small = np.zeros(max(9, nw // 2), np.uint8)
    assert N.encode_changes(ch.ectx, ch.rank, ch.bvals, ch.tvals, dt.itemsize, dt.bits, C._kind(dt), nctx,
                            small) == K.ulp_encode_changes(ch.ectx, ch.rank, ch.bvals, ch.tvals, dt.bits,
                                                           C._kind(dt), nctx, small.copy()) == -5


def test_a_far_gap_and_a_long_step_take_the_slow_paths():
    # One context: 2000 neighbouring changes, then two far ones. The Rice parameter follows the mean gap
    # (about 250, so k = 7), and the far gaps' quotients (about 2300) are unary codes past the 56 raw
    # bits of the one-put path. The change at 300,000 flips the sign: 2**15 ulps, a length past the
    # three-bit fast path.
    dt = dtype("BF16")
    base = np.full(1 << 19, 0x3C00, np.uint16)
    target = base.copy()
    target[:2000] += np.uint16(1)
    target[502_000] += np.uint16(1)
    target[300_000] = 0xBC00
    ch = C.scan_chunk(dt, base, target)
    out_n, out_k = np.zeros(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
    nk = K.ulp_encode_changes(ch.ectx, ch.rank, ch.bvals, ch.tvals, 16, 0, 256, out_k)
    nn = N.encode_changes(ch.ectx, ch.rank, ch.bvals, ch.tvals, 2, 16, 0, 256, out_n)
    assert nn == nk > 0 and out_n[:nn].tobytes() == out_k[:nk].tobytes()


@pytest.mark.parametrize("rate", [0.0, 0.035, 0.2])
def test_fused_scan_and_code_equal_the_two_steps(simd, rate):
    dt = dtype("BF16")
    base, target = _pair(dt, (1 << 19) - 7, 5, rate, "weights")
    shift, mask, nctx = C._ctx(dt)
    cap = C.max_payload_len(dt, base.size) + 64
    bufs, out = _scan_bufs(base.size, np.uint16), np.zeros(cap, np.uint8)
    m, nbytes = N.scan16(base, target, shift, mask, nctx, *bufs, dt.bits, C._kind(dt), out)
    ch = C.scan_chunk(dt, base, target)
    assert m == ch.m
    if m == 0:
        assert nbytes == 0
        return
    want = np.zeros(cap, np.uint8)
    nw = K.ulp_encode_changes(ch.ectx, ch.rank, ch.bvals, ch.tvals, dt.bits, C._kind(dt), nctx, want)
    assert nbytes == nw and out[:nbytes].tobytes() == want[:nw].tobytes()


def test_chunks_encode_the_same_with_either_kernels(monkeypatch):
    # The codec's entry points, native or not, choose the same encoding and write the same payload:
    # float chunks the ulp coding wins, dense chunks (dense candidates), integer chunks (sparse XOR).
    cases = [("BF16", 0.035, "weights"), ("BF16", 0.5, "random"), ("F16", 0.01, "weights"), ("I16", 0.02, "small"),
             ("F32", 0.03, "weights"), ("F8_E4M3", 0.05, "random")]
    for name, rate, steps in cases:
        dt = dtype(name)
        base, target = _pair(dt, 70_001, 11, rate, steps)
        monkeypatch.setattr(NAT, "USE_NATIVE", True)
        nat = C.encode_chunk(dt, base, target), C.encode_raw(dt, base.view(np.uint8), target.view(np.uint8))
        monkeypatch.setattr(NAT, "USE_NATIVE", False)
        ref = C.encode_chunk(dt, base, target)
        assert nat[0] == ref and nat[1] == ref, name


def test_a_misaligned_raw_view_is_copied_not_refused():
    # A tensor at an odd offset in its file: the native scan refuses the address (BufferError) and the
    # encoder copies the segment, with the same result.
    dt = dtype("BF16")
    base, target = _pair(dt, 4001, 3, 0.05, "weights")
    rb, rt = np.zeros(base.nbytes + 1, np.uint8), np.zeros(target.nbytes + 1, np.uint8)
    rb[1:], rt[1:] = base.view(np.uint8), target.view(np.uint8)
    with pytest.raises(BufferError):
        N.scan16(rb[1:], rt[1:], 7, 255, 256, *_scan_bufs(base.size, np.uint16))
    assert C.encode_raw(dt, rb[1:], rt[1:]) == C.encode_chunk(dt, base, target) is not None


def test_bad_buffers_are_refused_before_any_work():
    b = np.zeros(64, np.uint16)
    small = _scan_bufs(10, np.uint16)
    with pytest.raises(ValueError, match="pos holds 40 bytes, needs 256"):
        N.scan16(b, b, 7, 255, 256, *small)
    with pytest.raises(ValueError, match="target holds 64 bytes, needs 128"):
        N.scan16(b, b[:32], 7, 255, 256, *_scan_bufs(64, np.uint16))
    with pytest.raises(ValueError, match="differ in length"):
        N.scan16(b, np.zeros(65, np.uint16), 7, 255, 256, *_scan_bufs(64, np.uint16))
    with pytest.raises(ValueError, match="out of range"):
        N.scan16(b, b, 7, 255, 255, *_scan_bufs(64, np.uint16))  # a context id past the counters
    with pytest.raises(ValueError, match="context 300 out of range"):
        N.encode_changes(np.array([300], np.int32), np.zeros(1, np.int32), b[:1], b[:1], 2, 16, 0, 256,
                         np.zeros(64, np.uint8))
    ro = np.zeros(64, np.int32)
    ro.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        N.scan16(b, b, 7, 255, 256, ro, ro, ro, b.copy(), b.copy())


def test_the_encoder_writes_the_same_delta_with_either_kernels(tmp_path, monkeypatch):
    # Whole deltas, byte for byte: a mixed-dtype pair (bf16 over several chunks, f32, f16, fp8, int32, an
    # unchanged tensor), and a pair whose bf16 tensor sits at an odd offset in its file.
    from _pairs import write_pair, write_raw_safetensors

    from deltarefit.encode import encode

    pairs = [write_pair(tmp_path, change=0.03)]
    rng = np.random.default_rng(1)
    b = ((rng.standard_normal(300_000).astype(np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)
    t = b.copy()
    t[rng.random(b.size) < 0.04] += 1
    odd = []
    for name, w in (("odd_base", b), ("odd_target", t)):
        path = tmp_path / f"{name}.safetensors"
        write_raw_safetensors(path, {"a.flag": ("U8", (3,), np.zeros(3, np.uint8)), "b.weight": ("BF16", w.shape, w)})
        odd.append(str(path))
    pairs.append(tuple(odd))
    for i, (bp, tp) in enumerate(pairs):
        outs = {}
        for native in (True, False):
            monkeypatch.setattr(NAT, "USE_NATIVE", native)
            out = tmp_path / f"{i}-{native}.delta"
            rep = encode(bp, tp, str(out), threads=2)
            assert rep.changed_elements > 0
            outs[native] = out.read_bytes()
        assert outs[True] == outs[False], (bp, tp)


def test_the_additive_digest_is_native_and_importing_it_loads_no_numba(simd):
    """``integrity.additive`` runs the native kernel where it was built (each SIMD path: the numba kernel's sums),
    and importing it (as every live engine and publisher does) costs no numba import."""
    import subprocess
    import sys

    from deltarefit.integrity import additive as digest

    assert digest._native() is not None
    rng = np.random.default_rng(5)
    seed = digest.seeds("t", "BF16", (9,))
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        bits = rng.integers(0, np.iinfo(dt).max, 5003, dtype=dt, endpoint=True)
        flat = rng.integers(0, 2**50, bits.size).astype(np.int64)
        for f, start in ((flat, 0), (None, 2**33 + 7)):
            np.testing.assert_array_equal(digest._sums(f, start, bits, seed),
                                          digest._sums(f, start, bits, seed, force_numba=True))
        # a tensor in a mapped checkpoint may sit at any offset: elements and indices read unaligned
        raw = np.zeros(bits.nbytes + 1, np.uint8)
        raw[1:] = bits.view(np.uint8)
        odd = raw[1:].view(dt)
        rawf = np.zeros(flat.nbytes + 1, np.uint8)
        rawf[1:] = flat.view(np.uint8)
        oddf = rawf[1:].view(np.int64)
        assert dt == np.uint8 or not odd.flags.aligned
        np.testing.assert_array_equal(digest._sums(oddf, 0, odd, seed), digest._sums(flat, 0, bits, seed))
    code = ("import sys; from deltarefit.integrity import additive as digest; import numpy as np; "
            "digest.partial_run(digest.seeds('t', 'BF16', (3,)), 0, np.arange(3, dtype=np.uint16)); "
            "print('numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_one_switch_turns_every_native_kernel_on_and_off(monkeypatch):
    """``codec.native.USE_NATIVE`` is the one switch: flipped off, the scan, coder and decoder (``chunk``), the
    element calls (``elements``), the history merge (``history``) and the additive digest all take their
    numba or numpy paths; flipped on, each finds its native kernel. No module keeps a copy of it."""
    from deltarefit.codec import elements, history
    from deltarefit.integrity import additive

    view, pos = np.zeros(8, np.uint16), np.arange(3, dtype=np.int64)
    monkeypatch.setattr(NAT, "USE_NATIVE", False)
    assert C.kernels_in_use() == "numba scan, coder and decoder"
    assert elements.native_for(view, pos, view[:3]) is None and additive._native() is None
    assert history._merge_kernel() is not N.merge_records
    monkeypatch.setattr(NAT, "USE_NATIVE", True)
    assert "native coder and decoder" in C.kernels_in_use()
    assert elements.native_for(view, pos, view[:3]) is N and additive._native() is N.digest
    assert history._merge_kernel() is N.merge_records
    for mod in (C, elements, history, additive):
        assert not hasattr(mod, "USE_NATIVE"), mod.__name__
    assert not hasattr(C, "_native")  # the extension, too, is reached through codec.native alone


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_elements_at_positions_agree_with_numpy_and_refuse_a_bad_position_unwritten(simd, native, monkeypatch):
    """``codec.elements.put`` / ``equal_at`` and ``integrity.additive.move`` (the per-chunk element work of an apply,
    native without the GIL): numpy's results on every item size and block boundary of the digest move, on
    the native kernels and on the numpy fallback; a position outside the array (one past the end, or
    negative, which numpy would wrap) raises IndexError with nothing written."""
    from deltarefit import elements
    from deltarefit.integrity import additive as digest

    monkeypatch.setattr(NAT, "USE_NATIVE", native)
    rng = np.random.default_rng(11)
    seed = digest.seeds("t", "BF16", (9,))
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        for m in (0, 1, 255, 256, 257, 700):
            view = rng.integers(0, np.iinfo(dt).max, 1000, dtype=dt, endpoint=True)
            pos = np.sort(rng.choice(view.size, m, replace=False)).astype(np.int64)
            new = rng.integers(0, np.iinfo(dt).max, m, dtype=dt, endpoint=True)
            want = digest.change(seed, pos + 2**33, view[pos], new)
            np.testing.assert_array_equal(digest.move(seed, 2**33, view, pos, new), want)
            assert elements.equal_at(view, pos, view[pos].copy())
            assert elements.equal_at(view, pos, new) == bool(np.array_equal(view[pos], new))
            ref = view.copy()
            ref[pos] = new
            elements.put(view, pos, new)
            np.testing.assert_array_equal(view, ref)
            assert elements.equal_at(view, pos, new)
        for bad in (view.size, -1):
            pos = np.array([3, bad], np.int64)
            vals = np.ones(2, dt)
            before = view.copy()
            for call, args in ((elements.put, (view, pos, vals)), (elements.equal_at, (view, pos, vals)),
                               (digest.move, (seed, 0, view, pos, vals))):
                with pytest.raises(IndexError):
                    call(*args)
            np.testing.assert_array_equal(view, before)
