"""Cheap checks of untrusted JSON text before ``json.loads`` builds it.

``json.loads`` spends 5-45 bytes of memory per byte of text on hostile shapes (``[[],[],...]`` makes a
list of 56 bytes from 3 bytes of text; deep nesting recurses) and only fails after the whole value is
built. The file formats read here (a delta's manifest, a safetensors header) have flat, known shapes,
so bounds that their real contents never come near are checked first, by ``bytes.count`` and numpy
passes over slices of the text, without building anything:

* containers: at most one ``[`` or ``{`` per ``bytes_per_container`` bytes of text (plus a little
  slack for tiny documents); brackets inside strings are counted too, which only makes this stricter;
* nesting depth: at most ``max_depth`` levels, measured over the brackets outside strings;
* optionally (``arrays_of_numbers``), no string, object or array inside an array, and (``max_array_len``)
  no array longer than a bound;
* optionally (``bytes_per_string``), at most one string (an object's key included) per that many bytes
  of text: a string costs Python 50-60 bytes however short, so a text of short strings or keys costs
  up to 16 bytes per byte where this bound does not hold (escaped quotes are counted too, which only
  makes it stricter);
* optionally (``bytes_per_value``), at most one value per that many bytes, counting a value per comma and
  per array or object (commas inside strings are counted too): every element of a container costs
  Python at least its 8-byte slot, and a number or a string an object of 24-60 bytes more, so text
  of one-byte numbers (``[0,0,...]``) or floats (``[1.0,...]``) is what this bounds.

What passes still costs memory in proportion to its length (up to about 16 bytes per byte of text for a
list of short strings, which ``arrays_of_numbers`` rules out, and about 12 for an object of many short
keys); the callers bound the length itself.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

__all__ = ["LOCAL_STATE_MAX_BYTES", "brief", "json_shape_problem", "json_shape_problem_of_pieces", "small_json"]

LOCAL_STATE_MAX_BYTES = 1 << 20  # a state file deltarefit keeps beside a checkpoint or in a state directory

_BRIEF = reprlib.Repr()
_BRIEF.maxlist = _BRIEF.maxdict = 8
_BRIEF.maxstring = _BRIEF.maxother = 80
_BRIEF.maxlevel = 3

_STEP = np.zeros(256, np.int64)  # nesting: +1 for [ and {, -1 for ] and }
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_ARRAY_STEP = np.zeros(256, np.int64)  # arrays only
_ARRAY_STEP[ord("[")] = 1
_ARRAY_STEP[ord("]")] = -1
_QUOTE, _BRACE, _COMMA, _OPEN = ord('"'), ord("{"), ord(","), ord("[")
_SLICE = 1 << 16  # bytes per numpy pass: about 3 MiB of temporaries, whatever the text's length


def brief(value: object) -> str:
    """``repr`` of a value parsed from untrusted JSON, cut short (a hostile list may hold millions of
    elements, and an error message is one short line)."""
    return _BRIEF.repr(value)


def small_json(raw: bytes, *, max_depth: int = 8, bytes_per_container: int = 16) -> Any:
    """The JSON value of a small local state file (a version state, a publisher state), whose text is at
    most ``LOCAL_STATE_MAX_BYTES`` (the caller reads no more): its shape bounded first (nesting, containers
    per byte), so that no text recurses or amplifies. ``ValueError`` with a one-line reason otherwise."""
    import json

    if len(raw) > LOCAL_STATE_MAX_BYTES:
        raise ValueError(f"more than {LOCAL_STATE_MAX_BYTES} bytes")
    why = json_shape_problem(raw, max_depth=max_depth, bytes_per_container=bytes_per_container)
    if why is not None:
        raise ValueError(why)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"not JSON ({type(e).__name__})") from None


def json_shape_problem(raw: bytes, *, max_depth: int, bytes_per_container: int, slack: int = 64,
                       arrays_of_numbers: bool = False, max_array_len: int | None = None,
                       bytes_per_string: int | None = None, bytes_per_value: int | None = None) -> str | None:
    """What is wrong with the shape of JSON text ``raw`` (one line, no location), or None.
    ``arrays_of_numbers``: arrays may not hold strings, objects or arrays (a safetensors header's shapes
    and offsets), which rules out lists of short strings, the costliest text per byte.
    ``max_array_len`` (with ``arrays_of_numbers``, whose arrays do not nest in the formats read here):
    no array holds more elements (a shape of millions of numbers is refused before it is built).
    ``bytes_per_string``: at most one string or key per that many bytes (plus ``slack``).
    ``bytes_per_value``: at most one value (a comma, or a container's first element) per that many bytes
    (plus ``slack``).

    Not a validator: ``None`` means only that parsing it cannot amplify memory beyond the bounds in
    the module docstring; the caller still parses and checks types."""
    return json_shape_problem_of_pieces([raw], max_depth=max_depth, bytes_per_container=bytes_per_container,
                                        slack=slack, arrays_of_numbers=arrays_of_numbers, max_array_len=max_array_len,
                                        bytes_per_string=bytes_per_string, bytes_per_value=bytes_per_value)


def json_shape_problem_of_pieces(pieces: Iterable[bytes], *, max_depth: int, bytes_per_container: int,
                                 slack: int = 64, arrays_of_numbers: bool = False,
                                 max_array_len: int | None = None, bytes_per_string: int | None = None,
                                 bytes_per_value: int | None = None) -> str | None:
    """``json_shape_problem`` of the text that ``pieces`` make end to end (cut anywhere, a string or an
    escape included), read once, piece by piece: what it holds at once is a piece and the numpy
    temporaries of one ``_SLICE``, so a text that is never whole in memory (a manifest as it is
    decompressed) is checked in a few MiB."""
    count = [0, 0, 0, 0]  # bytes, brackets, quotes, commas

    def counted() -> Iterator[bytes]:
        for piece in pieces:
            count[0] += len(piece)
            count[1] += piece.count(b"[") + piece.count(b"{")
            if bytes_per_string is not None:
                count[2] += piece.count(b'"')
            if bytes_per_value is not None:
                count[3] += piece.count(b",")
            yield piece

    depth, in_array, longest = _scan(_unescaped(counted()), arrays_of_numbers)
    containers, allowed = count[1], count[0] // bytes_per_container + slack
    if containers > allowed:
        return (f"holds {containers} JSON arrays/objects in {count[0]} bytes, more than one per "
                f"{bytes_per_container} bytes (limit {allowed})")
    if bytes_per_string is not None and count[2] // 2 > count[0] // bytes_per_string + slack:
        return (f"holds {count[2] // 2} JSON strings in {count[0]} bytes, more than one per {bytes_per_string} "
                f"bytes (limit {count[0] // bytes_per_string + slack})")
    if bytes_per_value is not None and count[3] + containers > count[0] // bytes_per_value + slack:
        return (f"holds {count[3] + containers} JSON values in {count[0]} bytes, more than one per {bytes_per_value} "
                f"bytes (limit {count[0] // bytes_per_value + slack})")
    if depth > max_depth:
        return f"nests JSON {depth} levels deep, limit {max_depth}"
    if in_array:
        return "has a JSON array holding strings or objects or other arrays (arrays here hold numbers only)"
    if max_array_len is not None and longest > max_array_len:
        return f"has a JSON array of {longest} elements, limit {max_array_len}"
    return None


def _unescaped(pieces: Iterable[bytes]) -> Iterator[bytes]:
    """The pieces with escapes dropped: ``\\\\`` pairs, then ``\\"``, whole copies made by
    ``bytes.replace`` (never an object per match). A piece's trailing run of backslashes is held back
    and goes first in the next piece, so a run is never cut, and the result is that of the whole text."""
    carry = b""
    for got in pieces:
        text = carry + got if carry else got
        k = len(text) - len(text.rstrip(b"\\"))
        carry = text[len(text) - k:] if k else b""
        text = text[:len(text) - k] if k else text
        yield text.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in text else text
    if carry:
        yield carry.replace(b"\\\\", b"")


def _scan(pieces: Iterable[bytes], arrays_of_numbers: bool) -> tuple[int, bool, int]:
    """The deepest nesting of ``[``/``{`` outside strings, and (with ``arrays_of_numbers``) whether a
    string or an object starts inside an array (text that is not JSON gives some answer; the parser
    refuses it afterwards). The pieces come with their escapes dropped (``_unescaped``): every quote
    left opens or closes a string, so a byte is inside one when an odd number of quotes precede it
    (the opening quote included)."""
    deepest = level = array_level = quotes = commas = 0
    open_at = -1  # the comma count where the array now open began (arrays of numbers do not nest)
    longest = 0
    in_array = False
    for a in _slices(pieces):
        quote = a == _QUOTE
        inside = (np.cumsum(quote) + quotes) & 1
        quotes = int(inside[-1])
        outside = inside == 0
        steps = _STEP[a] * outside
        levels = np.cumsum(steps) + level
        deepest = max(deepest, int(levels.max()))
        level = int(levels[-1])
        if arrays_of_numbers:
            arrays = np.cumsum(_ARRAY_STEP[a] * outside) + array_level
            array_level = int(arrays[-1])
            opens = (quote & (inside == 1)) | ((a == _BRACE) & outside)  # a string or an object begins
            # ... inside an array, or an array inside an array (which the count of elements below, by
            # pairs of brackets, would not see).
            in_array = in_array or bool((opens & (arrays > 0)).any() or ((a == _OPEN) & outside & (arrays > 1)).any())
            # Elements of an array: the commas inside it, plus one (an empty array counts one: harmless).
            cum = np.cumsum((a == _COMMA) & outside & (arrays > 0)) + commas
            commas = int(cum[-1]) if cum.size else commas
            br = np.flatnonzero(_ARRAY_STEP[a] * outside)
            if br.size:
                kinds, vals = a[br] == _OPEN, cum[br]
                if open_at >= 0:  # an array opened in an earlier slice
                    kinds, vals = np.concatenate([[True], kinds]), np.concatenate([[open_at], vals])
                pair = kinds[:-1] & ~kinds[1:]  # an opening bracket followed by a closing one
                if pair.any():
                    longest = max(longest, int((vals[1:][pair] - vals[:-1][pair]).max()) + 1)
                open_at = int(vals[-1]) if kinds[-1] else -1
            if open_at >= 0:
                longest = max(longest, commas - open_at + 1)  # an array still open at the slice's end
    return deepest, in_array, longest


def _slices(pieces: Iterable[bytes]) -> Iterator[np.ndarray]:
    """The pieces as uint8 arrays of at most ``_SLICE`` bytes, none empty (views, no copies)."""
    for piece in pieces:
        data = np.frombuffer(piece, np.uint8)
        for i in range(0, data.size, _SLICE):
            yield data[i:i + _SLICE]


def parse_cost(raw: bytes) -> int:
    """An upper estimate of the bytes ``json.loads(raw)`` holds at its peak (CPython 3.11, 64-bit),
    from counts alone (``bytes.count`` passes, nothing built): twice the text (its decoded copy, and the
    characters of the strings and numbers built from it), 232 per object (a small dict and its memo of
    keys), 80 per array, 40 per comma (an element's slot and a number of up to 19 digits) and 80 per
    string (a short str and its dict entry). Measured against it: 3-lists of 3-digit numbers cost 392 MiB
    per 32 MiB of text (estimated 464), one-key objects 12.3 bytes per byte (23), a 1T MoE's real
    manifest of 26 MiB 132 MiB (201). Counts inside strings are counted too, which only adds."""
    return (2 * len(raw) + 232 * raw.count(b"{") + 80 * raw.count(b"[") + 40 * raw.count(b",")
            + 80 * (raw.count(b'"') // 2))

