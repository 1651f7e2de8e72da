"""Cheap checks of untrusted JSON text before ``json.loads`` builds it.

``json.loads`` spends 5-45 bytes of memory per byte of text on hostile shapes (``[[],[],...]`` makes a
list of 56 bytes from 3 bytes of text; deep nesting recurses) and only fails after the whole value is
built. The file formats read here (a delta's manifest, a safetensors header) have flat, known shapes,
so two bounds that their real contents never come near are checked first, at C speed and without
building anything:

* containers: at most one ``[`` or ``{`` per ``bytes_per_container`` bytes of text (plus a little
  slack for tiny documents); brackets inside strings are counted too, which only makes this stricter;
* nesting depth: at most ``max_depth`` levels, measured over the brackets outside strings.

What passes still costs memory in proportion to its length (at most about 16 bytes per byte of text,
for a list of short strings); the callers bound the length itself.
"""

from __future__ import annotations

import numpy as np

__all__ = ["json_shape_problem"]

_STEP = np.zeros(256, np.int64)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_QUOTE = ord('"')
_SLICE = 1 << 18  # bytes per numpy pass: a few MiB of temporaries, whatever the text's length


def json_shape_problem(raw: bytes, *, max_depth: int, bytes_per_container: int, slack: int = 64) -> str | None:
    """What is wrong with the shape of JSON text ``raw`` (one line, no location), or None.

    Not a validator: ``None`` means only that parsing it cannot amplify memory beyond the bounds in
    the module docstring; the caller still parses and checks types."""
    containers = raw.count(b"[") + raw.count(b"{")
    allowed = len(raw) // bytes_per_container + slack
    if containers > allowed:
        return (f"holds {containers} JSON arrays/objects in {len(raw)} bytes, more than one per "
                f"{bytes_per_container} bytes (limit {allowed})")
    depth = _depth(raw)
    if depth > max_depth:
        return f"nests JSON {depth} levels deep, limit {max_depth}"
    return None


def _depth(raw: bytes) -> int:
    """The deepest nesting of ``[``/``{`` outside strings (text that is not JSON gives some number;
    the parser refuses it afterwards). Escapes go first: ``\\\\`` pairs, then ``\\"``, whole
    copies made by ``bytes.replace`` (never an object per match); then every quote left opens or
    closes a string, so a bracket is inside one when an odd number of quotes precede it."""
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in raw else raw
    data = np.frombuffer(text, np.uint8)
    deepest = level = quotes = 0
    for i in range(0, data.size, _SLICE):
        a = data[i:i + _SLICE]
        inside = (np.cumsum(a == _QUOTE) + quotes) & 1
        quotes = int(inside[-1])
        steps = _STEP[a]
        steps[inside.astype(bool)] = 0
        levels = np.cumsum(steps) + level
        deepest = max(deepest, int(levels.max()))
        level = int(levels[-1])
    return deepest
