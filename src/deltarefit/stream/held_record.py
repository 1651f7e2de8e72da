"""The fields of a version record beside a checkpoint (``records.record_version`` writes it, ``held_state``
reads it), each typed when read: a record is a file any local writer can edit, and every reader (sync,
status, the engines) takes its fields as what they are named."""

from __future__ import annotations

import math


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_held(d: object) -> None:
    """Every field of a version state, typed (``record_version`` writes them): ``ValueError`` naming the
    first that is not, so that no reader meets a float version, an infinite one or a list for a URL."""
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    v, fp = d.get("version"), d.get("fingerprint")
    if not _int(v) or not 0 <= v < 1 << 62:
        raise ValueError(f"version {v!r:.40} is not a version number")
    if not isinstance(fp, str) or len(fp) != 64 or fp.strip("0123456789abcdef"):
        raise ValueError(f"fingerprint {fp!r:.80} is not 64 hex digits")
    for key in ("stream", "stream_id"):
        if d.get(key) is not None and not isinstance(d[key], str):
            raise ValueError(f"{key} is a {type(d[key]).__name__}, not a string")
    if "updated" in d and (not isinstance(d["updated"], int | float) or isinstance(d["updated"], bool)
                           or not math.isfinite(d["updated"])):
        raise ValueError("updated is not a time")
    ident = d.get("identity")
    if ident is not None and not (isinstance(ident, list) and all(  # per file: path, then integers
            isinstance(x, list) and x and isinstance(x[0], str) and all(_int(y) for y in x[1:]) for x in ident)):
        raise ValueError("identity is not a list of file identities")
    if d.get("identity_at_ns") is not None and not _int(d["identity_at_ns"]):
        raise ValueError("identity_at_ns is not an integer")
