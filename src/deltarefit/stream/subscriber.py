"""The subscriber: brings a local checkpoint from its version to the stream's head, verified.

``sync`` is staged: it reads and checks every commit record on the way (parent links, signatures),
picks the cheapest route in bytes (the chain of deltas, or the newest usable keyframe plus the deltas
after it), downloads every part into a staging directory and checks it against its record, and only
then writes (a route of deltas is planned while it downloads: see "Overlap"), version by version,
verifying the fingerprint after each and recording ``{version, fingerprint}`` atomically beside the
checkpoint. A sync interrupted anywhere resumes on the next run: applies are idempotent and crash-safe,
and the recorded version only moves after a verified apply.

Overlap (``stream.arriving``, "Overlap"): a route of deltas from a store with ranged reads, applied by
plain apply, has its first delta planned while its parts download, under the staged path's checks.

Every record must be of the stream the checkpoint follows: its identity (``records.stream_identity``,
fixed at the stream's first version) is recorded with the version and checked on every record read.
At the head, a sync checks the store's record of the held version (same fingerprint, same stream)
and the identity of the checkpoint's files as they were when last verified (``Checkpoint.identity``);
files that changed since are hashed again, and ``verify=True`` always hashes. Only a hash is reported
as "verified" (``SyncReport.verified``). A checkpoint that fails these checks is refused with the way
out: ``repair=True`` (``deltarefit sync --repair``) restores it from the stream.

History (``stream.history``, "A subscriber's book"): a subscriber keeps a history book beside its
checkpoint (``history_path``), which deltas coded with history decode against; the route is chosen
among those the book can decode.

Holder (``stream.holder``): what holds the version, by default the checkpoint (its version recorded
beside it, its files' identity vouching for it at the head); a live engine's weights in the vLLM
backend (``engines.vllm.holder``), which also plans its next delta ahead (``plan``).

Joint commit: ``prepare`` verifies a proposed (prepared, not yet committed) version against the
local checkpoint without writing it, and acknowledges it in the store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable

import blake3

from ..apply.files import ApplyReport
from ..apply.files import apply as apply_delta
from ..checkpoint.read import check_not_replaced
from ..errors import BaseMismatchError, DecodeError, UsageError
from ..history_book import HistoryBook
from ..io.beside import check_beside, own_dir
from ..io.fsutil import fs_error
from ..io.locks import checkpoint_lock, locked_method
from ..signing import SignatureError, Verifier
from ..storage.base import Store, open_store
from .arriving import PartDownloads, apply_arriving
from .chain import check_links, newest_keyframe, sync_target
from .history import book_writable_at, follows, lineage, open_book, resets, settle, start_over
from .holder import REPAIR_FIX, CheckpointHolder, Holder, hash_identity, history_path, state_path
from .joint import acknowledge
from .outcomes import Planned, SyncReport
from .progress import Opener, apply_phase, reporting, store_phase
from .records import (
    CommitRecord,
    MalformedRecordError,
    StreamError,
    check_identity,
    fetch_part,
    followed_stream,
    head,
    load_commit,
    now,
)
from .route import (
    Step,
    check_staged,
    choose_route,
    install_keyframe,
    overlaps,
    remove_keyframe_leftovers,
    staging_for,
)

__all__ = ["QUARANTINE_FIX", "REPAIR_FIX", "Planned", "Subscriber", "SyncReport", "history_path", "state_path", "sync"]

log = logging.getLogger(__name__)

# The way out of a record no publisher of the stream wrote, named in the refusals (REPAIR_FIX: holder.py).
QUARANTINE_FIX = ("; nothing was written; if the stream's publisher did not write it, "
                  "'deltarefit publish --quarantine-head' sets it aside")


def _checkpoint_lock_of(checkpoint: str) -> contextlib.AbstractContextManager[None]:
    # The same lock apply takes (apply.checkpoint_lock): sync and prepare hold it, and apply re-enters it.
    return checkpoint_lock(checkpoint)


class Subscriber:
    # Whether ``apply_hook`` keeps the history book: it is then called as ``apply_hook(delta_path, book)``
    # (``book``: the ``HistoryBook`` to decode against and advance once verified, or None) and returns
    # the apply's report (``target_fingerprint``, ``chunks_skipped``, ``chunks_recovered``). A hook that
    # does not (the default) is called with the path alone, returns the fingerprint, and the book
    # starts over after it: such a subscriber takes no route through deltas coded with history.
    hook_keeps_book = False
    progress: Opener | None = None  # told each long step's bytes (``stream.progress``); None: no calls

    def __init__(self, store: Store | str, checkpoint: str, *, subscriber_id: str | None = None,
                 public_key: str | None = None, threads: int | None = None,
                 apply_hook: Callable[[str], str] | None = None,
                 keyframe_hook: Callable[[], None] | None = None, stream_id: str | None = None,
                 holder: Holder | None = None) -> None:
        """``apply_hook(delta_path) -> target fingerprint`` replaces the plain in-place apply of each
        staged delta (an engine applies it to the checkpoint and reloads what changed, see
        ``deltarefit.engines.vllm.sync_engine``); it must end with the checkpoint at the delta's target.
        ``keyframe_hook()`` runs after a keyframe was installed into the checkpoint (an engine reloads
        everything), before the version is recorded. ``stream_id``: follow only the stream of this
        identity (``deltarefit log`` shows it); without it a new subscriber takes the identity of the
        stream's first version in the store. ``holder``: what holds the version (``stream.holder``),
        by default the checkpoint itself (``CheckpointHolder``); ``checkpoint`` is then where keyframes
        are installed and the staging and history book are kept beside."""
        self.store = open_store(store) if isinstance(store, str) else store
        self.checkpoint = os.path.abspath(checkpoint)
        self.id = subscriber_id or f"{os.uname().nodename}-{blake3.blake3(os.fsencode(self.checkpoint)).hexdigest(4)}"
        if not self.id.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise UsageError(f"subscriber id {self.id!r}: use letters, digits, '-', '_' and '.' only")
        self.verifier = Verifier(public_key) if public_key else None
        self.threads = threads
        self.holder: Holder = holder if holder is not None else CheckpointHolder(self.checkpoint, threads=threads)
        self.staging = self.checkpoint + ".deltarefit-staging"
        # A directory in memory (tmpfs) where a route of deltas is staged instead, while it fits
        # (``route.staging_for``); None: everything is staged beside the checkpoint. Keyframes always are
        # (they are renamed into place, and are the size of the checkpoint).
        self.memory_staging: str | None = None
        self.book_path = history_path(self.checkpoint)
        self.apply_hook = apply_hook
        self.keyframe_hook = keyframe_hook
        self.pinned_stream = stream_id
        self._ident: str | None = None  # identity of the followed stream, set at the start of each sync
        self._hashed_at: int | None = None  # the version a fingerprint of the checkpoint just matched
        # The parts of the overlapped sync in progress (their watermarks, ``early_reads``), else None.
        self.arriving: PartDownloads | None = None
        # The version whose delta, coded with history, the held book could not decode (nothing of it
        # written), in the sync attempt that just failed; else None.
        self._refused_history: int | None = None

    # -- state -----------------------------------------------------------------------------------

    def current(self) -> tuple[int, str] | None:
        """(version, fingerprint) of the local checkpoint as last verified, or None."""
        return self.holder.held()

    def _keeps_book(self) -> bool:
        """Whether this subscriber's applies decode against, and advance, its history book."""
        return self.apply_hook is None or self.hook_keeps_book

    def _record(self, version: int, fp: str, identity: tuple | None = None) -> None:
        """Record ``version``; ``identity``: the checkpoint's files' identity, taken after the last write
        and before (or by) the hash that verified ``fp``."""
        self.holder.record(version, fp, url=self.store.url, stream_id=self._ident, identity=identity)
        try:  # a heartbeat for retention; losing it costs nothing but an earlier prune
            self.store.put(f"subs/{self.id}.json", json.dumps({"version": version, "updated": now()}).encode())
        except Exception as e:
            log.warning("could not record subscriber position: %s", e)

    def _load(self, version: int) -> CommitRecord:
        try:
            return load_commit(self.store, version, self.verifier)  # with a key: signature checked unparsed
        except (MalformedRecordError, SignatureError) as e:
            raise type(e)(f"{e}{QUARANTINE_FIX}") from None

    def _commit(self, version: int) -> CommitRecord:
        """The record of ``version``, refused unless it is of the followed stream and, with a key,
        signed by it (checked over its stored bytes by ``_load``)."""
        rec = self._load(version)
        where = f"{self.store.url} version {version}"
        check_identity(rec, self._ident, where, "; a version copied in from another stream is set aside by this "
                       "stream's publisher with 'deltarefit publish --quarantine-head'; to follow a new stream "
                       "in this store instead, 'deltarefit sync --repair'")
        if self._ident is None and rec.stream is not None:  # a legacy holder meets the stream's identity
            self._ident = rec.stream
        return rec

    # -- sync ------------------------------------------------------------------------------------

    @locked_method(lambda self: _checkpoint_lock_of(self.checkpoint))
    def sync(self, *, to_version: int | None = None, verify: bool = False, repair: bool = False) -> SyncReport:
        """Bring the checkpoint to ``to_version`` (default: the head). At the head, ``verify`` hashes the
        checkpoint even when its files are unchanged since they were verified. ``repair`` ignores the
        recorded version and stream: a checkpoint whose fingerprint is a version of the store's stream
        is adopted at it, any other is replaced from the newest keyframe (the way out of an edited
        checkpoint, a store wiped and republished, or a checkpoint of another stream)."""
        return self._run(to_version, verify, repair, False)

    @locked_method(lambda self: _checkpoint_lock_of(self.checkpoint))
    def plan(self, *, to_version: int | None = None) -> SyncReport | Planned:
        """A sync up to its first write (an engine plans its next version while it serves): the route's
        records read and checked, its parts staged whole and checked, and its first step, if a delta,
        handed to the holder's ``plan``; returns ``Planned``, with nothing written or recorded. A holder
        already at ``to_version`` (default: the head) is checked as ``sync`` checks it (its report)."""
        return self._run(to_version, False, False, True)

    def _run(self, to_version: int | None, verify: bool, repair: bool, plan_only: bool) -> SyncReport | Planned:
        try:
            return self._sync_adopting(to_version, verify, repair, plan_only)
        except OSError as e:  # a full disk, a read-only or forbidden file: one line, the sync resumable
            raise fs_error(e, self.checkpoint, "sync failed (nothing recorded past the last verified version; "
                           "rerun once fixed)") from None

    def _sync_adopting(self, to_version: int | None, verify: bool, repair: bool,
                       plan_only: bool) -> SyncReport | Planned:
        # Names kept beside the checkpoint: another user's link or FIFO there is refused, never followed.
        check_beside(self.staging, "staging directory", directory=True)
        for p in remove_keyframe_leftovers(self.checkpoint):
            log.info("removed %s, left by a killed sync", p)
        try:
            return self._sync(to_version, verify, repair, plan_only)
        except BaseMismatchError as e:
            # Killed between installing a keyframe (or an apply) and recording it: the checkpoint is
            # ahead of its record. Find its version by fingerprint and go on from there, once.
            cur = self.current()
            if self._adopt_by_fingerprint(above=cur[0] if cur else 0)[0] is None:
                raise BaseMismatchError(f"{e}{REPAIR_FIX}") from None
            return self._sync(to_version, verify, False, plan_only)

    def _init_identity(self, held: str | None) -> None:
        """The identity of the followed stream (``records.followed_stream``: ``held``, the holder's, else
        pinned, else the store's), told to the holder (``bind_stream``)."""
        self._ident = followed_stream(self.store, held, self.pinned_stream, self.checkpoint, REPAIR_FIX,
                                      QUARANTINE_FIX, self.verifier)
        self.holder.bind_stream(self._ident)

    def _sync(self, to_version: int | None, verify: bool, repair: bool, plan_only: bool) -> SyncReport | Planned:
        self._refused_history = None
        try:
            return self._sync_once(to_version, verify, repair, plan_only)
        except DecodeError as e:
            if self._refused_history is None:
                raise
            # The book did not follow after all (edited, or a rerun found chunks already applied):
            # nothing of that delta was written. Started over, the book follows no chain delta coded
            # with history, so the plan takes a keyframe route (or refuses to sync at all).
            log.warning("%s; starting the history book over and planning the sync again", e)
            self._refused_history = None
            start_over(self.book_path)
            return self._sync_once(to_version, verify, repair, plan_only)

    def _book_follows(self, cur: tuple[int, str] | None, plan_only: bool) -> bool:
        """Whether the history book follows the stream's lineage at the held version, for the holder's
        whole group (``Holder.agree``: a tensor-parallel engine takes a route through deltas coded with
        history only where all of its books can decode them). A plan-only sync asks its own book alone:
        it runs beside the holder's serving, where no group call may be made, and a group's update
        plans its route again."""
        mine = cur is not None and follows(open_book(self.book_path), lineage(self._commit, cur[0]))
        return mine if plan_only else self.holder.agree(mine)

    def _sync_once(self, to_version: int | None, verify: bool, repair: bool, plan_only: bool) -> SyncReport | Planned:
        t0 = time.perf_counter()
        self._hashed_at = None
        target = sync_target(self.store.url, head(self.store), to_version)
        self._init_identity(self.holder.held_stream(repair=repair))
        cur = self._adopt(repair)
        start = cur[0] if cur else 0
        if cur and cur[0] > target:
            raise StreamError(f"{self.checkpoint} is at version {cur[0]}, ahead of {target}")
        if cur and cur[0] == target:
            return self._at_head(cur, start, verify, t0)
        # A new subscriber starts from the newest keyframe: read records back to it.
        first = newest_keyframe(self._load, target) if cur is None else cur[0] + 1
        recs = {v: self._commit(v) for v in range(first, target + 1)}
        check_links(recs, cur, self.store.url, REPAIR_FIX)  # the chain links up, from what we hold
        keeps_book = self._keeps_book()
        route, steps, recs = choose_route(
            self.store, cur, recs, target, load=self._load, commit=self._commit, keeps_book=keeps_book,
            writable=not keeps_book or book_writable_at(self.book_path), book_path=self.book_path,
            book_follows=lambda: self._book_follows(cur, plan_only), checkpoint=self.checkpoint)
        staging = own_dir(staging_for(steps, self.memory_staging, self.staging), "staging directory")
        local = {p.key: os.path.join(staging, p.key.replace("/", "_")) for st in steps for p in st.parts}
        if not plan_only and self.apply_hook is None and overlaps(self.store, steps):
            return self._sync_arriving(steps, staging, local, recs, cur, start, route, t0)
        parts = [p for st in steps for p in st.parts]
        with store_phase(self.store, self.progress, f"sync: fetch {route}", sum(p.bytes for p in parts)):
            fetched = sum(fetch_part(self.store, p, local[p.key]) for p in parts)  # stage everything first
        check_staged(self.store.url, steps, local)
        if plan_only:  # the staging is kept: the sync that writes this route finds its parts there
            if steps[0].kind == "delta" and self.holder.plans:
                self.holder.plan(local[steps[0].parts[0].key], self._book_for(steps[0], recs[steps[0].version]))
            return Planned(start, steps[-1].version, route)
        applied, version, fp = self._apply_steps(steps, local, recs, cur)
        shutil.rmtree(staging, ignore_errors=True)
        return SyncReport(start, version, fp, route, fetched, applied, time.perf_counter() - t0, verified=True)

    def _sync_arriving(self, steps: list[Step], staging: str, local: dict[str, str], recs: dict[int, CommitRecord],
                       cur: tuple[int, str] | None, start: int, route: str, t0: float) -> SyncReport:
        """A route of deltas, its first delta planned while the parts download (module docstring,
        "Overlap"; ``arriving.apply_arriving``), with the staged path's checks before the first write."""
        downloads = self.arriving = PartDownloads(self.store, [(st.parts[0], local[st.parts[0].key]) for st in steps])
        try:
            applied, version, fp = apply_arriving(
                downloads, local[steps[0].parts[0].key], self.checkpoint, self.threads,
                apply=reporting(apply_delta, self.progress, recs[steps[0].version]),
                check_staged=lambda: check_staged(self.store.url, steps, local),
                apply_steps=lambda first: self._apply_steps(steps, local, recs, cur, first_apply=first))
        finally:
            self.arriving = None
        shutil.rmtree(staging, ignore_errors=True)
        return SyncReport(start, version, fp, route, downloads.fetched, applied, time.perf_counter() - t0,
                          verified=True, early_reads=downloads.early_reads)

    def _apply_steps(self, steps: list[Step], local: dict[str, str], recs: dict[int, CommitRecord],
                     cur: tuple[int, str] | None,
                     first_apply: Callable[[HistoryBook | None], ApplyReport] | None = None
                     ) -> tuple[list[int], int, str]:
        """Apply the staged route version by version, recording each verified one, and keep the
        history book along (module docstring, "History"). ``first_apply(history)``: applies the first
        step instead (returns its report)."""
        applied: list[int] = []
        version, fp = cur if cur else (0, "")
        for i, st in enumerate(steps):
            rec = recs[st.version]
            book = self._book_for(st, rec)
            try:
                ident: tuple = ()
                consumed = False
                if st.kind == "keyframe":
                    install_keyframe(rec, local, self.staging, self.checkpoint)
                    got, ident = hash_identity(self.checkpoint, self.threads)
                    if self.keyframe_hook is not None and got == st.fingerprint:
                        # The hook consumes the installed files (an engine reloads them, then removes its
                        # scratch copy): they are checked to be the ones hashed before it reads them.
                        check_not_replaced(ident, f"installed version {st.version}")
                        self.keyframe_hook()
                        consumed = True
                elif self.apply_hook is not None and not (i == 0 and first_apply is not None):
                    if self.hook_keeps_book:
                        rep = self.apply_hook(local[st.parts[0].key], book)
                        got, ident = rep.target_fingerprint, getattr(rep, "identity", ())
                        if book is not None:
                            settle(self.book_path, rep)
                    else:
                        got = self.apply_hook(local[st.parts[0].key])
                else:
                    # apply verifies that the checkpoint reached the delta's own target fingerprint; the
                    # record must name that same fingerprint (an edited record must not be believed).
                    rep = first_apply(book) if i == 0 and first_apply is not None else apply_delta(
                        local[st.parts[0].key], self.checkpoint, threads=self.threads, history=book,
                        progress=apply_phase(self.progress, rec))
                    got, ident = rep.target_fingerprint, rep.identity
                    if book is not None:
                        settle(self.book_path, rep)
            except DecodeError as e:
                if st.kind == "delta" and rec.history:
                    self._refused_history = st.version
                    raise DecodeError(f"{e} (version {st.version} is coded against a history book)") from None
                raise
            if got != st.fingerprint:
                raise StreamError(f"{self.checkpoint}: fingerprint after version {st.version} is {got[:16]}…, "
                                  f"expected {st.fingerprint[:16]}…")
            if st.kind != "delta" or resets(rec) or not self._keeps_book():
                start_over(self.book_path)  # a keyframe, a catch-up, a version without history: no history
            version, fp = st.version, st.fingerprint
            # Hazard: an engine's hook that reports no identity leaves only the path's, taken after the fact.
            ident = ident or self.holder.identity()
            if not consumed:
                check_not_replaced(ident, f"synced to version {version}")
            self._record(version, fp, ident)
            applied.append(version)
        return applied, version, fp

    def _book_for(self, st: Step, rec: CommitRecord) -> HistoryBook | None:
        """The book step ``st`` decodes against: a delta coded with history decodes against the book, which
        its verified apply advances; a book that already holds the version (a kill after that, before the
        record) is not needed: the rerun finds every chunk applied."""
        if not (st.kind == "delta" and rec.history and self._keeps_book()):
            return None
        book = open_book(self.book_path)
        return None if book.tip == st.fingerprint else book

    def _at_head(self, cur: tuple[int, str], start: int, verify: bool, t0: float) -> SyncReport:
        """The holder holds the target version by its record: check that the store's record of it is the
        one synced, and that the holder still holds it (``Holder.check_held``; ``verify``: a hash).
        Refuses, with the way out, otherwise."""
        version, fp = cur
        rec = self._commit(version)
        if rec.fingerprint != fp:
            raise self.holder.mismatch(self.store.url, version, fp, rec.fingerprint)
        if self._hashed_at == version:  # adopted by its fingerprint just now
            return SyncReport(start, version, fp, "none", 0, [], time.perf_counter() - t0, verified=True)
        hashed, ident = self.holder.check_held(version, fp, verify=verify)
        if ident is not None:
            self._record(version, fp, ident)
        return SyncReport(start, version, fp, "none", 0, [], time.perf_counter() - t0, verified=hashed)

    def _adopt(self, repair: bool = False) -> tuple[int, str] | None:
        """The local state; for a checkpoint without one, find its version by fingerprint. ``repair``:
        ignore the state, and hold nothing when no version has the checkpoint's fingerprint. A holder
        that does not adopt (``Holder.adopts``) holds what it says."""
        if not self.holder.adopts:
            return self.current()
        cur = None if repair else self.current()
        if cur is not None or not os.path.exists(self.checkpoint):
            if cur is not None and not os.path.exists(self.checkpoint):
                raise StreamError(f"{self.checkpoint}: missing, but its version record exists{REPAIR_FIX}")
            return cur
        v, fp = self._adopt_by_fingerprint(above=0)
        if v is None:
            if repair:
                log.warning("%s: fingerprint %s… is no version of %s; restoring it from the newest keyframe",
                            self.checkpoint, fp[:16], self.store.url)
                return None
            raise StreamError(f"{self.checkpoint}: fingerprint {fp[:16]}… is no version of {self.store.url}"
                              f"{REPAIR_FIX.replace('restores the checkpoint', 'replaces it')}")
        return v, fp

    def _adopt_by_fingerprint(self, *, above: int) -> tuple[int | None, str]:
        """The newest version after ``above`` whose fingerprint the checkpoint has (recorded as held),
        or None; and the checkpoint's fingerprint (a holder that does not adopt: None, and its own)."""
        if not self.holder.adopts:
            return None, self.holder.held()[1]
        fp, ident = hash_identity(self.checkpoint, self.threads)  # identity before the hash: a write during it changes it
        for v in range(head(self.store), above, -1):
            if self._commit(v).fingerprint == fp:
                check_not_replaced(ident, f"verified at version {v}")
                self._record(v, fp, ident)
                self._hashed_at = v
                return v, fp
        return None, fp

    # -- joint commit ----------------------------------------------------------------------------

    @locked_method(lambda self: _checkpoint_lock_of(self.checkpoint))
    def prepare(self) -> int | None:
        """Acknowledge the proposed next version if it applies to the local checkpoint (nothing is
        written to the checkpoint). Returns the version acknowledged, or None if none is proposed."""
        return acknowledge(self.store, self.current(), self.id, verifier=self.verifier,
                           stream=lambda: self.holder.held_stream(repair=False) or self.pinned_stream,
                           staging=self.staging, checkpoint=self.checkpoint, threads=self.threads,
                           book_path=self.book_path)

def sync(store: str, checkpoint: str, **kwargs) -> SyncReport:
    """Library form of ``deltarefit sync STORE CHECKPOINT``."""
    opts = {k: kwargs.pop(k) for k in ("subscriber_id", "public_key", "threads", "stream_id") if k in kwargs}
    return Subscriber(store, checkpoint, **opts).sync(**kwargs)
