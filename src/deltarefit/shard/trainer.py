"""The trainer side of a sharded stream: ``ShardStreamPublisher``, one per trainer rank.

For version ``v`` (the committed head + 1) and an ``attempt`` id that every rank of this publish
agrees on:

1. ``recover``: bring the rank's baseline slice to the committed head (from the rank's saved state,
   then the committed parts of its rank of every later version; a rank with nothing rebuilds from the
   newest keyframe). The baseline only ever moves by a *committed* part of this rank.
2. ``upload``: diff the rank's master shard against its baseline into its part and create it under
   ``v/<v>/<attempt>/parts/rank-<r>`` (conditional create; a key holding other bytes is refused:
   an attempt id reused across runs).
3. ``commit_version`` (the committer, rank 0 by default): take every rank's part ref (key, bytes,
   BLAKE3) as the ranks handed it over a channel the store cannot forge (gathered over a
   ``torch.distributed`` group, returned through Ray, or in process), wait until every rank's
   descriptor exists in the store (polling with a deadline) and matches its ref; ``join`` the parts' heads, check that the parts' base digests are the
   parent version's target digests, upload the manifest, then create ``v/<v>/commit.json`` with the
   store's conditional create (signed with ``signing_key`` when given). That create is the commit point.
4. ``advance``: every rank, once the record exists, applies its rank's committed part to its baseline
   (its own bytes when they are the committed ones, else the committed part fetched and checked) and
   saves its state.

The refs never come from the store: anyone who can write to it (a rollout writes ``subs/`` and
``acks/``) could plant a rank's part under the attempt, visible in the listing, and a committer that
joined what it read back would sign the planted bits. A rank whose upload was refused (its key
already held other bytes) hands over no ref, and the version is not committed.

A kill anywhere leaves either no commit record (the attempt's objects are orphans: ignored by every
reader, removed by ``retain_sharded``; the rerun publishes under a new attempt) or a commit record some
ranks' baselines have not reached (their next ``recover`` follows it). A rank never advances on its
own uncommitted part.
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, replace

import blake3
import numpy as np

from ..dtypes import dtype as lookup_dtype
from ..errors import DeltaRefitError, PublishError, UsageError
from ..integrity import SEGMENT_BYTES
from ..io.fsutil import write_atomic
from ..io.locks import remove_dead_temps_beside
from ..signing import Signer, record_signature
from ..storage.base import Store, open_store
from ..stream.chain import commit_key, head, newest_keyframe
from ..stream.records import Part, StreamError, new_stream_id, now
from ..transport.collectives import all_gather_bytes, broadcast_bytes
from .names import Layout
from .part import join, manifest_bytes, read_part
from .publish import PartStats, ShardPublisher
from .records import (
    PartRef,
    ShardCommit,
    _check_attempt,
    _descriptor,
    _get_checked,
    _put_once,
    _ref,
    get_descriptor,
    head_key,
    load_shard_commit,
    manifest_key,
    new_attempt,
    parse_shard_commit,
    part_key,
    part_ref,
    shard_stream_identity,
    version_fingerprint,
)

log = logging.getLogger(__name__)


class ShardStreamPublisher:
    """One trainer rank of a sharded stream (see the module docstring for the protocol).

    ``layout``, ``served``, ``cuts``, ``rank``, ``world``: as ``ShardPublisher``. ``state_dir``: where the
    rank saves its baseline slice and committed version (``rank-<r>.npz``, written atomically after each
    advance); None keeps it in memory only, and a restarted rank rebuilds it from the stream's newest
    keyframe and the committed parts after it. ``group``: a ``torch.distributed`` group of the trainer
    ranks (group rank i = trainer rank i): the attempt id, the part descriptors and the outcome travel
    over it; without one (ranks in Ray actors, threads), each rank's ``upload`` returns its ref, the
    caller hands every ref to the committer's ``commit_version(refs=...)``, and each rank then
    ``advance``s to ``wait_commit`` (a single rank's ``publish`` does all three).
    ``committer``: the rank that commits. ``timeout``: seconds to wait for the other ranks' parts (the
    committer) or for the commit record (the others). ``keyframe_every``: version numbers divisible by
    it are keyframes (every cell overwritten; a late rollout rank starts there). ``format_version``: of
    the rank's parts (``ShardPublisher``; 2 by default); ranks of one stream may change it between versions.
    """

    def __init__(self, store: Store | str, layout: Layout, served: str | Mapping[str, str] = "BF16", *,
                 cuts: Mapping[str, tuple[tuple[int, ...], ...]] | None = None, rank: int = 0, world: int = 1,
                 state_dir: str | None = None, group=None, committer: int = 0, timeout: float = 60.0,
                 poll: float = 0.05, keyframe_every: int = 0, publisher_id: str | None = None,
                 chunk_bytes: int = SEGMENT_BYTES, signing_key: str | None = None, format_version: int = 2) -> None:
        if not 0 <= rank < world or not 0 <= committer < world or timeout <= 0 or keyframe_every < 0:
            raise UsageError("0 <= rank, committer < world, timeout > 0 and keyframe_every >= 0 are required, got "
                             f"rank={rank}, committer={committer}, world={world}, timeout={timeout}, "
                             f"keyframe_every={keyframe_every}")
        self.store = open_store(store) if isinstance(store, str) else store
        self.pub = ShardPublisher(layout, served, cuts=cuts, rank=rank, world=world, chunk_bytes=chunk_bytes,
                                  format_version=format_version)
        self.rank, self.world, self.committer = rank, world, committer
        self.group = group
        self.timeout, self.poll = timeout, poll
        self.keyframe_every = keyframe_every
        self.publisher_id = publisher_id or f"{os.uname().nodename}-{os.getpid()}"
        # The committer signs the records it creates (Ed25519, `deltarefit keygen`).
        self.signer = Signer(signing_key) if signing_key is not None else None
        self.state_path = None if state_dir is None else os.path.join(os.path.abspath(state_dir), f"rank-{rank}.npz")
        self.version = 0  # the committed version the baseline slice is at
        self.fingerprint: str | None = None
        self.last_stats: PartStats | None = None
        self.last_part: bytes | None = None  # the part this rank uploaded last (e.g. for partial digests)
        self._own: tuple[int, str, bytes] | None = None  # (version, attempt, part) uploaded, not yet advanced
        self._loaded = False

    # -- state -----------------------------------------------------------------------------------

    def _load_state(self) -> None:
        self._loaded = True
        if self.state_path is not None:  # a rank killed while saving left a temp of its baseline slice
            remove_dead_temps_beside(self.state_path)
        if self.state_path is None or not os.path.exists(self.state_path):
            return
        try:
            with np.load(self.state_path, allow_pickle=False) as z:
                meta = json.loads(bytes(z["__meta__"]).decode())
                arrays = {n: z[f"a{i}"] for i, n in enumerate(meta["names"])}
        except (OSError, ValueError, KeyError) as e:
            raise StreamError(f"{self.state_path}: unreadable rank state ({e})") from None
        if (meta.get("rank"), meta.get("world"), meta.get("stream")) != (self.rank, self.world, self.store.url):
            raise UsageError(f"{self.state_path}: state of rank {meta.get('rank')}/{meta.get('world')} of "
                             f"{meta.get('stream')}, not rank {self.rank}/{self.world} of {self.store.url}")
        want = {n: (lt.shape, lookup_dtype(self.pub.dtypes[n]).uint) for n, lt in self.pub.layout.items()}
        if set(arrays) != set(want) or any(arrays[n].shape != s or arrays[n].dtype != d for n, (s, d) in want.items()):
            raise UsageError(f"{self.state_path}: saved baseline does not match this rank's layout")
        self.pub.baseline = {n: np.ascontiguousarray(a) for n, a in arrays.items()}
        self.pub.committed_version = self.version = int(meta["version"])
        self.fingerprint = meta["fingerprint"]

    def _save_state(self) -> None:
        if self.state_path is None:
            return
        names = sorted(self.pub.baseline)
        meta = {"version": self.version, "fingerprint": self.fingerprint, "rank": self.rank, "world": self.world,
                "stream": self.store.url, "names": names}
        buf = io.BytesIO()
        # Memory hazard: one serialized copy of the baseline slice while it is written.
        np.savez(buf, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8),
                 **{f"a{i}": self.pub.baseline[n] for i, n in enumerate(names)})
        os.makedirs(os.path.dirname(self.state_path), exist_ok=True)
        write_atomic(self.state_path, buf.getvalue())

    def recover(self) -> int:
        """Bring the baseline slice to the stream's newest committed version; returns that version."""
        if not self._loaded:
            self._load_state()
        h = head(self.store)
        if h < self.version:
            raise StreamError(f"{self.store.url}: newest version {h} is older than rank {self.rank}'s baseline "
                              f"{self.version}")
        if h == self.version:
            return h
        if self.pub.baseline is None:  # a rank holding nothing rebuilds from the newest keyframe
            start = newest_keyframe(lambda v: load_shard_commit(self.store, v), h)
        else:
            start = self.version + 1
        for v in range(start, h + 1):
            self.advance(load_shard_commit(self.store, v))
        return self.version

    def advance(self, rec: ShardCommit) -> None:
        """Move the baseline slice to committed version ``rec`` (the next one, or a keyframe)."""
        if rec.version <= self.version and self.pub.baseline is not None:
            return  # already there (a rerun)
        if rec.world != self.world:
            raise StreamError(f"{self.store.url}: version {rec.version} has {rec.world} trainer ranks, not {self.world}")
        if self.pub.baseline is not None and (rec.version != self.version + 1 or rec.parent != self.fingerprint):
            raise StreamError(f"{self.store.url}: version {rec.version} does not follow rank {self.rank}'s baseline "
                              f"(version {self.version}): broken chain, or another publisher moved the stream on")
        if self.pub.baseline is None and not rec.keyframe:
            raise StreamError(f"rank {self.rank} holds no baseline and version {rec.version} is no keyframe")
        ref = rec.parts[self.rank]
        own = self._own
        if own is not None and own[0] == rec.version and _ref(ref.key, own[2]) == ref:
            blob = own[2]
        else:  # another attempt won (or a restarted rank): the committed part is the truth
            blob = _get_checked(self.store, ref, f"rank {self.rank} part of version {rec.version}")
        pt = read_part(blob, f"{self.store.url}/{ref.key}")
        if pt.version != rec.version or pt.header["rank"] != self.rank:
            raise StreamError(f"{self.store.url}/{ref.key}: part of rank {pt.header['rank']}, version {pt.version}")
        self.pub.commit(pt)  # checks each cell's base digest against the baseline before writing
        self.version, self.fingerprint = rec.version, rec.fingerprint
        self._own = None
        self._save_state()

    # -- publish ---------------------------------------------------------------------------------

    def upload(self, masters: Mapping[str, object], attempt: str, *, version: int | None = None) -> Part:
        """This rank's part of the next version, created under ``attempt``; returns its descriptor."""
        _check_attempt(attempt)
        v = self.recover() + 1
        if version is not None and version != v:
            raise StreamError(f"rank {self.rank} is at version {v - 1}; cannot publish version {version}")
        saved = self.pub.baseline
        if self.keyframe_every and v % self.keyframe_every == 0:
            self.pub.baseline = None  # a keyframe: every cell overwritten (every rank decides alike)
        try:
            blob, self.last_stats = self.pub.publish(masters, v)
        finally:
            self.pub.baseline = saved
        key = part_key(v, attempt, self.rank)
        _put_once(self.store, key, blob)
        # After the part: the descriptor's existence says the part is complete.
        _put_once(self.store, head_key(v, attempt, self.rank), _descriptor(key, blob))
        self._own = (v, attempt, blob)
        self.last_part = blob
        return part_ref(key, blob)

    def commit_version(self, version: int, attempt: str, *, refs: list[Part] | None = None,
                       step: int | None = None) -> ShardCommit:
        """(The committer.) Join every rank's part of ``version``/``attempt`` and create the commit record.

        ``refs``: every rank's ``upload`` return, in rank order, as the ranks handed them to the
        committer (never read back from the store; the store's descriptors must match them). None only
        for a single rank, whose own upload is the ref. The committer polls the store until every
        rank's descriptor exists, or ``timeout`` passes (PublishError, no commit). Does not advance this
        rank's baseline (``advance`` does)."""
        if self.rank != self.committer:
            raise UsageError(f"rank {self.rank} is not the committer (rank {self.committer})")
        _check_attempt(attempt)
        if version != self.version + 1:
            raise StreamError(f"committer is at version {self.version}; cannot commit version {version}")
        refs = self._trusted_refs(version, attempt, refs)
        descs = self._descriptors(version, attempt, refs)
        ranks_refs = [d[0] for d in descs]
        parts = [read_part(d[1], f"{self.store.url}/{d[0].key}", head_only=True) for d in descs]
        for r, pt in enumerate(parts):
            if pt.version != version or pt.header["rank"] != r or pt.header["world"] != self.world:
                raise PublishError(f"{self.store.url}/{ranks_refs[r].key}: part of rank {pt.header['rank']}/{pt.header['world']}, "
                                   f"version {pt.version}")
        man = join(parts, [(ref.bytes, ref.blake3) for ref in ranks_refs])  # refuses overlapping or missing cells
        parent = self.fingerprint if version > 1 else None
        fp, linked = version_fingerprint(man, parent)
        if not linked:
            raise PublishError(f"{self.store.url}: the parts of version {version} do not start from version "
                               f"{version - 1} (a rank's baseline diverged); not committed")
        mdata = manifest_bytes(man)
        mkey = manifest_key(version, attempt)
        _put_once(self.store, mkey, mdata)
        # Not part of same_version: a rerun of version 1's attempt draws another identity, and the
        # committed one is then the stream's.
        stream = new_stream_id() if version == 1 else shard_stream_identity(self.store)
        rec = ShardCommit(version, parent, fp, bool(man["keyframe"]), self.world, _ref(mkey, mdata),
                          tuple(ranks_refs), step, now(), self.publisher_id, stream=stream)
        if self.signer is not None:
            rec = replace(rec, signature=record_signature(self.signer, rec.signed_bytes()))
        # The commit point: the record is created last, conditionally; exactly one attempt wins.
        if not self.store.create(commit_key(version), rec.to_bytes()):
            theirs = load_shard_commit(self.store, version)
            if not theirs.same_version(rec):
                raise PublishError(f"{self.store.url}: version {version} was committed by another publisher first; "
                                   "this attempt's parts are orphans, the next publish follows the committed version")
            rec = theirs  # our own commit, created by an earlier try of this same attempt
        try:
            self.store.put("HEAD", f"{version}\n".encode())
        except DeltaRefitError as e:  # a hint only: head() probes forward from it
            log.warning("could not update HEAD: %s", e)
        return rec

    def _trusted_refs(self, version: int, attempt: str, refs: list[Part] | None) -> list[Part]:
        """``refs`` checked for shape (one ``Part`` per rank, each naming its rank's key); for a single rank
        without refs, its own upload's. PublishError otherwise: nothing is committed from the store alone."""
        if refs is None:
            own = self._own
            if self.world != 1 or own is None or own[:2] != (version, attempt):
                raise PublishError(f"{self.store.url}: version {version} attempt {attempt}: no part refs from the "
                                   f"ranks; the committer never commits what it reads back from the store (anyone "
                                   "who writes to it could plant a part): pass refs=, each rank's upload() return, "
                                   "handed over by the caller; not committed")
            return [part_ref(part_key(version, attempt, 0), own[2])]
        refs = list(refs)
        if len(refs) != self.world or not all(isinstance(r, Part) for r in refs):
            raise PublishError(f"{self.store.url}: version {version}: {len(refs)} part refs for {self.world} ranks; "
                               "not committed")
        for r, ref in enumerate(refs):
            if ref.key != part_key(version, attempt, r):
                raise PublishError(f"{self.store.url}: rank {r}'s ref names {ref.key}, not its part of version "
                                   f"{version} attempt {attempt}; not committed")
        return refs

    def _descriptors(self, version: int, attempt: str, refs: list[Part]) -> list[tuple[Part, bytes]]:
        """Every rank's descriptor of its part of ``version``/``attempt`` (checked against ``refs`` when
        given), polling the store until all exist; PublishError once another publisher committed the
        version, or after ``timeout`` seconds."""
        # The committer reads each rank's descriptor (size, BLAKE3, the part's head: a few KB), never a
        # whole part: at scale, the parts of a keyframe are the whole served model.
        keys = [part_key(version, attempt, r) for r in range(self.world)]
        descs: list[tuple[Part, bytes] | None] = [None] * self.world
        deadline = time.monotonic() + self.timeout
        while True:
            for r, k in enumerate(keys):
                if descs[r] is not None:
                    continue
                hk = head_key(version, attempt, r)
                try:
                    descs[r] = get_descriptor(self.store, hk)
                except KeyError:
                    continue
                d, ref = descs[r][0], refs[r]
                if d.key != k or (ref.key, ref.bytes, ref.blake3) != (d.key, d.bytes, d.blake3):
                    raise PublishError(f"{self.store.url}/{hk}: rank {r} describes {d}, expected part {k} "
                                       f"as the rank reported it, {ref} (planted by another writer of the "
                                       "store?); not committed")
                if not isinstance(ref, PartRef) or blake3.blake3(descs[r][1]).hexdigest() != ref.head:
                    raise PublishError(f"{self.store.url}/{hk}: rank {r}'s descriptor carries a part head that is "
                                       "not the one its upload() returned (rewritten by another writer of the "
                                       "store?), or its ref binds none (pass each rank's upload() return); "
                                       "not committed")
            missing = [r for r, d in enumerate(descs) if d is None]
            if not missing:
                break
            if self.store.exists(commit_key(version)):
                raise PublishError(f"{self.store.url}: version {version} was committed by another publisher while "
                                   f"waiting for ranks {missing}; not committed, baselines unchanged")
            if time.monotonic() > deadline:
                raise PublishError(f"{self.store.url}: version {version} attempt {attempt}: no part from ranks "
                                   f"{missing} within {self.timeout:g} s; not committed, baselines unchanged")
            time.sleep(self.poll)
        return descs

    def wait_commit(self, version: int) -> ShardCommit:
        """(Non-committer ranks.) The commit record of ``version`` once it exists; PublishError after
        ``timeout`` seconds without one (the baseline stays where it is)."""
        deadline = time.monotonic() + self.timeout
        while not self.store.exists(commit_key(version)):
            if time.monotonic() > deadline:
                raise PublishError(f"{self.store.url}: version {version} was not committed within {self.timeout:g} s "
                                   f"(committer rank {self.committer} failed or is late); rank {self.rank}'s baseline "
                                   "unchanged")
            time.sleep(self.poll)
        return load_shard_commit(self.store, version)

    def publish(self, masters: Mapping[str, object], *, attempt: str | None = None,
                step: int | None = None) -> ShardCommit:
        """Publish this rank's part of the next version and return the committed record, after this
        rank's baseline advanced to it. Every trainer rank calls it for the same step."""
        if self.group is not None:
            return self._publish_group(masters, attempt, step)
        if self.world > 1:
            raise UsageError("without a process group, the ranks' part refs must reach the committer over a "
                             "channel the store cannot forge: call upload() on every rank, hand the refs to the "
                             "committer's commit_version(version, attempt, refs=...), then advance(wait_commit("
                             "version)) on every rank (integrations.ray_shard does this through Ray)")
        attempt = attempt or new_attempt()
        self.upload(masters, attempt)
        v = self.version + 1
        rec = self.commit_version(v, attempt, step=step)
        self.advance(rec)
        return rec

    def _publish_group(self, masters, attempt: str | None, step: int | None) -> ShardCommit:
        import torch.distributed as dist

        # Every rank takes part in every collective below, whatever failed locally, or the group hangs.
        # Only JSON crosses ranks (byte tensors), never pickled objects.
        src = dist.get_global_rank(self.group, self.committer)
        mine_attempt = attempt or (new_attempt() if self.rank == self.committer else None)
        attempt = broadcast_bytes(mine_attempt.encode() if self.rank == self.committer else None, src,
                                  self.group).decode()
        try:
            ref = self.upload(masters, attempt)
            mine = {"ref": asdict(ref), "version": self.version + 1}
        except Exception as e:  # reported to the committer, re-raised there as PublishError
            mine = {"error": f"rank {self.rank}: {e}"}
        got = [json.loads(b) for b in all_gather_bytes(json.dumps(mine).encode(), self.group)]
        outcome: list = [None]
        if self.rank == self.committer:
            errors = [g["error"] for g in got if "error" in g]
            try:
                if errors:
                    raise PublishError("; ".join(errors) + "; not committed, baselines unchanged")
                if len({g["version"] for g in got}) != 1:
                    raise PublishError(f"ranks publish different versions {[g['version'] for g in got]}")
                refs = [PartRef(**g["ref"]) for g in got]
                outcome = [self.commit_version(got[0]["version"], attempt, refs=refs, step=step).to_bytes().decode()]
            except Exception as e:  # every rank must hear the outcome
                outcome = [{"error": str(e)}]
        sent = json.dumps(outcome[0]).encode() if self.rank == self.committer else None
        outcome = [json.loads(broadcast_bytes(sent, src, self.group))]
        if isinstance(outcome[0], dict):
            self._own = None
            raise PublishError(outcome[0]["error"])
        rec = parse_shard_commit(outcome[0].encode(), "commit record from the committer")
        self.advance(rec)
        return rec
