"""Writing safetensors files: ``write_safetensors`` streams ``TensorSource`` chunks into a standard
safetensors file (readable by ``safetensors`` itself), data aligned to each tensor's itemsize, written to a
temp file in the same directory and atomically renamed onto the target; memory stays O(one chunk)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Iterable
from typing import Any, BinaryIO

import numpy as np

from ..dtypes import DTYPES
from ..errors import CheckpointError
from ..io.fsutil import create_temp, fsync_dir
from .header import MAX_HEADER_BYTES, TensorSource, _is_count, _shape_str


def _sorted_sources(path: str, sources: list[TensorSource]) -> list[TensorSource]:
    """Validate sources; order them by (itemsize descending, name) so every tensor stays aligned."""
    seen: set[str] = set()
    for s in sources:
        where = f"{path}: tensor {s.name!r}"
        if not isinstance(s.name, str) or not s.name or s.name == "__metadata__":
            raise CheckpointError(f"{where}: not a valid tensor name")
        if s.name in seen:
            raise CheckpointError(f"{where}: given twice")
        seen.add(s.name)
        if not isinstance(s.dtype, str) or s.dtype not in DTYPES:
            raise CheckpointError(f"{where}: unknown dtype {s.dtype!r}; supported: {', '.join(DTYPES)}")
        if not all(_is_count(d) for d in s.shape):
            raise CheckpointError(f"{where}: shape {s.shape!r} is not a tuple of non-negative integers")
        need = math.prod(int(d) for d in s.shape) * DTYPES[s.dtype].itemsize
        if s.nbytes != need:
            raise CheckpointError(
                f"{where}: nbytes {s.nbytes} but {_shape_str(s.dtype, s.shape)} needs {need}"
            )
    return sorted(sources, key=lambda s: (-DTYPES[s.dtype].itemsize, s.name))


def _header_bytes(path: str, sources: list[TensorSource], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, Any] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise CheckpointError(f"{path}: metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    off = 0
    for s in sources:
        header[s.name] = {
            "dtype": s.dtype,
            "shape": [int(d) for d in s.shape],
            "data_offsets": [off, off + s.nbytes],
        }
        off += s.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    if len(raw) > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{path}: header of {len(raw)} bytes exceeds the {MAX_HEADER_BYTES >> 20} MiB limit"
        )
    return struct.pack("<Q", len(raw)) + raw


def _byte_view(chunk: bytes | memoryview | np.ndarray) -> memoryview:
    if isinstance(chunk, np.ndarray):
        return memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
    mv = memoryview(chunk)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _stream(f: BinaryIO, path: str, s: TensorSource) -> None:
    """Write one source's chunks as they come; the byte count must be exactly ``s.nbytes``."""
    n = 0
    for chunk in s.chunks():
        mv = _byte_view(chunk)
        n += mv.nbytes
        if n > s.nbytes:
            break
        f.write(mv)
    if n != s.nbytes:
        got = f"more than {s.nbytes}" if n > s.nbytes else str(n)
        raise CheckpointError(
            f"{path}: tensor {s.name!r}: source produced {got} bytes but {_shape_str(s.dtype, s.shape)} "
            f"needs {s.nbytes}"
        )


def write_safetensors(
    path: str | os.PathLike[str], tensors: Iterable[TensorSource], *, metadata: dict[str, str] | None = None,
    mode: int | None = None,
) -> None:
    """Write a standard safetensors file atomically (temp file, fsync, rename, fsync the directory).
    ``mode``: the file's permission bits (set before the rename; default: as the umask gives)."""
    p = os.fspath(path)
    sources = _sorted_sources(p, list(tensors))
    header = _header_bytes(p, sources, metadata)
    tmp = p + f".tmp-{os.getpid()}"
    try:
        with os.fdopen(create_temp(tmp), "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(header)
            for s in sources:
                _stream(f, p, s)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        fsync_dir(os.path.dirname(os.path.abspath(p)))
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise CheckpointError(f"{p}: write failed: {e}") from e
        raise
