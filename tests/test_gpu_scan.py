"""The fused Triton scan (``deltarefit.gpu.scan``) and the encode and apply that stand on it.

Without CUDA the kernels run through Triton's interpreter on CPU tensors (numpy; seconds per segment,
so the inputs are small: tensors of a few thousand elements, one or two whole segments where the
segment logic needs them). The scan is compared with the host's ``codec.kernels.ulp_scan``, the
context table with a stable sort, the encoder's bytes with the host encoder's, and the apply with the
target bit for bit. With CUDA (``-m gpu``) the same tests run compiled on the device.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is in the test extra: pip install -e '.[test]' (make test installs it)")
pytest.importorskip("triton", reason="triton (x86_64) is in the test extra: pip install -e '.[test]' (make test installs it)")
from test_gpu_apply import _delta, _on, _same_bits  # noqa: E402
from test_gpu_encode import _bits, _check_same_bytes  # noqa: E402

from deltarefit.codec import kernels as K  # noqa: E402
from deltarefit.codec.chunk import _ctx  # noqa: E402
from deltarefit.dtypes import dtype  # noqa: E402
from deltarefit.errors import DecodeError, VerificationError  # noqa: E402
from deltarefit.gpu import scan as S  # noqa: E402
from deltarefit.gpu.apply import apply_to_device_tensors  # noqa: E402
from deltarefit.integrity import SEGMENT_BYTES  # noqa: E402

CUDA = torch.cuda.is_available()

# Triton decides between compiled and interpreted kernels when they are decorated (the kernels module's
# first import): without a GPU, import it under the interpreter, then restore the env; the interpreted
# tests set it again while they run (``device`` below).
_saved = os.environ.get("TRITON_INTERPRET")
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    _kernels = S._kernels()
finally:
    if _saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved
INTERPRETED = _kernels is not None and S._interpreted(_kernels)

_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture(params=["interpreter", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch):
    if request.param == "cuda":
        if not (CUDA and S.available(torch.device("cuda"))):
            pytest.skip("needs CUDA and compiled Triton kernels (a CUDA machine: pytest -m gpu)")
        return "cuda"
    if not INTERPRETED:
        pytest.skip("CUDA is available: the kernels are compiled (run -m gpu)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert S.available(torch.device("cpu"))
    return "cpu"


def _rand(tdt, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if tdt.is_floating_point:
        return (torch.randn(n, generator=g) * 3).to(tdt)
    return torch.randint(-99, 99, (n,), generator=g).to(tdt)


CASES = [  # (dtype, torch dtype, elements, changed fraction, launch shape or None for the default)
    ("BF16", torch.bfloat16, 5000, 0.03, S.ScanConfig(block=64, tile=1024)),  # 5 tiles, the last short
    ("BF16", torch.bfloat16, 3000, 0.5, None),
    ("F8_E4M3", torch.float8_e4m3fn, 4099, 0.2, S.ScanConfig(block=128, tile=512)),
    ("F16", torch.float16, 2000, 0.1, None),
    ("I32", torch.int32, 1500, 0.05, None),  # one context: ranks are positions
    ("F64", torch.float64, (1 << 17) + 3000, 0.02, None),  # two segments in one batch
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[2]}")
def test_fused_scan_is_the_host_scan(device, case):
    name, tdt, n, frac, cfg = case
    dt = dtype(name)
    rng = np.random.default_rng(n)
    b = _rand(tdt, n, n)
    t = _bits(b, rng, frac)
    if name == "BF16" and frac > 0.1:
        t.view(torch.int16)[-7:] ^= 0x7FFF  # far moves and NaN patterns at the end of the buffer
    bi, ti = (x.view(_WIDTH[dt.itemsize]).to(device) for x in (b, t))
    per = SEGMENT_BYTES // dt.itemsize
    count = -(-n // per)
    *got, per_seg = S.scan_batch(bi, ti, dt, count, config=cfg)
    got = [x.cpu().numpy() for x in got]
    bu, tu = b.view(_WIDTH[dt.itemsize]).numpy().view(dt.uint), t.view(_WIDTH[dt.itemsize]).numpy().view(dt.uint)
    shift, mask, nctx = _ctx(dt)
    o = 0
    for k in range(count):
        bs, ts = bu[k * per:(k + 1) * per], tu[k * per:(k + 1) * per]
        ref = [np.empty(bs.size, np.int32) for _ in range(3)] + [np.empty(bs.size, dt.uint) for _ in range(2)]
        m = K.ulp_scan(bs, ts, shift, mask, nctx, *ref)
        assert m > 0 and per_seg[k] == m
        for g, r in zip(got, ref, strict=True):
            assert np.array_equal(g[o:o + m].view(r.dtype), r[:m]), (name, k)
        o += m
    assert o == got[0].size


@pytest.mark.parametrize("case", [c for c in CASES if c[2] < 10_000], ids=lambda c: f"{c[0]}-{c[2]}")
def test_context_table_is_the_stable_order(device, case):
    name, tdt, n, _, cfg = case
    dt = dtype(name)
    b = _rand(tdt, n, n + 1).view(_WIDTH[dt.itemsize])
    perm, start, count = S.context_perm(b.to(device), dt, config=cfg)
    shift, mask, nctx = _ctx(dt)
    e = ((b.numpy().view(dt.uint).astype(np.uint64) >> np.uint64(shift)) & np.uint64(mask)).astype(np.int64)
    counts = np.bincount(e, minlength=nctx)
    assert np.array_equal(perm.cpu().numpy(), np.argsort(e, kind="stable"))
    assert np.array_equal(count.cpu().numpy(), counts)
    assert np.array_equal(start.cpu().numpy(), np.cumsum(counts) - counts)


def _small_pair(seed: int):
    """A few tensors of a few thousand elements: ulp, dense and integer encodings, NaN payloads."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    base = {
        "w.bf16": (torch.randn(60, 100, generator=g) * 0.02).to(torch.bfloat16),
        "dense.bf16": torch.randn(2000, generator=g).to(torch.bfloat16),
        "w.f8": (torch.randn(4096, generator=g) * 4).to(torch.float8_e4m3fn),
        "w.f16": torch.randn(3000, generator=g).to(torch.float16),
        "ids.i32": torch.randint(-1000, 1000, (2000,), generator=g, dtype=torch.int32),
        "same": torch.randn(100, generator=g).to(torch.bfloat16),
        "specials.f32": torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -1e-40, 3.0]),
    }
    target = {k: v.clone() for k, v in base.items()}
    target["w.bf16"] = _bits(base["w.bf16"], rng, 0.03)
    target["dense.bf16"] = torch.randn(2000, generator=g).to(torch.bfloat16)  # every element: a whole-chunk encoding
    target["w.f8"] = _bits(base["w.f8"], rng, 0.2)
    target["w.f16"] = _bits(base["w.f16"], rng, 0.1)
    target["ids.i32"] = _bits(base["ids.i32"], rng, 0.02, ulps=(-5, 3, 100))
    sp = torch.tensor([float("nan"), 0.0, -0.0, float("-inf"), 2e-40, 3.0])
    sp.view(torch.int32)[0] = 0x7FC00123  # a NaN payload
    target["specials.f32"] = sp
    return base, target


def test_encode_through_the_fused_scan_writes_the_host_encoders_bytes(tmp_path, device):
    base, target = _small_pair(0)
    host = _check_same_bytes(tmp_path, _on(base, device), _on(target, device), 1, scan="triton")
    assert host.encodings["ulp"] > 0 and host.encodings["dense_xor"] + host.encodings["overwrite"] > 0


def test_apply_through_the_device_rank_map_is_bit_exact_then_a_no_op(tmp_path, device):
    base, target = _small_pair(1)
    path, enc = _delta(tmp_path, base, target)
    assert enc.encodings["ulp"] >= 4
    live = _on(base, device)
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    rep = apply_to_device_tensors(path, live, scan="triton")
    assert rep.target_fingerprint == enc.target_fingerprint and rep.chunks_applied > 0
    assert {k: v.data_ptr() for k, v in live.items()} == ptrs
    assert _same_bits(_on(live, "cpu"), target)
    again = apply_to_device_tensors(path, live, scan="triton")
    assert (again.chunks_applied, again.chunks_skipped) == (0, rep.chunks_applied)


def test_apply_refuses_a_payload_that_decodes_elsewhere_before_writing(tmp_path, device):
    """Another pair's ulp payload under this pair's records (every offset and hash recomputed): its
    ranks map to other positions, so the device post-image check (or the rank bound) refuses it."""
    import dataclasses

    from _pairs import Delta

    rng = np.random.default_rng(2)
    g = torch.Generator().manual_seed(2)
    base = {"a": (torch.randn(6000, generator=g) * 0.02).to(torch.bfloat16)}
    p1, _ = _delta(tmp_path, base, {"a": _bits(base["a"], rng, 0.03)}, "d1.delta")
    p2, _ = _delta(tmp_path, base, {"a": _bits(base["a"], rng, 0.03)}, "d2.delta")
    d, d2 = Delta.parse(open(p1, "rb").read()), Delta.parse(open(p2, "rb").read())
    k, k2 = d.record_of("a"), d2.record_of("a")
    d.payloads[k] = d2.payloads[k2]
    d.tensor("a")[1]["changed"] += d2.records[k2].n_changed - d.records[k].n_changed
    d.records[k] = dataclasses.replace(d.records[k], n_changed=d2.records[k2].n_changed)
    crafted = d.write(tmp_path / "crafted.delta")
    live = _on(base, device)
    with pytest.raises((DecodeError, VerificationError), match="tensor 'a' chunk 0"):
        apply_to_device_tensors(crafted, live, scan="triton")
    assert _same_bits(_on(live, "cpu"), base)


def test_triton_scan_refused_where_it_cannot_run(tmp_path, monkeypatch):
    """Without the interpreter, CPU tensors cannot take the kernels: asking for them is a usage error
    (and "auto" falls back to the sort, which the other encoder tests cover)."""
    from deltarefit.errors import UsageError
    from deltarefit.gpu.encode import encode_tensors

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    base, target = _small_pair(3)
    with pytest.raises(UsageError, match="scan='triton'"):
        encode_tensors(base, target, str(tmp_path / "d.delta"), scan="triton")
    with pytest.raises(UsageError, match="scan must be one of"):
        encode_tensors(base, target, str(tmp_path / "d.delta"), scan="sort")
    assert not (tmp_path / "d.delta").exists()
