"""The publisher's baseline: the checkpoint that holds the committed version, how it advances after a
commit (a verified copy, or the delta applied in place), the segment hashes kept of it for the next
encode, and its rebuild from the stream (``reset_baseline``)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import replace

from ..apply.files import apply as apply_delta
from ..checkpoint.read import open_checkpoint
from ..encode import EncodeReport, KnownHashes
from ..errors import DecodeError
from ..history_book import HistoryBook, MovesRecorder
from ..io.fsutil import write_atomic
from .chain import holds
from .history import open_book, resets, settle, start_over
from .publish_state import _TEMP_SUFFIX, RESET_FIX, PublishState
from .records import (
    CommitRecord,
    Part,
    StreamError,
    commit_key,
    fetch_part,
    head,
    parse_commit,
    stream_identity,
)

log = logging.getLogger(__name__)


class BaselineMixin:
    """``Publisher``'s baseline methods (they use its state: store, state_dir, baseline, ...)."""

    def reset_baseline(self) -> PublishState | None:
        """Forget this publisher's baseline and state and rebuild them from the stream: the newest
        keyframe, then the deltas after it to the head, each record checked (identity; signature with
        this publisher's key, if any) and the baseline verified after each. An empty stream leaves no
        state (the next publish starts a new stream). The way out of a baseline edited by hand, a store
        wiped or replaced under the state, or a stream moved on by another publisher."""
        pending = os.path.join(self.state_dir, "pending.json")
        if os.path.exists(pending):  # a killed publish: its parts are orphans unless it committed
            with open(pending, "rb") as f:
                mine = f.read()
            with contextlib.suppress(StreamError):
                rec = parse_commit(mine, pending)
                if not holds(self.store, commit_key(rec.version), mine):
                    self._drop_attempt(rec)
            os.unlink(pending)
        for p in (self.state_path, self.known_path, self.keyframe_copy, self.keyframe_copy + ".json"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        start_over(self.book_path)  # rebuilt with the baseline: a keyframe starts it, each delta advances it
        start_over(self.staged_moves_path)
        self._known = None
        shutil.rmtree(self.staging, ignore_errors=True)
        h = head(self.store)
        if h == 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.baseline)
            log.warning("%s: the stream is empty; the next publish starts a new stream", self.store.url)
            return None
        sid = stream_identity(self.store)
        k = h
        rec = self._trusted(k, sid, self.verifier is not None)
        while not rec.keyframe and k > 1:
            k -= 1
            rec = self._trusted(k, sid, self.verifier is not None)
        if not rec.keyframe:
            raise StreamError(f"{self.store.url}: no keyframe to rebuild the baseline from")
        st = self._advance(None, rec)
        for v in range(k + 1, h + 1):
            rec = self._trusted(v, sid, self.verifier is not None)
            if rec.parent != st.fingerprint or rec.delta is None:
                raise StreamError(f"{self.store.url}: version {v} does not follow version {v - 1}: broken chain")
            st = self._advance(st, rec)
        if st.stream_id is None and sid is not None:
            st = replace(st, stream_id=sid)
            self._save_state(st)
        log.warning("baseline rebuilt from the stream at version %d", st.version)
        return st

    def _advance(self, st: PublishState | None, rec: CommitRecord) -> PublishState:
        """Make the baseline equal to committed version ``rec`` and record it."""
        if st is not None and st.version == rec.version and st.fingerprint == rec.fingerprint:
            return st
        os.makedirs(self.staging, exist_ok=True)
        if st is not None and rec.delta is not None and rec.parent == st.fingerprint:
            local = self._fetch(rec.delta, os.path.join(self.staging, "advance.delta"))
            try:  # idempotent: a rerun is a no-op
                self._apply_with_book(rec, local)
            except DecodeError as e:
                if not rec.history:
                    raise
                raise StreamError(f"{e} (version {rec.version} is coded against a history book this publisher's "
                                  f"{self.book_path} is not){RESET_FIX}") from None
            os.unlink(local)
        elif rec.keyframe:
            kdir = os.path.join(self.staging, "keyframe")
            os.makedirs(kdir, exist_ok=True)
            for name, part in rec.keyframe:
                self._fetch(part, os.path.join(kdir, name))
            tmp = _temp_beside(self.baseline)
            _copy_checkpoint(kdir if len(rec.keyframe) > 1 else os.path.join(kdir, rec.keyframe[0][0]), tmp)
            os.replace(tmp, self.baseline)
            shutil.rmtree(kdir, ignore_errors=True)
        else:
            raise StreamError(f"{self.store.url}: version {rec.version} cannot be reached from this publisher's "
                              "baseline")
        if resets(rec):
            start_over(self.book_path)
        from ..api import verify

        verify(self.baseline, rec.fingerprint, threads=self.threads)
        st = PublishState(rec.version, rec.fingerprint, rec.stream or (st.stream_id if st else None))
        self._save_state(st)
        log.info("baseline advanced to version %d", rec.version)
        return st

    def _book_for(self, rec: CommitRecord) -> HistoryBook | None:
        """The book to apply ``rec``'s delta to the baseline with: the baseline's, for a delta coded
        with history, unless the book already holds that version (its apply was verified and the book
        advanced before a kill: the rerun finds every chunk applied and needs no history)."""
        if not rec.history:
            return None
        book = open_book(self.book_path)
        return None if book.tip == rec.fingerprint else book

    def _apply_with_book(self, rec: CommitRecord, local: str) -> None:
        """Apply ``rec``'s delta to the baseline, advancing the history book with it. Where this
        publisher staged the version's moves (a publish killed after its commit), the apply decodes
        against a scratch copy of the book and the book takes the staged moves: the baseline may have
        reached the version already, and an apply that finds chunks applied has lost their moves."""
        book = self._book_for(rec)
        staged = self._staged_moves(rec.fingerprint) if book is not None else None
        if staged is None:
            rep = apply_delta(local, self.baseline, threads=self.threads, history=book)
            if book is not None:
                settle(self.book_path, rep)
            return
        scratch = self.book_path + ".scratch"
        shutil.rmtree(scratch, ignore_errors=True)
        if os.path.isdir(self.book_path):  # else the empty book (after a start)
            shutil.copytree(self.book_path, scratch)
        try:
            apply_delta(local, self.baseline, threads=self.threads, history=HistoryBook(scratch))
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

    def _remember_baseline(self, rep: EncodeReport) -> None:
        """Keep ``rep``'s target segment hashes for the next encode, bound to the baseline file as it is
        now. The baseline has just been verified to hold ``rep``'s target fingerprint (both advance
        routes check it), so its segments hash to exactly these, barring a BLAKE3 collision. The
        identity is taken after our last write, so any later write to the file changes it."""
        with open_checkpoint(self.baseline) as ck:
            self._known = KnownHashes(ck.identity(), rep.target_hashes, rep.target_sums)
        # A cache, so no fsync: a file torn by a power loss fails its checksum and is ignored.
        write_atomic(self.known_path, self._known.to_bytes(), durable=False)

    def _known_base(self) -> KnownHashes | None:
        """The kept baseline hashes, from memory or (a new process) from ``known_path``; None if none."""
        if self._known is None and os.path.exists(self.known_path):
            try:
                with open(self.known_path, "rb") as f:
                    self._known = KnownHashes.from_bytes(f.read())
            except (OSError, ValueError) as e:
                log.warning("%s: ignored (%s); the baseline is hashed instead", self.known_path, e)
        return self._known

    def _forget_known(self) -> None:
        self._known = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.known_path)

    def _advance_by_copy(self, checkpoint: str, fp: str) -> bool:
        """Replace the baseline with a verified copy of the committed ``checkpoint`` (see ``advance``).
        False, with the baseline untouched, where the apply route must be taken instead. A kill at any
        point leaves the old baseline and at most a temp file, which ``recover`` removes before it
        applies the committed delta."""
        if self.advance != "copy" or not os.path.isfile(checkpoint):
            return False
        from ..api import fingerprint

        tmp = _temp_beside(self.baseline)
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
        os.replace(tmp, self.baseline)
        return True


def _temp_beside(path: str) -> str:
    """Where a new ``path`` is built before it is renamed into place; ``recover`` removes leftovers."""
    return f"{path}{_TEMP_SUFFIX}{os.getpid()}"


def _copy_checkpoint(src: str, dest: str) -> None:
    """The baseline is always one file: a directory checkpoint is rewritten as a single file."""
    if os.path.isfile(src):
        shutil.copyfile(src, dest)
        return
    from ..checkpoint.header import TensorSource
    from ..checkpoint.write import write_safetensors
    from ..integrity import SEGMENT_BYTES

    with open_checkpoint(src) as ck:
        sources = [TensorSource(n, i.dtype, i.shape, i.nbytes,
                                lambda n=n, i=i: (ck.raw(n)[o:o + SEGMENT_BYTES] for o in range(0, i.nbytes, SEGMENT_BYTES)))
                   for n, i in ck.tensors.items()]
        write_safetensors(dest, sources)
