"""A live engine following a sharded version stream (``shard/``: every trainer rank uploads its part of a
version, one commits): ``ShardFollower``, which the weight-transfer backend uses when the stream's
records are sharded ones (``stream_kind``; nothing to configure).

The engine's captured layout is already a sharded rollout's: each checkpoint tensor lives in parameters
through ``engines.placement.Placement(param, piece)``, a ``geometry.projection.Piece`` as in
``shard.names.Layout``. ``engine_layout`` turns it into one (each parameter holding placed tensors, and
each host copy of a tensor the engine reloads, whole), and the follower brings the engine to a version
with ``shard.sync.sync_sharded`` itself: records, parent links, stream identity and signatures checked,
the needed parts fetched and checked, all before any write; each cell's pre-image checked (a wrong base:
``BaseMismatchError``, nothing written), written in place, re-digested. After each version's write
(``on_applied``) the engine does what it does after a plain apply (``LiveEngine.settle``): digests re-taken
from the weights, layers of its reload set fed through vLLM's reload and read back through their kernels,
derived copies rebuilt and read back. The version is recorded only once every tensor's additive digest, as
the engine holds it, equals the version's target (so ``engine_state_fingerprint`` is the record's). The
route is the chain from the engine's version, or, where retention deleted the objects of the version after
it, the newest keyframe (every cell overwritten, then checked as any version) and the chain from there.
``prepare`` fetches and checks the route ahead (``shard.sync.stage_sharded``) while the engine serves.

A tensor-parallel engine's workers follow together over the group vLLM keeps beside the device one
(``live.group``: ``sync_sharded``'s TP group): each applies the cells meeting its slices, and the group's
summed slice digests are checked against the version's before and after. CPU parameters only; other
engines are refused at init, with nothing written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from typing import Any

from ...errors import MalformedRecordError, StreamError, UsageError, VerificationError
from ...geometry.projection import whole_piece
from ...io.locks import owned_temp
from ...shard.names import Layout, LocalTensor
from ...shard.records import SHARD_COMMIT_FORMAT, load_shard_commit, shard_stream_identity, state_fingerprint
from ...shard.sync import ShardSyncReport, stage_sharded, sync_sharded
from ...storage.base import Store
from ...stream.chain import MAX_RECORD_BYTES, commit_key, get_capped, head, newest_keyframe, sync_target
from ...stream.records import StreamIdentityError, held_state, load_commit, record_json, record_version
from .holder import SCRATCH_PREFIX

log = logging.getLogger(__name__)

__all__ = ["ShardFollower", "engine_layout", "engine_state_fingerprint", "stream_kind", "version_fingerprint"]


def stream_kind(store: Store) -> str | None:
    """"sharded" when the stream's newest record is a sharded commit record, "plain" for any other (the
    plain reader then checks it), None for an empty stream. A stream holds one kind of record."""
    v = head(store)
    if v == 0:
        return None
    raw = get_capped(store, commit_key(v), MAX_RECORD_BYTES)
    try:  # the records' own parser, shape-bounded before it parses
        d = record_json(raw, f"{store.url}/{commit_key(v)}") if raw is not None else None
    except MalformedRecordError:
        return "plain"  # refused by the plain reader, which names the problem
    return "sharded" if isinstance(d, dict) and d.get("format") == SHARD_COMMIT_FORMAT else "plain"


def version_fingerprint(store: Store, version: int) -> str:
    """The fingerprint the record of ``version`` names, for a plain or a sharded stream: what an engine
    following it reports (``deltarefit_live_describe``'s "fingerprint") once at that version."""
    if stream_kind(store) == "sharded":
        return load_shard_commit(store, version).fingerprint
    return load_commit(store, version).fingerprint


def engine_state_fingerprint(live: Any) -> str | None:
    """A ``LiveEngine``'s weights' fingerprint as a sharded stream names a version (``shard.records.
    state_fingerprint``: dtype, shape and additive digest of every tensor), from its held additive digests;
    None while a failed write is not settled."""
    if not live.settled:
        return None
    return state_fingerprint({n: {"dtype": i.dtype, "shape": list(i.shape), "target": live.sums[n].hex()}
                              for n, i in live.target.tensors.items()})


def engine_layout(live: Any) -> tuple[dict[str, Any], Layout]:
    """A ``LiveEngine``'s weights as a sharded rollout rank holds them: (``{local name: tensor}``, its
    ``Layout``). Local names are ``param:<parameter>`` (the pieces of every checkpoint tensor placed in
    it) and ``host:<tensor>`` (the host copy of a tensor the engine reloads, whole). In a tensor-parallel
    group a tensor every worker holds whole (not split between them: replicated, or a host copy) is owned
    by worker 0 alone, so that the group's summed slice digests count each element once."""
    rank = live.group.rank

    def owned(piece: Any, split: bool) -> Any:
        return piece if split or rank == 0 else dataclasses.replace(piece, owner=False)

    tensors: dict[str, Any] = {}
    pieces: dict[str, list] = {}
    for name in sorted(live.placements):
        for pl in live.placements[name]:
            key = f"param:{pl.param}"
            tensors[key] = live.params[pl.param]
            pieces.setdefault(key, []).append(owned(pl.piece, name in live.shared))
    layout: Layout = {k: LocalTensor(tuple(tensors[k].shape), tuple(ps)) for k, ps in pieces.items()}
    for name, t in sorted(live.host.items()):
        key = f"host:{name}"
        tensors[key] = t
        layout[key] = LocalTensor(tuple(t.shape), (owned(whole_piece(name, tuple(t.shape)), False),))
    off = sorted(k for k, t in tensors.items() if t.device.type != "cpu")
    if off:
        raise UsageError(f"deltarefit: a sharded stream is applied into CPU parameters only; {off[0]} is on "
                         f"{tensors[off[0]].device}")
    return tensors, layout


class ShardFollower:
    """A worker's ``LiveEngine`` (``live``) following the sharded stream in ``store`` (module docstring).

    ``version``: the version the engine was started from (checked against its weights), else the newest
    whose fingerprint the engine's weights have (an engine started from the full export of version N
    holds N); an engine holding no version of the stream is refused. ``public_key``: every record on a
    route must be signed by it."""

    def __init__(self, live: Any, store: Store, *, version: int | None = None, public_key: str | None = None
                 ) -> None:
        self.live, self.store, self.public_key = live, store, public_key
        self.tensors, self.layout = engine_layout(live)
        fp = engine_state_fingerprint(live)
        if fp is None:
            raise VerificationError("the engine's held digests do not describe its weights; init again")
        held = self._held(fp, version)
        # The version these weights hold, where ``sync_sharded`` reads it: in memory's stead, a file in a
        # scratch directory owned by this engine (removed at close; a dead engine's, by the next one).
        self.scratch, self.scratch_lock = owned_temp(SCRATCH_PREFIX)
        self.state_path = os.path.join(self.scratch, "held.json")
        record_version(self.state_path, held[0], held[1], store.url, stream_id=shard_stream_identity(store))
        self.held_now = held
        self.reloaded: list[str] = []  # layers reloaded by the sync in progress
        self.staged: Any = None  # the next update's route, fetched and checked ahead (``prepare``)
        live.stream_fingerprint = lambda: engine_state_fingerprint(live)

    def _held(self, fp: str, version: int | None) -> tuple[int, str]:
        if version is not None:
            rec = load_shard_commit(self.store, version)
            if rec.fingerprint != fp:
                raise StreamError(f"{self.store.url} version {version} is {rec.fingerprint[:16]}…; the engine "
                                  f"holds {fp[:16]}…")
            return version, fp
        for v in range(head(self.store), 0, -1):
            if load_shard_commit(self.store, v).fingerprint == fp:
                return v, fp
        raise StreamError(f"the engine's weights ({fp[:16]}…) are no version of {self.store.url}; start it from "
                          "a version's full export (shard.convert.export_full)")

    def held(self) -> tuple[int, str]:
        return self.held_now

    def prepare(self, to_version: int | None = None) -> None:
        """Fetch and check the route to ``to_version`` ahead (``shard.sync.stage_sharded``: records, links,
        manifests and the parts the engine needs), writing nothing and making no collective call, so the
        engine may serve meanwhile; the next ``sync`` uses it."""
        self.staged = None
        self.staged = stage_sharded(self.store, self.tensors, self.layout, state_path=self.state_path,
                                    to_version=to_version, public_key=self.public_key, holds_all=True)

    def sync(self, to_version: int | None = None) -> ShardSyncReport:
        """Bring the engine to ``to_version`` (default: the head), verified (module docstring); refused
        with nothing written where a check before the write fails. Rerun after any failure."""
        self.reloaded = []
        staged, self.staged = self.staged, None
        if self._chain_gone(sync_target(self.store.url, head(self.store), to_version)):
            self._drop_held()  # sync_sharded then starts from the newest keyframe
        with self.live.writing():
            rep = sync_sharded(self.store, self.tensors, self.layout, state_path=self.state_path,
                               to_version=to_version, group=self.live.group.pg, adopt=False,
                               public_key=self.public_key, holds_all=True, on_applied=self._settle,
                               staged=staged)
        self.held_now = (rep.version, rep.fingerprint)
        return rep

    def _chain_gone(self, target: int) -> bool:
        """Whether the objects of the version after the one held were deleted (retention keeps those from
        the newest keyframe on: an engine restarted from an old export) while a keyframe after it, up to
        ``target``, lets the engine go on from there."""
        v = self.held_now[0]
        if v + 1 >= target or newest_keyframe(lambda x: load_shard_commit(self.store, x), target) <= v + 1:
            return False
        return not self.store.exists(load_shard_commit(self.store, v + 1).manifest.key)

    def _drop_held(self) -> None:
        """Forget the version held (the keyframe route overwrites every cell); the stream must still be
        the one followed."""
        held = (held_state(self.state_path) or {}).get("stream_id")
        ident = shard_stream_identity(self.store)
        if held is not None and held != ident:
            raise StreamIdentityError(f"{self.store.url}: holds stream {ident}, this engine follows {held}")
        log.info("deltarefit: version %d's successor is gone from %s; going on from its newest keyframe",
                 self.held_now[0], self.store.url)
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.state_path)

    def _settle(self, man: dict) -> None:
        """After a version's write: the engine's steps after an apply, then every tensor's digest as the
        engine holds it against the version's target."""
        changed = [n for n, e in man["tensors"].items() if man["keyframe"] or e["base"] != e["target"]]
        self.reloaded += self.live.settle(changed)
        wrong = sorted(n for n, e in man["tensors"].items() if self.live.sums[n].hex() != e["target"])
        if wrong:
            raise VerificationError(f"version {man['version']}: tensor {wrong[0]!r} (and {len(wrong) - 1} more) "
                                    "as the engine holds it is not the version's; not recorded")
        if engine_state_fingerprint(self.live) != state_fingerprint(man["tensors"]):  # the same tensors, no others
            raise VerificationError(f"version {man['version']}: the engine holds other tensors than the "
                                    "version's; not recorded")

    def close(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            os.close(self.scratch_lock)
            self.scratch = None
