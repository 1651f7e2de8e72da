"""A version manifest as a rollout reads it: its stored bytes checked in one pass against the one form
the committer writes, then kept as offsets into those bytes.

The committer stores a manifest as ``part.manifest_bytes`` writes it: ``json.dumps`` with sorted keys,
compact separators and ASCII escapes, no signature. That form is the grammar here, and any other byte
(whitespace, another key order, an unknown key, a float, a non-canonical escape, a duplicate or
unsorted name) is refused in one line naming its offset::

    {"changed":N,"elements":N,"format":"deltarefit.shard_version","format_version":1,"keyframe":B,
     "parts":[{"blake3":"<64 hex>","bytes":N,"covers":{"<name>":[[lo,hi],...],...},"rank":R},...],
     "tensors":{"<name>":{"base":null|"<32 hex>","dtype":"BF16","shape":[N,...],"target":"<32 hex>"},...},
     "version":N,"world":N}

**Memory before trust.** A manifest of an unsigned stream is parsed before anything vouches for it,
so what it costs must not grow faster than its size. ``json.loads`` builds a Python object per number,
list and string: 4-6x the text (a real 1T-MoE manifest of 29 MiB, 5.0x). Here nothing is built per
entry that outlives the entry: per tensor 25 bytes of arrays (its offsets, its rank and its name's hash
in a sorted index) against at least 85 bytes of text, per part 20 bytes against at least 109, nothing
per cover but a bounded cache (the shapes and good bounds of at most 16,384 tensors). The checks are
regular expressions over the bytes (C loops, no nesting to recurse into). The peak is the stored bytes
plus under half of them, so under twice the manifest's size plus a fixed amount (``bench.trust_memory``
prints it at the cap).

**Access.** ``VersionManifest`` is a read-only ``Mapping`` with the keys above; ``["tensors"]`` is a
``Mapping`` from name to ``{"base", "dtype", "shape", "target"}`` built on access, iterated in sorted
order; ``["parts"]`` is a list of part ``Mapping`` s whose ``"covers"`` iterates its entries from the
bytes. A dict manifest (``part.join``'s) and this one are read by the same code.
"""

from __future__ import annotations

import bisect
import json
import operator
import re
from array import array
from collections.abc import Iterator, Mapping

import numpy as np

from ..dtypes import DTYPES
from ..errors import FormatError

_NUM = rb"(?:0|[1-9][0-9]{0,18})"  # a non-negative integer under 10**19 (checked under 2**63 below)
# A name as json.dumps(ensure_ascii=True) writes it: printable ASCII but '"' and '\', or an escape.
_CH = rb'[\x20\x21\x23-\x5b\x5d-\x7f]*'  # (an unrolled loop: runs of plain characters between escapes)
_STR = rb'"(' + _CH + rb'(?:\\(?:["\\bfnrt]|u[0-9a-f]{4})' + _CH + rb')*)"'
_HEAD = re.compile(rb'\{"changed":(' + _NUM + rb'),"elements":(' + _NUM + rb'),"format":"deltarefit\.shard_version",'
                   rb'"format_version":1,"keyframe":(true|false),"parts":\[')
_PART_HEAD = re.compile(rb'\{"blake3":"[0-9a-f]{64}","bytes":(' + _NUM + rb'),"covers":\{')
# At most 64 dims (MAX_NDIM), as a tensor's shape: a cover's bounds are parsed whole.
_COVER = re.compile(_STR + rb':\[((?:\[' + _NUM + rb',' + _NUM + rb'\])(?:,\[' + _NUM + rb',' + _NUM + rb'\]){0,63})?\]')
_PART_TAIL = re.compile(rb'\},"rank":(' + _NUM + rb')\}')
# Groups: 1 name, 2 base (null or quoted hex), 3 dtype, 4 the shape's dims, 5 target (quoted hex).
_TENSOR = re.compile(_STR + rb':\{"base":(null|"[0-9a-f]{32}"),"dtype":"([A-Z0-9_]{1,16})",'
                     rb'"shape":\[((?:' + _NUM + rb')(?:,' + _NUM + rb'){0,63})?\],"target":("[0-9a-f]{32}")\}')
_TAIL = re.compile(rb'\},"version":(' + _NUM + rb'),"world":(' + _NUM + rb')\}\Z')
_INT = re.compile(_NUM)
_FORMAT_VERSION = re.compile(rb'"format_version":(-?[0-9]+)')
_INT_MAX = (1 << 63) - 1
_KEYS = ("changed", "elements", "format", "format_version", "keyframe", "parts", "tensors", "version", "world")


def _int(raw: bytes, what: str, at: int) -> int:
    v = int(raw)
    if v > _INT_MAX:
        raise FormatError(f"byte {at}: {what} {raw[:24].decode()} is past 2**63")
    return v


def _name(raw: bytes) -> str:
    """A name's text (between its quotes, as matched by ``_STR``) decoded."""
    return json.loads(b'"' + raw + b'"') if b"\\" in raw else raw.decode("ascii")


def _canonical(name: str) -> bytes:
    """The bytes json.dumps(ensure_ascii=True) writes for ``name``, without the quotes."""
    return json.dumps(name)[1:-1].encode("ascii")


def _expect(m: re.Match | None, what: str, at: int) -> re.Match:
    if m is None:
        raise FormatError(f"byte {at}: expected {what} in the committer's form "
                          "(sorted keys, compact separators, ASCII)")
    return m


class VersionManifest(Mapping):
    """A checked version manifest over its stored bytes (see the module's docstring)."""

    __slots__ = ("_p_bytes", "_p_covers", "_p_end", "_p_hash", "_top", "data", "tensors")

    def __init__(self, data: bytes) -> None:
        """Check ``data`` whole; ``FormatError`` (one line, with the byte offset) on any departure."""
        if not isinstance(data, bytes):
            data = bytes(data)
        if len(data) >= 1 << 32:  # (offsets are kept in 32 bits; manifests are capped far below)
            raise FormatError(f"a version manifest of {len(data)} bytes: more than 4 GiB")
        self.data = data
        fv = _FORMAT_VERSION.search(data, 0, 256)
        if fv is not None and fv[1] != b"1":
            raise FormatError(f"byte {fv.start(1)}: format_version {fv[1][:24].decode()}; this reader knows 1 "
                              "(upgrade deltarefit)")
        m = _expect(_HEAD.match(data), 'the head {"changed":..,"format_version":1,..,"parts":[', 0)
        top = {"changed": _int(m[1], "changed", m.start(1)), "elements": _int(m[2], "elements", m.start(2)),
               "format": "deltarefit.shard_version", "format_version": 1, "keyframe": m[3] == b"true"}
        pos = m.end()
        p_bytes, p_hash, p_covers, p_end = array("q"), array("I"), array("I"), array("I")
        if data[pos:pos + 1] != b"]":
            while True:
                m = _expect(_PART_HEAD.match(data, pos), 'a part {"blake3":..,"bytes":..,"covers":{', pos)
                if int(m[1]) > _INT_MAX or len(p_hash) >= 1 << 31:
                    raise FormatError(f"byte {m.start(1)}: part bytes past 2**63")
                p_bytes.append(int(m[1]))
                p_hash.append(pos + 11)
                p_covers.append(m.end())
                # A covers object ends at the first '},"rank":' (a bare '"' cannot stand in a name), its
                # entries checked once the tensors are known (``TensorTable.check_covers``).
                end = data.find(b'},"rank":', m.end())
                m = _expect(_PART_TAIL.match(data, end) if end > 0 else None, '},"rank":R}', m.end())
                p_end.append(end)
                if int(m[1]) != len(p_hash) - 1:
                    raise FormatError(f"byte {m.start(1)}: part of rank {m[1][:24].decode()} where rank "
                                      f"{len(p_hash) - 1} belongs (parts are listed by rank, from 0)")
                pos = m.end()
                if data[pos:pos + 1] != b",":
                    break
                pos += 1
        if data[pos:pos + 13] != b'],"tensors":{':
            raise FormatError(f"byte {pos}: expected the end of the parts and \"tensors\"")
        self.tensors = TensorTable(data, pos + 13)
        m = _expect(_TAIL.match(data, self.tensors.end), '},"version":N,"world":N} and the end', self.tensors.end)
        top["version"] = _int(m[1], "version", m.start(1))
        top["world"] = _int(m[2], "world", m.start(2))
        self._top, self._p_bytes, self._p_hash, self._p_covers, self._p_end = top, p_bytes, p_hash, p_covers, p_end
        self.tensors.check_covers(p_covers, p_end)

    def _covers(self, rank: int) -> Iterator[tuple[int, bytes, bytes]]:
        """(offset, raw name, bounds text) of each cover of the part of ``rank``."""
        pos, end, data = self._p_covers[rank], self._p_end[rank], self.data
        while pos < end:
            m = _COVER.match(data, pos, end)
            yield pos, m[1], m[2] or b""
            pos = m.end() + 1

    def __getitem__(self, key: str):
        if key == "tensors":
            return self.tensors
        if key == "parts":
            return [PartEntry(self, r) for r in range(len(self._p_hash))]
        return self._top[key]

    def __iter__(self) -> Iterator[str]:
        return iter(_KEYS)

    def __len__(self) -> int:
        return len(_KEYS)

    def part_count(self) -> int:
        return len(self._p_hash)

    def part_ref(self, rank: int) -> tuple[int, str]:
        """(bytes, blake3) of the part of ``rank``, without building its covers."""
        return self._p_bytes[rank], self.data[self._p_hash[rank]:self._p_hash[rank] + 64].decode()


class PartEntry(Mapping):
    """One part of a ``VersionManifest``: rank, bytes, blake3 and covers (iterated from the bytes)."""

    __slots__ = ("_man", "_rank")

    def __init__(self, man: VersionManifest, rank: int) -> None:
        self._man, self._rank = man, rank

    def __getitem__(self, key: str):
        man, r = self._man, self._rank
        if key == "rank":
            return r
        if key == "bytes":
            return man._p_bytes[r]
        if key == "blake3":
            return man.data[man._p_hash[r]:man._p_hash[r] + 64].decode()
        if key == "covers":
            return Covers(man, r)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(("blake3", "bytes", "covers", "rank"))

    def __len__(self) -> int:
        return 4


def _bounds(raw: bytes) -> list[list[int]]:
    v = [int(x) for x in _INT.findall(raw)]
    return [v[i:i + 2] for i in range(0, len(v), 2)]


class Covers(Mapping):
    """A part's covers, ``{tensor: [[lo, hi) per dim]}``, read from the manifest's bytes on each pass."""

    __slots__ = ("_man", "_rank")

    def __init__(self, man: VersionManifest, rank: int) -> None:
        self._man, self._rank = man, rank

    def __getitem__(self, name: str) -> list[list[int]]:
        want = _canonical(name) if isinstance(name, str) else None
        for _, raw, bounds in self._man._covers(self._rank):
            if raw == want:
                return _bounds(bounds)
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (_name(raw) for _, raw, _ in self._man._covers(self._rank))

    def __len__(self) -> int:
        return sum(1 for _ in self._man._covers(self._rank))

    def items(self):  # one pass over the bytes, not a lookup per name; one entry built at a time
        return ((_name(raw), _bounds(b)) for _, raw, b in self._man._covers(self._rank))


class TensorTable(Mapping):
    """The manifest's ``tensors``: name -> ``{"base", "dtype", "shape", "target"}``, sorted by name.

    Kept as offsets (``_start``: a name's opening quote, ``_val``: its value's ``{``, ``_stop``: past
    its ``}``) and, for lookups, the names' hashes sorted (``_hashes``, ``_order``)."""

    __slots__ = ("_data", "_hashes", "_ndim", "_order", "_start", "_stop", "_val", "end")

    def __init__(self, data: bytes, pos: int) -> None:
        self._data = data
        start, val, stop, ndim = array("I"), array("I"), array("I"), array("B")
        prev: str | None = None
        if data[pos:pos + 1] != b"}":
            while True:
                m = _expect(_TENSOR.match(data, pos),
                            '"name":{"base":..,"dtype":..,"shape":[..],"target":..}', pos)
                name = _name(m[1])
                if b"\\" in m[1] and _canonical(name) != m[1]:  # one text per name: lookups compare bytes
                    raise FormatError(f"byte {m.start(1)}: tensor {name[:80]!r} is not written as json.dumps "
                                      "writes it (a non-canonical escape)")
                if prev is not None and name <= prev:
                    raise FormatError(f"byte {pos}: tensor {name[:80]!r} is not after {prev[:80]!r} "
                                      "(names are sorted, each once)")
                if m[3].decode() not in DTYPES:
                    raise FormatError(f"byte {m.start(3)}: tensor {name[:80]!r} has unknown dtype "
                                      f"{m[3].decode()!r}")
                dims = m[4] or b""
                for d in _INT.findall(dims):
                    _int(d, f"tensor {name[:80]!r} dimension", m.start(4))
                start.append(pos)
                val.append(m.end(1) + 2)
                stop.append(m.end())
                ndim.append(dims.count(b",") + 1 if dims else 0)
                prev, pos = name, m.end()
                if data[pos:pos + 1] != b",":
                    break
                pos += 1
        self._start, self._val, self._stop, self._ndim, self.end = start, val, stop, ndim, pos
        # The lookup index: Python's hash of each name's bytes (seeded per process, so collisions cannot
        # be planted), sorted. numpy sorts at 8 bytes a name; two arrays are kept.
        n = len(start)
        h = np.fromiter((hash(data[start[i] + 1:val[i] - 2]) for i in range(n)), np.int64, n)
        order = np.argsort(h, kind="stable")
        self._hashes = array("q", h[order].tobytes())
        self._order = array("I", order.astype(np.uint32).tobytes())

    def _raw(self, i: int) -> bytes:
        return self._data[self._start[i] + 1:self._val[i] - 2]

    def _find(self, raw: bytes) -> int:
        """The index of the tensor named by ``raw`` (its bytes as stored), or -1."""
        h = hash(raw)
        j = bisect.bisect_left(self._hashes, h)
        while j < len(self._hashes) and self._hashes[j] == h:
            if self._raw(self._order[j]) == raw:
                return self._order[j]
            j += 1
        return -1

    def check_covers(self, starts: array, ends: array) -> None:
        """Each part's covers (the spans ``starts[r]:ends[r]``, their grammar checked): every name a
        tensor of the manifest, one ``[lo,hi]`` per dim, ``lo <= hi <= dim``. ``FormatError`` naming
        the first that is not. (The hot loop of a load: a real 1T MoE has 270,000 covers.)"""
        data, shapes, le = self._data, {}, operator.le
        starts_, vals, n = self._start, self._val, len(self._start)
        ints, cover = _INT.findall, _COVER.finditer
        for start, end in zip(starts, ends, strict=True):
            at, prev = start, -1
            for m in cover(data, start, end):
                if m.start() != at or (at != start and data[at - 1] != 44):  # entries back to back, ','
                    raise FormatError(f"byte {at}: expected a cover \"name\":[[lo,hi],..] in the committer's form")
                at = m.end() + 1
                raw, bounds = m.group(1, 2)
                i = prev + 1  # most often the next tensor (a part covers runs of them): no lookup
                if i >= n or data[starts_[i] + 1:vals[i] - 2] != raw:
                    i = self._find(raw)
                if 0 <= i <= prev:  # tensors are sorted by name: so are a part's covers, each once
                    raise FormatError(f"byte {m.start()}: a part covers {_name(raw)[:80]!r} after "
                                      f"{_name(self._raw(prev))[:80]!r} (names are sorted, each once)")
                prev = i
                # Per tensor its shape and the last 8 bounds found good (a dense tensor's slices recur
                # in every part of a tensor-parallel group); at most 16,384 tensors kept.
                shape, good = shapes.get(i) or (None, ())
                if bounds in good:
                    continue
                if shape is None and i >= 0:
                    if len(shapes) >= 1 << 14:
                        shapes.clear()
                    shape = self.shape(i)
                v = list(map(int, ints(bounds))) if bounds else []
                if shape is None or len(v) != 2 * len(shape) or not (
                        all(map(le, v[::2], v[1::2])) and all(map(le, v[1::2], shape))):
                    what = "is not a tensor of the manifest" if shape is None else f"does not fit its shape {shape}"
                    raise FormatError(f"byte {m.start()}: a part's cover of {_name(raw)[:80]!r}, "
                                      f"{str(_bounds(bounds or b''))[:200]}, {what}")
                if bounds is not None:
                    shapes[i] = shape, (bounds, *good[:7])
            if at != end + 1 and start != end:
                raise FormatError(f"byte {at - 1}: expected a cover \"name\":[[lo,hi],..] in the committer's form")

    def shape(self, i: int) -> list[int]:
        return json.loads(self._data[self._val[i]:self._stop[i]])["shape"]

    def __getitem__(self, name: str) -> dict:
        i = self._find(_canonical(name)) if isinstance(name, str) else -1
        if i < 0:
            raise KeyError(name)
        return json.loads(self._data[self._val[i]:self._stop[i]])

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._find(_canonical(name)) >= 0

    def __iter__(self) -> Iterator[str]:
        return (_name(self._raw(i)) for i in range(len(self._start)))

    def __len__(self) -> int:
        return len(self._start)

    def items(self):  # in name order, one parse per entry (no lookups)
        return ((_name(self._raw(i)), json.loads(self._data[self._val[i]:self._stop[i]]))
                for i in range(len(self._start)))

    def values(self):
        return (v for _, v in self.items())

    def state_items(self, which: str) -> Iterator[bytes | None]:
        """Per tensor in name order, ``json.dumps([name, dtype, shape, digest], separators=(",", ":"))``
        as bytes, cut from the stored text (which json.dumps wrote in the same escapes); None for a
        null digest. ``which``: "base" or "target". What ``records.state_fingerprint`` hashes."""
        g = 2 if which == "base" else 5
        if len(self._start) == 0:
            return
        for m in _TENSOR.finditer(self._data, self._start[0], self.end):  # the entries, back to back
            d = m[g]
            yield None if d == b"null" else b'["' + m[1] + b'","' + m[3] + b'",[' + (m[4] or b"") + b"]," + d + b"]"
