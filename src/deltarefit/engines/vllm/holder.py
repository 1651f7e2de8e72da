"""The live engine as what holds a stream's version (``stream.holder.Holder``): ``EngineHolder``, and the
``Subscriber`` the vLLM backend syncs the worker's weights with (``engine_subscriber``).

The held version is in the worker's memory (the engine's weights), not in a file beside a checkpoint: a
restarted engine holds what it loaded, whatever a file says. Deltas reach it through ``LiveEngine.apply``
(the subscriber's apply hook), keyframes through its reload path (the keyframe hook), and a plan-only
sync (``Subscriber.plan``) leaves the first delta planned against the live weights (``LiveEngine.prepare``)
for the update that writes it.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from ...history_book import HistoryBook
from ...io.locks import owned_temp
from ...storage.base import Store
from ...stream.records import StreamError
from ...stream.subscriber import Subscriber

log = logging.getLogger(__name__)

SCRATCH_PREFIX = "deltarefit-engine-"
MEMORY_DIR = "/dev/shm"  # a tmpfs on Linux hosts: the engine's delta staging and history book


def _usable(directory: str) -> bool:
    return os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)


class EngineHolder:
    """A live engine (``live``: the worker's ``LiveEngine``) holding version ``held`` of a stream."""

    adopts = False  # the engine's version is known; nothing on disk to adopt

    def __init__(self, live: Any, held: tuple[int, str]) -> None:
        self.live = live
        # The worker keeps a history book (in memory, else in the scratch) and follows streams coded with
        # history; in a tensor-parallel group, each worker the book of the segments it decodes.
        self.keeps_book = bool(live.keeps_history)
        self.held_now = held
        self.stream_ident: str | None = None  # the stream first synced from, followed for the engine's life
        self.reports: list[Any] = []  # the refits of the sync in progress (``LiveEngine.apply``'s reports)
        self.prepared: Any = None  # worker.PreparedRefit, for the next sync's first delta
        # Staging and keyframes, removed at close; an engine killed before that leaves its scratch,
        # which the next engine on this host removes (owned_temp: locked while its engine lives).
        self.scratch, self.scratch_lock = owned_temp(SCRATCH_PREFIX)
        self.keyframe_dir = os.path.abspath(os.path.join(self.scratch, "keyframe"))  # the subscriber's checkpoint
        # Deltas are staged, and the history book kept, in memory where the host has a tmpfs: the engine
        # holds its weights in memory, and a refit then writes no byte to disk (keyframes, the size of
        # the checkpoint, are staged on disk). Same ownership rules as the scratch.
        self.memory, self.memory_lock = (owned_temp(SCRATCH_PREFIX, MEMORY_DIR) if _usable(MEMORY_DIR)
                                         else (None, None))

    @property
    def plans(self) -> bool:
        """A tensor-parallel group, whose workers plan together, plans in the update instead."""
        return bool(self.live.prepares)

    # -- Holder ----------------------------------------------------------------------------------

    def held(self) -> tuple[int, str]:
        return self.held_now

    def held_stream(self, *, repair: bool) -> str | None:
        return self.stream_ident  # kept in memory, so ``repair`` has no record to ignore

    def bind_stream(self, ident: str | None) -> None:
        self.stream_ident = ident

    def record(self, version: int, fp: str, *, url: str, stream_id: str | None, identity: tuple | None) -> None:
        self.held_now = (version, fp)

    def identity(self) -> tuple:
        return ()  # the engine's weights are memory: no files whose identity could vouch for them

    def check_held(self, version: int, fp: str, *, verify: bool) -> tuple[bool, tuple | None]:
        """``verify`` re-hashes every weight where the engine holds it (else the report says it was not
        verified); nothing is recorded again."""
        if verify:
            self.live.verify()
        return verify, None

    def mismatch(self, url: str, version: int, fp: str, recorded: str) -> StreamError:
        return StreamError(f"{url}: version {version} is {recorded[:16]}…, but this engine holds {fp[:16]}… at "
                           "that version (store wiped and republished?)")

    def agree(self, mine: bool) -> bool:
        return self.live.agree(mine)  # every worker of a tensor-parallel group asks at the same point

    def plan(self, delta_path: str, book: HistoryBook | None) -> None:
        self.drop_prepared()
        self.prepared = self.live.prepare(delta_path, book)

    # -- the subscriber's hooks ------------------------------------------------------------------

    def apply(self, delta_path: str, history: Any = None) -> Any:
        """The apply hook (``Subscriber.hook_keeps_book``): the report where the engine keeps a book, else
        the fingerprint. The plan a plan-only sync made is written when it is of this delta (the live
        engine drops it, and plans again, if it went stale)."""
        prepared, self.prepared = self.prepared, None
        if prepared is not None and prepared.delta_path != delta_path:
            prepared.close()
            prepared = None
        rep = self.live.apply(delta_path, history=history, prepared=prepared)
        self.reports.append(rep)
        return rep if self.keeps_book else rep.target_fingerprint

    def install_keyframe(self) -> None:
        """The keyframe hook: reload every weight from the installed keyframe, then remove it."""
        self.live.reload_all(self.keyframe_dir)
        shutil.rmtree(self.keyframe_dir, ignore_errors=True)

    def drop_prepared(self) -> None:
        if self.prepared is not None:
            self.prepared.close()
            self.prepared = None

    def close(self) -> None:
        """Drop the plan kept, remove the scratch and the memory staging, release their locks."""
        self.drop_prepared()
        for path, lock in ((self.scratch, self.scratch_lock), (self.memory, self.memory_lock)):
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
                os.close(lock)


def engine_subscriber(store: Store, holder: EngineHolder, **kw: Any) -> Subscriber:
    """The stream subscriber that moves ``holder``'s engine along the stream (``kw``: ``Subscriber``'s)."""
    sub = Subscriber(store, holder.keyframe_dir, holder=holder, apply_hook=holder.apply,
                     keyframe_hook=holder.install_keyframe, **kw)
    if holder.memory is not None:
        sub.memory_staging = os.path.join(holder.memory, "staging")
        sub.book_path = os.path.join(holder.memory, "history")
    sub.hook_keeps_book = holder.keeps_book  # its apply hook decodes against the book and advances it
    return sub

