"""Minimal raw-bit safetensors I/O for the benchmark (independent of the codec's own reader).

Contract:

* :func:`tensor_index` maps every tensor of a checkpoint (one ``.safetensors`` file, or an HF directory
  with ``model.safetensors.index.json`` or any ``*.safetensors`` files) to its file, dtype, shape and
  absolute byte range.
* :func:`read_raw` returns one tensor's bytes as a flat array of the unsigned integer type of the
  element width (``BF16`` -> ``uint16``); values are never converted, so every dtype (bf16 included,
  which ``safe_open(framework="numpy")`` rejects) is read bit-exactly. Memory is O(tensor).
* :func:`iter_pair` walks two checkpoints with the same tensor names, dtypes and shapes, in sorted
  name order, one tensor at a time.
* :class:`StreamingWriter` writes a valid safetensors file tensor by tensor: the header (all names,
  dtypes, shapes) is written first, then each tensor's bytes in the declared order, so a file of any
  size is produced with memory O(one tensor).
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

import numpy as np

log = logging.getLogger(__name__)

ITEMSIZE: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip


def uint_dtype(dtype: str) -> np.dtype:
    """The little-endian unsigned integer numpy type with the width of safetensors dtype ``dtype``."""
    try:
        return np.dtype(f"<u{ITEMSIZE[dtype]}")
    except KeyError:
        raise ValueError(f"unsupported safetensors dtype {dtype!r}") from None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    start: int  # absolute offset in ``file``
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return self.nbytes // ITEMSIZE[self.dtype]


def checkpoint_files(path: str | os.PathLike[str]) -> list[str]:
    """The safetensors files of a checkpoint: the file itself, or those of an HF directory."""
    p = Path(path)
    if p.is_file():
        return [str(p)]
    if not p.is_dir():
        raise FileNotFoundError(f"no checkpoint at {p}")
    index = p / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [str(p / f) for f in sorted(set(weight_map.values()))]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {p}")
    return [str(f) for f in files]


def read_header(file: str) -> list[TensorInfo]:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        s, e = meta["data_offsets"]
        out.append(TensorInfo(name, meta["dtype"], tuple(meta["shape"]), file, base + s, base + e))
    return out


def tensor_index(path: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint by name (sorted by name)."""
    out: dict[str, TensorInfo] = {}
    for f in checkpoint_files(path):
        for t in read_header(f):
            if t.name in out:
                raise ValueError(f"tensor {t.name!r} appears twice in {path}")
            out[t.name] = t
    return dict(sorted(out.items()))


def read_raw(info: TensorInfo) -> np.ndarray:
    """One tensor's bytes as a flat unsigned-integer array of its element width."""
    dt = uint_dtype(info.dtype)
    with open(info.file, "rb") as f:
        arr = np.fromfile(f, dtype=dt, count=info.numel, offset=info.start)
    if arr.size != info.numel:
        raise ValueError(f"{info.file}: tensor {info.name!r} truncated")
    return arr


def checkpoint_tensor_bytes(path: str | os.PathLike[str]) -> int:
    """Total raw bytes of all tensors (headers excluded)."""
    return sum(t.nbytes for t in tensor_index(path).values())


def checkpoint_file_bytes(path: str | os.PathLike[str]) -> int:
    return sum(os.path.getsize(f) for f in checkpoint_files(path))


def iter_pair(base: str, target: str) -> Iterator[tuple[TensorInfo, np.ndarray, np.ndarray]]:
    """``(target_info, base_raw, target_raw)`` per tensor, sorted by name; layouts must match."""
    bi, ti = tensor_index(base), tensor_index(target)
    if bi.keys() != ti.keys():
        missing = sorted(bi.keys() ^ ti.keys())[:5]
        raise ValueError(f"base and target hold different tensors (e.g. {missing})")
    for name, t in ti.items():
        b = bi[name]
        if (b.dtype, b.shape) != (t.dtype, t.shape):
            raise ValueError(
                f"tensor {name!r}: base {b.dtype}{list(b.shape)} != target {t.dtype}{list(t.shape)}"
            )
        yield t, read_raw(b), read_raw(t)


def same_tensors(a: str, b: str) -> bool:
    """True when both checkpoints hold the same tensors with identical raw bytes."""
    try:
        return all(np.array_equal(x, y) for _, x, y in iter_pair(a, b))
    except ValueError:
        return False


class StreamingWriter:
    """Write a safetensors file tensor by tensor, in the order of ``specs`` (name, dtype, shape)."""

    def __init__(self, path: str | os.PathLike[str], specs: Sequence[tuple[str, str, Sequence[int]]]):
        self.path = str(path)
        self._specs = [(n, d, tuple(int(x) for x in s)) for n, d, s in specs]
        header: dict[str, object] = {}
        off = 0
        for name, dt, shape in self._specs:
            nbytes = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dt]
            header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nbytes]}
            off += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(blob)) + blob)
        self._next = 0

    def write(self, name: str, raw: np.ndarray) -> None:
        """Write the next tensor (the whole of it, or several consecutive slices via :meth:`write_part`)."""
        self.write_part(name, raw, last=True)

    def write_part(self, name: str, raw: np.ndarray, *, last: bool) -> None:
        exp_name, dt, _shape = self._specs[self._next]
        if name != exp_name:
            raise ValueError(f"expected tensor {exp_name!r} next, got {name!r}")
        if raw.dtype.itemsize != ITEMSIZE[dt]:
            raise ValueError(f"tensor {name!r}: element width {raw.dtype.itemsize} != {dt}")
        self._f.write(np.ascontiguousarray(raw).tobytes())
        if last:
            self._next += 1

    def close(self) -> None:
        self._f.close()
        if self._next != len(self._specs):
            raise ValueError(f"{self.path}: only {self._next} of {len(self._specs)} tensors written")
        expected = self._data_end()
        if os.path.getsize(self.path) != expected:
            raise ValueError(f"{self.path}: size {os.path.getsize(self.path)} != declared {expected}")

    def _data_end(self) -> int:
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        total = sum(int(np.prod(s, dtype=np.int64)) * ITEMSIZE[d] for _, d, s in self._specs)
        return 8 + n + total

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if et is None:
            self.close()
        else:
            self._f.close()
