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
are no longer proposed, and orphan parts (a publish that died before committing, or lost a race) and
unfinished uploads (the store's ``sweep_temps``: temp files, multipart uploads of killed writers)
older than ``orphan_grace`` seconds. A dry run reports exactly these and deletes nothing.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from ..storage.base import MTIME, SWEEP_TEMPS, Store
from .records import MalformedRecordError, StreamError, head, list_versions, load_commit, parse_proposal

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
        try:
            d = json.loads(store.get(k))
            if float(d["updated"]) >= cutoff:
                out[k[len("subs/"):-len(".json")]] = int(d["version"])
        except (KeyError, ValueError, TypeError):
            log.warning("ignoring unreadable subscriber record %s", k)
    return out


def retain(store: Store, *, ttl: float = 24 * 3600, orphan_grace: float = 3600, dry_run: bool = False) -> RetentionReport:
    h = head(store)
    versions = list_versions(store)
    recs = {}
    malformed: dict[int, str] = {}
    for v in versions:
        try:
            recs[v] = load_commit(store, v)
        except MalformedRecordError as e:
            log.warning("retention: %s; keeping every object of version %d", e, v)
            malformed[v] = str(e)
    keyframes = [v for v, r in recs.items() if r.keyframe]
    k = keyframes[-1] if keyframes else 0
    live = live_subscribers(store, ttl)
    s = min(live.values()) if live else h
    cut = min(s, k)
    keep: set[str] = set()
    for v, r in recs.items():
        if v == k:
            keep.update(p.key for _, p in r.keyframe)
        if r.delta is not None and v > cut:
            keep.add(r.delta.key)
        if r.catchup is not None and r.catchup_from == k:  # catch-ups from older keyframes lead nowhere kept
            keep.add(r.catchup.key)
    referenced = {p.key for r in recs.values()
                  for p in ([r.delta] if r.delta else []) + [q for _, q in r.keyframe] + ([r.catchup] if r.catchup else [])}
    rep = RetentionReport(h, k, min(live.values()) if live else None, malformed=malformed)
    # Proposals (joint commit) still open: for a version after the head and younger than the grace.
    # Settled ones (at or below the head) and stale ones (a joint publish that died) are removed.
    proposals: set[int] = set()
    for key in store.list("v/"):
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == "prepared.json":
            v = int(parts[1])
            try:
                _, deadline = parse_proposal(store.get(key), key)
            except (KeyError, StreamError):
                deadline = 0.0  # unreadable: treat as dead
            if v > h and time.time() < deadline + orphan_grace:
                proposals.add(v)
            else:
                rep.deleted.append(key)
    for key in store.list("v/"):
        parts = key.split("/")
        if len(parts) < 4:
            continue  # commit and prepared records
        v = int(parts[1])
        if key in keep or v in malformed:
            rep.kept_bytes += store.size(key)
            continue
        if key not in referenced and (v in proposals or not _older_than(store, key, orphan_grace)):
            continue  # an orphan still being uploaded or proposed
        rep.deleted.append(key)
    for key in store.list("acks/"):
        if int(key.split("/")[1]) not in proposals:
            rep.deleted.append(key)
    if not dry_run:
        for key in rep.deleted:
            store.delete(key)
    # Unfinished uploads of killed writers, invisible to list(); a dry run lists them.
    if SWEEP_TEMPS in store.capabilities:
        rep.deleted += store.sweep_temps(orphan_grace, dry_run=dry_run)
    log.info("retention: head %d, keyframe %d, oldest live %s: deleted %d objects", h, k, rep.oldest_live,
             len(rep.deleted))
    return rep


def _older_than(store: Store, key: str, seconds: float) -> bool:
    if MTIME not in store.capabilities:
        return True  # stores without timestamps (memory) treat every orphan as old
    return time.time() - store.mtime(key) > seconds
