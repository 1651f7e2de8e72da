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
or one on a device, is converted (or copied to the host) a segment (1 MiB of served bytes) at a time, in
the encoder's work that codes that segment and in the keyframe's write: the host holds at most the
encoder's window of segments, never a whole tensor. (A version whose delta needs a converted tensor's
additive digest by a pass over it, rare: a tensor the scan did not record, loads that one whole.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checkpoint.header import TensorSource
from ..checkpoint.write import write_safetensors
from ..errors import UsageError
from ..integrity import SEGMENT_BYTES

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
            try:  # a safetensors header holds UTF-8 (a lone surrogate has none)
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise UsageError(f"tensor name {name!r}: not encodable as UTF-8 (a lone surrogate?)") from None
            if name in self._src:
                raise UsageError(f"tensor {name!r} is given twice")
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_nested:
                what = "a nested tensor" if isinstance(t, torch.Tensor) and t.is_nested else type(t).__name__
                raise UsageError(f"tensor {name!r}: expected a dense torch.Tensor, got {what}")
            if t.is_meta or t.device.type == "meta":
                raise UsageError(f"tensor {name!r} is on the meta device: it holds no data to publish (materialize "
                                 "it first, e.g. to_empty() then load its weights)")
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

    def raw(self, name: str):
        """The tensor's served bytes, 1-D uint8: a view of the tensor where it is on the CPU in its served
        dtype; else a ``_Lazy`` whose slices convert (or copy off the device) only when loaded."""
        import torch

        from ..apply.tensors import safetensors_dtype

        t, dt = self._src[name]
        if t.numel() == 0:
            return np.zeros(0, np.uint8)
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        t = t.contiguous()  # (a no-op for a trainer's parameters)
        if safetensors_dtype(t.dtype) == dt and t.device.type == "cpu":
            return t.reshape(-1).view(torch.uint8).numpy()
        return _Lazy(t.reshape(-1), dt, self.tensors[name].nbytes)

    def write(self, path: str) -> None:
        """Write these tensors, as served, into one safetensors file at ``path`` (atomically), a segment at
        a time: a keyframe version's file."""
        write_safetensors(path, [TensorSource(n, i.dtype, i.shape, i.nbytes, _chunks(self, n))
                                 for n, i in self.tensors.items()])


class _Lazy:
    """A tensor's served bytes not yet on the host: ``lazy[a:b]`` is a ``_Lazy`` of those bytes, ``load()``
    makes them an array (the encoder loads each segment in the work that codes it). ``flat``: the
    tensor, 1-D and contiguous, in its own dtype and on its own device."""

    def __init__(self, flat, dt: str, nbytes: int, start: int = 0, stop: int | None = None) -> None:
        self.flat, self.dt, self.start = flat, dt, start
        self.stop = nbytes if stop is None else stop
        self.nbytes = self.size = self.stop - self.start

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, s: slice) -> _Lazy:
        a, b, step = s.indices(self.size)
        if step != 1:
            raise ValueError("a lazy tensor's bytes slice with step 1 only")
        return _Lazy(self.flat, self.dt, 0, self.start + a, self.start + max(a, b))

    def load(self) -> np.ndarray:
        import torch

        from ..apply.tensors import safetensors_dtype
        from ..shard.convert import to_served_bits

        isz = _ITEMSIZE.get(self.dt, self.flat.element_size())
        part = self.flat[self.start // isz:self.stop // isz]
        if safetensors_dtype(part.dtype) == self.dt:  # a device tensor in its served dtype: copied, no change
            return part.view(torch.uint8).cpu().numpy()
        # bf16/fp16 -> fp32 is exact, so every conversion goes through the fp32 one.
        return to_served_bits(part.to(dtype=torch.float32).cpu().numpy(), self.dt).view(np.uint8)


_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}


def _chunks(st: ServedTensors, name: str):
    def pieces():
        raw = st.raw(name)
        if not isinstance(raw, _Lazy):
            yield raw
            return
        for a in range(0, raw.size, SEGMENT_BYTES):
            yield raw[a:a + SEGMENT_BYTES].load()

    return pieces


def _served_dtype(name: str, own: str, served: str | Mapping[str, str] | None) -> str:
    if served is None:
        return own
    if isinstance(served, str):
        return served if own in _CONVERTIBLE else own
    dt = served.get(name, own)
    if dt != own and dt not in SERVED_FLOATS:
        raise UsageError(f"tensor {name!r}: served dtype {dt!r}: expected one of {', '.join(SERVED_FLOATS)}")
    return dt
