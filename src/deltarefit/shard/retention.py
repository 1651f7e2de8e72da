"""Retention of a sharded stream: the chain layer's policy (``stream.chain.plan_retention``) for
sharded records."""

from __future__ import annotations

from ..storage.base import Store, open_store
from ..stream.chain import RecordKind, check_orphan_grace, head, list_versions, plan_retention
from .records import ShardCommit, load_shard_commit


def _parts(r: ShardCommit) -> list:
    return [r.manifest, *r.parts]


# A version's manifest and parts are kept from the cut on: a holder of the cut rebuilds nothing, but
# trainers and late joiners rebuild from the keyframe, which is never after the cut.
SHARDED = RecordKind(parts=_parts, needed=lambda r, cut, k: _parts(r) if r.version >= cut else [],
                     committed_orphans_expire=True)


def retain_sharded(store: Store | str, *, keep_from: int | None = None, orphan_grace: float = 3600.0,
                   dry_run: bool = False, unsafe_short_grace: bool = False) -> list[str]:
    """Delete objects of a sharded stream nobody can need; returns the keys deleted.

    Kept: every commit record; the manifest and parts of every version from ``min(keep_from, newest
    keyframe)`` on (``keep_from``: the oldest version a rollout rank still holds; default the head),
    so trainers and late joiners can rebuild from the keyframe and every holder can follow the chain.
    Deleted: older committed objects, and objects of attempts no record names (dead or losing publishes,
    and the part descriptors the committer read) for versions already committed, or, for later
    versions, once older than ``orphan_grace`` seconds (a store without timestamps keeps those: they
    may be an upload in progress). A grace under ``MIN_ORPHAN_GRACE`` is refused unless
    ``unsafe_short_grace`` (``stream.chain.check_orphan_grace``)."""
    check_orphan_grace(orphan_grace, unsafe_short_grace)
    store = open_store(store) if isinstance(store, str) else store
    h = head(store)
    recs = {v: load_shard_commit(store, v) for v in list_versions(store)}
    deleted = plan_retention(store, h, recs, SHARDED, keep_from=keep_from, orphan_grace=orphan_grace).delete
    if not dry_run:
        for key in deleted:
            store.delete(key)
    return deleted
