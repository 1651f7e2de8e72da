"""Where a checkpoint stands in its version stream, read-only (``deltarefit status``).

``checkpoint_status`` reads the checkpoint's version record (``holder.state_path``: written by a
verified sync), the identity of its files (a ``stat`` per file, no hash), and, where a store is given
or recorded, the store's head, its stream identity and its record of the held version. It writes
nothing anywhere: no record, no lock, no staging, no store object (``deltarefit sync`` does all of
those; this only reports). Hashing the checkpoint is asked for (``verify=True``): a pass over every
byte, the one way to tell a checkpoint modified in place within its files' identity, and, for a
checkpoint without a record, the way to find which version it holds.

States (``CheckpointStatus.state``):

* ``no-record``: no version record; a sync adopts it by its fingerprint, or fills it from a keyframe.
* ``no-store``: a record, but no store given and none recorded to compare with.
* ``at-head`` / ``behind`` / ``ahead``: the held version against the store's head.
* ``other-stream``: the store holds another stream than the one the record names.
* ``replaced``: the store's record of the held version names another fingerprint (store wiped and
  republished).
* ``modified``: hashed (``verify``), the checkpoint is not the version its record names.
"""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import asdict, dataclass

from ..checkpoint.read import open_checkpoint
from ..errors import CheckpointError, StreamError, UsageError
from ..signing import Verifier
from ..storage.base import open_store
from .chain import commit_key, head
from .holder import hash_identity, state_path
from .records import (
    MalformedRecordError,
    held_state,
    identity_unchanged,
    load_commit,
    newest_with_fingerprint,
    stream_identity,
)

__all__ = ["CheckpointStatus", "checkpoint_status"]


@dataclass
class CheckpointStatus:
    """What ``deltarefit status --json`` prints (its fields, stable: docs/COMMAND-LINE.md, "deltarefit status")."""

    checkpoint: str  # absolute path
    record: str  # the version record's path (it may not exist)
    state: str  # one of the module docstring's states
    version: int | None  # the version recorded (None: no record)
    fingerprint: str | None  # the fingerprint recorded with it
    stream_id: str | None  # the identity of the stream recorded with it
    store: str | None  # the store compared with (given, else recorded), or None
    store_from: str | None  # "given", "recorded", or None
    head: int | None  # the store's newest version (None: no store read)
    behind: int | None  # head - version, where both are known (negative: ahead)
    files_unchanged: bool | None  # the files' identity is the one recorded when last verified (None: no record)
    too_soon: bool | None  # the identity recorded, but written under a timestamp tick ago: cannot tell unhashed
    hashed: str | None  # the fingerprint hashed now (verify), else None
    found_version: int | None  # hashed, without a record: the store's newest version of that fingerprint
    fix: str | None  # the command that brings it to the head or out of its state, or None at the head

    def as_dict(self) -> dict:
        return asdict(self)


def _sync_cmd(store: str | None, checkpoint: str, extra: str = "") -> str:
    return f"deltarefit sync {shlex.quote(store) if store else 'STORE'} {shlex.quote(checkpoint)}{extra}"


def checkpoint_status(checkpoint: str, *, store: str | None = None, verify: bool = False,
                      threads: int | None = None, public_key: str | None = None) -> CheckpointStatus:
    """Where ``checkpoint`` stands (module docstring), compared with ``store`` (a URL, else the one
    its record names). Raises ``CheckpointError`` for a checkpoint that is missing or unreadable,
    ``StreamError`` for a corrupt version record (the ``--repair`` way out; a recorded store that
    cannot be opened too), ``StoreError`` for a store that cannot be read or is not there,
    ``MalformedRecordError`` for a store record that cannot be parsed. ``public_key``: every store
    record read (the head's, the held version's, the stream's first) must verify with this Ed25519
    key (``SignatureError`` otherwise). Writes nothing."""
    ck = os.path.abspath(checkpoint)
    rec_path = state_path(ck)
    if not os.path.lexists(ck):
        how = (f"its version record {rec_path} exists: '{_sync_cmd(store, checkpoint, ' --repair')}' restores it"
               if os.path.lexists(rec_path) else
               f"'{_sync_cmd(store, checkpoint)}' creates it from the stream's newest keyframe")
        raise CheckpointError(f"{ck}: no such checkpoint file or directory (nothing written); {how}")
    with open_checkpoint(ck) as c:  # a checkpoint at all (a FIFO or a text file is refused), and its identity
        ident = c.identity()
    state = held_state(rec_path)
    url = store or (state or {}).get("stream") or None
    st = {"checkpoint": ck, "record": rec_path, "store": url, "hashed": None, "found_version": None,
          "store_from": "given" if store else "recorded" if url else None, "head": None, "behind": None}
    if state is None:
        st.update(version=None, fingerprint=None, stream_id=None, files_unchanged=None, too_soon=None)
    else:
        same = identity_unchanged(state, ident) or identity_settled(state, ident, time.time_ns())
        st.update(version=state["version"], fingerprint=state["fingerprint"], stream_id=state.get("stream_id"),
                  files_unchanged=same, too_soon=not same and _same_identity(state, ident))
    if verify:
        st["hashed"] = hash_identity(ck, threads)[0]
    try:
        s = None if url is None else open_store(url, create=False)
    except UsageError as e:
        if store:
            raise
        raise StreamError(f"{rec_path}: names store {url!r}, which cannot be opened ({e}); "
                          f"'{_sync_cmd(None, checkpoint, ' --repair')}' with the store rebuilds the record") from None
    verifier = Verifier(public_key) if public_key else None
    if s is not None:
        st["head"] = head(s)
        if verifier is not None and st["head"]:  # the head shown is one the key signed
            load_commit(s, st["head"], verifier)
    state_name, fix = _judge(st, s, checkpoint, verifier)
    return CheckpointStatus(state=state_name, fix=fix, **st)


# Whole-second times (FAT keeps 2 s, some network file systems 1 s) show in every time a file system
# records; the others keep nanoseconds, set from the kernel's clock tick (1-10 ms): a margin of ten.
COARSE_TICK_NS = 2_000_000_000
FINE_TICK_NS = 100_000_000


def _same_identity(state: dict, identity: tuple) -> bool:
    rec = state.get("identity")
    return isinstance(rec, list) and rec == [list(x) for x in identity]


def identity_settled(state: dict, identity: tuple, now_ns: int) -> bool:
    """Whether ``identity`` (taken now) is the one ``state`` recorded after the last write and the
    verification of a sync (``record_version``: the identity after the final flush, and the time after
    it), and a timestamp tick has passed since the files' last change: a write since would have given
    them a later time. What a sync's ``identity_unchanged`` asks more (the recording itself clear of
    the tick, as git's index does) a sync's own write never meets, so its next check hashes; ``status``
    reads without hashing. Hazard: another process writing within the tick right after the sync's last
    write, after its read-back, is not seen (as a writer during the writes is not); ``--verify`` hashes."""
    at = state.get("identity_at_ns")
    if not isinstance(at, int) or not _same_identity(state, identity):
        return False
    times = [t for x in identity for t in (x[4], x[5])]
    tick = COARSE_TICK_NS if all(t % 1_000_000_000 == 0 for t in times) else FINE_TICK_NS
    last = max(times, default=0)
    return last <= at and last + tick < now_ns


def _judge(st: dict, s, checkpoint: str, verifier: Verifier | None) -> tuple[str, str | None]:
    """(state, fix) from what was read; looks up the store's records as needed (read-only)."""
    url, h, v = st["store"], st["head"], st["version"]
    if v is None:
        if s is not None and st["hashed"] is not None:
            st["found_version"] = newest_with_fingerprint(s, st["hashed"], verifier)[0]
            if st["found_version"] is None:  # a plain sync refuses a fingerprint that is no version
                return "no-record", _sync_cmd(url, checkpoint, " --repair")
        return "no-record", _sync_cmd(url, checkpoint)
    if st["hashed"] is not None and st["hashed"] != st["fingerprint"]:
        return "modified", _sync_cmd(url, checkpoint, " --repair")
    if s is None:
        return "no-store", _sync_cmd(None, checkpoint)
    st["behind"] = h - v
    try:
        ident = stream_identity(s, verifier)
    except MalformedRecordError:
        ident = None  # the store's first record cannot be read: compared below by the held version's
    if ident is not None and st["stream_id"] is not None and ident != st["stream_id"]:
        return "other-stream", _sync_cmd(url, checkpoint, " --repair")
    if v > h:
        return "ahead", _sync_cmd(url, checkpoint, " --repair")
    if not s.exists(commit_key(v)):  # retention removed it: which fingerprint it was is not known here
        return ("at-head", None) if v == h else ("behind", _sync_cmd(url, checkpoint))
    if load_commit(s, v, verifier).fingerprint != st["fingerprint"]:
        return "replaced", _sync_cmd(url, checkpoint, " --repair")
    return ("at-head", None) if v == h else ("behind", _sync_cmd(url, checkpoint))
