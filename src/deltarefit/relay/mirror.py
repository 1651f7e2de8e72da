"""A relay's mirror of the version stream: a local directory store filled part by part.

The mirror uses the origin's keys, so the stream ``Subscriber`` syncs a checkpoint from it with all of
its checks. A part being received lives in ``<key>.partial``; bytes are appended at exactly the offset
received so far, hashed as they come, and only a part whose size and BLAKE3 match its commit record is
renamed to its key. A version's ``commit.json`` is written after all of its parts (and after the
version before it), so the mirror is a consistent store at every moment and a reader never sees a
version it can't fetch.

In-memory state per part (``PartState.have``) is what lets child writers stream bytes onward as soon as
they are on disk (cut-through): they read from the file up to ``have``, never ahead of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import blake3

from ..storage.local import LocalStore
from ..stream.chain import MAX_RECORD_BYTES, get_bounded
from ..stream.records import CommitRecord, Part, commit_key, list_versions, load_commit, parse_commit
from .protocol import BadPartError, ProtocolError


@dataclass
class PartState:
    part: Part
    final: str  # the key's path in the mirror
    have: int = 0  # bytes on disk (in .partial until done)
    done: bool = False
    epoch: int = 0  # bumped when received bytes are discarded: readers streaming it must restart
    _hasher: blake3.blake3 | None = field(default=None, repr=False)
    _fd: int | None = field(default=None, repr=False)

    @property
    def partial(self) -> str:
        return self.final + ".partial"

    def path(self) -> str:
        """The file holding the bytes now (read it at once: ``done`` may flip with a rename)."""
        return self.final if self.done else self.partial


@dataclass
class VersionState:
    version: int
    raw: bytes  # the commit record as published (forwarded byte for byte)
    rec: CommitRecord
    keys: list[str]  # the parts this relay receives (and forwards) for this version
    committed: bool = False

    @property
    def has_keyframe(self) -> bool:
        return bool(self.rec.keyframe) and all(p.key in self.keys for _, p in self.rec.keyframe)


def parts_of(rec: CommitRecord) -> dict[str, Part]:
    ps = ([rec.delta] if rec.delta else []) + [p for _, p in rec.keyframe] + ([rec.catchup] if rec.catchup else [])
    return {p.key: p for p in ps}


class Mirror:
    """The versions and parts a relay knows, over a ``LocalStore`` directory."""

    def __init__(self, root: str) -> None:
        self.store = LocalStore(root)
        self.versions: dict[int, VersionState] = {}
        self.parts: dict[str, PartState] = {}
        self._pulse = asyncio.Event()
        for v in list_versions(self.store):  # committed earlier: forwardable as they are
            rec = load_commit(self.store, v)
            keys = [k for k in parts_of(rec) if self.store.exists(k)]
            raw = get_bounded(self.store, commit_key(v), MAX_RECORD_BYTES, "commit record")
            self.versions[v] = VersionState(v, raw, rec, keys, committed=True)
            for k in keys:
                p = parts_of(rec)[k]
                self.parts[k] = PartState(p, self.store._path(k), p.bytes, True)

    # -- change notification ---------------------------------------------------------------------

    def changed(self) -> None:
        """Wake every task waiting in ``wait`` (they re-check their condition)."""
        self._pulse.set()
        self._pulse = asyncio.Event()

    async def wait(self, pred, timeout: float | None = None) -> bool:
        """Wait until ``pred()`` holds; False on timeout."""
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        while not pred():
            left = None if end is None else end - loop.time()
            if left is not None and left <= 0:
                return False
            await wait_event(self._pulse, left)
        return True

    # -- what we hold ----------------------------------------------------------------------------

    def committed_top(self) -> int:
        vs = [v for v, s in self.versions.items() if s.committed]
        return max(vs) if vs else 0

    def known(self) -> dict[int, bool]:
        return {v: s.has_keyframe for v, s in self.versions.items()}

    def offsets(self) -> dict[str, int]:
        """Bytes held of every part not yet committed, for a resuming HELLO (files on disk included)."""
        out = {k: ps.have for k, ps in self.parts.items() if not ps.done or not self._committed_key(k)}
        vdir = os.path.join(self.store.root, "v")
        for d, _, files in os.walk(vdir) if os.path.isdir(vdir) else ():
            for f in files:
                if ".tmp-" in f or f in ("commit.json", "prepared.json"):
                    continue
                key = os.path.relpath(os.path.join(d, f), self.store.root).replace(os.sep, "/")
                key = key.removesuffix(".partial")
                if key not in self.parts:
                    out[key] = os.path.getsize(os.path.join(d, f))
        return out

    def _committed_key(self, key: str) -> bool:
        return any(s.committed and key in s.keys for s in self.versions.values())

    # -- receiving -------------------------------------------------------------------------------

    def add_version(self, version: int, raw: bytes, keys: list[str]) -> VersionState:
        """Register a version's record and the parts that will follow. Parts already on disk (a
        restart, or a resume after a parent died) count as received."""
        rec = parse_commit(raw, f"relay record for version {version}")
        if rec.version != version:
            raise ProtocolError(f"record for version {version} says version {rec.version}")
        allp = parts_of(rec)
        if not keys or any(k not in allp for k in keys):
            raise ProtocolError(f"version {version}: announced parts are not the record's")
        vs = VersionState(version, raw, rec, list(keys))
        self.versions[version] = vs
        for k in keys:
            if k in self.parts and self.parts[k].part == allp[k]:
                continue
            ps = PartState(allp[k], self.store._path(k))
            if os.path.exists(ps.final) and os.path.getsize(ps.final) == ps.part.bytes:
                ps.have, ps.done = ps.part.bytes, True  # renamed only after its hash matched
            elif os.path.exists(ps.partial):
                ps.have = min(os.path.getsize(ps.partial), ps.part.bytes)
            self.parts[k] = ps
        self.changed()
        return vs

    def drop_uncommitted(self, below: int | None = None, only: Iterable[int] | None = None) -> list[int]:
        """Forget uncommitted versions (all, those below ``below``, or those in ``only``); their part
        files stay on disk as resume points. Returns the versions dropped."""
        keep = None if only is None else set(only)
        gone = [v for v, s in self.versions.items() if not s.committed and (below is None or v < below)
                and (keep is None or v in keep)]
        for v in gone:
            for k in self.versions.pop(v).keys:
                ps = self.parts.pop(k, None)
                if ps is not None:
                    _close(ps)
        self.changed()
        return gone

    async def write(self, key: str, offset: int, data: bytes) -> PartState:
        """Append received bytes of a part at ``offset`` (which must be exactly what we hold)."""
        ps = self.parts.get(key)
        if ps is None:
            raise ProtocolError(f"data for {key}, which is not an announced part")
        if ps.done:
            return ps  # already whole here (a resend after a resume): the bytes are not needed
        if offset != ps.have or offset + len(data) > ps.part.bytes or not data:
            raise ProtocolError(f"data for {key} at {offset}+{len(data)}, holding {ps.have} of {ps.part.bytes}")
        if ps._fd is None:
            os.makedirs(os.path.dirname(ps.final), exist_ok=True)
            ps._fd = os.open(ps.partial, os.O_RDWR | os.O_CREAT, 0o644)
            os.ftruncate(ps._fd, ps.have)  # bytes beyond what we count are not ours
            ps._hasher = blake3.blake3()
            if ps.have:  # resuming: hash what is already there, off the event loop
                ps._hasher = await asyncio.to_thread(_hash_prefix, ps._fd, ps.have)
        os.pwrite(ps._fd, data, offset)
        ps._hasher.update(data)
        ps.have += len(data)
        if ps.have == ps.part.bytes:
            digest = ps._hasher.hexdigest()
            _close(ps)
            if digest != ps.part.blake3:
                # Discard it all: the next attempt (a reconnect) fetches it from 0.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(ps.partial)
                ps.have = 0
                ps.epoch += 1
                self.changed()
                raise BadPartError(f"{key}: received bytes do not match the record's BLAKE3; discarded")
            os.replace(ps.partial, ps.final)
            ps.done = True
        self.changed()
        return ps

    def commit_ready(self) -> list[int]:
        """Write ``commit.json`` for every version whose parts are all in place, in version order
        (a version waits for the one before it, when that one is known). Returns those committed."""
        out = []
        for v in sorted(self.versions):
            s = self.versions[v]
            if s.committed:
                continue
            prev = self.versions.get(v - 1)
            if (prev is not None and not prev.committed) or not all(self.parts[k].done for k in s.keys):
                break
            self.store.put(commit_key(v), s.raw)
            s.committed = True
            out.append(v)
        if out:
            self.changed()
        return out

    def close(self) -> None:
        for ps in self.parts.values():
            _close(ps)


async def wait_event(ev: asyncio.Event, timeout: float | None) -> bool:
    """``ev.wait()`` with a timeout; False on timeout. Hazard: in Python 3.11 ``wait_for`` returns
    normally when its task is cancelled just as the awaited future completes, so a loop around it would
    never end (``asyncio.run`` then hangs at exit). A pending cancellation is re-raised here."""
    try:
        await asyncio.wait_for(ev.wait(), timeout)
        return True
    except TimeoutError:
        return False
    finally:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError


def _close(ps: PartState) -> None:
    if ps._fd is not None:
        os.close(ps._fd)
        ps._fd = None


def _hash_prefix(fd: int, n: int) -> blake3.blake3:
    h = blake3.blake3()
    off = 0
    while off < n:
        b = os.pread(fd, min(8 << 20, n - off), off)
        if not b:
            break
        h.update(b)
        off += len(b)
    return h
