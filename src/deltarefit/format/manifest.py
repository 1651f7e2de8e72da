"""A delta's manifest, read from untrusted bytes in bounded memory. See FORMAT.md, "Memory before trust".

``read_manifest`` never holds the manifest's text, nor a Python object tree of it: the zstd frame is
decompressed twice, 64 KiB at a time, first through ``jsonlimits`` (the shape bounds: nesting and
containers per byte, over the whole text), then through a decoder that parses one tensor entry (or one
top-level value) at a time with ``json``'s own scanner (``raw_decode``), checks it, turns it into a
``TensorEntry`` and drops its dicts. What it keeps is charged to a ``layout.ManifestBudget`` entry by
entry, so a small file is refused before it makes the reader large, whatever its expansion. Held at
once besides: a window of text of about 2 x ``MANIFEST_VALUE_CHARS``, one value's objects, the zstd
window (``MANIFEST_WINDOW`` at most) and the shape scan's temporaries.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from typing import Any

import zstandard

from ..dtypes import DTYPES
from ..errors import FormatError, LimitError
from ..integrity import DIGEST_BYTES
from ..io.jsonlimits import brief, json_shape_problem_of_pieces
from .layout import (
    MANIFEST_BYTES_PER_CONTAINER,
    MANIFEST_EXPANSION,
    MANIFEST_MAX_DEPTH,
    MANIFEST_VALUE_CHARS,
    MANIFEST_WINDOW,
    MAX_MANIFEST_TEXT,
    MAX_NDIM,
    OPS,
    SUM_BYTES,
    ManifestBudget,
    TensorEntry,
    TensorMeta,
    manifest_limit,
)

# Top-level values a reader keeps (``DeltaReader.manifest``), each only where its text is short; others
# are parsed (they must be JSON) and dropped. ``stats`` is informational.
KEPT = ("base_fingerprint", "format", "hash", "segment_bytes", "stats", "target_fingerprint", "version")
KEPT_CHARS = 4096
_PIECE = 1 << 16
_WS = re.compile(r"[ \t\n\r]*")
_DTYPE_NAMES = {k: k for k in DTYPES}  # one str object per dtype name, whatever the text spelled
_OP_NAMES = {k: k for k in OPS}


class _NotText(ValueError):
    pass


class _TooLong(Exception):
    pass


def _text_only(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A manifest object, refused where a key or a string holds an unpaired surrogate escape: JSON
    can spell one, UTF-8 cannot encode it, so a tensor so named could be neither hashed, looked up
    in a checkpoint, nor written."""
    for k, v in pairs:
        for s in (k, v) if isinstance(v, str) else (k,):
            _check_text(s)
    return dict(pairs)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise _NotText(f"{ascii(s)[:80]} is not Unicode text (an unpaired surrogate escape)") from None


_DECODER = json.JSONDecoder(object_pairs_hook=_text_only)


def declared_size(frame: bytes | memoryview, p: str) -> int:
    """The expanded size a manifest frame declares, within ``manifest_limit`` of its own size."""
    limit = manifest_limit(len(frame))
    try:
        size = zstandard.get_frame_parameters(frame).content_size
    except zstandard.ZstdError as e:
        raise FormatError(f"{p}: manifest is not a valid zstd frame ({e})") from None
    if size == zstandard.CONTENTSIZE_UNKNOWN:
        raise FormatError(f"{p}: manifest zstd frame does not declare its content size")
    if size > limit:
        raise LimitError(f"{p}: manifest expands to {size} bytes from {len(frame)}, limit {limit} "
                         f"(1 MiB + {MANIFEST_EXPANSION}x its compressed size, at most {MAX_MANIFEST_TEXT})")
    return size


def pieces(frame: bytes | memoryview, size: int, p: str) -> Iterator[bytes]:
    """The manifest's text, ``_PIECE`` bytes at a time; a frame that expands to other than ``size``
    bytes, needs a window over ``MANIFEST_WINDOW`` or is not zstd fails (``FormatError``) when that shows."""
    got = 0
    try:
        with zstandard.ZstdDecompressor(max_window_size=MANIFEST_WINDOW).stream_reader(frame) as r:
            while piece := r.read(_PIECE):
                got += len(piece)
                if got > size:
                    raise FormatError(f"{p}: manifest expands to more than the {size} bytes its frame declares")
                yield piece
    except zstandard.ZstdError as e:
        raise FormatError(f"{p}: manifest is not a valid zstd frame ({e})") from None
    if got != size:
        raise FormatError(f"{p}: manifest expands to {got} bytes, its frame declares {size}")


def read_manifest(frame: bytes | memoryview, p: str, budget: ManifestBudget) -> tuple[dict | None, list | None]:
    """The manifest in ``frame``: its kept top-level values (``KEPT``; None where the manifest is not
    an object) and its tensor entries (None where ``tensors`` is missing or not a list), checked one by
    one (``_tensor_entry``, names strictly increasing, record ranges consecutive) and charged to
    ``budget``. Errors are ``FormatError``/``LimitError`` naming ``p``."""
    size = declared_size(frame, p)
    problem = json_shape_problem_of_pieces(pieces(frame, size, p), max_depth=MANIFEST_MAX_DEPTH,
                                           bytes_per_container=MANIFEST_BYTES_PER_CONTAINER)
    if problem:
        raise LimitError(f"{p}: manifest {problem}")
    text = _Text(pieces(frame, size, p))
    try:
        return _parse(text, p, budget)
    except _NotText as e:
        raise FormatError(f"{p}: manifest: {e}") from None
    except _TooLong:
        raise LimitError(f"{p}: manifest holds a tensor entry or top-level value of more than "
                         f"{MANIFEST_VALUE_CHARS} characters") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # ValueError covers JSONDecodeError and integers past Python's digit limit; RecursionError
        # deep nesting. Hostile manifests must fail as format errors, not crash the reader.
        raise FormatError(f"{p}: manifest is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None


def _parse(text: _Text, p: str, budget: ManifestBudget) -> tuple[dict | None, list | None]:
    if text.peek() != "{":
        text.value()
        text.end()
        return None, None
    text.take()
    top: dict[str, Any] = {}
    tensors: list | None = None
    seen: set[str] = set()
    if text.peek() == "}":
        text.take()
        text.end()
        return top, None
    while True:
        if text.peek() != '"':
            raise ValueError(f"expecting a key at character {text.where()}")
        key, _ = text.value()
        _check_text(key)
        if text.peek() != ":":
            raise ValueError(f"expecting ':' at character {text.where()}")
        text.take()
        if key in seen:
            raise FormatError(f"{p}: manifest lists {key!r} twice")
        if key == "tensors":
            seen.add(key)
            if text.peek() == "[":
                tensors = _tensors(text, p, budget)
            else:
                text.value()
        else:
            v, n = text.value()
            if isinstance(v, str):
                _check_text(v)
            if key in KEPT:
                seen.add(key)
                if n <= KEPT_CHARS:
                    top[key] = v
        c = text.peek()
        text.take()
        if c == "}":
            break
        if c != ",":
            raise ValueError(f"expecting ',' or '}}' at character {text.where() - 1}")
    text.end()
    return top, tensors


def _tensors(text: _Text, p: str, budget: ManifestBudget) -> list[TensorEntry]:
    """The tensor list's entries, from its ``[`` on: each checked, then charged to ``budget`` before
    the next is parsed."""
    text.take()
    out: list[TensorEntry] = []
    if text.peek() == "]":
        text.take()
        return out
    prev = None
    nxt = 0
    while True:
        t, _ = text.value()
        e = _tensor_entry(t, f"{p}: tensor #{len(out)}", budget)
        del t
        if prev is not None and e.name <= prev:
            if e.name == prev:
                raise FormatError(f"{p}: tensor {e.name!r} listed twice")
            raise FormatError(f"{p}: tensor {e.name!r} is listed after {prev!r} (tensors are sorted by name)")
        if e.first != nxt:
            raise FormatError(f"{p}: tensor {e.name!r}: chunk records start at {e.first}, expected {nxt}")
        nxt += e.count
        prev = e.name
        out.append(e)
        c = text.peek()
        text.take()
        if c == "]":
            return out
        if c != ",":
            raise ValueError(f"expecting ',' or ']' at character {text.where() - 1}")


class _Text:
    """The manifest's text, decoded as it is decompressed: a window that holds, after the position
    read next, at least ``MANIFEST_VALUE_CHARS`` + 1 characters or all that is left."""

    def __init__(self, source: Iterator[bytes]) -> None:
        self._source = source
        self._utf8 = codecs.getincrementaldecoder("utf-8")("strict")
        self.buf = ""
        self.pos = 0
        self.eof = False
        self._dropped = 0  # characters before buf[0]

    def _fill(self) -> None:
        if self.eof or len(self.buf) - self.pos > MANIFEST_VALUE_CHARS:
            return
        parts = [self.buf[self.pos:]]
        n = len(parts[0])
        while n <= 2 * MANIFEST_VALUE_CHARS:
            piece = next(self._source, None)
            if piece is None:
                parts.append(self._utf8.decode(b"", final=True))
                self.eof = True
                break
            parts.append(self._utf8.decode(piece))
            n += len(parts[-1])
        self._dropped += self.pos
        self.buf, self.pos = "".join(parts), 0

    def where(self) -> int:
        return self._dropped + self.pos

    def peek(self) -> str:
        """The next character that is not whitespace ("" at the end), not consumed."""
        while True:
            self._fill()  # before each look: a value starting here has its window
            end = _WS.match(self.buf, self.pos).end()
            if end == self.pos:
                return self.buf[self.pos:self.pos + 1]
            self.pos = end

    def take(self) -> None:
        """Consume the character ``peek`` returned."""
        self.pos += 1

    def end(self) -> None:
        if self.peek():
            raise ValueError(f"extra data at character {self.where()}")

    def value(self) -> tuple[Any, int]:
        """The JSON value that starts at the next non-whitespace character, and its length in
        characters. ``_TooLong`` where it is longer than ``MANIFEST_VALUE_CHARS``."""
        self.peek()
        start = self.pos
        try:
            v, end = _DECODER.raw_decode(self.buf, start)
        except json.JSONDecodeError as e:
            # Cut off by the window's end (the window holds more than the limit after ``start``)?
            if not self.eof and (e.pos >= len(self.buf) - 8 or e.msg.startswith("Unterminated string")):
                raise _TooLong from None
            raise
        if end - start > MANIFEST_VALUE_CHARS or (end == len(self.buf) and not self.eof):
            raise _TooLong
        self.pos = end
        return v, end - start


def _hex(v: Any, where: str) -> str:
    if not isinstance(v, str) or len(v) != 2 * DIGEST_BYTES:
        raise FormatError(f"{where}: expected a {2 * DIGEST_BYTES}-digit hex digest")
    try:
        bytes.fromhex(v)
    except ValueError:
        raise FormatError(f"{where}: not hex") from None
    return v


def _meta(v: Any, where: str) -> TensorMeta | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise FormatError(f"{where}: expected an object")
    dt = v.get("dtype")
    if not isinstance(dt, str) or dt not in DTYPES:
        raise FormatError(f"{where}: unsupported dtype {brief(dt)}")
    shape = v.get("shape")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 48 for d in shape)):
        raise FormatError(f"{where}: bad shape {brief(shape)}")
    add = v.get("sum")
    if add is not None and (not isinstance(add, str) or len(add) != 2 * SUM_BYTES
                            or any(c not in "0123456789abcdef" for c in add)):
        raise FormatError(f"{where}: additive digest 'sum' must be {2 * SUM_BYTES} lowercase hex digits, got {brief(add)}")
    m = TensorMeta(_DTYPE_NAMES[dt], tuple(shape), bytes.fromhex(_hex(v.get("digest"), f"{where} digest")),
                   bytes.fromhex(add) if add is not None else None)
    if m.nbytes >= 1 << 50:
        raise LimitError(f"{where}: tensor of {m.nbytes} bytes exceeds the limit of {(1 << 50) - 1}")
    return m


def _tensor_entry(t: Any, where: str, budget: ManifestBudget | None = None) -> TensorEntry:
    """A manifest's tensor entry, checked; with ``budget``, charged to it (its metadata shared with
    the previous entry's where equal, see ``ManifestBudget.share``)."""
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise FormatError(f"{where}: expected an object with a name")
    where = f"{where.rsplit(':', 1)[0]}: tensor {t['name']!r}"
    op = t.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise FormatError(f"{where}: unknown op {brief(op)}")
    base, target = _meta(t.get("base"), f"{where} base"), _meta(t.get("target"), f"{where} target")
    need = {"same": (1, 1), "patch": (1, 1), "add": (0, 1), "remove": (1, 0), "replace": (1, 1)}[op]
    if (base is not None, target is not None) != (bool(need[0]), bool(need[1])):
        raise FormatError(f"{where}: op {op!r} needs base={bool(need[0])} target={bool(need[1])}")
    if op in ("same", "patch") and (base.dtype, base.shape) != (target.dtype, target.shape):
        raise FormatError(f"{where}: op {op!r} cannot change dtype or shape")
    if op == "same" and base.digest != target.digest:
        raise FormatError(f"{where}: op 'same' with different digests")
    ints = [t.get(k) for k in ("changed", "first", "count")]
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62 for x in ints):
        raise FormatError(f"{where}: changed/first/count must be non-negative integers below 2**62, got {brief(ints)}")
    if budget is not None:
        base, target = budget.charge(t["name"], (base, target))
    return TensorEntry(t["name"], _OP_NAMES[op], base, target, *ints)
