"""Sharded versions in the version stream: every trainer rank publishes its part, one rank commits.

The protocol, by role, one module each (this module re-exports them):

* ``records``    the commit record (``ShardCommit``), its keys, descriptors, ``state_fingerprint``
* ``trainer``    ``ShardStreamPublisher``: the trainer side
* ``sync``       ``sync_sharded``: the rollout side (``group``: its TP collectives)
* ``retention``  ``retain_sharded``: the chain layer's retention for sharded records

What plain and sharded streams share (the head, the newest keyframe, the link check, retention) is
the chain layer's, ``stream/chain.py``.

Keys (the chain's layout, ``stream/chain.py``; a stream holds either plain or sharded versions)::

    v/000000000042/commit.json                       the sharded commit record: created last, conditionally
    v/000000000042/<attempt>/parts/rank-<r>          trainer rank r's part (``part.py`` format)
    v/000000000042/<attempt>/manifest.json           the version manifest (``part.join``), canonical bytes
    HEAD                                             a hint naming the newest version

**Trainer side** (``trainer.py``): every trainer rank uploads its part of version ``v`` under an
``attempt`` all ranks agree on; the committer joins the parts' descriptors into the manifest and
creates ``v/<v>/commit.json`` conditionally (the commit point); then every rank advances its baseline
slice by its committed part. A kill anywhere leaves either no commit record (the attempt's objects are
orphans, removed by ``retain_sharded``) or a record some baselines have not reached yet (their next
``recover`` follows it).

**Identity of a version.** ``fingerprint`` = BLAKE3 over the sorted (name, dtype, shape, target
additive digest) of every checkpoint tensor of the manifest (``state_fingerprint``): layout
independent, computable by any group that holds a partition of the tensors. A record's ``parent`` is
the previous version's fingerprint; for a delta version it must equal the fingerprint of the
manifest's *base* digests, so parts computed from a diverged baseline are never committed. The
additive digests catch accidental errors; what travels is bound by BLAKE3 (record -> manifest and
parts), and the record itself by a signature where the committer has a key: with ``signing_key`` it
signs every record it creates (Ed25519 over ``signed_bytes()``, as plain records), and
``sync_sharded(public_key=...)`` refuses a record on its route without a valid one. Every record
carries the stream's identity (``stream``, fixed at version 1 by its committer, under the signature);
``sync_sharded`` records it with the version and refuses records of another stream
(``StreamIdentityError``), as plain subscribers do (records without one are legacy, see
``stream/records.py``).

**Rollout side** (``sync.py``): a rollout rank checks every record, manifest and needed part of its
route (and the parent links) before any write, then applies version by version and records each
verified one; a rank holding nothing starts at the newest keyframe, or adopts the version its tensors
already hold.
"""

from __future__ import annotations

from ..stream.records import held_version
from .records import (
    SHARD_COMMIT_FORMAT,
    SHARD_COMMIT_VERSION,
    ShardCommit,
    head_key,
    load_manifest,
    load_shard_commit,
    manifest_key,
    new_attempt,
    parse_shard_commit,
    part_key,
    shard_stream_identity,
    state_fingerprint,
)
from .retention import retain_sharded
from .sync import ShardSyncReport, sync_sharded
from .trainer import ShardStreamPublisher

__all__ = ["SHARD_COMMIT_FORMAT", "SHARD_COMMIT_VERSION", "ShardCommit", "ShardStreamPublisher", "ShardSyncReport",
           "head_key", "held_version", "load_manifest", "load_shard_commit", "manifest_key", "new_attempt",
           "parse_shard_commit", "part_key", "retain_sharded", "shard_stream_identity", "state_fingerprint",
           "sync_sharded"]
