"""The sharded part format and the version manifest that joins parts.

A **part** is what one trainer rank publishes for one version: for every checkpoint tensor it owns
elements of, the *cells* it covers (boxes in checkpoint coordinates) with, per cell, the additive
base/target digests and the codec chunks of the cell's changes in cell (box) order. It holds no
executable content: fixed bytes, one JSON header, raw codec payloads. Never pickled.

```
offset 0   magic  b"DRSHPART" (8) | u16 format_version (1 or 2) | u16 zero | u32 header_len
offset 16  header (header_len bytes of UTF-8 JSON)
           payload (header["payload_bytes"] bytes: chunk payloads back to back, in header order)
```

Header::

    {"format": "deltarefit.shard_part", "format_version": 2, "version": 7, "rank": 0, "world": 2,
     "keyframe": false, "payload_bytes": 1234, "payload_blake3": "<64 hex>",
     "tensors": [{"name": "model.layers.0.mlp.down_proj.weight", "dtype": "BF16", "shape": [64, 128],
                  "cells": [{"box": [[off, stride, len], ...one per checkpoint dim],
                             "base": "<32 hex additive digest>" | null (keyframe),
                             "target": "<32 hex>", "changed": 17,
                             "chunks": [[first, count, encoding, n_changed, offset, length, decoded_len]]}]}]}

A chunk covers cell-order elements ``[first, first + count)`` (at most ``chunk_elems`` =
1 MiB / itemsize); only chunks with changes are listed (a keyframe lists every chunk, encoding
``overwrite``). ``offset`` is relative to the payload start. Encodings and payloads are exactly the
codec's (FORMAT.md, "Chunks and encodings"), with the chunk's base being the base bits of those cell
elements in cell order. ``format_version`` (the prefix's and the header's, equal) follows the delta format's
(FORMAT.md, "Versions"): a version 1 part holds encodings 1-5 only, a version 2 part also 6 and 7; readers
read both and refuse any other version.

A **version manifest** (``join``) names every part by size and BLAKE3 (and the bounding box of its
cells per tensor, ``covers``, so a rollout rank fetches only the parts that meet its slices) and
gives, per checkpoint tensor, the base and target digests (sums of the cells' digests). ``join`` checks that the parts'
cells of each tensor are pairwise disjoint and cover it exactly, so a lost, duplicated or overlapping
part is refused before any rollout sees it. The manifest's canonical bytes (sorted keys, compact) can
be signed with Ed25519 (``deltarefit.signing``).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import blake3

from ..codec.chunk import ENCODING_NAMES, OVERWRITE, max_payload_len
from ..dtypes import DType
from ..dtypes import dtype as lookup_dtype
from ..errors import FormatError, IntegrityError, LimitError
from ..format.layout import check_encodings, check_version
from ..geometry.projection import Box, intersect_boxes
from ..integrity import additive as D
from ..io.jsonlimits import json_shape_problem_of_pieces, parse_cost

MAGIC = b"DRSHPART"
FORMAT_VERSION = 2  # what ``write_part`` writes by default; readers read ``format.VERSIONS`` (1 and 2)
# What a real header needs: about 250 bytes per cell (its box and two digests; the tensor's name, dtype
# and shape once per tensor) and 45 per listed chunk (a keyframe lists every 1 MiB chunk). A rank of a
# 1T-parameter MoE over 256 ranks, its experts spread by expert parallelism, covers about 1,000 checkpoint
# tensors (its experts, its slices of the dense ones), each cut into at most 8 cells by the rollout
# layouts: 8,000 x 250 bytes = 2 MB, and its 8 GB of weights are 8,000 chunks, 360 KB, on a keyframe.
# 16 MiB leaves seven times that (60,000 cells of one rank). What parsing a hostile header that size
# costs (its shape bounded below) stays under 256 MiB (``bench.hostile``).
MAX_HEADER = 16 << 20
HEADER_MAX_DEPTH = 8
# Real headers hold one array/object per 29 bytes or more (a cell of a 2-d box and one chunk; a keyframe's
# chunk lists run at one per 40) and one string (keys included) per 24 bytes or more (a delta of many
# small cells: keys, digests); a 3-element list costs Python about 90 bytes, a string 50-60.
HEADER_BYTES_PER_CONTAINER = 16
HEADER_BYTES_PER_STRING = 16
HEADER_PARSE_BUDGET = 64 << 20  # ``parse_cost`` of a header: real ones ~10x their size (2.4 MB: 24 MiB)
_PREFIX = struct.Struct("<8sHHI")
_PIECE = 1 << 20  # the shape pass reads the header in slices of this many bytes


@dataclass(frozen=True)
class Chunk:
    first: int
    count: int
    encoding: int
    n_changed: int
    offset: int
    length: int
    decoded_len: int


@dataclass(frozen=True)
class Cell:
    box: Box
    base: str | None
    target: str
    changed: int
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class TensorPart:
    name: str
    dtype: str
    shape: tuple[int, ...]
    cells: tuple[Cell, ...]


@dataclass(frozen=True)
class Part:
    header: dict
    tensors: tuple[TensorPart, ...]
    payload: memoryview

    @property
    def version(self) -> int:
        return int(self.header["version"])

    @property
    def keyframe(self) -> bool:
        return bool(self.header["keyframe"])

    def payload_of(self, c: Chunk) -> bytes:
        return bytes(self.payload[c.offset:c.offset + c.length])


def write_part(header: dict, payload: bytes, format_version: int = FORMAT_VERSION) -> bytes:
    """Serialize a part of ``format_version`` (1 or 2); fills in ``payload_bytes`` and ``payload_blake3``.
    A chunk of an encoding that version lacks is refused (``FormatError``)."""
    check_version(format_version, "part", "part format version")
    check_encodings(format_version, (k[2] for t in header.get("tensors", ()) for c in t["cells"] for k in c["chunks"]),
                    "part", "part")
    header = dict(header, format="deltarefit.shard_part", format_version=format_version,
                  payload_bytes=len(payload), payload_blake3=blake3.blake3(payload).hexdigest())
    hb = json.dumps(header, separators=(",", ":"), sort_keys=True).encode("utf-8")
    if len(hb) > MAX_HEADER:  # refused here, by the writer, rather than by every reader
        raise LimitError(f"part header of {len(hb)} bytes exceeds the {MAX_HEADER >> 20} MiB limit (too many "
                         "chunks for one rank: shard the checkpoint over more ranks)")
    return _PREFIX.pack(MAGIC, format_version, 0, len(hb)) + hb + payload


def _int(x, where: str, lo: int = 0) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < lo:
        raise FormatError(f"{where}: expected an integer >= {lo}, got {x!r}")
    return x


def _hex(x, where: str, nullable: bool) -> str | None:
    if x is None and nullable:
        return None
    if not isinstance(x, str):
        raise FormatError(f"{where}: expected a digest, got {x!r}")
    try:
        D.from_hex(x)
    except ValueError:
        raise FormatError(f"{where}: bad digest {x!r}") from None
    return x


def part_head(data: bytes | memoryview) -> bytes:
    """The fixed prefix and JSON header of a serialized part: what a committer needs to join it
    (``read_part(head, head_only=True)``), a few KB instead of the payload."""
    mv = memoryview(data)
    if len(mv) < _PREFIX.size:
        raise FormatError(f"{len(mv)} bytes is too short for a part")
    hlen = _PREFIX.unpack(mv[:_PREFIX.size])[3]
    return bytes(mv[:_PREFIX.size + hlen])


def read_part(data: bytes | memoryview, where: str = "part", *, head_only: bool = False,
              max_header: int = MAX_HEADER) -> Part:
    """Parse and validate a part (every bound checked before any payload is decoded). With
    ``head_only``, ``data`` is ``part_head`` of it: everything but the payload is checked, and chunk
    offsets are checked against the header's payload size; the result has an empty payload.
    ``max_header``: a tighter bound on its header (``budget.header_budget`` of the version manifest)."""
    h, payload = _read_header(memoryview(data), where, min(max_header, MAX_HEADER))
    payload_bytes = _check_payload(h, payload, where, head_only)
    for k in ("version", "rank", "world"):
        _int(h.get(k), f"{where}: {k}")
    keyframe = h.get("keyframe")
    if not isinstance(keyframe, bool) or not isinstance(h.get("tensors"), list):
        raise FormatError(f"{where}: bad keyframe flag or tensor list")
    pos = 0  # the next chunk's payload offset: chunks are contiguous, in header order
    tensors = []
    for ti, t in enumerate(h["tensors"]):
        tensor, pos = _read_tensor(t, ti, where, keyframe, pos)
        tensors.append(tensor)
        check_encodings(h["format_version"], (k.encoding for c in tensor.cells for k in c.chunks),
                        f"{where}: tensor {tensor.name!r}", "part")
    if pos != payload_bytes:
        raise FormatError(f"{where}: chunks cover {pos} of {payload_bytes} payload bytes")
    return Part(h, tuple(tensors), payload)


def _read_header(mv: memoryview, where: str, cap: int = MAX_HEADER) -> tuple[dict, memoryview]:
    """The fixed prefix and JSON header of a part, checked; the header and the bytes after it."""
    if len(mv) < _PREFIX.size:
        raise FormatError(f"{where}: {len(mv)} bytes is too short for a part")
    magic, ver, zero, hlen = _PREFIX.unpack(mv[:_PREFIX.size])
    if magic != MAGIC:
        raise FormatError(f"{where}: not a deltarefit shard part (magic {magic!r})")
    check_version(ver, where, "part format version")
    if zero:
        raise FormatError(f"{where}: the prefix's reserved field is {zero}, not 0")
    if hlen > cap and cap < MAX_HEADER:
        raise LimitError(f"{where}: header of {hlen} bytes exceeds the {cap} bytes what the version manifest says "
                         "the part covers may need")
    if hlen > MAX_HEADER or _PREFIX.size + hlen > len(mv):
        raise LimitError(f"{where}: header of {hlen} bytes does not fit")
    raw = mv[_PREFIX.size:_PREFIX.size + hlen]
    # Memory before trust: the header's shape is bounded before json.loads builds it (a part nests 7
    # levels), read in slices (no copy of the header), and its text is decoded straight from the part.
    why = json_shape_problem_of_pieces((bytes(raw[i:i + _PIECE]) for i in range(0, hlen, _PIECE)),
                                       max_depth=HEADER_MAX_DEPTH, bytes_per_container=HEADER_BYTES_PER_CONTAINER,
                                       bytes_per_string=HEADER_BYTES_PER_STRING)
    cost = sum(parse_cost(bytes(raw[i:i + _PIECE])) + 80 for i in range(0, hlen, _PIECE))  # +80: a cut string
    if why is None and cost > HEADER_PARSE_BUDGET:
        why = f"would cost about {cost >> 20} MiB parsed, more than {HEADER_PARSE_BUDGET >> 20} MiB"
    if why is not None:
        raise LimitError(f"{where}: header {why}")
    try:
        h = json.loads(str(raw, "utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"{where}: header is not JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(h, dict) or h.get("format") != "deltarefit.shard_part" or h.get("format_version") != ver \
            or type(h.get("format_version")) is not int:
        raise FormatError(f"{where}: not a shard part header of format version {ver} (the prefix's)")
    return h, mv[_PREFIX.size + hlen:]


def _check_payload(h: dict, payload: memoryview, where: str, head_only: bool) -> int:
    """The header's payload size, checked against the payload and its BLAKE3 (a head: no payload)."""
    payload_bytes = _int(h.get("payload_bytes"), f"{where}: payload_bytes")
    if head_only:
        if len(payload):
            raise FormatError(f"{where}: a part head has {len(payload)} bytes after its header")
    elif payload_bytes != len(payload):
        raise IntegrityError(f"{where}: payload is {len(payload)} bytes, header says {h.get('payload_bytes')}")
    elif blake3.blake3(payload).hexdigest() != h.get("payload_blake3"):
        raise IntegrityError(f"{where}: payload does not hash to the header's BLAKE3")
    return payload_bytes


def _read_tensor(t, ti: int, where: str, keyframe: bool, pos: int) -> tuple[TensorPart, int]:
    """Header entry ``ti`` as a TensorPart, its chunks' payloads starting at ``pos``; and the offset
    after them."""
    w = f"{where}: tensor {ti}"
    if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not isinstance(t.get("shape"), list):
        raise FormatError(f"{w}: malformed entry")
    w = f"{where}: tensor {t['name']!r}"
    try:
        if not isinstance(t.get("dtype"), str):
            raise FormatError(f"dtype {t.get('dtype')!r} is not a name")
        dt = lookup_dtype(t["dtype"])
    except FormatError as e:
        raise FormatError(f"{w}: {e}") from None
    shape = tuple(_int(d, f"{w}: shape") for d in t["shape"])
    if not shape or len(shape) > 64 or not isinstance(t.get("cells"), list):
        raise FormatError(f"{w}: bad shape or cell list")
    cells = []
    for ci, c in enumerate(t["cells"]):
        cell, pos = _read_cell(c, f"{w} cell {ci}", shape, dt, keyframe, pos)
        cells.append(cell)
    return TensorPart(t["name"], dt.name, shape, tuple(cells)), pos


def _read_cell(c, wc: str, shape: tuple[int, ...], dt: DType, keyframe: bool, pos: int) -> tuple[Cell, int]:
    """A tensor entry's cell: its box inside ``shape``, digests, and chunks (see ``_read_chunks``)."""
    if not isinstance(c, dict) or not isinstance(c.get("box"), list) or len(c["box"]) != len(shape):
        raise FormatError(f"{wc}: malformed")
    try:
        aps = [tuple(_int(v, wc, lo) for v, lo in zip(ap, (0, 1, 1), strict=True)) for ap in c["box"]]
    except (TypeError, ValueError):
        raise FormatError(f"{wc}: malformed box") from None
    if any(o + s * (n - 1) >= d for (o, s, n), d in zip(aps, shape, strict=True)):
        raise FormatError(f"{wc}: box {c['box']} leaves shape {list(shape)}")
    box = Box.from_json(shape, aps)
    base = _hex(c.get("base"), f"{wc}: base", nullable=keyframe)
    if keyframe and base is not None:
        raise FormatError(f"{wc}: a keyframe cell has no base")
    target = _hex(c.get("target"), f"{wc}: target", nullable=False)
    changed = _int(c.get("changed"), f"{wc}: changed")
    if not isinstance(c.get("chunks"), list):
        raise FormatError(f"{wc}: no chunk list")
    chunks, total, pos = _read_chunks(c["chunks"], wc, box, dt, keyframe, pos)
    if keyframe:
        if sum(ch.count for ch in chunks) != box.count:
            raise FormatError(f"{wc}: a keyframe cell's chunks must cover it")
    elif total != changed:
        raise FormatError(f"{wc}: chunks hold {total} changes, cell says {changed}")
    return Cell(box, base, target, changed, tuple(chunks)), pos


def _read_chunks(entries: list, wc: str, box: Box, dt: DType, keyframe: bool,
                 pos: int) -> tuple[list[Chunk], int, int]:
    """A cell's chunk list: in cell order inside the box, at most ``chunk_elems`` each, encodings and
    sizes within the codec's bounds, payloads contiguous from ``pos``. Returns (chunks, their changes,
    the payload offset after them)."""
    chunk_elems = max(1, (1 << 20) // dt.itemsize)
    chunks, end, total = [], 0, 0
    for k in entries:
        if not isinstance(k, list) or len(k) != 7:
            raise FormatError(f"{wc}: malformed chunk {k!r}")
        ch = Chunk(*(_int(v, wc) for v in k))
        if ch.first < end or ch.count < 1 or ch.count > chunk_elems or ch.first + ch.count > box.count:
            raise FormatError(f"{wc}: chunk {k} out of order or outside the cell of {box.count} elements")
        if ch.encoding not in ENCODING_NAMES or (keyframe and ch.encoding != OVERWRITE):
            raise FormatError(f"{wc}: bad encoding {ch.encoding}")
        if not (0 if keyframe else 1) <= ch.n_changed <= ch.count:
            raise FormatError(f"{wc}: chunk claims {ch.n_changed} changes in {ch.count} elements")
        if ch.offset != pos or ch.length > max_payload_len(dt, ch.count):
            raise FormatError(f"{wc}: chunk payload at {ch.offset}+{ch.length} is not contiguous/limited")
        if ch.decoded_len > 2 * ch.count * dt.itemsize + 64:
            raise LimitError(f"{wc}: decoded length {ch.decoded_len} over the limit "
                             f"{2 * ch.count * dt.itemsize + 64}")
        pos += ch.length
        end = ch.first + ch.count
        total += ch.n_changed
        chunks.append(ch)
    return chunks, total, pos


# ---------------------------------------------------------------------------------------- manifest


def _size_and_hash(b: bytes | memoryview | tuple[int, str]) -> tuple[int, str]:
    if isinstance(b, tuple):
        return int(b[0]), str(b[1])
    return len(b), blake3.blake3(b).hexdigest()


def join(parts: Sequence[Part], blobs: Sequence[bytes | memoryview | tuple[int, str]]) -> dict:
    """The version manifest of parts of every trainer rank. ``blobs``: the parts' serialized bytes, or
    their (size, BLAKE3) when only their heads were read (``read_part(..., head_only=True)``).

    Refuses (FormatError) parts of different versions, missing or repeated ranks, and cells of a tensor
    that overlap or do not cover it exactly. Reads headers only (parts are already parsed).
    """
    if not parts or len(parts) != len(blobs):
        raise FormatError("join needs every part and its bytes")
    world = parts[0].header["world"]
    ranks = sorted(p.header["rank"] for p in parts)
    if ranks != list(range(world)) or {p.header["world"] for p in parts} != {world}:
        raise FormatError(f"parts of ranks {ranks} do not make a world of {world}")
    if len({p.version for p in parts}) != 1 or len({p.keyframe for p in parts}) != 1:
        raise FormatError("parts of different versions (or keyframe flags) cannot be joined")
    cells: dict[str, list[Cell]] = {}
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for p in parts:
        for t in p.tensors:
            if meta.setdefault(t.name, (t.dtype, t.shape)) != (t.dtype, t.shape):
                raise FormatError(f"tensor {t.name!r}: parts disagree on dtype/shape")
            cells.setdefault(t.name, []).extend(t.cells)
    tensors = {}
    changed = elements = 0
    for name in sorted(cells):
        dt, shape = meta[name]
        cs = cells[name]
        n = sum(c.box.count for c in cs)
        if n != math.prod(shape):
            raise FormatError(f"tensor {name!r}: parts cover {n} of {math.prod(shape)} elements")
        # Equal counts plus pairwise disjoint cells means an exact cover. Sweep along dim 0: only cells
        # whose dim-0 ranges overlap are compared (dim-0 shards: a handful each).
        order = sorted(cs, key=lambda c: c.box.aps[0].off)
        active: list[Cell] = []
        for c in order:
            active = [a for a in active if a.box.aps[0].last >= c.box.aps[0].off]
            for a in active:
                if intersect_boxes(a.box, c.box) is not None:
                    raise FormatError(f"tensor {name!r}: cells {a.box.to_json()} and {c.box.to_json()} overlap")
            active.append(c)
        base = None if parts[0].keyframe else D.ZERO.copy()
        target = D.ZERO.copy()
        for c in cs:
            if base is not None:
                base = D.add(base, D.from_hex(c.base))
            target = D.add(target, D.from_hex(c.target))
            changed += c.changed
        elements += n
        tensors[name] = {"dtype": dt, "shape": list(shape), "base": None if base is None else D.to_hex(base),
                         "target": D.to_hex(target)}
    return {"format": "deltarefit.shard_version", "format_version": 1, "version": parts[0].version,
            "keyframe": parts[0].keyframe, "world": world,
            "parts": [{"rank": p.header["rank"], "bytes": sh[0], "blake3": sh[1], "covers": _covers(p)}
                      for p, sh in sorted(zip(parts, map(_size_and_hash, blobs), strict=True),
                                          key=lambda pb: pb[0].header["rank"])],
            "tensors": tensors, "changed": changed, "elements": elements}


def _covers(p: Part) -> dict[str, list[list[int]]]:
    """Per tensor, the bounding box ``[[lo, hi) per dim]`` of a part's cells: lets a rollout rank fetch
    only the parts that meet its slice (``parts_needed``). An over-approximation is harmless: apply
    checks exact coverage."""
    out = {}
    for t in p.tensors:
        if t.cells:
            out[t.name] = [[min(c.box.aps[d].off for c in t.cells), max(c.box.aps[d].last for c in t.cells) + 1]
                           for d in range(len(t.shape))]
    return out


# What a real version manifest needs: about 160 bytes per tensor (its name, dtype, shape and two digests)
# and 75 per tensor a part covers. A 1T-parameter MoE of 71,000 checkpoint tensors (61 layers of 384
# experts of 3 matrices, and the dense ones) over 256 ranks with its experts spread by expert parallelism
# (each rank covering about 1,000 tensors: its experts and its slices of the dense ones) needs
# 71,000 x 160 + 256 x 1,000 x 75 bytes = 30 MB. Past the cap a manifest is refused before it is read.
MAX_MANIFEST_BYTES = 32 << 20


def manifest_bytes(manifest: dict) -> bytes:
    """Canonical bytes (what a signature covers): sorted keys, compact separators, UTF-8, no signature.
    Refused (``LimitError``) past ``MAX_MANIFEST_BYTES``, here, rather than by every reader."""
    m = {k: v for k, v in manifest.items() if k != "signature"}
    data = json.dumps(m, sort_keys=True, separators=(",", ":")).encode("utf-8")
    if len(data) > MAX_MANIFEST_BYTES:
        raise LimitError(f"version manifest of {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES >> 20} MiB limit "
                         "(too many tensors covered by too many parts)")
    return data


def sign_manifest(manifest: dict, signer) -> dict:
    """Add an Ed25519 signature (``deltarefit.signing.Signer``) over the canonical bytes."""
    return dict(manifest, signature={"alg": "ed25519", "key_id": signer.key_id,
                                     "sig": signer.sign(manifest_bytes(manifest))})


def verify_manifest(manifest: dict, verifier) -> None:
    """Raise ``SignatureError`` unless the manifest carries a valid signature by ``verifier``'s key."""
    from ..signing import SignatureError

    sig = manifest.get("signature")
    if not isinstance(sig, dict) or sig.get("alg") != "ed25519" or sig.get("key_id") != verifier.key_id:
        raise SignatureError(f"version {manifest.get('version')}: unsigned or signed by another key")
    verifier.verify(manifest_bytes(manifest), sig.get("sig", ""), f"version {manifest.get('version')}")


def check_blob(manifest: dict, rank: int, blob: bytes | memoryview) -> None:
    """The part of ``rank`` must have the manifest's size and BLAKE3 (IntegrityError otherwise)."""
    ent = next((p for p in manifest["parts"] if p["rank"] == rank), None)
    if ent is None:
        raise FormatError(f"version {manifest['version']} has no part of rank {rank}")
    if len(blob) != ent["bytes"] or blake3.blake3(blob).hexdigest() != ent["blake3"]:
        raise IntegrityError(f"version {manifest['version']}: part of rank {rank} does not match its size/BLAKE3")
