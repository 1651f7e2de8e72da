"""Collective live targets: two tensor-parallel workers (real processes, a real gloo group on loopback)
refit their slices in place, each checking whole segments assembled over the group."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from deltarefit.encode import encode

WORKER = os.path.join(os.path.dirname(__file__), "_live_tp_worker.py")


def _ckpt(d: str, ts: dict) -> str:
    os.makedirs(d, exist_ok=True)
    save_file(ts, os.path.join(d, "model.safetensors"))
    return d


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, base: str, delta: str, corrupt_rank: int | None = None, held: bool = False) -> list[dict]:
    port = _port()
    procs = []
    for r in range(2):
        arg = {"rank": r, "world": 2, "port": port, "base": base, "delta": delta,
               "out": str(tmp_path / f"rank{r}.safetensors"), "corrupt": r == corrupt_rank,
               "held": held}
        procs.append(subprocess.Popen([sys.executable, WORKER, json.dumps(arg)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def _pair(tmp_path):
    g = torch.Generator().manual_seed(0)
    # 1100 x 512 bf16: a segment (512 Ki elements) spans the two workers' rows of "up"
    base = {"up.weight": (torch.randn(1100, 512, generator=g) * 0.05).to(torch.bfloat16),
            "down.weight": (torch.randn(256, 1100, generator=g) * 0.05).to(torch.bfloat16),
            "norm.weight": torch.ones(512, dtype=torch.bfloat16)}
    rng = np.random.default_rng(1)
    target = {}
    for n, t in base.items():
        bits = t.clone().view(torch.int16).view(-1).numpy()
        idx = rng.choice(bits.size, bits.size // 30, replace=False)
        bits[idx] += 1
        target[n] = torch.from_numpy(bits).view(torch.bfloat16).view(t.shape)
    b, t = _ckpt(str(tmp_path / "base"), base), _ckpt(str(tmp_path / "target"), target)
    delta = str(tmp_path / "step.delta")
    encode(b, t, delta, sums=True)  # additive digests: read by held-digest applies, ignored by the others
    return base, target, b, delta


@pytest.mark.parametrize("held", [False, True], ids=["segments", "held-digests"])
def test_two_workers_refit_their_slices_in_place_bit_exact(tmp_path, held):
    _base, target, b, delta = _pair(tmp_path)
    outs = _run(tmp_path, b, delta, held=held)
    assert all(o.get("ok") for o in outs), outs
    assert all(o["held"] == (3 if held else 0) for o in outs), outs
    assert outs[0]["shared"] == ["down.weight", "up.weight"]  # the norm is replicated: each checks its own
    r0, r1 = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2))
    assert torch.equal(torch.cat([r0["up"], r1["up"]]).view(torch.int16), target["up.weight"].view(torch.int16))
    assert torch.equal(torch.cat([r0["down"], r1["down"]], 1).view(torch.int16),
                       target["down.weight"].view(torch.int16))
    for r in (r0, r1):
        assert torch.equal(r["norm"].view(torch.int16), target["norm.weight"].view(torch.int16))


@pytest.mark.parametrize("held", [False, True], ids=["segments", "held-digests"])
def test_one_workers_refusal_stops_both_before_any_write(tmp_path, held):
    _base, _target, b, delta = _pair(tmp_path)
    outs = _run(tmp_path, b, delta, corrupt_rank=1, held=held)
    assert outs[1]["error"] == "BaseMismatchError" and "norm" in outs[1]["message"], outs
    assert outs[0]["error"] == "VerificationError" and "another process" in outs[0]["message"], outs
    assert outs[0]["untouched"] and outs[1]["untouched"]
