"""The rollout side of a sharded stream: ``sync_sharded`` brings one rollout rank's tensors to a
version, verified.

It reads the records after the held version, checks the parent links (``stream.chain.check_links``),
fetches the manifest and only the parts ``needed_ranks`` names for this rank's layout, checks each
against its record (size + BLAKE3) and the manifest against its record, all before any write; then
applies version by version with ``apply_version`` (pre-image checked per cell, idempotent) and records
``{version, fingerprint}`` atomically after each verified version. Every record must be of the stream
the rank follows (``stream``, fixed at version 1, recorded with the version: ``StreamIdentityError``
otherwise) and, with ``public_key``, signed by that key.

A rank that holds nothing (no state file) starts from the newest keyframe version at or below the
target (``stream.chain.newest_keyframe``), or, with ``adopt=True``, first looks for a version its
tensors already hold (e.g. loaded from the full checkpoint export of that version by the engine's
own loader): every cell meeting its slices must have that version's target digest. Such a rank needs
no keyframe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..errors import BaseMismatchError, DeltaRefitError, FormatError, UsageError, VerificationError
from ..io.locks import remove_dead_temps_beside
from ..signing import Verifier
from ..storage.base import Store, open_store
from ..stream.chain import check_links, commit_key, head, newest_keyframe, sync_target
from ..stream.records import (
    StreamError,
    StreamIdentityError,
    check_identity,
    held_state,
    held_version,
    record_version,
)
from .budget import header_budget
from .group import TPGroup
from .names import Layout, identity_layout
from .part import read_part
from .records import ShardCommit, _get_checked, load_manifest, load_shard_commit, shard_stream_identity
from .rollout import ApplyStats, _plan, apply_version, needed_ranks


@dataclass
class ShardSyncReport:
    from_version: int
    version: int
    fingerprint: str | None
    route: str  # "none", "chain", "keyframe", "adopted"
    bytes_fetched: int
    versions_applied: list[int] = field(default_factory=list)
    applied: list[ApplyStats] = field(default_factory=list)
    seconds: float = 0.0
    staged: bool = False  # the route was fetched and checked ahead (``stage_sharded``)


def _module_tensors(obj) -> tuple[Mapping[str, object], bool]:
    if isinstance(obj, Mapping):
        return obj, False
    import torch

    if isinstance(obj, torch.nn.Module):
        sd = obj.state_dict(keep_vars=True)
        return {n: v.detach() for n, v in sd.items() if isinstance(v, torch.Tensor)}, True
    raise UsageError("tensors: a {name: tensor} mapping or a torch module")


def _layout_for(layout: Layout | None, tensors: Mapping[str, object], man: dict) -> Layout:
    if layout is not None:
        return layout
    missing = sorted(set(man["tensors"]) - set(tensors))
    if missing:
        raise UsageError(f"no tensor {missing[0]!r} (and {len(missing) - 1} more) of the version; pass a layout")
    return identity_layout({n: tuple(tensors[n].shape) for n in man["tensors"]})


def _at_version(man: dict, blobs: Mapping[int, bytes], tensors, layout: Layout) -> bool:
    """Whether every cell of the version meeting this rank's slices is at its target (read-only)."""
    parts = [read_part(b, f"version {man['version']} part {r}", max_header=header_budget(man, r))
             for r, b in sorted(blobs.items())]
    try:
        todo, _ = _plan(parts, tensors, layout, owners_only=False, require_cover=True)
    except (BaseMismatchError, VerificationError, FormatError, UsageError):
        return False
    return not todo


class _Stager:
    """The versions of a route, each fetched once and checked before any write: its record (signature,
    stream identity), its manifest, and the parts this rank's layout needs."""

    def __init__(self, store: Store, tensors, layout: Layout | None, verifier: Verifier | None,
                 ident: str | None, holds_all: bool = False, public_key: str | None = None) -> None:
        self.store, self.tensors, self.layout = store, tensors, layout
        self.verifier, self.ident, self.holds_all = verifier, ident, holds_all
        self.public_key = public_key
        self.fetched = 0
        self.cache: dict[int, tuple[ShardCommit, dict, dict[int, bytes]]] = {}

    def serves(self, store: Store, tensors, layout: Layout | None, public_key: str | None, ident: str | None,
               holds_all: bool) -> bool:
        """Whether what this stager holds was fetched and checked as a sync with these arguments would."""
        return (self.store.url == store.url and self.tensors is tensors and self.layout is layout
                and (self.public_key, self.ident, self.holds_all) == (public_key, ident, holds_all))

    def stage(self, v: int) -> tuple[ShardCommit, dict, dict[int, bytes]]:
        if v not in self.cache:
            where = f"{self.store.url}/{commit_key(v)}"
            rec = load_shard_commit(self.store, v, self.verifier)  # signature checked before parsing
            check_identity(rec, self.ident, where)
            man = load_manifest(self.store, rec)
            self.fetched += rec.manifest.bytes
            self.layout = _layout_for(self.layout, self.tensors, man)
            if self.holds_all:
                _check_holds_all(man, self.layout, where)
            blobs = {r: _get_checked(self.store, rec.parts[r], f"rank {r} part of version {v}")
                     for r in needed_ranks(man, self.layout)}
            self.fetched += sum(len(b) for b in blobs.values())
            self.cache[v] = (rec, man, blobs)
        return self.cache[v]


def _check_holds_all(man: dict, layout: Layout, where: str) -> None:
    """Refuse, before any write, a version with a tensor this rank's layout holds no piece of (a rank
    that must hold every tensor, e.g. an engine worker: such a tensor would be left at its old bits)."""
    held = {p.name for lt in layout.values() for p in lt.pieces if p.count}
    missing = sorted(set(man["tensors"]) - held)
    if missing:
        raise UsageError(f"{where}: version {man['version']} has tensor {missing[0]!r} (and {len(missing) - 1} "
                         "more) that this rank does not hold; nothing written")


def _agreed(g: TPGroup, err: DeltaRefitError | None, theirs: DeltaRefitError) -> None:
    """Every member of the group goes on, or every one raises: its own error, else ``theirs``."""
    if not g.agree(err is None):
        raise err if err is not None else theirs


def _followed_identity(store: Store, state_path: str, verifier: Verifier | None = None) -> str | None:
    """The identity of the stream this rank follows: recorded with its version, else the store's (with
    ``verifier``, its version 1 signature-checked before parsing); refused when the store holds another
    stream."""
    held = (held_state(state_path) or {}).get("stream_id")
    store_ident = shard_stream_identity(store, verifier)
    if held is not None and store_ident is not None and held != store_ident:
        raise StreamIdentityError(f"{store.url}: holds stream {store_ident}, {state_path} records stream {held} "
                                  "(store wiped and republished, or another run's store?)")
    return held or store_ident


def _adopted(st: _Stager, g: TPGroup, target: int, first: int) -> ShardCommit | None:
    """The newest version from ``target`` down to ``first`` that this rank's tensors (loaded by another
    path) already hold, when every member of the group holds it; else None."""
    found, err = None, None
    try:
        for v in range(target, first - 1, -1):
            rec, man, blobs = st.stage(v)
            if _at_version(man, blobs, st.tensors, st.layout):
                found = rec
                break
    except DeltaRefitError as e:
        err = e
    _agreed(g, err, StreamError(f"{st.store.url}: another rank of the group could not stage the versions it needs"))
    fv = found.version if found is not None else 0
    return found if g.same([fv]) and found is not None else None  # only a version every member holds


def _stage_route(st: _Stager, g: TPGroup, first: int, target: int, cur: tuple[int, str] | None) -> None:
    """Stage every version of the route and check that the chain links up from what this rank holds."""
    err = None
    try:
        check_links({v: st.stage(v)[0] for v in range(first, target + 1)}, cur, st.store.url)
    except DeltaRefitError as e:
        err = e
    _agreed(g, err, StreamError(f"{st.store.url}: another rank of the group refused the route"))


def _apply_route(st: _Stager, g: TPGroup, rep: ShardSyncReport, first: int, target: int, state_path: str,
                 on_applied: Callable[[dict], None] | None = None) -> None:
    """Apply the staged versions in order, checking the group's digests around each, recording each;
    ``on_applied(manifest)`` after each write, before the version's checks and record."""
    for v in range(first, target + 1):
        rec, man, blobs = st.cache[v]
        # A kill after apply and before the record leaves tensors at the target: accepted (apply skips them).
        bad = [] if man["keyframe"] else g.check(st.tensors, st.layout, man, "base", "target")
        if bad:
            raise BaseMismatchError(f"version {v}: the TP group's base digests differ from the version's for "
                                    f"{len(bad)} tensors (e.g. {bad[0]}): refusing the version, nothing written")
        err = None
        try:
            rep.applied.append(apply_version(man, blobs, st.tensors, st.layout))
        except DeltaRefitError as e:
            err = e
        _agreed(g, err, VerificationError(
            f"version {v}: another rank of the group refused it; this rank's slices hold it, not recorded"))
        if on_applied is not None:  # after the agreement: it may make the group's collective calls
            try:
                on_applied(man)
            except DeltaRefitError as e:
                err = e
            _agreed(g, err, VerificationError(
                f"version {v}: another rank of the group failed after its write; not recorded"))
        bad = g.check(st.tensors, st.layout, man, "target")
        if bad:
            raise VerificationError(f"version {v}: the TP group's target digests differ for {len(bad)} tensors "
                                    f"(e.g. {bad[0]}); not recorded")
        record_version(state_path, v, rec.fingerprint, st.store.url, stream_id=st.ident)
        rep.version, rep.fingerprint = v, rec.fingerprint
        rep.versions_applied.append(v)


def stage_sharded(store: Store | str, tensors, layout: Layout | None = None, *, state_path: str,
                  to_version: int | None = None, public_key: str | None = None, holds_all: bool = False
                  ) -> _Stager:
    """What ``sync_sharded`` with the same arguments will need, fetched and checked ahead (records,
    signatures, stream identity, parent links from the version recorded at ``state_path``, manifests and
    the needed parts), with nothing written and no collective call: e.g. on a thread while an engine
    serves. Pass it to ``sync_sharded(staged=...)``, which then fetches none of it again (and still
    makes every check that involves the tensors or the group). A refusal is raised here, and again by
    the sync. A rank that holds nothing stages nothing."""
    store = open_store(store) if isinstance(store, str) else store
    tensors, _ = _module_tensors(tensors)
    target = sync_target(store.url, head(store), to_version)
    verifier = Verifier(public_key) if public_key is not None else None
    st = _Stager(store, tensors, layout, verifier, _followed_identity(store, state_path, verifier), holds_all,
                 public_key)
    cur = held_version(state_path)
    if cur is not None and cur[0] < target:
        check_links({v: st.stage(v)[0] for v in range(cur[0] + 1, target + 1)}, cur, store.url)
    return st


def sync_sharded(store: Store | str, tensors, layout: Layout | None = None, *, state_path: str,
                 to_version: int | None = None, group=None, adopt: bool = True,
                 public_key: str | None = None, holds_all: bool = False,
                 on_applied: Callable[[dict], None] | None = None, staged: _Stager | None = None
                 ) -> ShardSyncReport:
    """Bring one rollout rank's tensors to the newest (or ``to_version``) sharded version, verified.

    ``tensors``: ``{local name: tensor}`` in ``layout`` (CPU torch tensors or numpy arrays, written in
    place), or a torch module (identity layout when ``layout`` is None). ``state_path``: the file
    recording the version these tensors hold; it describes *these* tensors, so a rank that reloads its
    weights by another path must remove it (or rely on ``adopt``). ``group``: the rank's
    ``torch.distributed`` TP group (all members call together and hold the same version): the group's
    summed slice digests are checked against each version's base before and target after apply.

    Every record, manifest and needed part of the route is fetched and checked (size + BLAKE3 against
    the record, parent links, fingerprints) before anything is written; then each version is applied
    (``apply_version``: per-cell pre-image check, idempotent) and recorded. A rerun after a kill
    anywhere resumes: cells already at their target are skipped. With ``public_key`` every record on
    the route must carry a valid signature of that key (``SignatureError`` otherwise, nothing written).

    ``holds_all``: this rank must hold a piece of every tensor of each version (an engine worker); a
    version with a tensor its layout lacks is refused when staged, nothing written. ``on_applied``:
    called with each version's manifest right after its write, in every member of the group, before the
    group's target digests are checked and the version recorded, once every member's write succeeded (so
    it may make the group's collective calls, in the same order in every member): what the holder must do
    after a write (an engine: reload what its kernels keep apart, re-check them). It must be idempotent: a
    rerun after a failure calls it again. Its ``DeltaRefitError`` fails the version (agreed over the
    group), which is then not recorded. ``staged``: ``stage_sharded``'s, made with the same arguments
    (otherwise ignored).
    """
    t0 = time.perf_counter()
    store = open_store(store) if isinstance(store, str) else store
    verifier = Verifier(public_key) if public_key is not None else None
    tensors, _ = _module_tensors(tensors)
    g = TPGroup(group)
    target = sync_target(store.url, head(store), to_version)
    remove_dead_temps_beside(state_path)  # a sync killed while recording its version
    cur = held_version(state_path)
    ident = _followed_identity(store, state_path, verifier)
    start = cur[0] if cur else 0
    if not g.same([start, target]):
        raise UsageError("the ranks of the TP group hold different versions or sync to different ones")
    if cur and cur[0] > target:
        raise StreamError(f"{state_path}: holds version {cur[0]}, ahead of {target}")
    if cur and cur[0] == target:
        return ShardSyncReport(start, target, cur[1], "none", 0, seconds=time.perf_counter() - t0)
    st = staged if staged is not None and staged.serves(store, tensors, layout, public_key, ident, holds_all) \
        else _Stager(store, tensors, layout, verifier, ident, holds_all, public_key)
    route = "chain"
    if cur is None:
        first, route = newest_keyframe(lambda v: load_shard_commit(store, v, verifier), target), "keyframe"
        found = _adopted(st, g, target, first) if adopt else None  # tensors loaded by another path
        if found is not None:
            record_version(state_path, found.version, found.fingerprint, store.url, stream_id=ident)
            cur, route, first = (found.version, found.fingerprint), "adopted", found.version + 1
    else:
        first = cur[0] + 1
    _stage_route(st, g, first, target, cur)
    rep = ShardSyncReport(start, cur[0] if cur else 0, cur[1] if cur else None, route, st.fetched,
                          staged=st is staged)
    _apply_route(st, g, rep, first, target, state_path, on_applied)
    rep.bytes_fetched = st.fetched
    rep.seconds = time.perf_counter() - t0
    return rep
