"""The publisher: turns each new checkpoint into a committed version bound to its parent.

Protocol for version N (the parent N-1 is the publisher's committed baseline):

1. Encode the delta from the baseline to the new checkpoint (and, on keyframe versions, keep the
   checkpoint's files too) into a local staging directory (another model refused: ``relatedness``).
2. Upload the parts under ``v/N/<attempt>/`` (an attempt id unique to this publish).
3. Joint commit (optional): put ``v/N/prepared.json``, wait for enough subscribers to acknowledge
   that they verified the delta against their copy of N-1; too few in time aborts the version.
4. Create ``v/N/commit.json`` conditionally. This is the commit point: losing the race to another
   publisher raises ``PublishError`` and removes this attempt's parts.
5. Advance the baseline by applying the delta to it in place (crash-safe, verified), then record
   ``{version, fingerprint}`` in ``publisher.json`` atomically.

A publisher killed anywhere leaves either no visible version (orphan parts, removed by retention) or a
committed version its baseline has not reached yet; the next run finds its own commit and finishes
step 5 before anything else. Publishing the same checkpoint again returns the existing version.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..encode import EncodeReport
from ..encode import encode as encode_delta
from ..errors import DeltaRefitError, PublishError, UsageError
from ..history_book import HistoryBook
from ..io.fsutil import write_atomic
from ..io.locks import lock_path_beside, locked_method
from ..signing import SignatureError, Signer, check_record_signature, record_signature
from ..storage.base import Store, open_store
from .attempts import Attempts, _checkpoint_files
from .baseline import Baseline, _temp_beside, remove_temps_of
from .chain import chain_bytes
from .history import open_book, resets, start_over
from .progress import Opener, encoding, phase, store_phase, tensor_bytes
from .publish_state import (
    ALL,
    ATTEMPT_NAME,
    QUARANTINE_FIX,
    RESET_FIX,
    PublishState,
    default_state_dir,
    keyframe_state,
    remember_format,
    stream_format,
)
from .records import (
    CommitRecord,
    MalformedRecordError,
    Part,
    StreamError,
    StreamIdentityError,
    check_identity,
    commit_key,
    file_hash,
    head,
    load_commit,
    new_stream_id,
    now,
    stream_identity,
    vkey,
)
from .relatedness import check_one_model
from .unchanged import InputGuard, check_decodes

if TYPE_CHECKING:
    from .served import ServedTensors

__all__ = ["ALL", "PublishError", "Publisher", "default_state_dir", "publish"]

log = logging.getLogger(__name__)


class Publisher:
    """Publishes checkpoints to ``store``; keeps its committed baseline under ``state_dir``.

    ``keyframe_every``: a keyframe every K versions (the first version always is one).
    ``keyframe_ratio``: also a keyframe once the deltas since the last keyframe add up to this
    fraction of a full checkpoint. ``quorum``: joint commit, wait for this many subscriber acks
    (``ALL``: every live subscriber, those that synced within ``live_ttl`` seconds; at least one)
    (``ack_timeout`` seconds) before committing. ``signing_key``: sign commit records (Ed25519 PEM).
    ``advance``: how the baseline follows a committed delta. ``"copy"`` (default) copies the
    committed checkpoint file beside it, verifies its fingerprint and renames it over the baseline:
    one hash pass and a copy instead of a decode and the apply's hash passes (a whole publish 1.32x faster in
    docs/STREAMS.md, ``python -m deltarefit.apps.bench.stream``), at the cost of a second copy of the checkpoint
    on disk for a moment (keyframes need it anyway). ``"apply"`` applies the delta in place (no second copy).
    Directory checkpoints, and a checkpoint that changed after it was encoded, always take the apply route.
    ``another_model``: publish a checkpoint that looks like another model (most elements changed:
    ``relatedness``), else refused (``UsageError``). ``sums`` (default on): deltas carry each changed tensor's
    additive digest, so a live engine checks a refit in O(changed elements) (FORMAT.md, "Held digests"); one
    more pass over the changed tensors per encode. ``history``: code each version's delta against a history
    book kept in ``state_dir/history`` as well (encoding 5 or 7, kept where smaller; the record's ``history``
    flag), which describes the baseline: it advances only once the version is committed and the baseline has
    reached it, starts over at keyframes, and where it does not follow the stream's lineage at the baseline
    (``stream.history``) the version is published without it. Catch-up deltas never use it.
    ``format_version``: of the deltas (1 or 2; FORMAT.md, "Versions"); None: the one this publisher last
    published (``publish_state.stream_format``: 2 for a new stream); subscribers follow a stream of both.
    """
    progress: Opener | None = None  # told each long step's bytes (``stream.progress``); None: no calls

    def __init__(self, store: Store | str, state_dir: str, *, keyframe_every: int = 20,
                 keyframe_ratio: float = 0.5, quorum: int = 0, ack_timeout: float = 60.0, live_ttl: float = 3600.0,
                 signing_key: str | None = None, threads: int | None = None, publisher_id: str | None = None,
                 catchup: bool = False, advance: str = "copy", sums: bool = True, history: bool = False,
                 another_model: bool = False, format_version: int | None = None) -> None:
        if advance not in ("copy", "apply") or format_version not in (None, 1, 2):
            raise UsageError(f"advance must be 'copy' or 'apply' and format_version 1, 2 or None, not {advance!r} "
                             f"and {format_version!r}")
        self.sums, self.another_model, self.format_version = sums, another_model, format_version
        if keyframe_every < 1 or keyframe_ratio <= 0 or (quorum < 0 and quorum != ALL) or ack_timeout <= 0:
            raise UsageError("keyframe_every >= 1, keyframe_ratio > 0, quorum >= 0 (or ALL) and ack_timeout > 0 "
                             f"are required, got keyframe_every={keyframe_every}, keyframe_ratio={keyframe_ratio}, "
                             f"quorum={quorum}, ack_timeout={ack_timeout}")
        self.live_ttl, self.state_dir = live_ttl, os.path.abspath(state_dir)
        store = open_store(store) if isinstance(store, str) else store
        # What holds the committed version (the baseline file, its state, hashes and book), and what the
        # publisher leaves in the store on the way to a commit: parts held, not inherited.
        self.base = Baseline(store, self.state_dir, threads=threads, advance=advance)
        self.attempts = Attempts(store, self.state_dir, self._check_trust)
        self._store = store
        self.keyframe_every, self.keyframe_ratio = keyframe_every, keyframe_ratio
        self.quorum, self.ack_timeout, self.threads = quorum, ack_timeout, threads
        self.signer = Signer(signing_key) if signing_key else None
        # The records this publisher follows (other publishers' versions, a reset) are checked with its
        # own key: in a signed stream a record it cannot verify is not a version of the stream.
        self.verifier = self.signer.verifier() if self.signer else None
        self._head_rec: CommitRecord | None = None  # the record of the baseline's version, after recover
        # Catch-up deltas: each version also ships one delta straight from the newest keyframe, so a late joiner
        # needs the keyframe and one delta instead of the chain (a local copy of it, a second encode per publish).
        self.catchup, self.history = catchup, history
        if catchup and history:
            log.warning("catch-up deltas and history do not combine: a subscriber takes no catch-up to a version "
                        "coded with history (its book could not follow the next delta), see docs/STREAMS.md")
        self.keyframe_copy, self.publisher_id = (os.path.join(self.state_dir, "keyframe.safetensors"),
                                                 publisher_id or f"{os.uname().nodename}-{os.getpid()}")
        self.baseline, self.state_path, self.staging = self.base.path, self.base.state_path, self.base.staging
        self.known_path, self.book_path, self.staged_moves_path = (self.base.known_path, self.base.book_path,
                                                                   self.base.staged_moves_path)
        self._fmt = 2  # the format version of the publish in progress (``stream_format``)

    @property
    def store(self) -> Store:
        """The stream's store; replacing it (a rate-limited or counting wrapper) replaces it everywhere."""
        return self._store

    @store.setter
    def store(self, store: Store) -> None:
        self._store = self.base.store = self.attempts.store = store

    # -- state -----------------------------------------------------------------------------------

    def state(self) -> PublishState | None:
        """The committed version this publisher's baseline holds, as recorded; None without a state."""
        return self.base.state()

    def _save_state(self, st: PublishState) -> None:
        self.base.save_state(st)

    @locked_method(lambda self: (lock_path_beside(self.state_dir), f"publisher state {self.state_dir}"))
    def recover(self) -> PublishState | None:
        """Bring the baseline to the stream's head: finish our own publish that committed but died
        before its baseline advanced, and follow versions other publishers committed on our parent."""
        st = self.state()
        pending = os.path.join(self.state_dir, "pending.json")
        # What a killed publish left behind: the temp of every file it writes atomically in its state
        # directory. This process holds the state's lock, so no live writer of these names remains.
        remove_temps_of(self.baseline, self.keyframe_copy, self.keyframe_copy + ".json", self.known_path,
                        self.state_path, pending, os.path.join(self.state_dir, ATTEMPT_NAME))
        done: list[PublishState] = []
        self.attempts.settle_killed(lambda rec: done.append(self.base.advance_to(st, rec)))
        st = done[0] if done else st
        self.attempts.drop_dead()
        h = head(self.store)
        self._head_rec = None
        if st is None:
            if h:
                raise StreamError(f"{self.store.url}: the stream already has {h} versions and this publisher "
                                  f"({self.state_dir}) has no baseline{RESET_FIX}, or publish into a new stream")
            return None
        if h < st.version:
            raise StreamError(f"{self.store.url}: newest version {h} is older than this publisher's {st.version} "
                              f"(store wiped or replaced?){RESET_FIX}")
        where = f"{self.store.url}/{commit_key(st.version)}"
        try:
            sid = stream_identity(self.store)
            mine = load_commit(self.store, st.version)
        except MalformedRecordError as e:
            raise MalformedRecordError(f"{e}{RESET_FIX}") from None
        if st.stream_id is not None and sid != st.stream_id:
            raise StreamIdentityError(f"{self.store.url}: the store holds stream {sid}, this publisher's baseline is "
                                      f"of stream {st.stream_id} (store wiped and republished?){RESET_FIX}")
        if mine.fingerprint != st.fingerprint:
            raise StreamError(f"{where}: version {st.version} is {mine.fingerprint[:16]}…, this publisher committed "
                              f"{st.fingerprint[:16]}… (store wiped and republished?){RESET_FIX}")
        if st.stream_id is None and sid is not None:  # a state from before identities: bind it now
            st = replace(st, stream_id=sid)
            self._save_state(st)
        signed = mine.signature is not None
        while st.version < h:
            rec = self._trusted(st.version + 1, sid, signed)
            if rec.parent != st.fingerprint or rec.delta is None:
                raise StreamError(f"{self.store.url}: version {rec.version} does not follow this publisher's "
                                  f"baseline {st.fingerprint[:16]}… (another publisher moved the stream on)"
                                  f"{RESET_FIX}")
            st = self.base.advance_to(st, rec)
            mine, signed = rec, signed or rec.signature is not None
        self._head_rec = mine
        return st

    def _check_trust(self, rec: CommitRecord, sid: str | None, signed: bool, where: str) -> None:
        """Refuse a record this publisher must not build on: of another stream, unsigned in a signed
        stream, or (with a key) not verifying with this publisher's key."""
        check_identity(rec, sid, where)
        if signed and rec.signature is None:
            raise SignatureError(f"{where}: commit record is not signed, in a signed stream")
        if self.verifier is not None and (signed or rec.signature is not None):
            check_record_signature(rec.signature, rec.signed_bytes(), self.verifier, where)

    def _trusted(self, version: int, sid: str | None, signed: bool) -> CommitRecord:
        """The record of ``version``, refused (with the way out) unless ``_check_trust`` accepts it."""
        where = f"{self.store.url}/{commit_key(version)}"
        try:
            rec = load_commit(self.store, version, self.verifier if signed else None)  # signed: checked unparsed
            self._check_trust(rec, sid, signed, where)
        except (MalformedRecordError, StreamIdentityError, SignatureError) as e:
            raise type(e)(f"{e}{QUARANTINE_FIX}") from None
        return rec

    # -- the ways out of stuck states ------------------------------------------------------------

    def reset_baseline(self) -> PublishState | None:
        """Forget this publisher's baseline and state and rebuild them from the stream: the newest
        keyframe, then the deltas after it to the head, each record checked (identity; signature with
        this publisher's key, if any) and the baseline verified after each. An empty stream leaves no
        state (the next publish starts a new stream). The way out of a baseline edited by hand, a store
        wiped or replaced under the state, or a stream moved on by another publisher."""
        self.attempts.settle_killed(None)  # its parts are orphans unless it committed
        for p in (self.keyframe_copy, self.keyframe_copy + ".json"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        self.base.forget()
        h = head(self.store)
        sid = None if h == 0 else stream_identity(self.store)
        st = self.base.rebuild(h, lambda v: self._trusted(v, sid, self.verifier is not None), self.attempts.set_aside)
        if st is None:
            return None
        if st.stream_id is None and sid is not None:
            st = replace(st, stream_id=sid)
            self._save_state(st)
        log.warning("baseline rebuilt from the stream at version %d", st.version)
        return st

    def quarantine_head(self) -> list[int]:
        """Set aside the records at the head that can be no version of this stream (``_unusable``:
        garbage, another stream's, unsigned in a signed stream...), newest first, so that the next
        publish takes their version number. Each is moved to ``quarantine/<version>-<id>.json`` (kept
        for inspection; ``list_versions`` and retention ignore it) and its parts become orphans that
        retention removes. A usable head stops it: valid versions are never set aside. Only versions
        after this publisher's committed one are considered, and without a state only malformed
        records (a wrong ``signing_key`` must not make the stream's own history look foreign). With a
        state, a delta after it that does not decode on the baseline is set aside too. Returns the
        versions set aside."""
        st = self.state()
        return self.attempts.quarantine(st.version if st is not None else 0, strict=st is not None,
                                        decodes=(lambda rec: self.base.undecodable(rec, st)) if st else None)

    # -- publish ---------------------------------------------------------------------------------

    def publish_tensors(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], *,
                        served: str | Mapping[str, str] | None = None, step: int | None = None,
                        reset_baseline: bool = False, quarantine_head: bool = False) -> CommitRecord:
        """``publish`` of a trainer's weights in memory, as the checkpoint they would be saved as, without
        writing it: ``tensors`` and ``served`` as ``stream.served.ServedTensors`` takes them (CPU or device
        tensors, referenced: unchanged until this returns; ``served="BF16"`` serves fp32 masters as bf16).
        A delta version writes no checkpoint (the baseline advances by applying it); a keyframe streams
        them into one staged file. Record, fingerprint and delta are ``publish``'s for them as safetensors."""
        from .served import ServedTensors

        return self.publish(ServedTensors(tensors, served), step=step, reset_baseline=reset_baseline,
                            quarantine_head=quarantine_head)

    @locked_method(lambda self: (lock_path_beside(self.state_dir), f"publisher state {self.state_dir}"))
    def publish(self, checkpoint: str | ServedTensors, *, step: int | None = None, reset_baseline: bool = False,
                quarantine_head: bool = False) -> CommitRecord:
        """Commit ``checkpoint`` as the next version; returns its commit record. ``quarantine_head`` and
        ``reset_baseline`` first run ``quarantine_head()`` and ``reset_baseline()`` (in that order).
        ``checkpoint``: a path, or tensors in memory (``publish_tensors``)."""
        if quarantine_head:
            self.quarantine_head()
        if reset_baseline:
            self.reset_baseline()
        st = self.recover()
        if st is not None and self.signer is None and self._head_rec is not None and self._head_rec.signature:
            raise UsageError(f"{self.store.url}: version {st.version} is signed (key "
                             f"{self._head_rec.signature.get('key_id', '?')}) and an unsigned version would stop "
                             "every subscriber that verifies; publish with --sign KEY")
        version = 1 if st is None else st.version + 1
        attempt = f"{vkey(version)}/{uuid.uuid4().hex[:12]}"
        shutil.rmtree(self.staging, ignore_errors=True)
        os.makedirs(self.staging)
        book = self.base.book_at(st) if self.history and st is not None else None
        self._fmt = stream_format(self.state_dir, self.format_version, st is not None)
        guard = InputGuard(checkpoint)  # the input as it is before the first read (it may change: ``unchanged``)
        rep, delta_part, fp, full_bytes = self._delta(st, checkpoint, attempt, book, guard.source)
        if st is not None and fp == st.fingerprint:
            shutil.rmtree(self.staging, ignore_errors=True)
            log.info("checkpoint is already version %d; nothing to publish", st.version)
            return load_commit(self.store, st.version)
        keyframe = st is None or version % self.keyframe_every == 0 or chain_bytes(
            lambda v: load_commit(self.store, v), version) + (delta_part.bytes if delta_part else 0) >= (
            self.keyframe_ratio * max(full_bytes, 1))
        catchup_from, catchup_part = self._catchup(version, checkpoint, attempt, guard.source) if not keyframe else (
            None, None)
        kf_parts: list[tuple[str, Part]] = []
        if keyframe and not isinstance(checkpoint, str):
            # Tensors in memory: the keyframe's one file, streamed into staging (it becomes the baseline).
            staged = os.path.join(self.staging, "keyframe.safetensors")
            checkpoint.write(staged)
            checkpoint = staged
        if keyframe:
            files = _checkpoint_files(checkpoint)
            told = phase(self.progress, "publish: hash keyframe", sum(os.path.getsize(p) for _, p in files))
            kf_parts = [(name, Part(f"{attempt}/keyframe/{name}", os.path.getsize(p), file_hash(p, told)))
                        for name, p in files]
        if fp is None:  # the first version: nothing encoded, the checkpoint hashed whole
            from ..api import fingerprint

            full_bytes = tensor_bytes(checkpoint)
            fp = fingerprint(checkpoint, threads=self.threads,
                             progress=phase(self.progress, "publish: fingerprint", full_bytes))
        rec = CommitRecord(version, st.fingerprint if st else None, fp, "keyframe" if keyframe else "delta",
                           delta_part, kf_parts, full_bytes, step, now(), self.publisher_id, catchup_from,
                           catchup_part, stream=st.stream_id if st else new_stream_id(),
                           history=book is not None and delta_part is not None)
        if self.signer:
            rec = _signed(rec, self.signer)
        if rec.history and not resets(rec):
            start_over(self.staged_moves_path)
            HistoryBook(self.staged_moves_path).commit(fp, rep.moves, parent=None)
        with store_phase(self.store, self.progress, f"publish: upload {rec.kind}", rec.part_bytes):
            pending = self.attempts.upload_and_commit(
                rec, attempt, checkpoint, quorum=self.quorum, ack_timeout=self.ack_timeout, live_ttl=self.live_ttl,
                before_commit=guard.check if kf_parts else None)
        try:
            self._after_commit(rec, checkpoint, rep, pending)
        except (OSError, DeltaRefitError) as e:
            # The version is committed (subscribers sync to it): this publish succeeded, and failing it
            # would have a caller publish again what is out already. What did not follow is local
            # state that ``recover`` finishes from pending.json on the next run (a full disk freed).
            log.warning("%s: version %d is committed, but the publisher state in %s could not follow it (%s); "
                        "the next publish finishes that first", self.store.url, version, self.state_dir, e)
        remember_format(self.state_dir, self._fmt)
        log.info("published version %d (%s, %d bytes)", version, rec.kind, rec.part_bytes)
        return rec

    def _delta(self, st: PublishState | None, checkpoint: str | ServedTensors, attempt: str, book: HistoryBook | None,
               source: str) -> tuple[EncodeReport | None, Part | None, str | None, int]:
        """(encode report, delta part, target fingerprint, full bytes) of ``checkpoint`` against the
        committed baseline, staged; all None/0 for a first version. Refuses a baseline that is not the
        committed version. ``book``: the baseline's history book, coded against too."""
        if st is None:
            return None, None, None, 0
        local = os.path.join(self.staging, "delta")
        # Staged, not durable: the store makes its copy durable, and nothing after a crash reads
        # the staged file (a rerun encodes again; recovery fetches the committed part).
        rep = encode_delta(self.baseline, checkpoint, local, threads=self.threads, known_base=self.base.known_base(),
                           durable=False, sums=self.sums, history=book, progress=encoding(self.progress, checkpoint),
                           format_version=self._fmt)
        if rep.base_fingerprint != st.fingerprint and rep.base_hashes_known:
            # The kept hashes do not describe the committed baseline (their file edited, or a write
            # the identity missed): drop them and hash the baseline, so the check below is the
            # same as without them.
            log.warning("%s: kept baseline hashes do not match the committed version; hashing the baseline",
                        self.known_path)
            self.base.forget_known()
            rep = encode_delta(self.baseline, checkpoint, local, threads=self.threads, durable=False,
                               sums=self.sums, history=book, format_version=self._fmt)
        if rep.base_fingerprint != st.fingerprint:
            raise StreamError(f"{self.baseline}: baseline fingerprint {rep.base_fingerprint[:16]}… is not the "
                              f"committed {st.fingerprint[:16]}… (modified by hand?){RESET_FIX}")
        check_one_model(rep.changed_fraction, self.baseline, checkpoint, st.version, allowed=self.another_model)
        fp = rep.target_fingerprint
        if fp != st.fingerprint:  # nothing committed that does not decode to what was hashed
            check_decodes(local, self.baseline, source=source, threads=self.threads, history=book)
        part = None if fp == st.fingerprint else Part(f"{attempt}/delta", os.path.getsize(local), file_hash(local))
        return rep, part, fp, rep.full_bytes

    def _catchup(self, version: int, checkpoint: str | ServedTensors, attempt: str, source: str) -> tuple[int | None,
                                                                                                    Part | None]:
        """(the keyframe it starts from, its part) of a staged catch-up delta from the newest keyframe
        to ``checkpoint``, when this publisher ships them and the chain since that keyframe is long
        enough to need one; (None, None) otherwise."""
        kf_state = keyframe_state(self.keyframe_copy)
        if not self.catchup or kf_state is None or kf_state[0] >= version - 1:
            return None, None
        local = os.path.join(self.staging, "catchup")
        crep = encode_delta(self.keyframe_copy, checkpoint, local, threads=self.threads, durable=False,
                            sums=self.sums, format_version=self._fmt)
        if crep.base_fingerprint != kf_state[1]:
            return None, None
        check_decodes(local, self.keyframe_copy, source=source, threads=self.threads)
        return kf_state[0], Part(f"{attempt}/catchup", os.path.getsize(local), file_hash(local))

    def _after_commit(self, rec: CommitRecord, checkpoint: str | ServedTensors, rep: EncodeReport | None,
                      pending: str) -> None:
        """Committed: advance the baseline (and the keyframe copy), then the history book, save the
        state, move HEAD. A kill between any two steps leaves the book at the baseline's parent (which
        ``recover`` advances with the baseline, see ``Baseline.advance_to``) or at the baseline."""
        version, fp, delta_part, keyframe = rec.version, rec.fingerprint, rec.delta, rec.kind == "keyframe"
        if delta_part:
            if isinstance(checkpoint, str) and self.base.advance_by_copy(checkpoint, fp):
                if rec.history and not resets(rec):
                    open_book(self.book_path).commit(fp, rep.moves, parent=rec.parent)
            else:  # the apply advances the book with the baseline, once verified
                self.base.apply_with_book(rec, os.path.join(self.staging, "delta"))
        else:
            self.base.replace_with(checkpoint)
        if resets(rec):
            start_over(self.book_path)
        self._save_state(PublishState(version, fp, rec.stream))
        start_over(self.staged_moves_path)
        if delta_part:
            self.base.remember(rep)
        if keyframe and self.catchup:  # the base of the catch-up deltas to come
            tmp = _temp_beside(self.keyframe_copy)
            shutil.copyfile(self.baseline, tmp)
            os.replace(tmp, self.keyframe_copy)
            write_atomic(self.keyframe_copy + ".json", json.dumps({"version": version, "fingerprint": fp}).encode())
        os.unlink(pending)
        os.unlink(os.path.join(self.state_dir, ATTEMPT_NAME))
        self.store.put("HEAD", f"{version}\n".encode())
        shutil.rmtree(self.staging, ignore_errors=True)

def _signed(rec: CommitRecord, signer: Signer) -> CommitRecord:
    return replace(rec, signature=record_signature(signer, rec.signed_bytes()))


def publish(store: str, checkpoint: str, *, state_dir: str | None = None, step: int | None = None,
            **kwargs) -> CommitRecord:
    """Library form of ``deltarefit publish STORE CHECKPOINT``."""
    return Publisher(store, state_dir or default_state_dir(store), **kwargs).publish(checkpoint, step=step)
