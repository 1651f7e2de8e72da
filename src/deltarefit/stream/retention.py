"""Retention: delete the parts nobody can need any more, never those a live subscriber needs.

What is kept, with ``h`` the head, ``k`` the newest keyframe and ``s`` the oldest version a live
subscriber holds (subscribers report their version to ``subs/<id>.json`` on every sync; one silent
for longer than ``ttl`` seconds is not live):

* the keyframe parts of ``k`` (late joiners start there);
* every delta part of versions after ``min(s, k)``, so each live subscriber can follow the chain;
* catch-up deltas from ``k``;
* all commit records (they are small and are the history ``log`` shows);
* every object under a version whose commit record is malformed (its parts cannot be told from
  orphans; ``deltarefit publish --quarantine-head`` sets such a record aside, and its parts then go).

Deleted: other keyframe parts, delta parts of versions up to ``min(s, k)``, acks of versions that
are no longer proposed, and orphan parts of committed versions (a publish that died before
committing, or lost a race; an orphan of a version after the head may be a publish in progress and
is never deleted, ``chain.plan_retention``) and
unfinished uploads (the store's ``sweep_temps``: temp files, multipart uploads of killed writers)
older than ``orphan_grace`` seconds. A store that keeps no timestamps (memory) keeps every orphan:
its age is unknown, and it may be an upload in progress (``chain.older_than``). A dry run reports
exactly these and deletes nothing.

The policy (the cut, what each record keeps, orphans) is the chain layer's (``chain.plan_retention``),
shared with sharded streams; this module adds what only plain streams have: subscriber heartbeats,
joint-commit proposals and acks, and the store's unfinished uploads.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from ..storage.base import SWEEP_TEMPS, Store
from .chain import MAX_RECORD_BYTES, RecordKind, check_orphan_grace, get_capped, plan_retention, version_of
from .records import (
    CommitRecord,
    MalformedRecordError,
    StreamError,
    head,
    is_int,
    list_versions,
    load_commit,
    proposal_parts,
    record_parts,
    subscriber_json,
)

log = logging.getLogger(__name__)


@dataclass
class RetentionReport:
    head: int
    keyframe: int
    oldest_live: int | None
    deleted: list[str] = field(default_factory=list)
    kept_bytes: int = 0
    malformed: dict[int, str] = field(default_factory=dict)  # version -> why its record was not read


def live_subscribers(store: Store, ttl: float) -> dict[str, int]:
    out: dict[str, int] = {}
    cutoff = time.time() - ttl
    for k in store.list("subs/"):
        d = subscriber_json(store, k)
        if d is None:
            continue
        v, t = d.get("version"), d.get("updated")
        if not (is_int(v) and v >= 0 and isinstance(t, (int, float)) and not isinstance(t, bool)
                and math.isfinite(t)):
            log.warning("%s/%s: ignoring subscriber record without a version and a time", store.url, k)
            continue
        if t >= cutoff:
            out[k[len("subs/"):-len(".json")]] = v
    return out


def _needed(r: CommitRecord, cut: int, k: int) -> list:
    """The objects of a plain record still needed: the newest keyframe's files (late joiners start
    there), deltas after the cut (each live subscriber follows the chain), catch-ups from that keyframe
    (catch-ups from older keyframes lead nowhere kept)."""
    return (([p for _, p in r.keyframe] if r.version == k else []) + ([r.delta] if r.delta and r.version > cut else [])
            + ([r.catchup] if r.catchup is not None and r.catchup_from == k else []))


PLAIN = RecordKind(parts=record_parts, needed=_needed)


def retain(store: Store, *, ttl: float = 24 * 3600, orphan_grace: float = 3600, dry_run: bool = False,
           unsafe_short_grace: bool = False) -> RetentionReport:
    """Apply the policy above. ``orphan_grace`` under ``chain.MIN_ORPHAN_GRACE`` is refused unless
    ``unsafe_short_grace`` (no publish runs on the stream meanwhile)."""
    check_orphan_grace(orphan_grace, unsafe_short_grace)
    h = head(store)
    recs = {}
    malformed: dict[int, str] = {}
    for v in list_versions(store):
        try:
            recs[v] = load_commit(store, v)
        except MalformedRecordError as e:
            log.warning("retention: %s; keeping every object of version %d", e, v)
            malformed[v] = str(e)
    live = live_subscribers(store, ttl)
    proposals, settled = _open_proposals(store, h, orphan_grace)
    plan = plan_retention(store, h, recs, PLAIN, keep_from=min(live.values()) if live else h, orphan_grace=orphan_grace,
                          unreadable=malformed, open_versions=proposals)
    rep = RetentionReport(plan.head, plan.keyframe, min(live.values()) if live else None, malformed=malformed)
    rep.deleted += settled + plan.delete
    rep.kept_bytes = sum(store.size(key) for key in plan.keep)
    for key in store.list("acks/"):
        v = version_of(key.split("/")[1]) if key.count("/") >= 2 else None
        if v is None or v not in proposals:  # a name that is no version acknowledges nothing
            rep.deleted.append(key)
    if not dry_run:
        for key in rep.deleted:
            store.delete(key)
    if SWEEP_TEMPS in store.capabilities:  # unfinished uploads of killed writers, invisible to list(); a dry run lists them
        rep.deleted += store.sweep_temps(orphan_grace, dry_run=dry_run)
    log.info("retention: head %d, keyframe %d, oldest live %s: deleted %d objects", rep.head, rep.keyframe,
             rep.oldest_live, len(rep.deleted))
    return rep


def _open_proposals(store: Store, h: int, orphan_grace: float) -> tuple[set[int], list[str]]:
    """Proposals (joint commit) still open: for a version after the head and younger than the grace;
    and the keys of the others, settled (at or below the head) or stale (a joint publish that died)."""
    proposals: set[int] = set()
    settled: list[str] = []
    for key in store.list("v/"):
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == "prepared.json" and version_of(parts[1]) is not None:
            v = version_of(parts[1])
            try:
                data = get_capped(store, key, MAX_RECORD_BYTES)
                if data is None:
                    raise StreamError(f"{key}: proposal too large")
                _, deadline = proposal_parts(data, key)  # the record is never parsed: no key here
            except (KeyError, StreamError):
                deadline = 0.0  # unreadable: treat as dead
            if v > h and time.time() < deadline + orphan_grace:
                proposals.add(v)
            else:
                settled.append(key)
    return proposals, settled
