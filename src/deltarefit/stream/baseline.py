"""The publisher's baseline (``Baseline``, an object ``Publisher`` holds): the checkpoint that holds the
committed version and the state that names it, how it advances after a commit (a verified copy, or the
delta applied in place), the segment hashes kept of it for the next encode, and its rebuild from the
stream (``Publisher.reset_baseline``)."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
from collections.abc import Callable

from ..apply.files import apply as apply_delta
from ..checkpoint.read import open_checkpoint
from ..encode import EncodeReport, KnownHashes
from ..errors import CheckpointError, DecodeError, VerificationError
from ..history_book import HistoryBook, MovesRecorder
from ..io.beside import own_dir, own_dir_in
from ..io.fsutil import create_temp, open_regular, write_atomic
from ..storage.base import Store
from .history import follows, lineage, open_book, resets, settle, start_over
from .publish_state import _TEMP_SUFFIX, RESET_FIX, PublishState, read_state_json
from .records import CommitRecord, Part, StreamError, commit_key, fetch_part, load_commit
from .unchanged import undecodable

log = logging.getLogger(__name__)


class Baseline:
    """The checkpoint file that holds a publisher's committed version (``path``), the state that names
    that version (``state_path``, ``publisher.json``), the segment hashes kept of it for the next encode
    (``known``) and its history book. ``Publisher`` holds one; ``advance``: its advance route ("copy" or
    "apply", see ``Publisher``)."""

    def __init__(self, store: Store, state_dir: str, *, threads: int | None, advance: str) -> None:
        self.store = store
        self.threads = threads
        self.advance = advance
        # The state directory (default inside the store, which other users may write): made, or taken only
        # where it is this user's directory, never through a link planted there.
        own_dir_in(state_dir, "publisher state directory")
        self.path = os.path.join(state_dir, "baseline.safetensors")
        self.state_path = os.path.join(state_dir, "publisher.json")
        self.staging = os.path.join(state_dir, "staging")
        # The baseline's segment hashes, from the encode whose target it became (see ``remember``); used
        # while the baseline file keeps its identity. Kept in memory and in known_path, so that a
        # publish in a new process (each `deltarefit publish`) finds them too.
        self.known: KnownHashes | None = None
        self.known_path = os.path.join(state_dir, "baseline.hashes")
        # The baseline's history book. Kept by every publisher that follows a version coded with one
        # (recover, reset_baseline), so that it can decode the next; written into only with history.
        self.book_path = os.path.join(state_dir, "history")
        # The moves of the version being published, kept from before its commit until its book commit:
        # a kill after the baseline reached it (its chunks then all found applied, their moves gone)
        # still advances the book by them (``advance_to``).
        self.staged_moves_path = os.path.join(state_dir, "history.pending")

    # -- state -----------------------------------------------------------------------------------

    def state(self) -> PublishState | None:
        """The committed version the baseline holds, as recorded; None without a state."""
        try:
            d = read_state_json(self.state_path, "publisher state")
            sid = d.get("stream_id")
            return PublishState(int(d["version"]), str(d["fingerprint"]), None if sid is None else str(sid))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise StreamError(f"{self.state_path}: unreadable publisher state ({e}){RESET_FIX}") from None

    def save_state(self, st: PublishState) -> None:
        d = {"version": st.version, "fingerprint": st.fingerprint, "stream": self.store.url}
        if st.stream_id is not None:
            d["stream_id"] = st.stream_id
        write_atomic(self.state_path, json.dumps(d).encode())

    def forget(self) -> None:
        """Drop the state, the kept hashes, the history book, the staged moves and the staging: what
        ``rebuild`` starts from."""
        for p in (self.state_path, self.known_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        start_over(self.book_path)  # rebuilt with the baseline: a keyframe starts it, each delta advances it
        start_over(self.staged_moves_path)
        self.known = None
        shutil.rmtree(self.staging, ignore_errors=True)

    def rebuild(self, h: int, trusted: Callable[[int], CommitRecord],
                set_aside: Callable[[int, str], None] | None = None) -> PublishState | None:
        """Rebuild the baseline from the stream (after ``forget``): the newest keyframe, then the deltas
        after it to the head ``h``, each record from ``trusted(version)`` (which refuses one this
        publisher must not build on) and the baseline verified after each. None for an empty stream
        (no baseline left). ``set_aside(h, why)``: called for a head delta that does not decode on the
        version before it (``undecodable``), rebuilt then to that version instead."""
        try:
            return self._rebuild(h, trusted)
        except (VerificationError, DecodeError):
            if set_aside is None or h < 2:
                raise
            self.forget()
            st = self._rebuild(h - 1, trusted)
            why = self.undecodable(trusted(h), st) if st is not None else None
            if why is None:
                raise
            set_aside(h, f"{self.store.url}/{commit_key(h)}: {why}")
            return st

    def book_at(self, st: PublishState) -> HistoryBook | None:
        """The history book to code the next delta against: the baseline's, where it follows the
        stream's lineage at the baseline; else None (the version goes out without history, which
        starts every book over at it)."""
        book = open_book(self.book_path)
        if follows(book, lineage(lambda v: load_commit(self.store, v), st.version)):
            return book
        log.warning("%s: the history book does not describe the baseline (version %d); this version is "
                    "published without history, which starts the book over", self.book_path, st.version)
        return None

    def undecodable(self, rec: CommitRecord, st: PublishState) -> str | None:
        """Why delta ``rec`` does not decode on this baseline at ``st`` (its parent, verified), or None
        where it does or cannot be told here: not a delta on it, or coded with a history book that is
        not at ``st`` (``unchanged.undecodable``)."""
        if rec.delta is None or rec.parent != st.fingerprint or (
                rec.history and open_book(self.book_path).tip != st.fingerprint):
            return None
        os.makedirs(self.staging, exist_ok=True)
        local = self._fetch(rec.delta, os.path.join(self.staging, "check.delta"))
        try:
            return undecodable(local, self.path, threads=self.threads, history=self._book_for(rec))
        finally:
            os.unlink(local)

    def _rebuild(self, h: int, trusted: Callable[[int], CommitRecord]) -> PublishState | None:
        if h == 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            log.warning("%s: the stream is empty; the next publish starts a new stream", self.store.url)
            return None
        k = h
        rec = trusted(k)
        while not rec.keyframe and k > 1:
            k -= 1
            rec = trusted(k)
        if not rec.keyframe:
            raise StreamError(f"{self.store.url}: no keyframe to rebuild the baseline from")
        st = self.advance_to(None, rec)
        for v in range(k + 1, h + 1):
            rec = trusted(v)
            if rec.parent != st.fingerprint or rec.delta is None:
                raise StreamError(f"{self.store.url}: version {v} does not follow version {v - 1}: broken chain")
            st = self.advance_to(st, rec)
        return st

    # -- advance ---------------------------------------------------------------------------------

    def advance_to(self, st: PublishState | None, rec: CommitRecord) -> PublishState:
        """Make the baseline equal to committed version ``rec`` and record it."""
        if st is not None and st.version == rec.version and st.fingerprint == rec.fingerprint:
            return st
        own_dir(self.staging, "publisher staging directory")
        if st is not None and rec.delta is not None and rec.parent == st.fingerprint:
            local = self._fetch(rec.delta, os.path.join(self.staging, "advance.delta"))
            try:  # idempotent: a rerun is a no-op
                self.apply_with_book(rec, local)
            except DecodeError as e:
                if not rec.history:
                    raise
                raise StreamError(f"{e} (version {rec.version} is coded against a history book this publisher's "
                                  f"{self.book_path} is not){RESET_FIX}") from None
            except VerificationError as e:  # committed by a publisher whose input changed under it?
                raise type(e)(f"{e}; version {rec.version} does not decode on the version before it: 'deltarefit "
                              "publish --quarantine-head' (same arguments) sets it aside") from None
            os.unlink(local)
        elif rec.keyframe:
            kdir = own_dir(os.path.join(self.staging, "keyframe"), "publisher staging directory")
            for name, part in rec.keyframe:
                self._fetch(part, os.path.join(kdir, name))
            tmp = _temp_beside(self.path)
            _copy_checkpoint(kdir if len(rec.keyframe) > 1 else os.path.join(kdir, rec.keyframe[0][0]), tmp)
            os.replace(tmp, self.path)
            shutil.rmtree(kdir, ignore_errors=True)
        else:
            raise StreamError(f"{self.store.url}: version {rec.version} cannot be reached from this publisher's "
                              "baseline")
        if resets(rec):
            start_over(self.book_path)
        from ..api import verify

        verify(self.path, rec.fingerprint, threads=self.threads)
        st = PublishState(rec.version, rec.fingerprint, rec.stream or (st.stream_id if st else None))
        self.save_state(st)
        log.info("baseline advanced to version %d", rec.version)
        return st

    def replace_with(self, checkpoint: str) -> None:
        """The baseline becomes a copy of ``checkpoint`` (a keyframe version, which has no delta)."""
        tmp = _temp_beside(self.path)
        _copy_checkpoint(checkpoint, tmp)
        os.replace(tmp, self.path)

    def _book_for(self, rec: CommitRecord) -> HistoryBook | None:
        """The book to apply ``rec``'s delta to the baseline with: the baseline's, for a delta coded
        with history, unless the book already holds that version (its apply was verified and the book
        advanced before a kill: the rerun finds every chunk applied and needs no history)."""
        if not rec.history:
            return None
        book = open_book(self.book_path)
        return None if book.tip == rec.fingerprint else book

    def apply_with_book(self, rec: CommitRecord, local: str) -> None:
        """Apply ``rec``'s delta to the baseline, advancing the history book with it. Where this
        publisher staged the version's moves (a publish killed after its commit), the apply decodes
        against a scratch copy of the book and the book takes the staged moves: the baseline may have
        reached the version already, and an apply that finds chunks applied has lost their moves."""
        book = self._book_for(rec)
        staged = self._staged_moves(rec.fingerprint) if book is not None else None
        if staged is None:
            rep = apply_delta(local, self.path, threads=self.threads, history=book)
            if book is not None:
                settle(self.book_path, rep)
            return
        scratch = self.book_path + ".scratch"
        shutil.rmtree(scratch, ignore_errors=True)
        if os.path.isdir(self.book_path):  # else the empty book (after a start)
            shutil.copytree(self.book_path, scratch)
        try:
            apply_delta(local, self.path, threads=self.threads, history=HistoryBook(scratch))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        book.commit(rec.fingerprint, staged, parent=rec.parent)
        start_over(self.staged_moves_path)

    def _staged_moves(self, fp: str) -> MovesRecorder | None:
        """The moves ``publish`` staged for version ``fp`` before committing it, or None."""
        try:
            staged = HistoryBook(self.staged_moves_path)
            return staged.tip_moves() if staged.tip == fp else None
        except (DecodeError, OSError) as e:
            log.warning("%s: ignored (%s)", self.staged_moves_path, e)
            return None

    def _fetch(self, part: Part, dest: str) -> str:
        fetch_part(self.store, part, dest)
        return dest

    def remember(self, rep: EncodeReport) -> None:
        """Keep ``rep``'s target segment hashes for the next encode, bound to the baseline file as it is
        now. The baseline has just been verified to hold ``rep``'s target fingerprint (both advance
        routes check it), so its segments hash to exactly these, barring a BLAKE3 collision. The
        identity is taken after our last write, so any later write to the file changes it."""
        with open_checkpoint(self.path) as ck:
            self.known = KnownHashes(ck.identity(), rep.target_hashes, rep.target_sums)
        # A cache, so no fsync: a file torn by a power loss fails its checksum and is ignored.
        write_atomic(self.known_path, self.known.to_bytes(), durable=False)

    def known_base(self) -> KnownHashes | None:
        """The kept baseline hashes, from memory or (a new process) from ``known_path``; None if none."""
        if self.known is None and os.path.exists(self.known_path):
            try:  # a regular file only (a FIFO planted there must not hang the publish)
                with os.fdopen(open_regular(self.known_path, os.O_RDONLY, what="kept baseline hashes"), "rb") as f:
                    self.known = KnownHashes.from_bytes(f.read())
            except (OSError, ValueError, CheckpointError) as e:
                log.warning("%s: ignored (%s); the baseline is hashed instead", self.known_path, e)
        return self.known

    def forget_known(self) -> None:
        self.known = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.known_path)

    def advance_by_copy(self, checkpoint: str, fp: str) -> bool:
        """Replace the baseline with a verified copy of the committed ``checkpoint`` (``Publisher``'s ``advance``).
        False, with the baseline untouched, where the apply route must be taken instead. A kill at any
        point leaves the old baseline and at most a temp file, which ``recover`` removes before it
        applies the committed delta."""
        if self.advance != "copy" or not os.path.isfile(checkpoint):
            return False
        from ..api import fingerprint

        tmp = _temp_beside(self.path)
        try:
            shutil.copyfile(checkpoint, tmp)
            got = fingerprint(tmp, threads=self.threads)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        if got != fp:  # rewritten since it was encoded: the committed delta is the truth
            os.unlink(tmp)
            log.warning("%s changed after it was encoded; advancing the baseline by applying the delta",
                        checkpoint)
            return False
        os.replace(tmp, self.path)
        return True


def _temp_beside(path: str) -> str:
    """Where a new ``path`` is built before it is renamed into place; ``recover`` removes leftovers."""
    return f"{path}{_TEMP_SUFFIX}{os.getpid()}"


def _copy_checkpoint(src: str, dest: str) -> None:
    """The baseline is always one file: a directory checkpoint is rewritten as a single file."""
    if os.path.isfile(src):
        # Created afresh (``create_temp``: exclusive, never through a link planted at ``dest``).
        with open(src, "rb") as f, os.fdopen(create_temp(dest), "wb") as g:
            shutil.copyfileobj(f, g, 16 << 20)
        return
    from ..checkpoint.header import TensorSource
    from ..checkpoint.write import write_safetensors
    from ..integrity import SEGMENT_BYTES

    with open_checkpoint(src) as ck:
        sources = [TensorSource(n, i.dtype, i.shape, i.nbytes,
                                lambda n=n, i=i: (ck.raw(n)[o:o + SEGMENT_BYTES] for o in range(0, i.nbytes, SEGMENT_BYTES)))
                   for n, i in ck.tensors.items()]
        write_safetensors(dest, sources)


def remove_temps_of(*paths: str) -> None:
    """Remove the temps a killed writer left of each of ``paths`` (``_temp_beside``'s names); the caller
    holds the lock under which they are written."""
    for base in paths:
        for stale in glob.glob(glob.escape(base) + _TEMP_SUFFIX + "*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
