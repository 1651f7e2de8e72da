"""Residual conversion: the one deterministic function from fp32 master weights to served bits.

A full export and the sharded diff both call these functions, so a delta is computed on exactly the
bits a full checkpoint would hold. Conversion is elementwise (bf16, fp16) or blockwise with the block
grid fixed in checkpoint coordinates (fp8), so converting a shard, a chunk or the whole tensor gives
the same bits for the same elements.

Contracts (all on bit patterns, never on tolerances):

* ``BF16``: round to nearest, ties to even, of the fp32 value; overflow goes to +-inf; -0.0, inf and
  subnormals are exact. Equal bit for bit to torch's ``.to(torch.bfloat16)`` for every non-NaN input.
* ``F16``: IEEE round to nearest even (numpy's ``astype(float16)``), overflow to +-inf, fp16
  subnormals rounded correctly. Equal bit for bit to torch's ``.to(torch.float16)`` for every non-NaN.
* NaN (both): a quiet NaN with the input's sign and the top bits of its payload (what x86 F16C and
  IEEE 754 recommend). torch's own CPU kernels do *not* agree with themselves here (bf16 NaN comes out
  as 0xFFFF, sign lost; fp16 NaN comes out as 0x7E00 or with the payload depending on the element's
  position in the vectorized loop), which is why we fix the rule instead of calling torch.
* ``F32``: the master bits unchanged.
* ``F8_E4M3`` with block scales (``convert_fp8_blocks``): per block of ``FP8_BLOCK`` (128 x 128 for
  2-D tensors, 128 for 1-D) ``scale_inv = amax / 448`` in fp32 (``amax`` over finite elements; an
  all-zero or all-non-finite block has ``scale_inv = 1.0``), ``q = e4m3fn(x / scale_inv)`` rounded to
  nearest even; NaN and +-inf become NaN (0x7F with the sign; e4m3fn has no inf). The scale tensor is
  stored beside the weight as ``<name>_scale_inv`` (fp32, shape ``ceil(shape / block)``), the
  DeepSeek-V3 convention: ``dequant = q * scale_inv``.

The residual: the master keeps everything below one served ulp. Nothing is tracked: every publish
converts the current masters and diffs against the served baseline, so updates that individually
round away accumulate in the masters and show up in the delta of the step at which they cross a
rounding boundary.
"""

from __future__ import annotations

import numpy as np

from ..errors import UsageError

SERVED_DTYPES = ("BF16", "F16", "F32")
FP8_BLOCK = 128
FP8_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"

_U32 = np.uint32


def _f32(master) -> np.ndarray:
    """A float32 numpy array of ``master`` (torch tensor or numpy array; shares memory where possible)."""
    try:
        import torch

        if isinstance(master, torch.Tensor):
            master = master.detach()
            if master.dtype != torch.float32:
                raise UsageError(f"master weights must be float32, got {master.dtype}")
            return master.cpu().numpy()
    except ImportError:  # pragma: no cover - torch is optional for the numpy path
        pass
    a = np.asarray(master)
    if a.dtype != np.float32:
        raise UsageError(f"master weights must be float32, got {a.dtype}")
    return a


def to_bf16_bits(x) -> np.ndarray:
    """bf16 bit patterns (uint16) of a float32 array: round to nearest even, NaN quieted with sign kept."""
    u = np.ascontiguousarray(_f32(x)).view(_U32)
    # u + 0x7FFF + lsb never overflows 32 bits for a non-NaN (the largest is -inf: 0xFF800000 + 0x8000).
    r = ((u + (_U32(0x7FFF) + ((u >> _U32(16)) & _U32(1)))) >> _U32(16)).astype(np.uint16)
    nan = (u & _U32(0x7FFFFFFF)) > _U32(0x7F800000)
    if nan.any():
        r[nan] = ((u[nan] >> _U32(16)) | _U32(0x0040)).astype(np.uint16)
    return r


def to_f16_bits(x) -> np.ndarray:
    """fp16 bit patterns (uint16) of a float32 array: IEEE round to nearest even, NaN quieted, sign kept."""
    f = np.ascontiguousarray(_f32(x))
    with np.errstate(over="ignore", invalid="ignore"):
        r = f.astype(np.float16).view(np.uint16)
    u = f.view(_U32)
    nan = (u & _U32(0x7FFFFFFF)) > _U32(0x7F800000)
    if nan.any():
        un = u[nan]
        r[nan] = (((un >> _U32(16)) & _U32(0x8000)) | _U32(0x7E00) | ((un >> _U32(13)) & _U32(0x03FF))).astype(
            np.uint16)
    return r


def to_served_bits(x, dtype: str) -> np.ndarray:
    """Served bits of fp32 masters ``x`` for an elementwise served dtype (``BF16``, ``F16``, ``F32``)."""
    if dtype == "BF16":
        return to_bf16_bits(x)
    if dtype == "F16":
        return to_f16_bits(x)
    if dtype == "F32":
        return np.ascontiguousarray(_f32(x)).view(_U32).copy()
    raise UsageError(f"served dtype {dtype!r} is not elementwise; use one of {SERVED_DTYPES} "
                     "(F8_E4M3 goes through convert_fp8_blocks)")


def e4m3fn_bits(q: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bit patterns (uint8) of float32 values: nearest even; NaN, inf and overflow -> NaN."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    u = q.view(_U32)
    sign = ((u >> _U32(24)) & _U32(0x80)).astype(np.uint8)
    a = u & _U32(0x7FFFFFFF)
    af = a.view(np.float32)
    out = np.empty(q.shape, np.uint8)
    sub = af < np.float32(2.0**-6)
    # Subnormals (and values rounding up to the smallest normal): code = rint(|x| * 2^9), exact scaling.
    out[sub] = np.rint(af[sub] * np.float32(512.0)).astype(np.uint8)
    n = ~sub
    an = a[n]
    code = ((an + (_U32(0x7FFFF) + ((an >> _U32(20)) & _U32(1)))) >> _U32(20)).astype(np.int64) - (120 << 3)
    code[(code > 0x7E) | (an >= _U32(0x7F800000))] = 0x7F
    out[n] = code.astype(np.uint8)
    return out | sign


def fp8_block_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the ``_scale_inv`` tensor of a weight of ``shape``."""
    return tuple(-(-int(d) // FP8_BLOCK) for d in shape)


def convert_fp8_blocks(x) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3fn bits uint8 of ``x``'s shape, ``scale_inv`` float32 of ``fp8_block_shape``) for a 1-D/2-D
    float32 array whose block grid starts at its own index 0 (a whole tensor or a block-aligned slice)."""
    f = np.ascontiguousarray(_f32(x))
    if f.ndim not in (1, 2):
        raise UsageError(f"fp8 block conversion handles 1-D and 2-D tensors, not shape {f.shape}")
    f2 = f.reshape(1, -1) if f.ndim == 1 else f
    r, c = f2.shape
    br, bc = (1, FP8_BLOCK) if f.ndim == 1 else (FP8_BLOCK, FP8_BLOCK)
    nbr, nbc = -(-r // br), -(-c // bc)
    pad = np.zeros((nbr * br, nbc * bc), np.float32)
    with np.errstate(invalid="ignore"):
        pad[:r, :c] = np.where(np.isfinite(f2), np.abs(f2), 0)
    amax = pad.reshape(nbr, br, nbc, bc).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    full = np.repeat(np.repeat(scale, br, axis=0), bc, axis=1)[:r, :c]
    with np.errstate(invalid="ignore", over="ignore"):
        q = e4m3fn_bits(f2 / full)
    return q.reshape(f.shape), scale.reshape(fp8_block_shape(f.shape))


def export_full(masters: dict, served: dict[str, str] | str) -> dict[str, tuple[str, np.ndarray]]:
    """Full conversion of checkpoint-named fp32 masters: ``{name: (dtype, bits)}`` (fp8 adds scales).

    ``served`` is one dtype for all, or ``{name: dtype}``. This is the reference a sharded publish must
    equal bit for bit.
    """
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, m in masters.items():
        dt = served if isinstance(served, str) else served[name]
        if dt == "F8_E4M3":
            q, s = convert_fp8_blocks(m)
            out[name] = ("F8_E4M3", q)
            out[name + SCALE_SUFFIX] = ("F32", s.view(_U32))
        else:
            out[name] = (dt, to_served_bits(m, dt))
    return out
