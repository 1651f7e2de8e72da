"""What the publisher's modules share: the state it keeps of the committed version, the names of its
state files, and the fixes its refusals name."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import blake3

from ..errors import CheckpointError, StreamError
from ..io.fsutil import open_regular, read_capped, write_atomic
from ..io.jsonlimits import LOCAL_STATE_MAX_BYTES, small_json

ALL = -1  # quorum: every live subscriber


# How each stuck state is left: named in the refusals, implemented by the publisher (``reset_baseline`` and
# ``quarantine_head``, the CLI's ``publish --reset-baseline`` and ``publish --quarantine-head``).
RESET_FIX = "; 'deltarefit publish --reset-baseline' (same arguments) rebuilds the baseline from the stream"
QUARANTINE_FIX = ("; if no publisher of this stream wrote it, 'deltarefit publish --quarantine-head' (same "
                  "arguments) sets it aside")


@dataclass
class PublishState:
    version: int
    fingerprint: str
    stream_id: str | None = None  # the stream's identity (None only in states written before identities)


_TEMP_SUFFIX = ".tmp-"
FORMAT_NAME = "format.json"  # the stream's delta format version, as this publisher last published it


def stream_format(state_dir: str, asked: int | None, has_state: bool) -> int:
    """The delta format version (FORMAT.md, "Versions") of the next version a publisher keeping its state in
    ``state_dir`` publishes: ``asked`` where given (1 or 2), else the one it last published (``FORMAT_NAME``), else
    2 for a new stream (no state) and 1 for a stream its publisher kept before format versions were a setting
    (its subscribers may read version 1 only). A stream may change it between any two versions."""
    if asked is not None:
        return asked
    try:
        v = read_state_json(os.path.join(state_dir, FORMAT_NAME), "publisher format setting")["format_version"]
    except FileNotFoundError:
        return 2 if not has_state else 1
    except (ValueError, KeyError, TypeError, CheckpointError) as e:
        raise StreamError(f"{os.path.join(state_dir, FORMAT_NAME)}: unreadable ({e}); publish with --format-version "
                          "1 or 2 to write it again") from None
    if v not in (1, 2) or type(v) is not int:
        raise StreamError(f"{os.path.join(state_dir, FORMAT_NAME)}: format version {v!r} is not 1 or 2; publish with "
                          "--format-version 1 or 2 to write it again")
    return v


def remember_format(state_dir: str, version: int) -> None:
    """Record ``version`` as the stream's format version for the next publish (``stream_format``)."""
    path = os.path.join(state_dir, FORMAT_NAME)
    try:
        if read_state_json(path, "publisher format setting").get("format_version") == version:
            return
    except (FileNotFoundError, ValueError, AttributeError, CheckpointError):
        pass
    write_atomic(path, json.dumps({"format_version": version}).encode())
ATTEMPT_NAME = "attempt.json"  # the upload in progress: {"attempt": "v/<version>/<id>"}


def keyframe_state(keyframe_copy: str) -> tuple[int, str] | None:
    """(version, fingerprint) of the publisher's keyframe copy (the base of its catch-up deltas), from
    the record beside it; None without one."""
    try:
        d = read_state_json(keyframe_copy + ".json", "keyframe copy record")
        return int(d["version"]), str(d["fingerprint"])
    except (FileNotFoundError, ValueError, KeyError, TypeError, CheckpointError):
        return None


def default_state_dir(store: str) -> str:
    """Where a publisher keeps its baseline when not told: inside a local store (``STORE/.publisher``),
    else under ``$XDG_CACHE_HOME/deltarefit`` (``~/.cache``) by a hash of the store's URL."""
    if "://" not in store or store.startswith("file://"):
        return os.path.join(os.path.abspath(store.removeprefix("file://")), ".publisher")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "deltarefit", "publisher-" + blake3.blake3(os.fsencode(store)).hexdigest(8))


def read_state_json(path: str, what: str) -> Any:
    """The JSON of a publisher's state file at ``path``: a regular file only, never through a symlink (a
    FIFO planted there must not hang the publish: ``CheckpointError``), at most ``LOCAL_STATE_MAX_BYTES``
    read and its shape bounded before parsing (``ValueError`` otherwise); ``FileNotFoundError`` when
    absent."""
    with os.fdopen(open_regular(path, os.O_RDONLY, what=what), "rb") as f:
        return small_json(read_capped(f.fileno(), LOCAL_STATE_MAX_BYTES))
