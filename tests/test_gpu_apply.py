"""The device-side apply (``deltarefit.gpu.apply``) on CPU tensors: bit-exact against the target for
every dtype and encoding, idempotent, resumable, and refusing wrong bases and lying deltas before any
write. On a CUDA machine the same tests run on the GPU too (``-m gpu``)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is in the test extra: pip install -e '.[test]' (make test installs it)")
from safetensors.torch import load_file, save_file  # noqa: E402
from test_gpu_encode import _bits, _pair  # noqa: E402

import deltarefit  # noqa: E402
from deltarefit.apply.tensors import state_dict_fingerprint  # noqa: E402
from deltarefit.errors import BaseMismatchError, DecodeError, UsageError, VerificationError  # noqa: E402
from deltarefit.gpu.apply import apply_to_device_tensors  # noqa: E402


def _patch_only_pair(seed: int = 0):
    base, target = _pair(seed)
    for k in ("removed", "retyped", "added"):
        base.pop(k, None)
        target.pop(k, None)
    return base, target


def _delta(tmp_path, base, target, name="d.delta", format_version: int = 1):
    """The host encoder's delta (format 1 by default: the ulp encoding these tests apply through the
    device's rank map; format 2's ulp2 class is tests/test_gpu_ulp2_apply.py's)."""
    save_file(base, str(tmp_path / "base.safetensors"))
    save_file(target, str(tmp_path / "target.safetensors"))
    rep = deltarefit.encode(str(tmp_path / "base.safetensors"), str(tmp_path / "target.safetensors"),
                            str(tmp_path / name), format_version=format_version)
    return str(tmp_path / name), rep


def _same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


def _on(d: dict, device: str) -> dict:
    return {k: v.to(device).contiguous() for k, v in d.items()}


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device (runs on a CUDA machine: pytest -m gpu)")
    return request.param


def test_applies_bit_exact_then_is_a_no_op(tmp_path, device):
    base, target = _patch_only_pair()
    path, enc = _delta(tmp_path, base, target)
    assert enc.encodings["ulp"] > 0 and enc.encodings["dense_xor"] + enc.encodings["overwrite"] > 0
    live = _on(load_file(str(tmp_path / "base.safetensors")), device)
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    rep = apply_to_device_tensors(path, live)
    assert rep.target_fingerprint == enc.target_fingerprint
    assert rep.chunks_applied > 0 and rep.chunks_skipped == 0
    assert {k: v.data_ptr() for k, v in live.items()} == ptrs  # in place: the same storage
    assert _same_bits(_on(live, "cpu"), target)
    again = apply_to_device_tensors(path, live)
    assert (again.chunks_applied, again.chunks_skipped) == (0, rep.chunks_applied)
    assert state_dict_fingerprint(_on(live, "cpu")) == enc.target_fingerprint


def test_resumes_tensors_left_half_applied(tmp_path, device):
    rng = np.random.default_rng(1)
    g = torch.Generator().manual_seed(1)
    base = {"a": (torch.randn(4 << 20, generator=g) * 0.02).to(torch.bfloat16)}  # 8 segments
    target = {"a": _bits(base["a"], rng, 0.03)}
    path, _ = _delta(tmp_path, base, target)
    live = _on(base, device)
    live["a"][: 3 << 19] = target["a"][: 3 << 19].to(device)  # the first 3 segments already written
    rep = apply_to_device_tensors(path, live)
    assert (rep.chunks_applied, rep.chunks_skipped) == (5, 3)
    assert _same_bits(_on(live, "cpu"), target)


def test_wrong_base_refused_nothing_written(tmp_path, device):
    base, target = _patch_only_pair()
    path, _ = _delta(tmp_path, base, target)
    other = {k: v.clone() for k, v in base.items()}
    other["big.bf16"].view(torch.int16).reshape(-1)[12345] += 1  # one element off in one segment
    live = _on(other, device)
    with pytest.raises(BaseMismatchError, match=r"big\.bf16"):
        apply_to_device_tensors(path, live)
    assert _same_bits(_on(live, "cpu"), other)
    wrong_shape = _on(base, device)
    wrong_shape["w.f32"] = wrong_shape["w.f32"][:-1].contiguous()
    with pytest.raises(BaseMismatchError, match=r"w\.f32"):
        apply_to_device_tensors(path, wrong_shape)
    extra = _on(base, device)
    extra["stray"] = torch.zeros(3, device=device)
    with pytest.raises(BaseMismatchError, match="stray"):
        apply_to_device_tensors(path, extra)


@pytest.mark.parametrize("lie", ["count", "payload"])
def test_a_consistent_delta_that_lies_is_refused_before_writing(tmp_path, device, lie):
    """Deltas edited with every offset and hash recomputed (``_pairs.Delta``), so only decoding can tell:
    a change count one short, or another pair's chunk payload under this pair's records. Refused
    before any tensor is touched."""
    import dataclasses

    from _pairs import Delta

    rng = np.random.default_rng(2)
    g = torch.Generator().manual_seed(2)
    base = {"a": (torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16)}
    p1, _ = _delta(tmp_path, base, {"a": _bits(base["a"], rng, 0.03)}, "d1.delta")
    d = Delta.parse(open(p1, "rb").read())
    k = d.record_of("a")
    if lie == "count":
        d.records[k] = dataclasses.replace(d.records[k], n_changed=d.records[k].n_changed - 1)
        d.tensor("a")[1]["changed"] -= 1
    else:
        p2, _ = _delta(tmp_path, base, {"a": _bits(base["a"], rng, 0.03)}, "d2.delta")
        d2 = Delta.parse(open(p2, "rb").read())
        k2 = d2.record_of("a")
        d.payloads[k] = d2.payloads[k2]
        d.tensor("a")[1]["changed"] += d2.records[k2].n_changed - d.records[k].n_changed
        d.records[k] = dataclasses.replace(d.records[k], n_changed=d2.records[k2].n_changed)
    crafted = d.write(tmp_path / "crafted.delta")
    live = _on(base, device)
    with pytest.raises((DecodeError, VerificationError), match="tensor 'a' chunk 0"):
        apply_to_device_tensors(crafted, live)
    assert _same_bits(_on(live, "cpu"), base)


def test_structural_deltas_are_refused_with_a_clear_error(tmp_path, device):
    base, target = _pair()
    path, _ = _delta(tmp_path, base, target)
    live = _on(base, device)
    with pytest.raises(UsageError, match="cannot be done in place"):
        apply_to_device_tensors(path, live)
    assert _same_bits(_on(live, "cpu"), base)


def test_a_chain_coded_with_history_is_applied_and_the_wrong_book_refused(tmp_path, device):
    """``apply_to_device_tensors(..., history=book)``: ``ulp_hist`` chunks (a momentum-like chain) decode
    against the book (on the host, from a copy of their segment), every chunk's moves (the ulp ones
    decoded on the device too) advance it as the trainer's advanced, and a book that is not the one a
    delta was coded against is refused by name with nothing written."""
    from _chains import follow_with_book, write_chain

    paths = write_chain(str(tmp_path / "chain"), 4, n=(1 << 19) + 3000, seed=8, rate=0.05, prefix="c")
    live = _on(load_file(paths[0]), device)
    follow_with_book(paths, str(tmp_path), lambda out, book: apply_to_device_tensors(out, live, history=book),
                     lambda: {k: v.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                              for k, v in live.items()})


def test_a_book_that_cannot_be_written_is_started_over_and_the_verified_apply_stands(tmp_path, device):
    """A verified ``apply_to_device_tensors(..., history=book)`` whose book cannot be written (a file
    planted where its directory goes) ends verified with the tensors at the target: the book is started
    over (the file removed), not the apply failed."""
    import os

    from _chains import checkpoint_bits, deltas_with_history, write_chain

    from deltarefit.history_book import HistoryBook

    paths = write_chain(str(tmp_path / "chain"), 1, n=(1 << 19) + 3000, seed=8, rate=0.05, prefix="c")
    live = _on(load_file(paths[0]), device)
    (out, enc, _), = deltas_with_history(paths, str(tmp_path))
    at = tmp_path / "book"
    book = HistoryBook(str(at))
    at.write_bytes(b"not a book")
    rep = apply_to_device_tensors(out, live, history=book)
    assert rep.target_fingerprint == enc.target_fingerprint == state_dict_fingerprint(_on(live, "cpu"))
    assert {k: v.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for k, v in live.items()} == \
        checkpoint_bits(paths[1])
    assert not os.path.lexists(at)
