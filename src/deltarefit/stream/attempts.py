"""The publisher's attempts (``Attempts``, an object ``Publisher`` holds): the upload of a version's parts
and its (joint) commit, a joint commit's proposal and acknowledgements, the removal of a dead or failed
attempt's parts, and setting aside a head no publisher of this stream wrote (``quarantine_head``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable

from ..checkpoint.read import open_checkpoint
from ..errors import CheckpointError, DeltaRefitError, PublishError
from ..io.fsutil import open_regular, read_capped, write_atomic
from ..signing import SignatureError
from ..storage.base import SWEEP_TEMPS, Store
from .chain import MAX_RECORD_BYTES, get_bounded, get_capped, holds
from .publish_state import ALL, ATTEMPT_NAME, read_state_json
from .records import (
    CommitRecord,
    MalformedRecordError,
    Part,
    StreamError,
    StreamIdentityError,
    commit_key,
    file_hash,
    head,
    load_commit,
    parse_commit,
    parse_proposal,
    prepared_key,
    proposal_bytes,
    stream_identity,
    subscriber_json,
    vkey,
)

log = logging.getLogger(__name__)


class Attempts:
    """A publisher's attempts in its store: the parts of each version it uploads under an attempt id,
    the joint commit's proposal and acks, the commit, and the removal of what a dead or failed attempt
    left. ``Publisher`` holds one; ``check_trust(rec, sid, signed, where)`` raises for a record the
    publisher must not build on (``Publisher._check_trust``)."""

    def __init__(self, store: Store, state_dir: str, check_trust: Callable[..., None]) -> None:
        self.store = store
        self.state_dir = state_dir
        self.staging = os.path.join(state_dir, "staging")
        self.check_trust = check_trust

    def quarantine(self, floor: int, *, strict: bool,
                   decodes: Callable[[CommitRecord], str | None] | None = None) -> list[int]:
        """``Publisher.quarantine_head`` for a publisher at version ``floor`` (0 without a state;
        ``strict``: it has one, and sets aside more than malformed records). ``decodes(rec)``: why the
        version after ``floor`` does not decode on the publisher's baseline, or None."""
        out = []
        while (h := head(self.store)) > floor and (
                why := self._unusable(h, strict=strict, decodes=decodes if h == floor + 1 else None)) is not None:
            self.set_aside(h, why)
            out.append(h)
        return out

    def set_aside(self, h: int, why: str) -> None:
        """Move the head's record (version ``h``) to ``quarantine/`` and HEAD down with it."""
        # Set aside whole where it is a record's size; a larger object is no record, and is not read
        # (memory before trust): what it was is noted in its place.
        data = get_capped(self.store, commit_key(h), MAX_RECORD_BYTES)
        if data is None:
            data = json.dumps({"set_aside": commit_key(h), "why": f"larger than {MAX_RECORD_BYTES} bytes, "
                               "not kept"}).encode()
        qkey = f"quarantine/{h:012d}-{uuid.uuid4().hex[:8]}.json"
        self.store.put(qkey, data)
        self.store.delete(commit_key(h))
        log.warning("set aside the record of version %d as %s: %s", h, qkey, why)
        self.store.put("HEAD", f"{head(self.store)}\n".encode())

    def _unusable(self, version: int, *, strict: bool,
                  decodes: Callable[[CommitRecord], str | None] | None = None) -> str | None:
        """Why the committed record of ``version`` can be no version of this stream, or None if it can:
        malformed; and, ``strict``, of another stream, unsigned in a signed stream, not verifying with
        this publisher's key, not following the version before it, or (``decodes``) a delta that does
        not decode to what it names (committed by a publisher whose input changed under it)."""
        where = f"{self.store.url}/{commit_key(version)}"
        try:
            rec = load_commit(self.store, version)
        except MalformedRecordError as e:
            return str(e)
        if not strict:
            return None
        prev, sid = None, None
        if version > 1:
            with contextlib.suppress(StreamError):
                sid = stream_identity(self.store)
            with contextlib.suppress(StreamError):
                prev = load_commit(self.store, version - 1)
        try:
            self.check_trust(rec, sid, prev is not None and prev.signature is not None, where)
        except (StreamIdentityError, SignatureError) as e:
            return str(e)
        if prev is not None and rec.parent != prev.fingerprint:
            return f"{where}: applies to {str(rec.parent)[:16]}…, not to version {version - 1}"
        why = decodes(rec) if decodes is not None else None
        return f"{where}: {why}" if why else None

    def joint(self, rec: CommitRecord, quorum: int, ack_timeout: float, live_ttl: float) -> None:
        # The wall-clock deadline lets retention tell a live proposal from a dead publisher's.
        self.store.put(prepared_key(rec.version), proposal_bytes(rec, time.time() + ack_timeout))
        deadline = time.monotonic() + ack_timeout
        need = quorum
        if need == ALL:
            from .retention import live_subscribers

            need = max(1, len(live_subscribers(self.store, live_ttl)))
        while True:
            acks = [k for k in self.store.list(f"acks/{rec.version:012d}/") if k.endswith(".json")]
            ok = 0
            for k in acks:
                a = subscriber_json(self.store, k)
                if a is None:
                    continue
                ok += a.get("ok") is True and a.get("fingerprint") == rec.fingerprint
            if ok >= need:
                return
            if time.monotonic() > deadline:
                self.store.delete(prepared_key(rec.version))
                raise PublishError(f"{self.store.url}: version {rec.version}: {ok} of {need} subscribers "
                                   f"acknowledged within {ack_timeout:g} s; not committed, baseline unchanged")
            time.sleep(0.05)

    def drop_dead(self) -> None:
        """Remove from the store what an upload of this state's that never committed left: its parts
        and its unfinished uploads (temp files, multipart uploads). The attempt id is this state's
        own, and the state is locked, so nothing else writes under it."""
        marker = os.path.join(self.state_dir, ATTEMPT_NAME)
        try:
            attempt = read_state_json(marker, "upload marker")["attempt"]  # a FIFO planted there: unreadable
            version = int(attempt.split("/")[1])
            if attempt != f"{vkey(version)}/{attempt.split('/')[2]}":
                raise ValueError(attempt)
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, CheckpointError):
            log.warning("%s: unreadable, ignored (retention removes orphan parts)", marker)
            os.unlink(marker)
            return
        if self.store.exists(commit_key(version)):
            try:
                rec = load_commit(self.store, version)
                committed = any(p.key.startswith(attempt + "/") for p in _parts_of(rec))
            except StreamError:  # unreadable: it might be ours, keep the parts (retention decides)
                committed = True
        else:
            committed = False
        if not committed:
            for key in self.store.list(attempt + "/"):
                self.store.delete(key)
            swept = (self.store.sweep_temps(0.0, prefix=attempt + "/")
                     if SWEEP_TEMPS in self.store.capabilities else [])
            log.info("removed the parts and %d unfinished uploads of %s, left by a killed publish", len(swept),
                     attempt)
        os.unlink(marker)

    def settle_killed(self, advance: Callable[[CommitRecord], object] | None) -> None:
        """Settle what a publish killed after keeping its record in ``pending.json`` left. A record the
        store holds committed: ``advance(rec)`` makes the baseline follow it (``recover``). Never
        committed, or another publisher's record won: its parts are orphans, removed, and with
        ``advance`` so is its dead joint proposal. ``advance`` None (``reset_baseline``, which rebuilds
        the baseline from the stream): an unreadable record is ignored instead of refused."""
        pending = os.path.join(self.state_dir, "pending.json")
        try:  # a regular file only (a FIFO planted there is named, not hung on), read up to a record's cap
            with os.fdopen(open_regular(pending, os.O_RDONLY, what="pending record"), "rb") as f:
                mine = read_capped(f.fileno(), MAX_RECORD_BYTES)
        except FileNotFoundError:
            return
        try:
            rec = parse_commit(mine, pending)
        except StreamError:
            if advance is not None:
                raise
            rec = None
        if rec is not None and holds(self.store, commit_key(rec.version), mine):
            if advance is not None:
                advance(rec)
        elif rec is not None:
            self.drop(rec)
            if advance is not None:
                with contextlib.suppress(KeyError, StreamError):
                    if parse_proposal(get_bounded(self.store, prepared_key(rec.version), MAX_RECORD_BYTES,
                                                  "proposal"), pending)[0] == rec:
                        self.store.delete(prepared_key(rec.version))  # our dead joint proposal
        os.unlink(pending)

    def drop(self, rec: CommitRecord) -> None:
        for part in _parts_of(rec):
            try:
                self.store.delete(part.key)
            except DeltaRefitError as e:  # best effort: retention removes orphans later
                log.warning("could not remove part %s: %s", part.key, e)


    def upload_and_commit(self, rec: CommitRecord, attempt: str, checkpoint: str, *, quorum: int,
                          ack_timeout: float, live_ttl: float, before_commit: Callable[[], None] | None = None) -> str:
        """Upload ``rec``'s staged parts, then (joint) commit it; the path of the local copy of the record
        kept until the baseline has advanced. A failure before the commit removes the attempt's parts.
        ``before_commit()``, after the upload, raises to refuse the commit (the input changed)."""
        version, delta_part, catchup_part, kf_parts = rec.version, rec.delta, rec.catchup, rec.keyframe
        # Upload, then (joint) commit. The attempt is named in the state first, so that the next run
        # removes what a kill mid-upload left in the store (parts and unfinished uploads).
        write_atomic(os.path.join(self.state_dir, ATTEMPT_NAME), json.dumps({"attempt": attempt}).encode(),
                     durable=False)  # lost to a power cut: retention removes the orphans instead
        try:
            if delta_part:
                self.store.put_file(delta_part.key, os.path.join(self.staging, "delta"))
            if catchup_part:
                self.store.put_file(catchup_part.key, os.path.join(self.staging, "catchup"))
            if kf_parts:
                for (_name, part), (_, path) in zip(kf_parts, _checkpoint_files(checkpoint), strict=True):
                    self.store.put_file(part.key, path)
            if before_commit is not None:
                before_commit()
            if quorum:
                self.joint(rec, quorum, ack_timeout, live_ttl)
            # The record we are about to commit, kept locally first: a kill right after the commit
            # is recognised on the next run by comparing it with the stored one.
            pending = os.path.join(self.state_dir, "pending.json")
            write_atomic(pending, rec.to_bytes())
            if not self.store.create(commit_key(version), rec.to_bytes()):
                os.unlink(pending)
                raise PublishError(f"{self.store.url}: version {version} was committed by another publisher first")
        except BaseException:
            if not holds(self.store, commit_key(version), rec.to_bytes()):
                self.drop(rec)
            raise
        self._restore_parts(rec, checkpoint)
        # A proposal for this version (ours, or a joint publish that died waiting) is settled now.
        self.store.delete(prepared_key(version))
        return pending

    def _restore_parts(self, rec: CommitRecord, checkpoint: str) -> None:
        """Committed: every part ``rec`` names must exist. One deleted meanwhile (a retention run older
        than this one's rule, which deleted parts of a version after the head it read) is uploaded
        again from its local copy, checked against the record first; refused (``PublishError``, the
        version is committed with a part missing) where that copy no longer matches."""
        local = []
        if rec.delta:
            local.append((rec.delta, os.path.join(self.staging, "delta")))
        if rec.catchup:
            local.append((rec.catchup, os.path.join(self.staging, "catchup")))
        if rec.keyframe:
            local += [(part, path) for (_, part), (_, path) in zip(rec.keyframe, _checkpoint_files(checkpoint),
                                                                   strict=True)]
        for part, path in local:
            try:
                if self.store.size(part.key) == part.bytes:
                    continue
            except KeyError:
                pass
            log.warning("%s/%s: part of committed version %d was deleted while it uploaded; uploading it again",
                        self.store.url, part.key, rec.version)
            if os.path.getsize(path) != part.bytes or file_hash(path) != part.blake3:
                raise PublishError(f"{self.store.url}/{part.key}: part of committed version {rec.version} was "
                                   f"deleted during the publish and {path} no longer holds it; publish the "
                                   "next version as a keyframe")
            self.store.put_file(part.key, path)


def _parts_of(rec: CommitRecord) -> list[Part]:
    return ([rec.delta] if rec.delta else []) + [p for _, p in rec.keyframe] + ([rec.catchup] if rec.catchup else [])


def _checkpoint_files(path: str) -> list[tuple[str, str]]:
    """(name inside the keyframe, local path) of a checkpoint's files, index included."""
    if os.path.isfile(path):
        return [("model.safetensors", path)]
    with open_checkpoint(path) as ck:
        files = [(os.path.basename(f), f) for f in ck.files()]
    idx = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(idx):
        files.append(("model.safetensors.index.json", idx))
    return files
