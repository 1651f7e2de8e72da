"""Publishing from a trainer's memory (``Publisher.publish_tensors``): a real torch model trained with AdamW,
its fp32 parameters published as bf16 each step, against the same weights saved with
``safetensors.torch.save_file`` and published through the checkpoint path, in two real stores on disk.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

import deltarefit
from deltarefit.apply.tensors import state_dict_fingerprint
from deltarefit.errors import UsageError
from deltarefit.storage import LocalStore
from deltarefit.stream import Publisher, Subscriber
from deltarefit.stream import served as served_mod
from deltarefit.stream.records import load_commit

STEPS = 5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(300, 48), torch.nn.Linear(48, 96), torch.nn.GELU(),
                            torch.nn.Linear(96, 48), torch.nn.LayerNorm(48))
    m.register_buffer("position_ids", torch.arange(64, dtype=torch.int64))  # an int tensor, published as is
    return m


def _step(m: torch.nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
    g = torch.Generator().manual_seed(100 + k)
    ids = torch.randint(0, 300, (8, 16), generator=g)
    loss = m(ids).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _served_sd(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (t.detach().to(torch.bfloat16) if t.is_floating_point() else t.detach()).contiguous()
            for n, t in m.state_dict().items()}


def _publisher(root, name: str) -> Publisher:
    return Publisher(LocalStore(str(root / name), create=True), str(root / f"{name}-state"), keyframe_every=3,
                     keyframe_ratio=1000.0)


def test_publish_from_memory_matches_the_checkpoint_path(tmp_path, monkeypatch):
    """Each version from memory has the checkpoint path's fingerprint, kind and delta bytes; a delta
    version writes no checkpoint file; a subscriber ends at the served weights' fingerprint."""
    written: list[str] = []
    real_write = served_mod.write_safetensors
    monkeypatch.setattr(served_mod, "write_safetensors", lambda p, *a, **k: (written.append(p), real_write(p, *a, **k)))
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    mem, disk = _publisher(tmp_path, "mem"), _publisher(tmp_path, "disk")
    kinds = []
    for k in range(STEPS):
        if k:
            _step(m, opt, k)
        before = len(written)
        a = mem.publish_tensors(m.state_dict(), served="BF16", step=k)
        ck = str(tmp_path / f"step{k}.safetensors")
        save_file(_served_sd(m), ck)
        b = disk.publish(ck, step=k)
        assert (a.version, a.kind, a.fingerprint, a.parent, a.full_bytes) == (
            b.version, b.kind, b.fingerprint, b.parent, b.full_bytes)
        assert a.fingerprint == state_dict_fingerprint(_served_sd(m))
        if a.kind == "delta":
            assert a.delta.blake3 == b.delta.blake3 and a.delta.bytes == b.delta.bytes
            assert len(written) == before, "a delta version wrote a checkpoint"
        else:
            assert len(written) == before + 1
        kinds.append(a.kind)
    assert kinds == ["keyframe", "delta", "keyframe", "delta", "delta"]  # every 3rd version
    # The same weights again: the committed version, nothing new.
    again = mem.publish_tensors(list(m.state_dict().items()), served="BF16")
    assert again.version == STEPS
    # A rollout syncing the memory stream holds the served weights, verified.
    ck = str(tmp_path / "rollout.safetensors")
    Subscriber(str(tmp_path / "mem"), ck).sync()
    deltarefit.verify(ck, load_commit(LocalStore(str(tmp_path / "mem")), STEPS).fingerprint)
    assert deltarefit.fingerprint(ck) == state_dict_fingerprint(_served_sd(m))
    # Nothing but the baseline and its state is left in the publisher's state directory.
    left = sorted(os.listdir(tmp_path / "mem-state"))
    assert not [f for f in left if f.endswith(".safetensors") and f != "baseline.safetensors"], left


def test_dtypes_kept_and_converted(tmp_path):
    """Without ``served`` each tensor keeps its dtype; a mapping converts only the named tensors; fp32
    masters served as F16 match torch's own conversion."""
    torch.manual_seed(1)
    t = {"a.weight": torch.randn(40, 33), "b.weight": torch.randn(17).to(torch.bfloat16),
         "c.scale": torch.randn(5, 5).to(torch.float16), "d.ids": torch.arange(9, dtype=torch.int32)}
    p = _publisher(tmp_path, "s")
    rec = p.publish_tensors(t)
    assert rec.fingerprint == state_dict_fingerprint(t)
    t2 = {**t, "a.weight": t["a.weight"] * 1.001}
    rec2 = p.publish_tensors(t2.items(), served={"a.weight": "F16"})
    assert rec2.version == 2
    assert rec2.fingerprint == state_dict_fingerprint({**t2, "a.weight": t2["a.weight"].to(torch.float16)})


@pytest.mark.parametrize(("tensors", "served", "words"), [
    ([("x", torch.zeros(3)), ("x", torch.ones(3))], None, "given twice"),
    ({"x": [1.0, 2.0]}, None, "expected a dense torch.Tensor"),
    ({"x": torch.zeros(3)}, "F8_E4M3", "served dtype 'F8_E4M3'"),
    ({"x": torch.zeros(3, dtype=torch.int32)}, {"x": "BF16"}, "cannot serve I32 as BF16"),
    ({"x": torch.zeros(3)}, {"y": "BF16"}, "not given: y"),
    ([torch.zeros(3)], None, "expected (name, tensor) pairs"),
])
def test_bad_tensors_are_refused_before_anything_is_written(tmp_path, tensors, served, words):
    p = _publisher(tmp_path, "bad")
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        p.publish_tensors(tensors, served=served)
    assert not os.path.exists(tmp_path / "bad" / "HEAD")
    assert [f for f in os.listdir(tmp_path / "bad") if not f.startswith(".")] == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on a CUDA machine)")
def test_publish_from_device_tensors_matches_the_cpu_copy(tmp_path):
    """Tensors on the GPU (fp32 masters and a bf16 tensor) publish the same versions as their CPU copies."""
    torch.manual_seed(3)
    cpu = {"a.weight": torch.randn(512, 300), "b.weight": torch.randn(1000).to(torch.bfloat16)}
    gpu = {k: v.cuda() for k, v in cpu.items()}
    recs = []
    for name, t in (("cpu", cpu), ("gpu", gpu)):
        p = _publisher(tmp_path, name)
        first = p.publish_tensors(t, served="BF16")
        t["a.weight"].add_(1e-3)
        recs.append((first, p.publish_tensors(t, served="BF16")))
    (c1, c2), (g1, g2) = recs
    assert (c1.fingerprint, c2.fingerprint, c2.delta.blake3) == (g1.fingerprint, g2.fingerprint, g2.delta.blake3)


def _encode_peak(tmp_path, rows: int) -> float:
    """Traced peak (MiB) of the encode of a delta version of one fp32 tensor of ``rows`` x 4096, served bf16."""
    import tracemalloc

    torch.manual_seed(0)
    w = {"big.weight": torch.randn(rows, 4096)}
    p = Publisher(LocalStore(str(tmp_path / f"s{rows}"), create=True), str(tmp_path / f"st{rows}"), threads=2)
    p.publish_tensors(w, served="BF16")
    w["big.weight"][::5] += 1e-2
    real, peak = p._delta, []

    def traced(*a, **k):
        tracemalloc.start()
        try:
            return real(*a, **k)
        finally:
            peak.append(tracemalloc.get_traced_memory()[1] / 2**20)
            tracemalloc.stop()

    p._delta = traced
    assert p.publish_tensors(w, served="BF16").kind == "delta"
    return peak[0]


@pytest.mark.xfail(strict=True, reason="known regression, open in issue 54's note: the decode check before a commit "
                   "(stream.unchanged.check_decodes, through apply.files.check's plan) adds a peak that grows with the "
                   "tensor (~44 MiB more at 64 MiB served)")
def test_converted_tensors_are_converted_a_segment_at_a_time(tmp_path):
    """The encode of an fp32 tensor served as bf16 holds a window of converted segments, not the tensor:
    doubling the tensor (32 -> 64 MiB of served bytes) adds well under its size to the traced peak
    (converting it whole added ~64 MiB)."""
    small, big = _encode_peak(tmp_path, 4096), _encode_peak(tmp_path, 8192)
    assert big - small < 16, (small, big)
