"""The publisher's attempts: a joint commit's proposal and acknowledgements, the removal of a dead or
failed attempt's parts, and setting aside a head no publisher of this stream wrote (``quarantine_head``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid

from ..errors import DeltaRefitError, PublishError
from ..signing import SignatureError
from ..storage.base import SWEEP_TEMPS
from .chain import MAX_RECORD_BYTES, get_capped
from .publish_state import ALL, ATTEMPT_NAME
from .records import (
    CommitRecord,
    MalformedRecordError,
    Part,
    StreamError,
    StreamIdentityError,
    commit_key,
    head,
    load_commit,
    prepared_key,
    proposal_bytes,
    stream_identity,
    subscriber_json,
    vkey,
)

log = logging.getLogger(__name__)


class AttemptsMixin:
    """``Publisher``'s attempts methods (they use its state: store, state_dir, baseline, ...)."""

    def quarantine_head(self) -> list[int]:
        """Set aside the records at the head that can be no version of this stream (``_unusable``:
        garbage, another stream's, unsigned in a signed stream...), newest first, so that the next
        publish takes their version number. Each is moved to ``quarantine/<version>-<id>.json`` (kept
        for inspection; ``list_versions`` and retention ignore it) and its parts become orphans that
        retention removes. A usable head stops it: valid versions are never set aside. Only versions
        after this publisher's committed one are considered, and without a state only malformed
        records (a wrong ``signing_key`` must not make the stream's own history look foreign).
        Returns the versions set aside."""
        st = self.state()
        floor = st.version if st is not None else 0
        out = []
        while (h := head(self.store)) > floor and (why := self._unusable(h, strict=st is not None)) is not None:
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
            out.append(h)
        if out:
            self.store.put("HEAD", f"{head(self.store)}\n".encode())
        return out

    def _unusable(self, version: int, *, strict: bool) -> str | None:
        """Why the committed record of ``version`` can be no version of this stream, or None if it can:
        malformed; and, ``strict``, of another stream, unsigned in a signed stream, not verifying with
        this publisher's key, or not following the version before it."""
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
            self._check_trust(rec, sid, prev is not None and prev.signature is not None, where)
        except (StreamIdentityError, SignatureError) as e:
            return str(e)
        if prev is not None and rec.parent != prev.fingerprint:
            return f"{where}: applies to {str(rec.parent)[:16]}…, not to version {version - 1}"
        return None

    def _joint(self, rec: CommitRecord) -> None:
        # The wall-clock deadline lets retention tell a live proposal from a dead publisher's.
        self.store.put(prepared_key(rec.version), proposal_bytes(rec, time.time() + self.ack_timeout))
        deadline = time.monotonic() + self.ack_timeout
        need = self.quorum
        if need == ALL:
            from .retention import live_subscribers

            need = max(1, len(live_subscribers(self.store, self.live_ttl)))
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
                                   f"acknowledged within {self.ack_timeout:g} s; not committed, baseline unchanged")
            time.sleep(0.05)

    def _drop_dead_attempt(self) -> None:
        """Remove from the store what an upload of this state's that never committed left: its parts
        and its unfinished uploads (temp files, multipart uploads). The attempt id is this state's
        own, and the state is locked, so nothing else writes under it."""
        marker = os.path.join(self.state_dir, ATTEMPT_NAME)
        try:
            with open(marker, "rb") as f:
                attempt = json.loads(f.read())["attempt"]
            version = int(attempt.split("/")[1])
            if attempt != f"{vkey(version)}/{attempt.split('/')[2]}":
                raise ValueError(attempt)
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
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

    def _drop_attempt(self, rec: CommitRecord) -> None:
        for part in _parts_of(rec):
            try:
                self.store.delete(part.key)
            except DeltaRefitError as e:  # best effort: retention removes orphans later
                log.warning("could not remove part %s: %s", part.key, e)


def _parts_of(rec: CommitRecord) -> list[Part]:
    return ([rec.delta] if rec.delta else []) + [p for _, p in rec.keyframe] + ([rec.catchup] if rec.catchup else [])
