"""A trainer's weights in memory, as the publisher reads a checkpoint: ``ServedTensors``.

``Publisher.publish_tensors`` hands the encoder a ``ServedTensors`` where ``Publisher.publish`` hands it an
opened checkpoint: the same ``tensors`` (name -> dtype, shape, bytes) and ``raw(name)`` (the tensor's
bytes, as a safetensors file of these weights would hold them). No checkpoint file is written for a
delta version; a keyframe version is streamed into the publisher's staging file, one tensor at a time.

The served bits of a tensor whose dtype is converted (an fp32 master served as bf16) come from the one
conversion function, ``shard.convert.to_served_bits`` (round to nearest even; a NaN stays a quiet NaN
with its sign and high payload bits, where ``torch.Tensor.to`` writes one canonical NaN), so publishing
from memory and publishing the same weights saved with ``safetensors.torch.save_file`` after
``.to(torch.bfloat16)`` give the same fingerprints and the same deltas, NaNs aside.

Memory: a tensor already in its served dtype on the CPU is read in place (no copy). A converted tensor,
or one on a device, costs its served bytes on the host while the encoder codes its segments: at most the
encoder's window of tensors at a time, never the whole model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checkpoint.header import TensorSource
from ..checkpoint.write import write_safetensors
from ..errors import UsageError

__all__ = ["SERVED_FLOATS", "ServedTensors"]

# The dtypes a served conversion may produce, and the floating dtypes it converts from. Other tensors
# (integers, bool, fp8 and other quantized payloads) are published in their own dtype.
SERVED_FLOATS = ("BF16", "F16", "F32")
_CONVERTIBLE = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class _Info:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class ServedTensors:
    """The ``Checkpoint`` surface the encoder and the publisher need (``tensors``, ``raw``, ``write``) over
    torch tensors in memory, as they will be served.

    ``tensors``: a mapping or an iterable of ``(name, tensor)``: dense torch tensors on the CPU or a device
    (a trainer's parameters after its gather). They are referenced, not copied; they must not change
    until the publish returns. ``served``: None (every tensor keeps its dtype), one of ``SERVED_FLOATS``
    (every bf16/fp16/fp32 tensor is served in it), or a mapping of name -> dtype for the tensors to
    convert (the others keep theirs). A name given twice, a non-tensor, or a conversion of anything but
    bf16/fp16/fp32 is refused (``UsageError``)."""

    def __init__(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
                 served: str | Mapping[str, str] | None = None) -> None:
        import torch

        from ..apply.tensors import safetensors_dtype

        if isinstance(served, str) and served not in SERVED_FLOATS:
            raise UsageError(f"served dtype {served!r}: expected one of {', '.join(SERVED_FLOATS)}")
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        self._src: dict[str, tuple[Any, str]] = {}
        self.tensors: dict[str, _Info] = {}
        for item in items:
            try:
                name, t = item
            except (TypeError, ValueError):
                raise UsageError(f"expected (name, tensor) pairs, got {type(item).__name__}") from None
            if not isinstance(name, str) or not name:
                raise UsageError(f"tensor name {name!r}: expected a non-empty str")
            if name in self._src:
                raise UsageError(f"tensor {name!r} is given twice")
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                raise UsageError(f"tensor {name!r}: expected a dense torch.Tensor, got {type(t).__name__}")
            own = safetensors_dtype(t.dtype)
            dt = _served_dtype(name, own, served)
            if dt != own and (own not in _CONVERTIBLE or dt not in SERVED_FLOATS):
                raise UsageError(f"tensor {name!r}: cannot serve {own} as {dt} (conversions are between "
                                 f"{', '.join(_CONVERTIBLE)})")
            shape = tuple(int(d) for d in t.shape)
            n = int(np.prod(shape, dtype=np.int64)) if shape else 1
            self._src[name] = (t.detach(), dt)
            self.tensors[name] = _Info(dt, shape, n * _ITEMSIZE.get(dt, t.element_size()))
        if isinstance(served, Mapping) and (unknown := sorted(set(served) - set(self._src))):
            raise UsageError(f"served dtypes name tensors that are not given: {', '.join(unknown[:5])}")

    def raw(self, name: str) -> np.ndarray:
        """The tensor's served bytes, 1-D uint8 (a view of the tensor where no conversion or copy is needed)."""
        import torch

        t, dt = self._src[name]
        if t.numel() == 0:
            return np.zeros(0, np.uint8)
        from ..apply.tensors import safetensors_dtype

        if safetensors_dtype(t.dtype) == dt:
            if t.is_conj() or t.is_neg():
                t = t.resolve_conj().resolve_neg()
            return t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        from ..shard.convert import to_served_bits

        # bf16/fp16 -> fp32 is exact, so every conversion goes through the fp32 one.
        f32 = t.contiguous().reshape(-1).to(dtype=torch.float32).cpu().numpy()
        return to_served_bits(f32, dt).view(np.uint8)

    def write(self, path: str) -> None:
        """Write these tensors, as served, into one safetensors file at ``path`` (atomically), a tensor at a
        time: a keyframe version's file."""
        write_safetensors(path, [TensorSource(n, i.dtype, i.shape, i.nbytes, _chunks(self, n))
                                 for n, i in self.tensors.items()])


_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}


def _chunks(st: ServedTensors, name: str):
    return lambda: [st.raw(name)]


def _served_dtype(name: str, own: str, served: str | Mapping[str, str] | None) -> str:
    if served is None:
        return own
    if isinstance(served, str):
        return served if own in _CONVERTIBLE else own
    dt = served.get(name, own)
    if dt != own and dt not in SERVED_FLOATS:
        raise UsageError(f"tensor {name!r}: served dtype {dt!r}: expected one of {', '.join(SERVED_FLOATS)}")
    return dt
