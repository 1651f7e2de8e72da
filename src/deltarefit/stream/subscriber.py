"""The subscriber: brings a local checkpoint from its version to the stream's head, verified.

``sync`` is staged: it reads and checks every commit record on the way (parent links, signatures),
picks the cheapest route in bytes (the chain of deltas, or the newest usable keyframe plus the deltas
after it), downloads every part into a staging directory and checks it against its record, and only
then writes (a route of deltas is planned while it downloads: see "Overlap"), version by version, verifying the fingerprint after each and recording
``{version, fingerprint}`` atomically beside the checkpoint. A sync interrupted anywhere resumes on
the next run: applies are idempotent and crash-safe, and the recorded version only moves after a
verified apply.

Overlap: a route of deltas (no keyframe) from a store with ranged reads (``get_range``), applied by
plain apply (no ``apply_hook``), is not staged whole first. Its parts stream into the staging
directory in route order on a background thread (``stream.arriving``: each part's header, then its
manifest and chunk table from the end of the file, then its payloads in order, hashed as they come),
and the first delta's plan runs on its part as it arrives, each chunk decoded once its bytes are
there; so a single-delta sync takes about max(download, plan) + write instead of download + plan +
write. The guarantees are the staged path's: the first write waits (``apply(before_write=)``) until
every part of the route has arrived whole with the size and BLAKE3 of its record (which is what
authenticates a part's header, manifest and table) and says what its record says, and until the
whole plan passed; a refusal before that point names a part that does not match its record if there
is one, else the plan's reason. Later deltas of a chain are planned once the one before is applied
(they apply to it), on parts already checked. A part that fails its check is removed from staging; a
checked one stays there until the sync ends, for a rerun. Keyframe routes, engine hooks and stores
without ranged reads stage every part whole first (``records.fetch_part``), as does ``prepare``.

Every record must be of the stream the checkpoint follows: its identity (``records.stream_identity``,
fixed at the stream's first version) is recorded with the version and checked on every record read.
At the head, a sync checks the store's record of the held version (same fingerprint, same stream)
and the identity of the checkpoint's files as they were when last verified (``Checkpoint.identity``);
files that changed since are hashed again, and ``verify=True`` always hashes. Only a hash is reported
as "verified" (``SyncReport.verified``). A checkpoint that fails these checks is refused with the way
out: ``repair=True`` (``deltarefit sync --repair``) restores it from the stream.

History (docs/STREAMS.md, "History"): a subscriber keeps a history book beside its checkpoint
(``history_path``), which deltas coded with history (record ``history``) decode against; each such
delta advances it, and a keyframe install, a catch-up step or a version without history starts it
over (``stream.history``). The route is chosen among those the book can decode (``route.decodable``):
a book that does not follow the stream's lineage at the held version (deleted, or after a rerun that
found chunks already applied) makes the chain refused and a keyframe route taken, and a catch-up
step is taken only where it leaves a book that can follow. Should a delta still be refused for its
history (``DecodeError``, nothing written), the book is started over and the sync planned again once,
which then takes a keyframe route.

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
from dataclasses import dataclass, field

from ..apply.files import ApplyReport
from ..apply.files import apply as apply_delta
from ..apply.files import check as check_delta
from ..checkpoint.read import check_not_replaced, open_checkpoint
from ..errors import BaseMismatchError, DecodeError, UsageError, VerificationError
from ..format import DeltaReader
from ..history_book import HistoryBook
from ..history_book import planted as book_planted
from ..history_book import writable as book_writable
from ..io.fsutil import fs_error
from ..io.locks import checkpoint_lock, locked_method
from ..signing import SignatureError, Verifier, check_record_signature
from ..storage.base import GET_RANGE, Store, open_store
from .arriving import ArrivingReader, PartDownloads
from .chain import MAX_RECORD_BYTES, check_links, get_bounded, newest_keyframe, sync_target
from .history import follows, lineage, open_book, resets, settle, start_over
from .records import (
    CommitRecord,
    MalformedRecordError,
    StreamError,
    StreamIdentityError,
    check_identity,
    fetch_part,
    head,
    held_state,
    held_version,
    identity_unchanged,
    load_commit,
    now,
    parse_proposal,
    prepared_key,
    record_version,
    stream_identity,
)
from .route import Step, cheapest_route, install_keyframe, remove_keyframe_leftovers

log = logging.getLogger(__name__)

# The ways out, named in the refusals (see ``Subscriber.sync`` and ``Publisher``).
REPAIR_FIX = "; 'deltarefit sync --repair' (same arguments) restores the checkpoint from the stream"
QUARANTINE_FIX = ("; if the stream's publisher did not write it, 'deltarefit publish --quarantine-head' sets it "
                  "aside")


@dataclass
class SyncReport:
    from_version: int
    version: int
    fingerprint: str
    route: str  # "none", "chain", "keyframe"
    bytes_fetched: int
    versions_applied: list[int] = field(default_factory=list)
    seconds: float = 0.0
    # True only when this sync hashed the checkpoint and it gave ``fingerprint`` (every apply does; at
    # the head, files whose identity changed since the last verification, or ``verify=True``). False
    # at the head when the checkpoint's files are unchanged since they were verified at ``version``.
    verified: bool = False
    # Chunk payloads the plan read before their part had wholly arrived: the download and the first
    # plan overlapped (0 on the staged path: keyframe routes, engine hooks, stores without ranged reads).
    early_reads: int = 0


def _checkpoint_lock_of(checkpoint: str) -> contextlib.AbstractContextManager[None]:
    # The same lock apply takes (apply.checkpoint_lock): sync and prepare hold it, and apply re-enters it.
    return checkpoint_lock(checkpoint)


def state_path(checkpoint: str) -> str:
    p = os.path.abspath(checkpoint)
    return os.path.join(p, ".deltarefit-version.json") if os.path.isdir(p) else p + ".deltarefit-version.json"


def history_path(checkpoint: str) -> str:
    """The checkpoint's history book: a directory beside it (beside, so that a keyframe renamed over a
    directory checkpoint leaves it where it is)."""
    return os.path.abspath(checkpoint) + ".deltarefit-history"


class Subscriber:
    # Whether ``apply_hook`` keeps the history book: it is then called as ``apply_hook(delta_path, book)``
    # (``book``: the ``HistoryBook`` to decode against and advance once verified, or None) and returns
    # the apply's report (``target_fingerprint``, ``chunks_skipped``, ``chunks_recovered``). A hook that
    # does not (the default) is called with the path alone, returns the fingerprint, and the book
    # starts over after it: such a subscriber takes no route through deltas coded with history.
    hook_keeps_book = False

    def __init__(self, store: Store | str, checkpoint: str, *, subscriber_id: str | None = None,
                 public_key: str | None = None, threads: int | None = None,
                 apply_hook: Callable[[str], str] | None = None,
                 keyframe_hook: Callable[[], None] | None = None, stream_id: str | None = None) -> None:
        """``apply_hook(delta_path) -> target fingerprint`` replaces the plain in-place apply of each
        staged delta (an engine applies it to the checkpoint and reloads what changed, see
        ``deltarefit.engines.vllm.sync_engine``); it must end with the checkpoint at the delta's target.
        ``keyframe_hook()`` runs after a keyframe was installed into the checkpoint (an engine reloads
        everything), before the version is recorded. ``stream_id``: follow only the stream of this
        identity (``deltarefit log`` shows it); without it a new subscriber takes the identity of the
        stream's first version in the store."""
        self.store = open_store(store) if isinstance(store, str) else store
        self.checkpoint = os.path.abspath(checkpoint)
        import blake3

        self.id = subscriber_id or f"{os.uname().nodename}-{blake3.blake3(os.fsencode(self.checkpoint)).hexdigest(4)}"
        if not self.id.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise UsageError(f"subscriber id {self.id!r}: use letters, digits, '-', '_' and '.' only")
        self.verifier = Verifier(public_key) if public_key else None
        self.threads = threads
        self.staging = self.checkpoint + ".deltarefit-staging"
        # A directory in memory (tmpfs) where a route of deltas is staged instead, while it fits
        # (``_staging_for``); None: everything is staged beside the checkpoint. Keyframes always are
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
        return held_version(state_path(self.checkpoint))

    def _files_identity(self) -> tuple:
        with open_checkpoint(self.checkpoint) as ck:
            return ck.identity()

    def _hash_identity(self) -> tuple[str, tuple]:
        """The checkpoint's fingerprint and the identity of the files hashed (taken before the hash, from
        the same handles: ``Checkpoint.hash_with_identity``)."""
        with open_checkpoint(self.checkpoint) as ck:
            fp, _, ident = ck.hash_with_identity(threads=self.threads)
        return fp, ident

    def _keeps_book(self) -> bool:
        """Whether this subscriber's applies decode against, and advance, its history book."""
        return self.apply_hook is None or self.hook_keeps_book

    def _record(self, version: int, fp: str, identity: tuple | None = None) -> None:
        """Record ``version``; ``identity``: the checkpoint's files' identity, taken after the last write
        and before (or by) the hash that verified ``fp``."""
        record_version(state_path(self.checkpoint), version, fp, self.store.url, stream_id=self._ident,
                       identity=identity)
        try:  # a heartbeat for retention; losing it costs nothing but an earlier prune
            self.store.put(f"subs/{self.id}.json", json.dumps({"version": version, "updated": now()}).encode())
        except Exception as e:
            log.warning("could not record subscriber position: %s", e)

    def _load(self, version: int) -> CommitRecord:
        try:
            return load_commit(self.store, version)
        except MalformedRecordError as e:
            raise MalformedRecordError(f"{e}{QUARANTINE_FIX}") from None

    def _commit(self, version: int) -> CommitRecord:
        """The record of ``version``, refused unless it is of the followed stream and, with a key,
        signed by it."""
        rec = self._load(version)
        where = f"{self.store.url} version {version}"
        try:
            self._check_signature(rec, where)
        except SignatureError as e:
            raise SignatureError(f"{e}{QUARANTINE_FIX}") from None
        check_identity(rec, self._ident, where, "; a version copied in from another stream is set aside by this "
                       "stream's publisher with 'deltarefit publish --quarantine-head'; to follow a new stream "
                       "in this store instead, 'deltarefit sync --repair'")
        if self._ident is None and rec.stream is not None:  # a legacy holder meets the stream's identity
            self._ident = rec.stream
        return rec

    def _check_signature(self, rec: CommitRecord, where: str) -> None:
        if self.verifier is not None:
            check_record_signature(rec.signature, rec.signed_bytes(), self.verifier, where)

    # -- sync ------------------------------------------------------------------------------------

    @locked_method(lambda self: _checkpoint_lock_of(self.checkpoint))
    def sync(self, *, to_version: int | None = None, verify: bool = False, repair: bool = False) -> SyncReport:
        """Bring the checkpoint to ``to_version`` (default: the head). At the head, ``verify`` hashes the
        checkpoint even when its files are unchanged since they were verified. ``repair`` ignores the
        recorded version and stream: a checkpoint whose fingerprint is a version of the store's stream
        is adopted at it, any other is replaced from the newest keyframe (the way out of an edited
        checkpoint, a store wiped and republished, or a checkpoint of another stream)."""
        try:
            return self._sync_adopting(to_version, verify, repair)
        except OSError as e:  # a full disk, a read-only or forbidden file: one line, the sync resumable
            raise fs_error(e, self.checkpoint, "sync failed (nothing recorded past the last verified version; "
                           "rerun once fixed)") from None

    def _sync_adopting(self, to_version: int | None, verify: bool, repair: bool) -> SyncReport:
        for p in remove_keyframe_leftovers(self.checkpoint):
            log.info("removed %s, left by a killed sync", p)
        try:
            return self._sync(to_version, verify, repair)
        except BaseMismatchError as e:
            # Killed between installing a keyframe (or an apply) and recording it: the checkpoint is
            # ahead of its record. Find its version by fingerprint and go on from there, once.
            cur = self.current()
            if self._adopt_by_fingerprint(above=cur[0] if cur else 0)[0] is None:
                raise BaseMismatchError(f"{e}{REPAIR_FIX}") from None
            return self._sync(to_version, verify, False)

    def _init_identity(self, state: dict | None) -> None:
        """The identity of the followed stream: recorded with the held version, else pinned, else the
        store's; refused when the store's stream is another one."""
        held = state.get("stream_id") if state else None
        if held is not None and self.pinned_stream is not None and held != self.pinned_stream:
            raise StreamIdentityError(f"{self.checkpoint}: follows stream {held}, not the requested "
                                      f"{self.pinned_stream}{REPAIR_FIX}")
        try:
            store_ident = stream_identity(self.store)
        except MalformedRecordError as e:
            raise MalformedRecordError(f"{e}{QUARANTINE_FIX}") from None
        self._ident = held or self.pinned_stream or store_ident
        if store_ident is not None and self._ident != store_ident:
            raise StreamIdentityError(f"{self.store.url}: holds stream {store_ident}, {self.checkpoint} follows "
                                      f"stream {self._ident} (store wiped and republished, or another run's "
                                      f"store?){REPAIR_FIX}")

    def _sync(self, to_version: int | None, verify: bool = False, repair: bool = False) -> SyncReport:
        self._refused_history = None
        try:
            return self._sync_once(to_version, verify, repair)
        except DecodeError as e:
            if self._refused_history is None:
                raise
            # The book did not follow after all (edited, or a rerun found chunks already applied):
            # nothing of that delta was written. Started over, the book follows no chain delta coded
            # with history, so the plan takes a keyframe route (or refuses to sync at all).
            log.warning("%s; starting the history book over and planning the sync again", e)
            self._refused_history = None
            start_over(self.book_path)
            return self._sync_once(to_version, verify, repair)

    def _book_writable(self) -> bool:
        """Whether the history book can be started over and advanced. Whatever else lies at its path
        (a symlink, dangling or planted, a FIFO, a file) is removed first, never followed."""
        if book_planted(self.book_path):
            start_over(self.book_path)
        return book_writable(self.book_path)

    def _book_follows(self, cur: tuple[int, str] | None) -> bool:
        """Whether the history book follows the stream's lineage at the held version."""
        return cur is not None and follows(open_book(self.book_path), lineage(self._commit, cur[0]))

    def _sync_once(self, to_version: int | None, verify: bool = False, repair: bool = False) -> SyncReport:
        t0 = time.perf_counter()
        self._hashed_at = None
        target = sync_target(self.store.url, head(self.store), to_version)
        state = None if repair else held_state(state_path(self.checkpoint))
        self._init_identity(state)
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
        writable = not keeps_book or self._book_writable()
        best = cheapest_route(self.store, cur, recs, book_follows=lambda: self._book_follows(cur),
                              keeps_book=keeps_book, book_writable=writable, or_none=cur is not None)
        if best is None:
            # The held book cannot decode the chain and no keyframe lies ahead: go back to the newest
            # keyframe (at or before the held version), which starts the book over. A book that cannot
            # be written would not follow after that keyframe either: the checkpoint stays where it is.
            if not writable:
                raise StreamError(f"{self.book_path}: history book cannot be written, and version {cur[0] + 1}'s "
                                  f"delta is coded against it; {self.checkpoint} stays at version {cur[0]} (make the "
                                  "book's directory writable, and sync again)")
            k = newest_keyframe(self._load, target)
            if k <= cur[0]:
                recs = {**{v: self._commit(v) for v in range(k, cur[0] + 1)}, **recs}
                check_links(recs, None, self.store.url, REPAIR_FIX)
                best = cheapest_route(self.store, None, recs, keeps_book=keeps_book, book_writable=writable)
            else:
                best = cheapest_route(self.store, cur, recs, book_follows=lambda: False, keeps_book=keeps_book,
                                      book_writable=writable)
        route, steps = best
        staging = self._staging_for(steps)
        os.makedirs(staging, exist_ok=True)
        local = {p.key: os.path.join(staging, p.key.replace("/", "_")) for st in steps for p in st.parts}
        if self._overlaps(steps):
            return self._sync_arriving(steps, staging, local, recs, cur, start, route, t0)
        fetched = 0
        for part in (p for st in steps for p in st.parts):  # stage everything first
            fetched += fetch_part(self.store, part, local[part.key])
        self._check_staged(steps, local)
        applied, version, fp = self._apply_steps(steps, local, recs, cur)
        shutil.rmtree(staging, ignore_errors=True)
        return SyncReport(start, version, fp, route, fetched, applied, time.perf_counter() - t0, verified=True)

    def _staging_for(self, steps: list[Step]) -> str:
        """Where a route's parts are staged: ``memory_staging`` for a route of deltas whose parts take at
        most a quarter of the room left there (an engine's: no byte of it reaches a disk), else beside
        the checkpoint (``staging``)."""
        mem = self.memory_staging
        if mem is None or any(st.kind == "keyframe" for st in steps):
            return self.staging
        need = sum(p.bytes for st in steps for p in st.parts)
        try:
            room = shutil.disk_usage(os.path.dirname(mem)).free
        except OSError:
            return self.staging
        return mem if need <= room // 4 else self.staging

    def _overlaps(self, steps: list[Step]) -> bool:
        """Whether this route is synced with its download and the first plan overlapped: deltas only
        (keyframes are staged whole), applied by plain apply (not an engine's hook), from a store with
        ranged reads."""
        return (self.apply_hook is None and GET_RANGE in self.store.capabilities
                and all(st.kind != "keyframe" for st in steps))

    def _check_staged(self, steps: list[Step], local: dict[str, str]) -> None:
        """Each staged delta must say what its record says, before any write."""
        for st in steps:
            if st.kind != "keyframe":
                with DeltaReader(local[st.parts[0].key]) as d:
                    if (d.base_fingerprint, d.target_fingerprint) != (st.parent, st.fingerprint):
                        raise StreamError(f"{self.store.url} version {st.version}: its {st.kind} goes from "
                                          f"{d.base_fingerprint[:16]}… to {d.target_fingerprint[:16]}…, the record "
                                          f"says {str(st.parent)[:16]}… to {st.fingerprint[:16]}…")

    def _sync_arriving(self, steps: list[Step], staging: str, local: dict[str, str], recs: dict[int, CommitRecord],
                       cur: tuple[int, str] | None, start: int, route: str, t0: float) -> SyncReport:
        """A route of deltas, its first delta planned while the parts download (module docstring,
        "Overlap"): every part streams into staging in order on a background thread; the first apply
        plans on its part as it arrives; before its first write, every part must be whole and match
        its record, and every delta must say what its record says, as on the staged path."""
        downloads = self.arriving = PartDownloads(self.store, [(st.parts[0], local[st.parts[0].key]) for st in steps])
        gate: list[bool] = []  # [True] once passed, [False] once refused

        def authenticated() -> None:
            """The first write waits here, after the whole plan passed: every part of the route whole,
            with its record's size and BLAKE3, and saying what its record says."""
            try:
                downloads.wait_all()
                self._check_staged(steps, local)
            except BaseException:
                gate.append(False)
                raise
            gate.append(True)

        first = steps[0].parts[0].key

        def apply_first(history: HistoryBook | None) -> ApplyReport:
            try:
                reader = ArrivingReader(downloads.parts[0])
                try:
                    return apply_delta(local[first], self.checkpoint, threads=self.threads, reader=reader,
                                       before_write=authenticated, history=history)
                finally:
                    reader.close()
            except Exception:
                if not gate:
                    # Refused before the gate, on bytes not yet authenticated: a part that does not
                    # match its record is the refusal to report (as the staged path reports it);
                    # otherwise the parts are what their records say, and the plan's refusal stands.
                    try:
                        authenticated()
                    except Exception as e:
                        raise e from None
                raise

        try:
            applied, version, fp = self._apply_steps(steps, local, recs, cur, first_apply=apply_first)
        except BaseException as e:
            if not isinstance(e, Exception):  # interrupted: stop the download where it is
                downloads.abandon()
            raise
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
                    got, ident = self._hash_identity()
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
                        local[st.parts[0].key], self.checkpoint, threads=self.threads, history=book)
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
            ident = ident or self._files_identity()
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
        """The checkpoint holds the target version by its record: check that the store's record of it is
        the one synced, and that the checkpoint still is it (its files' identity unchanged since they
        were verified, else a hash; ``verify``: always a hash). Refuses, with the way out, otherwise."""
        version, fp = cur
        rec = self._commit(version)
        if rec.fingerprint != fp:
            raise StreamError(f"{self.store.url}: version {version} is {rec.fingerprint[:16]}…, but "
                              f"{self.checkpoint} was synced to {fp[:16]}… at that version (store wiped and "
                              f"republished?){REPAIR_FIX}")
        if self._hashed_at == version:  # adopted by its fingerprint just now
            return SyncReport(start, version, fp, "none", 0, [], time.perf_counter() - t0, verified=True)
        ident = self._files_identity()
        if not verify and identity_unchanged(held_state(state_path(self.checkpoint)) or {}, ident):
            return SyncReport(start, version, fp, "none", 0, [], time.perf_counter() - t0, verified=False)
        got, ident = self._hash_identity()
        if got != fp:
            raise VerificationError(f"{self.checkpoint}: fingerprint {got[:16]}… is not version {version}'s "
                                    f"{fp[:16]}… (changed since it was synced){REPAIR_FIX}")
        check_not_replaced(ident, f"verified at version {version}")
        self._record(version, fp, ident)
        return SyncReport(start, version, fp, "none", 0, [], time.perf_counter() - t0, verified=True)

    def _adopt(self, repair: bool = False) -> tuple[int, str] | None:
        """The local state; for a checkpoint without one, find its version by fingerprint. ``repair``:
        ignore the state, and hold nothing when no version has the checkpoint's fingerprint."""
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
        or None; and the checkpoint's fingerprint."""
        fp, ident = self._hash_identity()  # identity before the hash: a write during it changes it
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
        cur = self.current()
        if cur is None:
            return None
        v = cur[0] + 1
        try:
            data = get_bounded(self.store, prepared_key(v), MAX_RECORD_BYTES, "proposal")
        except KeyError:
            return None
        rec, _ = parse_proposal(data, f"{self.store.url}/{prepared_key(v)}")
        self._check_signature(rec, f"{self.store.url} proposed version {v}")
        held = (held_state(state_path(self.checkpoint)) or {}).get("stream_id")
        check_identity(rec, held or self.pinned_stream, f"{self.store.url} proposed version {v}")
        ok, why = True, ""
        if rec.parent != cur[1] or rec.delta is None:
            ok, why = False, "parent is not the local checkpoint"
        else:
            dest = os.path.join(self.staging, rec.delta.key.replace("/", "_"))
            try:
                fetch_part(self.store, rec.delta, dest)
                check_delta(dest, self.checkpoint, threads=self.threads,
                            history=open_book(self.book_path) if rec.history else None)
            except Exception as e:  # any failure is a "no" vote, and its reason goes into the ack
                ok, why = False, str(e)
        ack = {"ok": ok, "fingerprint": rec.fingerprint, "subscriber": self.id, "why": why, "at": now()}
        self.store.put(f"acks/{v:012d}/{self.id}.json", json.dumps(ack).encode())
        shutil.rmtree(self.staging, ignore_errors=True)  # the proposal may never commit; sync fetches again
        return v if ok else None


def sync(store: str, checkpoint: str, **kwargs) -> SyncReport:
    """Library form of ``deltarefit sync STORE CHECKPOINT``."""
    opts = {k: kwargs.pop(k) for k in ("subscriber_id", "public_key", "threads", "stream_id") if k in kwargs}
    return Subscriber(store, checkpoint, **opts).sync(**kwargs)
