"""Format 2 through the device apply and the device encoder (``gpu.apply``, ``gpu.encode`` with the
kernels of ``gpu.ulp2``): deltas whose sparse chunks are ``ulp2`` / ``ulp2_hist`` are decoded on the
device (the Triton kernels, interpreted on CPU tensors here; compiled with ``-m gpu``), applied bit
for bit, refused before any write when a payload lies, and the device encoder writes the host
encoder's bytes. Tensors are small (a few thousand elements): the interpreter runs every lane step.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is in the test extra: pip install -e '.[test]' (make test installs it)")
pytest.importorskip("triton", reason="triton (x86_64) is in the test extra: pip install -e '.[test]' (make test installs it)")
from test_gpu_apply import _delta, _on, _same_bits  # noqa: E402
from test_gpu_encode import _bits, _check_same_bytes  # noqa: E402
from test_gpu_ulp2 import CUDA, INTERPRETED  # noqa: E402  (importing it loads the kernels as this machine needs)

from deltarefit.errors import DecodeError, VerificationError  # noqa: E402
from deltarefit.gpu import ulp2 as U  # noqa: E402
from deltarefit.gpu.apply import apply_to_device_tensors  # noqa: E402


@pytest.fixture(params=["interpreter", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch):
    if request.param == "cuda":
        if not (CUDA and U.available(torch.device("cuda"))):
            pytest.skip("needs CUDA and compiled Triton kernels (a CUDA machine: pytest -m gpu)")
        return "cuda"
    if not INTERPRETED:
        pytest.skip("CUDA is available: the kernels are compiled (run -m gpu)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "cpu"


def _pair(seed: int):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    base = {
        "w.bf16": (torch.randn(50, 40, generator=g) * 0.02).to(torch.bfloat16),
        "w.f32": torch.randn(2000, generator=g) * 0.1,
        "ids.i32": torch.randint(-1000, 1000, (300,), generator=g, dtype=torch.int32),
        "same": torch.randn(50, generator=g).to(torch.bfloat16),
    }
    target = {k: v.clone() for k, v in base.items()}
    target["w.bf16"] = _bits(base["w.bf16"], rng, 0.3)  # over ULP1_MAX_CHANGES: format 1's ulp is not tried
    target["w.f32"] = _bits(base["w.f32"], rng, 0.3, ulps=(-2, -1, 1, 7))
    target["ids.i32"] = _bits(base["ids.i32"], rng, 0.03, ulps=(-5, 3, 100))
    return base, target


class _Count:
    """Counts the chunks the device decoder takes (the real function runs)."""

    def __init__(self, monkeypatch):
        self.n = self.hist = 0
        real = U.decode_chunk

        def counted(*a, **k):
            self.n += 1
            self.hist += (a[5] if len(a) > 5 else k.get("states")) is not None
            return real(*a, **k)

        monkeypatch.setattr(U, "decode_chunk", counted)


def test_a_format_2_delta_is_decoded_on_the_device_and_applied_bit_exact_then_a_no_op(tmp_path, device,
                                                                                       monkeypatch):
    base, target = _pair(1)
    path, enc = _delta(tmp_path, base, target, format_version=2)
    assert enc.encodings.get("ulp2", 0) >= 2
    seen = _Count(monkeypatch)
    live = _on(base, device)
    rep = apply_to_device_tensors(path, live, scan="triton")
    assert rep.target_fingerprint == enc.target_fingerprint and rep.chunks_applied == 3
    assert seen.n == enc.encodings["ulp2"]  # every ulp2 chunk went through the device decoder
    assert _same_bits(_on(live, "cpu"), target)
    again = apply_to_device_tensors(path, live, scan="triton")
    assert (again.chunks_applied, again.chunks_skipped) == (0, rep.chunks_applied)


@pytest.mark.parametrize("lie", ["flip", "count"])
def test_a_format_2_payload_that_lies_is_refused_on_the_device_before_any_write(tmp_path, device, lie):
    """Deltas edited with every offset and hash recomputed (``_pairs.Delta``), so only decoding can tell:
    a stream byte flipped, or a change count one short. Nothing is written."""
    from _pairs import Delta

    base, target = _pair(2)
    p, _ = _delta(tmp_path, base, target, format_version=2)
    d = Delta.parse(open(p, "rb").read())
    k = d.record_of("w.bf16")
    assert d.records[k].encoding == U.ULP2
    if lie == "flip":
        pl = bytearray(d.payloads[k])
        pl[-3] ^= 0x10
        d.payloads[k] = bytes(pl)
    else:
        d.records[k] = dataclasses.replace(d.records[k], n_changed=d.records[k].n_changed - 1)
        d.tensor("w.bf16")[1]["changed"] -= 1
    crafted = d.write(tmp_path / "crafted.delta")
    live = _on(base, device)
    with pytest.raises((DecodeError, VerificationError), match=r"tensor 'w\.bf16' chunk 0"):
        apply_to_device_tensors(crafted, live, scan="triton")
    assert _same_bits(_on(live, "cpu"), base)


def test_the_device_encoder_writes_the_host_encoders_format_2_bytes(tmp_path, device):
    base, target = _pair(3)
    host = _check_same_bytes(tmp_path, _on(base, device), _on(target, device), 2, scan="triton")
    assert host.encodings["ulp2"] >= 2


def test_a_chain_coded_with_history_decodes_its_ulp2_hist_chunks_on_the_device(tmp_path, device, monkeypatch):
    """A momentum chain encoded with the trainer's book (``ulp2_hist`` chunks from the second delta on)
    followed by device tensors with their own book: each delta with history is first refused by name,
    nothing written, given an empty book; then every chunk decodes on the device against the book and
    the tensors end at each checkpoint bit for bit (``_chains.follow_with_book``)."""
    from _chains import follow_with_book
    from safetensors.torch import load_file, save_file

    rng = np.random.default_rng(4)
    w = (torch.randn(2000, generator=torch.Generator().manual_seed(4)) * 0.02).to(torch.bfloat16).view(torch.int16)
    idx = torch.from_numpy(rng.choice(2000, 600, replace=False))  # over ULP1_MAX_CHANGES
    step = torch.from_numpy(rng.choice([-1, 1], 600)).to(torch.int16)
    paths = []
    for i in range(4):  # the same elements keep moving the same way: what the history predicts
        paths.append(str(tmp_path / f"v{i}.safetensors"))
        save_file({"w": w.view(torch.bfloat16).clone()}, paths[-1])
        w = w.clone()
        w[idx] += step
    seen = _Count(monkeypatch)
    live = {"w": load_file(paths[0])["w"].to(device)}
    follow_with_book(paths, str(tmp_path),
                     lambda out, book: apply_to_device_tensors(out, live, history=book, scan="triton"),
                     lambda: {"w": live["w"].cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()})
    assert seen.hist > 0 and seen.n == 3
