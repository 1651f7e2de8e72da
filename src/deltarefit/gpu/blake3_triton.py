"""BLAKE3 segment hashes, tensor digests and fingerprints computed on the GPU with Triton.

Contracts:

* ``segment_hashes_gpu(raw)``: ``raw`` is a 1-D contiguous ``torch.uint8`` tensor (a tensor's raw
  bytes) on a CUDA device, any length (0 and lengths that are not multiples of 4, 64 or 1024 included).
  Returns a ``[n_segments, 16]`` uint8 tensor on the same device whose row ``i`` equals
  ``blake3.blake3(raw[i * 2**20 : (i + 1) * 2**20]).digest(16)`` (``deltarefit.integrity.seg_hash``);
  an empty input has no segments. The input is only read. Asynchronous like any CUDA op (no host sync);
  temporary device memory: 32 bytes per KiB of input (the chunk chaining values, ~3%).
* ``blake3_gpu(raw, out_len)``: plain BLAKE3 of the whole input (``out_len <= 32``), empty included.
* ``tensor_digest_gpu(t)`` / ``fingerprint_gpu(tensors)``: ``integrity.tensor_digest_from_segments`` /
  ``fingerprint_from_digests`` over these hashes; equal to ``apply.tensors.state_dict_fingerprint`` of
  the same tensors. Only the 16-byte segment hashes (16 bytes per MiB) are copied to the host.
* ``segment_hashes(raw, impl="auto")``: Triton when it is importable and ``raw`` is on CUDA, else
  ``blake3_torch``'s reference.

Kernels: ``_blake3_kernels.chunk_cv_kernel`` computes every chunk's chaining value of every segment in
one launch (one lane per chunk); whole chunks use the fast word loads (LOAD 1/2), the buffer's last,
short chunk (and everything, if the base is not 4-byte aligned) uses byte loads with zero padding
(LOAD 0). Then ``parent_kernel`` runs once per tree level (10 for 1 MiB segments) merging pairs within
every segment at once; the last level leaves each segment's root, whose first 16 bytes are the hash.

Without a GPU, set ``TRITON_INTERPRET=1`` before this module is first imported (and keep it set while
kernels run: Triton decorates some of its own modules lazily) and pass CPU tensors: Triton's interpreter
then runs the same kernels with numpy, about 1.5 s per program of up to ``tile`` chunks.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..integrity import SEG_HASH_BYTES, fingerprint_from_digests, tensor_digest_from_segments
from .blake3_torch import TreePlan, check_input, message_plan, segment_hashes_torch, segment_plan

try:
    from . import _blake3_kernels as _k

    HAVE_TRITON = True
    TRITON_IMPORT_ERROR: str | None = None
except ImportError as e:  # triton absent (or broken): the torch reference still works
    _k = None  # type: ignore[assignment]
    HAVE_TRITON = False
    TRITON_IMPORT_ERROR = f"{type(e).__name__}: {e}"

__all__ = ["HAVE_TRITON", "KernelConfig", "blake3_gpu", "fingerprint_gpu", "segment_hashes",
           "segment_hashes_gpu", "segment_hashes_torch", "tensor_digest_gpu"]


class KernelConfig:
    """Launch parameters of the chunk kernel: lanes (chunks) per program, warps, and word-load mode."""

    __slots__ = ("load", "num_warps", "tile")

    def __init__(self, tile: int = 128, num_warps: int = 4, load: int = 1) -> None:
        if tile <= 0 or tile & (tile - 1):
            raise ValueError(f"tile must be a power of two, got {tile}")
        if load not in (1, 2):
            raise ValueError("load must be 1 (u32 loads per word) or 2 (a [tile, 16] u32 tile per block)")
        self.tile, self.num_warps, self.load = tile, num_warps, load

    def __repr__(self) -> str:
        return f"KernelConfig(tile={self.tile}, num_warps={self.num_warps}, load={self.load})"


DEFAULT_CONFIG = KernelConfig()
_PARENT_TILE = 128


def _require_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError(f"triton is not importable ({TRITON_IMPORT_ERROR}); use segment_hashes_torch")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _roots(raw: torch.Tensor, plan: TreePlan, cfg: KernelConfig) -> torch.Tensor:
    """Root words of every segment, ``[n_segments, 8]`` int32 (u32 bit patterns) on ``raw``'s device."""
    assert _k is not None
    dev = raw.device
    n_chunks = plan.n_chunks
    cvs = torch.empty(n_chunks, 8, dtype=torch.int32, device=dev)
    if n_chunks == 0:
        return cvs
    # A CUDA tensor with no bytes has a null data pointer, which Triton refuses; nothing is read from it.
    src = raw if raw.numel() else torch.zeros(4, dtype=torch.uint8, device=dev)
    common = (plan.n_bytes, plan.chunks_per_seg, plan.seg_bytes)

    def launch(g0: int, g1: int, tile: int, num_warps: int, load: int) -> None:
        if g1 > g0:
            grid = (_cdiv(g1 - g0, tile),)
            _k.chunk_cv_kernel[grid](src, cvs, common[0], g0, g1, common[1], common[2],
                                     TILE=tile, LOAD=load, num_warps=num_warps)

    # u32 loads need a 4-byte aligned base; torch allocations are, views at odd offsets may not be.
    whole = plan.n_whole_chunks if src.data_ptr() % 4 == 0 else 0
    launch(0, whole, cfg.tile, cfg.num_warps, cfg.load)
    launch(whole, n_chunks, min(cfg.tile, 64), min(cfg.num_warps, 2), 0)

    level = cvs
    for in_full, last_in in plan.levels():
        out_full, last_out = (in_full + 1) // 2, (last_in + 1) // 2
        n_out = plan.n_full * out_full + last_out
        out = torch.empty(n_out, 8, dtype=torch.int32, device=dev)
        grid = (_cdiv(n_out, _PARENT_TILE),)
        _k.parent_kernel[grid](level, out, n_out, plan.n_full, in_full, max(out_full, 1), last_in,
                               TILE=_PARENT_TILE, num_warps=4)
        level = out
    assert level.shape[0] == plan.n_segments
    return level


def _as_bytes(words: torch.Tensor) -> torch.Tensor:
    """``[n, 8]`` int32 words -> ``[n, 32]`` uint8. Little-endian: CUDA devices and x86/ARM hosts are."""
    return words.contiguous().view(torch.uint8).reshape(words.shape[0], 32)


def segment_hashes_gpu(raw: torch.Tensor, *, config: KernelConfig | None = None) -> torch.Tensor:
    """``[n_segments, 16]`` uint8 segment hashes of ``raw``'s bytes, on ``raw``'s device (see module doc)."""
    _require_triton()
    check_input(raw)
    plan = segment_plan(raw.numel())
    return _as_bytes(_roots(raw, plan, config or DEFAULT_CONFIG))[:, :SEG_HASH_BYTES].contiguous()


def blake3_gpu(raw: torch.Tensor, out_len: int = 32, *, config: KernelConfig | None = None) -> bytes:
    """Plain BLAKE3 of all of ``raw`` (first ``out_len <= 32`` bytes; the XOF beyond is not implemented)."""
    _require_triton()
    check_input(raw)
    if not 0 < out_len <= 32:
        raise ValueError("out_len must be in 1..32")
    words = _roots(raw, message_plan(raw.numel()), config or DEFAULT_CONFIG)
    return bytes(_as_bytes(words).cpu().numpy()[0, :out_len])


def segment_hashes(raw: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """Segment hashes with ``impl`` = "triton", "torch", or "auto".

    "auto" is Triton when it is importable and can run on ``raw``'s device (CUDA, or any device under
    Triton's interpreter), else the torch reference.
    """
    if impl == "auto":
        runs = raw.device.type == "cuda" or type(getattr(_k, "chunk_cv_kernel", None)).__name__ == "InterpretedFunction"
        impl = "triton" if HAVE_TRITON and runs else "torch"
    if impl == "triton":
        return segment_hashes_gpu(raw)
    if impl == "torch":
        return segment_hashes_torch(raw)
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in safetensors (row-major) order as a 1-D uint8 tensor on its device."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


def tensor_digest_gpu(t: torch.Tensor, *, impl: str = "auto") -> bytes:
    """``integrity.tensor_digest`` of a torch tensor (dtype named as in safetensors), hashed on its device."""
    from ..apply.tensors import safetensors_dtype

    dtype = safetensors_dtype(t.dtype)
    raw = _raw_bytes(t)
    segs = segment_hashes(raw, impl=impl).cpu().numpy()  # 16 bytes per MiB cross to the host
    return tensor_digest_from_segments(dtype, tuple(int(d) for d in t.shape), raw.numel(),
                                       (bytes(r) for r in segs))


def fingerprint_gpu(tensors: Mapping[str, torch.Tensor], *, impl: str = "auto") -> str:
    """The checkpoint fingerprint (hex) of ``{name: tensor}``; equals ``apply.tensors.state_dict_fingerprint``."""
    return fingerprint_from_digests({name: tensor_digest_gpu(t, impl=impl) for name, t in tensors.items()})
