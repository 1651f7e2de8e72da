"""The device-side encoder (``deltarefit.gpu.encode``) on CPU tensors: the same delta, byte for byte,
as the host encoder on the same pair saved as safetensors files. On a CUDA machine the same tests run
on the GPU too (``-m gpu`` selects them)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is in the test extra: pip install -e '.[test]' (make test installs it)")
from safetensors.torch import save_file  # noqa: E402

import deltarefit  # noqa: E402
from deltarefit.gpu.encode import encode_tensors  # noqa: E402


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _bits(t: torch.Tensor, rng: np.random.Generator, frac: float, ulps=(-1, 1)) -> torch.Tensor:
    """``t`` with a fraction of its elements moved by a few ulps (integer steps on the bit pattern)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    out = t.clone()
    flat = out.reshape(-1).view(width)
    n = flat.numel()
    idx = torch.from_numpy(rng.choice(n, size=max(1, int(n * frac)), replace=False)) if n else torch.zeros(0)
    steps = torch.from_numpy(rng.choice(ulps, size=idx.numel())).to(flat.dtype)
    flat[idx.long()] = flat[idx.long()] + steps
    return out


def _pair(seed: int = 0):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    base = {
        "big.bf16": (torch.randn(1536, 1024, generator=g) * 0.02).to(torch.bfloat16),  # 3 segments
        "dense.bf16": (torch.randn(300, 1000, generator=g)).to(torch.bfloat16),
        "w.f32": torch.randn(70_000, generator=g),
        "w.f16": torch.randn(5000, generator=g).to(torch.float16),
        "w.f8": (torch.randn(4096, generator=g) * 4).to(torch.float8_e4m3fn),
        "w.f64": torch.randn(3000, generator=g, dtype=torch.float64),
        "ids.i32": torch.randint(-1000, 1000, (20_000,), generator=g, dtype=torch.int32),
        "mask.bool": torch.rand(3000, generator=g) > 0.5,
        "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "same": torch.randn(100, generator=g).to(torch.bfloat16),
        "removed": torch.randn(10, generator=g),
        "retyped": torch.randn(64, generator=g),
    }
    specials = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), float("-inf"), 1e-40, -1e-40, 3.0])
    base["specials.f32"] = specials.clone()
    target = {k: v.clone() for k, v in base.items()}
    target["big.bf16"] = _bits(base["big.bf16"], rng, 0.03)
    target["dense.bf16"] = _bits(base["dense.bf16"], rng, 0.5, ulps=(-3, -1, 1, 2, 40))
    target["w.f32"] = _bits(base["w.f32"], rng, 0.04, ulps=(-2, -1, 1, 7))
    target["w.f16"] = _bits(base["w.f16"], rng, 0.1)
    target["w.f8"] = _bits(base["w.f8"], rng, 0.2)
    target["w.f64"] = _bits(base["w.f64"], rng, 0.01)
    target["ids.i32"] = _bits(base["ids.i32"], rng, 0.02, ulps=(-5, 3, 100))
    target["mask.bool"] = base["mask.bool"].clone()
    target["mask.bool"][::97] = ~target["mask.bool"][::97]
    target["scalar"] = torch.tensor(1.5078125, dtype=torch.bfloat16)
    sp = torch.tensor([float("nan"), 0.0, -0.0, float("-inf"), float("inf"), 2e-40, -1e-40, 3.0])
    sp.view(torch.int32)[0] = 0x7FC00123  # a NaN payload
    target["specials.f32"] = sp
    del target["removed"]
    target["retyped"] = base["retyped"].to(torch.bfloat16)
    target["added"] = torch.arange(12, dtype=torch.int64)
    return base, target


def _check_same_bytes(tmp_path, base, target, format_version: int = 1, **kw):
    """Both encoders in ``format_version`` (1: the ulp encoding split between device and host, which
    these tests were written for; 2: the ulp2 class)."""
    save_file({k: v.cpu() for k, v in base.items()}, str(tmp_path / "base.safetensors"))
    save_file({k: v.cpu() for k, v in target.items()}, str(tmp_path / "target.safetensors"))
    host = deltarefit.encode(str(tmp_path / "base.safetensors"), str(tmp_path / "target.safetensors"),
                             str(tmp_path / "host.delta"), threads=2, format_version=format_version)
    dev = encode_tensors(base, target, str(tmp_path / "dev.delta"), threads=2, format_version=format_version, **kw)
    assert _sha(tmp_path / "host.delta") == _sha(tmp_path / "dev.delta")
    assert (dev.target_fingerprint, dev.changed_elements) == (host.target_fingerprint, host.changed_elements)
    # And the delta applies: the base file becomes the target, bit for bit.
    rep = deltarefit.apply(str(tmp_path / "dev.delta"), str(tmp_path / "base.safetensors"))
    assert rep.target_fingerprint == deltarefit.fingerprint(str(tmp_path / "target.safetensors"))
    return host


@pytest.mark.parametrize("format_version", [1, 2])
def test_same_bytes_as_the_host_encoder_every_dtype_and_structural_change(tmp_path, format_version):
    base, target = _pair()
    host = _check_same_bytes(tmp_path, base, target, format_version, batch_segments=2)
    ulp = "ulp" if format_version == 1 else "ulp2"
    assert host.encodings[ulp] > 0 and (host.encodings["dense_xor"] + host.encodings["overwrite"]) > 0


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_batching_does_not_change_the_bytes(tmp_path, batch):
    rng = np.random.default_rng(5)
    g = torch.Generator().manual_seed(5)
    base = {"a": (torch.randn(2_600_000, generator=g) * 0.01).to(torch.bfloat16)}  # 5 segments, last partial
    target = {"a": _bits(base["a"], rng, 0.03)}
    _check_same_bytes(tmp_path, base, target, batch_segments=batch)


@pytest.mark.gpu
def test_same_bytes_from_cuda_tensors(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (runs on a CUDA machine: pytest -m gpu)")
    base, target = _pair(3)
    _check_same_bytes(tmp_path, {k: v.cuda() for k, v in base.items()}, {k: v.cuda() for k, v in target.items()})
