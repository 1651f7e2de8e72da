"""Parse a safetensors file's header, strictly, into the ``TensorInfo`` of each of its tensors.

The header rules are ``checkpoint.read``'s contract ("Headers are parsed ..."): header length <= 100 MiB
and inside the file, its JSON bounded in depth and in containers per byte before it is parsed (see
``jsonlimits``), unique keys that are Unicode text, known dtypes, shapes of at most 64 non-negative
ints, ``data_offsets`` that hold exactly the shape's bytes inside the data section, no two tensors
overlapping. Every failure raises ``CheckpointError`` with one line that names the file and, where there
is one, the tensor. Reads the header only; ``checkpoint.read`` maps the data.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..dtypes import DTYPES
from ..errors import CheckpointError
from ..io.jsonlimits import brief, json_shape_problem
from .header import MAX_HEADER_BYTES, _shape_str

# A header nests 3 levels (the object, a tensor's entry, its shape), holds 3 arrays/objects per tensor
# in at least 48 bytes, and its arrays hold numbers only. Past these bounds a file is refused before
# json.loads.
HEADER_MAX_DEPTH = 3
MAX_NDIM = 64  # as in a delta's manifest
HEADER_BYTES_PER_CONTAINER = 8


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string, a key of deltarefit.dtypes.DTYPES
    shape: tuple[int, ...]
    nbytes: int
    file: str  # absolute path of the .safetensors file holding it
    offset: int  # absolute byte offset of the tensor data within that file


class _NotText(ValueError):
    """A string of the JSON that is no Unicode text: a ``\\ud800`` escape without its pair."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {brief(k)}")
        # JSON escapes can spell a lone surrogate; such a name cannot be hashed, written to a manifest
        # or rewritten (UTF-8 has no encoding for it), so it is refused here, once, with its name.
        for s in (k, v) if isinstance(v, str) else (k,):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise _NotText(f"{ascii(s)[:80]} is not Unicode text (an unpaired surrogate escape)") from None
        out[k] = v
    return out


def _load_json(raw: bytes, what: str, max_depth: int, *, arrays_of_numbers: bool = False) -> Any:
    # A header's arrays are shapes (at most MAX_NDIM numbers) and data offsets (two); twice that is
    # refused before parsing, what lies between by the shape check, which names the tensor.
    problem = json_shape_problem(raw, max_depth=max_depth, bytes_per_container=HEADER_BYTES_PER_CONTAINER,
                                 arrays_of_numbers=arrays_of_numbers,
                                 max_array_len=2 * MAX_NDIM if arrays_of_numbers else None)
    if problem:
        raise CheckpointError(f"{what} {problem}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{what} is not valid JSON: not UTF-8 text (byte {raw[e.start]:#04x} at offset "
                              f"{e.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _NotText as e:
        raise CheckpointError(f"{what}: {e}") from None
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{what} is not valid JSON: {e}") from None


def _read_header(f: BinaryIO, label: str, file: str) -> list[TensorInfo]:
    """Validate one file's header; its tensors in data order, offsets absolute."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise CheckpointError(f"{label}: truncated: {size} bytes, too short for the 8-byte header length")
    (hlen,) = struct.unpack("<Q", f.read(8))
    # What other files' first bytes give is a header length no checkpoint has, or a header that is not a
    # JSON object: such a file is named for what it is, not for its "header length".
    if hlen > MAX_HEADER_BYTES:
        raise CheckpointError(f"not a safetensors file: {label} (its first 8 bytes give a header length of {hlen}, "
                              f"which exceeds the {MAX_HEADER_BYTES >> 20} MiB limit)")
    first = f.read(1)
    if hlen < 2 or first != b"{":
        raise CheckpointError(f"not a safetensors file: {label} (its header is not a JSON object: it must start "
                              "with '{')")
    raw = first + f.read(hlen - 1) if 8 + hlen <= size else b""
    if len(raw) != hlen:
        raise CheckpointError(f"{label}: header length {hlen} runs past the end of the file ({size} bytes)")
    try:
        header = _load_json(raw, f"{label}: header", HEADER_MAX_DEPTH, arrays_of_numbers=True)
    except CheckpointError as e:
        if " is not valid JSON" in str(e):
            raise CheckpointError(f"not a safetensors file: {e}") from None
        raise
    if not isinstance(header, dict):
        raise CheckpointError(f"{label}: header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(f"{label}: __metadata__ is not an object of strings")
    start = 8 + hlen
    infos = [_read_entry(label, file, k, v, start, size - start) for k, v in header.items()]
    _check_overlaps(label, infos, start)
    return sorted(infos, key=lambda t: t.offset)


def _read_entry(label: str, file: str, name: str, entry: Any, start: int, data_size: int) -> TensorInfo:
    where = f"{label}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: header entry is not an object")
    dt = entry.get("dtype")
    if not isinstance(dt, str) or dt not in DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {brief(dt)}; supported: {', '.join(DTYPES)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape {brief(shape)} is not a list of non-negative integers")
    if len(shape) > MAX_NDIM:  # before the product: millions of dimensions would take minutes
        raise CheckpointError(f"{where}: shape has {len(shape)} dimensions, limit {MAX_NDIM}")
    offs = entry.get("data_offsets")
    if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int and o >= 0 for o in offs)):
        raise CheckpointError(f"{where}: data_offsets {brief(offs)} is not a pair of non-negative integers")
    begin, end = offs
    need = math.prod(shape) * DTYPES[dt].itemsize
    if begin > end:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] begin after they end")
    if end - begin != need:
        raise CheckpointError(
            f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes but {_shape_str(dt, shape)} needs {need}"
        )
    if end > data_size:
        raise CheckpointError(
            f"{where}: data_offsets [{begin}, {end}] run past the end of the data section ({data_size} bytes)"
        )
    return TensorInfo(name, dt, tuple(shape), need, file, start + begin)


def _check_overlaps(label: str, infos: list[TensorInfo], start: int) -> None:
    spans = sorted((t for t in infos if t.nbytes), key=lambda t: t.offset)
    for a, b in itertools.pairwise(spans):
        if b.offset < a.offset + a.nbytes:
            raise CheckpointError(
                f"{label}: tensors {a.name!r} [{a.offset - start}, {a.offset - start + a.nbytes}] and "
                f"{b.name!r} [{b.offset - start}, {b.offset - start + b.nbytes}] overlap"
            )
