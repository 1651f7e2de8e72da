"""GPU segment hashes equal the ``blake3`` package's, byte for byte.

Without CUDA: the pure-torch reference runs on every length, and the Triton kernels run through
Triton's interpreter (numpy on the CPU, ~1.5 s per kernel program) on a few lengths chosen to cover
every code path; ``-m slow`` runs all lengths through it. With CUDA (``-m gpu``): everything on the device.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch

from deltarefit.gpu import blake3_torch as bref
from deltarefit.gpu.blake3_torch import blake3_torch, segment_hashes_torch

CUDA = torch.cuda.is_available()

# Triton picks compiled vs interpreted kernels when they are decorated, i.e. when the kernels module is
# first imported. Without a GPU, ask for the interpreter for that import, then restore the env so nothing
# else in this process is affected; the interpreted tests set it again while they run (``interpret``),
# because Triton decorates some of its own modules lazily, on the first launch.
_saved = os.environ.get("TRITON_INTERPRET")
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    from deltarefit.gpu import blake3_triton as bt
finally:
    if _saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved

MIB = 1 << 20
EDGE_LENGTHS = [0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 3 * 1024 + 5, MIB - 1, MIB, MIB + 1, 3 * MIB + 777]
# Chunk counts that are not powers of two, in the last segment and alone: left-balanced trees with odd
# nodes carried up at various levels, next to full segments that need all 10 levels.
ODD_TREE_LENGTHS = [3 * 1024, 5 * 1024 + 1, 7 * 1024 + 9, MIB + 3 * 1024 + 1, 2 * MIB + 700 * 1024 + 13]

INTERPRETED = bt.HAVE_TRITON and type(bt._k.chunk_cv_kernel).__name__ == "InterpretedFunction"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED,
    reason=("triton is not importable: " + str(bt.TRITON_IMPORT_ERROR)) if not bt.HAVE_TRITON
    else "CUDA is available: the kernels are compiled (run -m gpu)",
)
needs_cuda = pytest.mark.skipif(not (CUDA and bt.HAVE_TRITON), reason="needs CUDA and triton")


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _expected(a: np.ndarray) -> list[bytes]:
    return [blake3.blake3(a[i:i + MIB]).digest(16) for i in range(0, a.size, MIB)]


def _rows(h: torch.Tensor) -> list[bytes]:
    assert h.dtype == torch.uint8 and h.dim() == 2 and h.shape[1] == 16
    return [bytes(r) for r in h.cpu().numpy()]


# ------------------------------------------------------------------------------- torch reference (CPU)


@pytest.mark.parametrize("n", EDGE_LENGTHS + ODD_TREE_LENGTHS)
def test_torch_reference_matches_blake3(n: int) -> None:
    a = _data(n, n)
    # Small batches: several passes per buffer, so the batching is exercised too.
    assert _rows(segment_hashes_torch(torch.from_numpy(a), batch_chunks=2048)) == _expected(a)


def test_torch_reference_whole_message() -> None:
    for n in [0, 1, 64, 1024, 1025, 3 * 1024, 5 * 1024 + 1, 9 * 1024 - 1, 17 * 1024]:
        a = _data(n, 7 + n)
        assert blake3_torch(torch.from_numpy(a), 32) == blake3.blake3(a).digest(32), n


def test_kernel_schedule_is_the_spec() -> None:
    """The kernel's written-out rounds use BLAKE3's lanes and message schedule (no triton needed)."""
    src = (Path(bref.__file__).parent / "_blake3_kernels.py").read_text()
    calls = re.findall(r"_g\(v(\d+), v(\d+), v(\d+), v(\d+), m(\d+), m(\d+)\)", src)
    assert len(calls) == 7 * 8
    for r, s in enumerate(bref.MSG_SCHEDULE):
        for k, lanes in enumerate(bref._G_LANES):
            got = tuple(int(x) for x in calls[8 * r + k])
            assert got == (*lanes, s[2 * k], s[2 * k + 1]), (r, k)


def test_fingerprint_torch_impl_matches_state_dict_fingerprint() -> None:
    from deltarefit.apply.tensors import state_dict_fingerprint

    g = torch.Generator().manual_seed(3)
    tensors = {
        "w": torch.randn(700, 1000, generator=g).to(torch.bfloat16),  # 1.4 MB: two segments
        "b": torch.randn(33, generator=g),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4, dtype=torch.int32),
        "t": torch.arange(12, dtype=torch.int16).reshape(3, 4).t(),  # not contiguous
    }
    assert bt.fingerprint_gpu(tensors, impl="torch") == state_dict_fingerprint(tensors)


# ------------------------------------------------------------------------- Triton kernels, interpreted

_INTERP = bt.KernelConfig(tile=2048, num_warps=4, load=1)  # one program for all whole chunks: fast here


@pytest.mark.usefixtures("interpret")
@needs_interpreter
def test_interpreter_full_segment_and_odd_tree() -> None:
    # A full segment (all 10 levels) beside a 6-chunk segment (carry at the second level) whose last
    # chunk is 7 bytes (byte-load kernel, zero padded block, block_len 7).
    a = _data(MIB + 5 * 1024 + 7, 1)
    assert _rows(bt.segment_hashes_gpu(torch.from_numpy(a), config=_INTERP)) == _expected(a)


@pytest.mark.usefixtures("interpret")
@needs_interpreter
def test_interpreter_tile_loads_single_chunk_root() -> None:
    a = _data(1024, 2)  # one whole chunk: ROOT on its last block, through the [tile, 16] word loads
    cfg = bt.KernelConfig(tile=64, num_warps=4, load=2)
    assert _rows(bt.segment_hashes_gpu(torch.from_numpy(a), config=cfg)) == _expected(a)


@pytest.mark.usefixtures("interpret")
@needs_interpreter
def test_interpreter_unaligned_view_uses_byte_loads() -> None:
    a = _data(1031, 3)
    raw = torch.from_numpy(a)[1:]  # base address odd: every chunk goes through the byte loads
    assert raw.data_ptr() % 4 != 0
    assert _rows(bt.segment_hashes_gpu(raw, config=_INTERP)) == _expected(a[1:])


@pytest.mark.usefixtures("interpret")
@needs_interpreter
def test_interpreter_empty_message() -> None:
    empty = torch.zeros(0, dtype=torch.uint8)
    assert bt.segment_hashes_gpu(empty).shape == (0, 16)  # no segments, no launch
    assert bt.blake3_gpu(empty, 32) == blake3.blake3(b"").digest(32)  # one empty block, START|END|ROOT


@pytest.mark.usefixtures("interpret")
@needs_interpreter
@pytest.mark.slow
@pytest.mark.parametrize("n", EDGE_LENGTHS + ODD_TREE_LENGTHS)
def test_interpreter_all_lengths(n: int) -> None:
    a = _data(n, n)
    assert _rows(bt.segment_hashes_gpu(torch.from_numpy(a), config=_INTERP)) == _expected(a)


# ------------------------------------------------------------------------------------------- on CUDA

CUDA_CONFIGS = [bt.KernelConfig(128, 4, 1), bt.KernelConfig(128, 4, 2), bt.KernelConfig(256, 4, 1)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cfg", CUDA_CONFIGS, ids=repr)
def test_cuda_all_lengths(cfg: bt.KernelConfig) -> None:
    for n in [*EDGE_LENGTHS, *ODD_TREE_LENGTHS, 64 * MIB + 12345]:
        a = _data(n, n)
        raw = torch.from_numpy(a).cuda()
        assert _rows(bt.segment_hashes_gpu(raw, config=cfg)) == _expected(a), n
        assert _rows(segment_hashes_torch(raw)) == _expected(a), n


@pytest.mark.gpu
@needs_cuda
def test_cuda_unaligned_and_whole_message() -> None:
    a = _data(3 * MIB + 5, 11)
    for off in (1, 2, 3, 4):
        raw = torch.from_numpy(a).cuda()[off:]
        assert _rows(bt.segment_hashes_gpu(raw)) == _expected(a[off:]), off
    for n in [0, 1, 1024, 5 * 1024 + 1, 3 * MIB + 5]:
        assert bt.blake3_gpu(torch.from_numpy(a[:n]).cuda()) == blake3.blake3(a[:n]).digest(), n


@pytest.mark.gpu
@needs_cuda
def test_cuda_fingerprint_matches_state_dict_fingerprint() -> None:
    from deltarefit.apply.tensors import state_dict_fingerprint

    g = torch.Generator().manual_seed(5)
    cpu = {"w": torch.randn(1500, 1000, generator=g).to(torch.bfloat16), "b": torch.randn(7, generator=g),
           "s": torch.tensor(1, dtype=torch.int64), "e": torch.zeros(0)}
    dev = {k: v.cuda() for k, v in cpu.items()}
    assert bt.fingerprint_gpu(dev) == state_dict_fingerprint(cpu)
