"""Sharded versions in the version stream: every trainer rank publishes its part, one rank commits.

Keys (the same layout as ``stream/records.py``; a stream holds either plain or sharded versions)::

    v/000000000042/commit.json                       the sharded commit record: created last, conditionally
    v/000000000042/<attempt>/parts/rank-<r>          trainer rank r's part (``part.py`` format)
    v/000000000042/<attempt>/manifest.json           the version manifest (``part.join``), canonical bytes
    HEAD                                             a hint naming the newest version

**Trainer side** (``ShardStreamPublisher``, one per trainer rank), for version ``v`` (the committed
head + 1) and an ``attempt`` id that every rank of this publish agrees on:

1. ``recover``: bring the rank's baseline slice to the committed head (from the rank's saved state,
   then the committed parts of its rank of every later version; a rank with nothing rebuilds from the
   newest keyframe). The baseline only ever moves by a *committed* part of this rank.
2. ``upload``: diff the rank's master shard against its baseline into its part and create it under
   ``v/<v>/<attempt>/parts/rank-<r>`` (conditional create; a key holding other bytes is refused:
   an attempt id reused across runs).
3. ``commit_version`` (the committer, rank 0 by default): wait until every rank's part exists (store
   polling with a deadline), or take their descriptors (key, bytes, BLAKE3) gathered over a
   ``torch.distributed`` group; fetch and parse every part, ``join`` them, check that the parts' base
   digests are the parent version's target digests, upload the manifest, then create
   ``v/<v>/commit.json`` with the store's conditional create. That create is the commit point.
4. ``advance``: every rank, once the record exists, applies its rank's committed part to its baseline
   (its own bytes when they are the committed ones, else the committed part fetched and checked) and
   saves its state.

A kill anywhere leaves either no commit record (the attempt's objects are orphans: ignored by every
reader, removed by ``retain_sharded``; the rerun publishes under a new attempt) or a commit record some
ranks' baselines have not reached (their next ``recover`` follows it). A rank never advances on its
own uncommitted part.

**Identity of a version.** ``fingerprint`` = BLAKE3 over the sorted (name, dtype, shape, target
additive digest) of every checkpoint tensor of the manifest (``state_fingerprint``): layout
independent, computable by any group that holds a partition of the tensors. A record's ``parent`` is
the previous version's fingerprint; for a delta version it must equal the fingerprint of the
manifest's *base* digests, so parts computed from a diverged baseline are never committed. The
additive digests catch accidental errors; what travels is bound by BLAKE3 (record -> manifest and
parts). Records may be signed (Ed25519, as plain records). Every record carries the stream's identity
(``stream``, fixed at version 1 by its committer, under the signature); ``sync_sharded`` records it
with the version and refuses records of another stream (``StreamIdentityError``), as plain
subscribers do (records without one are legacy, see ``stream/records.py``).

**Rollout side** (``sync_sharded``): read the records after the held version, check the parent
links, fetch the manifest and only the parts ``needed_ranks`` names for this rank's layout, check
each against its record (size + BLAKE3) and the manifest against its record, all before any write;
then apply version by version with ``apply_version`` (pre-image checked per cell, idempotent) and
record ``{version, fingerprint}`` atomically after each verified version.

A rank that holds nothing (no state file) starts from the newest keyframe version at or below the
target, or, with ``adopt=True``, first looks for a version its tensors already hold (e.g. loaded
from the full checkpoint export of that version by the engine's own loader): every cell meeting its
slices must have that version's target digest. Such a rank needs no keyframe.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import blake3
import numpy as np

from ..dtypes import dtype as lookup_dtype
from ..errors import BaseMismatchError, DeltaRefitError, FormatError, UsageError, VerificationError
from ..fsutil import write_atomic
from ..integrity import SEGMENT_BYTES
from ..signing import SignableRecord, Signer, Verifier, check_record_signature, record_signature
from ..storage.base import MTIME, Store, open_store
from ..stream.publisher import PublishError
from ..stream.records import (
    STREAM_ID_PATTERN,
    Part,
    StreamError,
    StreamIdentityError,
    check_identity,
    commit_key,
    head,
    held_state,
    held_version,
    legacy_identity,
    list_versions,
    load_record,
    new_stream_id,
    now,
    record_json,
    record_version,
    vkey,
)
from ..transport.collectives import all_gather_bytes, broadcast_bytes
from .names import Layout, identity_layout
from .part import join, manifest_bytes, part_head, read_part
from .publish import PartStats, ShardPublisher
from .rollout import ApplyStats, _plan, apply_version, group_check, needed_ranks, slice_digests

__all__ = ["ShardCommit", "ShardStreamPublisher", "ShardSyncReport", "held_version", "load_shard_commit",
           "new_attempt", "retain_sharded", "state_fingerprint", "sync_sharded"]

log = logging.getLogger(__name__)

SHARD_COMMIT_FORMAT = "deltarefit.shard_commit"
SHARD_COMMIT_VERSION = 1
_ATTEMPT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def part_key(version: int, attempt: str, rank: int) -> str:
    return f"{vkey(version)}/{attempt}/parts/rank-{rank}"


def head_key(version: int, attempt: str, rank: int) -> str:
    """A rank's descriptor of its part: size, BLAKE3 and the part's head (what the committer joins)."""
    return part_key(version, attempt, rank) + ".head.json"


def _descriptor(key: str, blob: bytes) -> bytes:
    ref = _ref(key, blob)
    return json.dumps({"key": ref.key, "bytes": ref.bytes, "blake3": ref.blake3,
                       "head": base64.b64encode(part_head(blob)).decode()}, sort_keys=True).encode()


def _parse_descriptor(data: bytes, where: str) -> tuple[Part, bytes]:
    try:
        d = json.loads(data)
        ref = Part(str(d["key"]), int(d["bytes"]), str(d["blake3"]))
        head_bytes = base64.b64decode(d["head"], validate=True)
    except (ValueError, KeyError, TypeError) as e:
        raise StreamError(f"{where}: malformed part descriptor ({type(e).__name__})") from None
    return ref, head_bytes


def manifest_key(version: int, attempt: str) -> str:
    return f"{vkey(version)}/{attempt}/manifest.json"


def new_attempt() -> str:
    """A fresh attempt id (the committer picks one per publish and hands it to every rank)."""
    return uuid.uuid4().hex[:16]


def _check_attempt(attempt: str) -> str:
    if not isinstance(attempt, str) or not _ATTEMPT.match(attempt):
        raise UsageError(f"attempt id {attempt!r}: use 1-64 letters, digits, '-' or '_'")
    return attempt


def state_fingerprint(tensors: Mapping[str, Mapping], which: str = "target") -> str | None:
    """The layout-independent identity of a sharded state: BLAKE3 of the sorted (name, dtype, shape,
    additive digest) of every tensor (``which``: the manifest's "target" or "base" digests). None when
    the digests are absent (the base of a keyframe)."""
    items = []
    for n in sorted(tensors):
        t = tensors[n]
        d = t[which]
        if d is None:
            return None
        items.append([n, str(t["dtype"]), [int(x) for x in t["shape"]], str(d)])
    data = json.dumps(items, separators=(",", ":")).encode("utf-8")
    return blake3.blake3(b"deltarefit.shard_state.v1\0" + data).hexdigest()


# --------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ShardCommit(SignableRecord):
    """The commit record of a sharded version (``v/<version>/commit.json``)."""

    version: int
    parent: str | None  # fingerprint of the previous version (None for version 1)
    fingerprint: str  # state_fingerprint of the manifest's target digests
    keyframe: bool
    world: int
    manifest: Part
    parts: tuple[Part, ...]  # rank order
    step: int | None = None
    created: float = 0.0
    publisher: str = ""
    signature: dict[str, str] | None = None  # Ed25519 over signed_bytes(), as plain commit records
    stream: str | None = None  # the stream's identity (None only in records from before identities)

    @property
    def attempt(self) -> str:
        return self.manifest.key.split("/")[2]

    @property
    def part_bytes(self) -> int:
        return sum(p.bytes for p in self.parts)

    def body(self) -> dict:
        return {"format": SHARD_COMMIT_FORMAT, "format_version": SHARD_COMMIT_VERSION, "version": self.version,
                "parent": self.parent, "fingerprint": self.fingerprint, "keyframe": self.keyframe,
                "world": self.world, "manifest": asdict(self.manifest), "parts": [asdict(p) for p in self.parts],
                "step": self.step, "created": self.created, "publisher": self.publisher,
                **({} if self.stream is None else {"stream": self.stream})}

    def same_version(self, other: ShardCommit) -> bool:
        """Same committed content (ignores who/when): a rerun recognises its own commit."""
        return (self.version, self.parent, self.fingerprint, self.keyframe, self.world, self.manifest, self.parts) == (
            other.version, other.parent, other.fingerprint, other.keyframe, other.world, other.manifest, other.parts)


def _ref_of(d, where: str) -> Part:
    if not isinstance(d, dict) or set(d) != {"key", "bytes", "blake3"}:
        raise StreamError(f"{where}: malformed object reference {d!r}")
    p = Part(d["key"], d["bytes"], d["blake3"])
    if (not isinstance(p.key, str) or not isinstance(p.bytes, int) or isinstance(p.bytes, bool) or p.bytes < 0
            or not isinstance(p.blake3, str) or not _HEX64.match(p.blake3)):
        raise StreamError(f"{where}: malformed object reference {d!r}")
    return p


def parse_shard_commit(data: bytes, where: str) -> ShardCommit:
    """Parse and validate a sharded commit record (shape, keys inside its version and one attempt)."""
    d = record_json(data, where)
    if not isinstance(d, dict):
        raise StreamError(f"{where}: commit record is not an object")
    if d.get("format") != SHARD_COMMIT_FORMAT or d.get("format_version") != SHARD_COMMIT_VERSION:
        raise StreamError(f"{where}: not a {SHARD_COMMIT_FORMAT} v{SHARD_COMMIT_VERSION} record (format "
                          f"{d.get('format')!r}: a plain stream is read with deltarefit.stream)")
    try:
        v, world = d["version"], d["world"]
        ok = (isinstance(v, int) and not isinstance(v, bool) and v >= 1 and isinstance(world, int)
              and not isinstance(world, bool) and world >= 1 and isinstance(d["keyframe"], bool)
              and isinstance(d["fingerprint"], str) and _HEX64.match(d["fingerprint"])
              and (d["parent"] is None or (isinstance(d["parent"], str) and _HEX64.match(d["parent"])))
              and (d["step"] is None or isinstance(d["step"], int)) and isinstance(d["parts"], list)
              and isinstance(d["created"], (int, float)) and isinstance(d["publisher"], str))
        if not ok:
            raise StreamError(f"{where}: inconsistent sharded commit record")
        sig = d.get("signature")
        if sig is not None and (not isinstance(sig, dict) or set(sig) != {"alg", "key_id", "sig"}
                                or not all(isinstance(x, str) for x in sig.values())):
            raise StreamError(f"{where}: malformed signature")
        stream = d.get("stream")
        if stream is not None and not (isinstance(stream, str) and STREAM_ID_PATTERN.match(stream)):
            raise StreamError(f"{where}: malformed stream identity")
        rec = ShardCommit(v, d["parent"], d["fingerprint"], d["keyframe"], world, _ref_of(d["manifest"], where),
                          tuple(_ref_of(p, where) for p in d["parts"]), d["step"], float(d["created"]), d["publisher"],
                          sig, stream)
    except KeyError as e:
        raise StreamError(f"{where}: malformed sharded commit record (no {e})") from None
    if len(rec.parts) != rec.world or (rec.version == 1) != (rec.parent is None) or (
            rec.version == 1 and not rec.keyframe):
        raise StreamError(f"{where}: inconsistent sharded commit record (version, parent, world, parts)")
    attempt = rec.manifest.key.split("/")[2] if rec.manifest.key.count("/") >= 2 else ""
    if not _ATTEMPT.match(attempt) or rec.manifest.key != manifest_key(rec.version, attempt) or any(
            p.key != part_key(rec.version, attempt, r) for r, p in enumerate(rec.parts)):
        raise StreamError(f"{where}: parts lie outside the version's attempt directory")
    return rec


def load_shard_commit(store: Store, version: int) -> ShardCommit:
    return load_record(store, version, parse_shard_commit)


def shard_stream_identity(store: Store) -> str | None:
    """The identity of the sharded stream in ``store`` (its version 1's, or the legacy identity derived
    from that record); None without a version 1."""
    if not store.exists(commit_key(1)):
        return None
    first = load_shard_commit(store, 1)
    return first.stream or legacy_identity(first)


def _ref(key: str, data: bytes | memoryview) -> Part:
    return Part(key, len(data), blake3.blake3(data).hexdigest())


def _get_checked(store: Store, ref: Part, what: str) -> bytes:
    """The object ``ref`` names, refused unless it has the record's size and BLAKE3."""
    try:
        data = store.get(ref.key)
    except KeyError:
        raise StreamError(f"{store.url}/{ref.key}: {what} is missing (pruned, or never uploaded)") from None
    if len(data) != ref.bytes or blake3.blake3(data).hexdigest() != ref.blake3:
        raise StreamError(f"{store.url}/{ref.key}: {what} does not match its commit record (size/BLAKE3)")
    return data


def _put_once(store: Store, key: str, data: bytes) -> None:
    """Create ``key``; an existing object must hold the same bytes (an idempotent rerun of this attempt)."""
    if store.create(key, data):
        return
    try:
        old = store.get(key)
    except KeyError:
        old = None
    if old != data:
        raise StreamError(f"{store.url}/{key}: already holds other bytes (an attempt id reused across runs?); "
                          "publish under a fresh attempt id")


def load_manifest(store: Store, rec: ShardCommit) -> dict:
    """The version manifest of a commit, checked against the record (bytes, parts, fingerprints)."""
    where = f"{store.url}/{rec.manifest.key}"
    data = _get_checked(store, rec.manifest, f"manifest of version {rec.version}")
    try:
        man = json.loads(data.decode("utf-8"))
        ok = (isinstance(man, dict) and man.get("format") == "deltarefit.shard_version"
              and man.get("version") == rec.version and man.get("keyframe") == rec.keyframe
              and man.get("world") == rec.world and isinstance(man.get("tensors"), dict)
              and [(p["rank"], p["bytes"], p["blake3"]) for p in man["parts"]]
              == [(r, p.bytes, p.blake3) for r, p in enumerate(rec.parts)])
        fp = state_fingerprint(man["tensors"]) if ok else None
        base = None if not ok or rec.keyframe else state_fingerprint(man["tensors"], "base")
    except (UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError, AttributeError) as e:
        raise StreamError(f"{where}: malformed manifest ({type(e).__name__})") from None
    if not ok:
        raise StreamError(f"{where}: manifest does not describe the committed version {rec.version}")
    if fp != rec.fingerprint or (not rec.keyframe and base != rec.parent):
        raise StreamError(f"{where}: manifest digests do not give the record's fingerprint/parent")
    return man


# --------------------------------------------------------------------------------------- trainer


class ShardStreamPublisher:
    """One trainer rank of a sharded stream (see the module docstring for the protocol).

    ``layout``, ``served``, ``cuts``, ``rank``, ``world``: as ``ShardPublisher``. ``state_dir``: where the
    rank saves its baseline slice and committed version (``rank-<r>.npz``, written atomically after each
    advance); None keeps it in memory only, and a restarted rank rebuilds it from the stream's newest
    keyframe and the committed parts after it. ``group``: a ``torch.distributed`` group of the trainer
    ranks (group rank i = trainer rank i): the attempt id, the part descriptors and the outcome travel
    over it; without one, ``publish`` needs ``attempt`` and the committer polls the store.
    ``committer``: the rank that commits. ``timeout``: seconds to wait for the other ranks' parts (the
    committer) or for the commit record (the others). ``keyframe_every``: version numbers divisible by
    it are keyframes (every cell overwritten; a late rollout rank starts there).
    """

    def __init__(self, store: Store | str, layout: Layout, served: str | Mapping[str, str] = "BF16", *,
                 cuts: Mapping[str, tuple[tuple[int, ...], ...]] | None = None, rank: int = 0, world: int = 1,
                 state_dir: str | None = None, group=None, committer: int = 0, timeout: float = 60.0,
                 poll: float = 0.05, keyframe_every: int = 0, publisher_id: str | None = None,
                 chunk_bytes: int = SEGMENT_BYTES, signing_key: str | None = None) -> None:
        if not 0 <= rank < world or not 0 <= committer < world or timeout <= 0 or keyframe_every < 0:
            raise UsageError("0 <= rank, committer < world, timeout > 0 and keyframe_every >= 0 are required, got "
                             f"rank={rank}, committer={committer}, world={world}, timeout={timeout}, "
                             f"keyframe_every={keyframe_every}")
        self.store = open_store(store) if isinstance(store, str) else store
        self.pub = ShardPublisher(layout, served, cuts=cuts, rank=rank, world=world, chunk_bytes=chunk_bytes)
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
            start = h
            while start > 1 and not load_shard_commit(self.store, start).keyframe:
                start -= 1
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
        return _ref(key, blob)

    def commit_version(self, version: int, attempt: str, *, refs: list[Part] | None = None,
                       step: int | None = None) -> ShardCommit:
        """(The committer.) Join every rank's part of ``version``/``attempt`` and create the commit record.

        ``refs``: the ranks' descriptors when they were gathered (checked against what the store holds);
        None: poll the store until every part exists or ``timeout`` passes (PublishError, no commit).
        Does not advance this rank's baseline (``advance`` does)."""
        if self.rank != self.committer:
            raise UsageError(f"rank {self.rank} is not the committer (rank {self.committer})")
        _check_attempt(attempt)
        if version != self.version + 1:
            raise StreamError(f"committer is at version {self.version}; cannot commit version {version}")
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
                    descs[r] = _parse_descriptor(self.store.get(hk), f"{self.store.url}/{hk}")
                except KeyError:
                    continue
                if descs[r][0].key != k or (refs is not None and refs[r] != descs[r][0]):
                    raise PublishError(f"{self.store.url}/{hk}: rank {r} describes {descs[r][0]}, expected part {k}"
                                       + (f" as reported {refs[r]}" if refs is not None else ""))
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
        ranks_refs = [d[0] for d in descs]
        parts = [read_part(d[1], f"{self.store.url}/{d[0].key}", head_only=True) for d in descs]
        for r, pt in enumerate(parts):
            if pt.version != version or pt.header["rank"] != r or pt.header["world"] != self.world:
                raise PublishError(f"{self.store.url}/{keys[r]}: part of rank {pt.header['rank']}/{pt.header['world']}, "
                                   f"version {pt.version}")
        man = join(parts, [(ref.bytes, ref.blake3) for ref in ranks_refs])  # refuses overlapping or missing cells
        fp = state_fingerprint(man["tensors"])
        parent = self.fingerprint if version > 1 else None
        if not man["keyframe"] and state_fingerprint(man["tensors"], "base") != parent:
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
            from dataclasses import replace

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
        if attempt is None:
            if self.world > 1:
                raise UsageError("without a process group every rank needs the same attempt id: pass attempt= "
                                 "(one per publish and run, e.g. new_attempt() on rank 0, broadcast)")
            attempt = new_attempt()
        self.upload(masters, attempt)
        v = self.version + 1
        rec = self.commit_version(v, attempt, step=step) if self.rank == self.committer else self.wait_commit(v)
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
                refs = [Part(**g["ref"]) for g in got]
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


# --------------------------------------------------------------------------------------- rollout


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


class _Group:
    """Collectives of a rollout TP group (None: a rank on its own)."""

    def __init__(self, group) -> None:
        self.group = group

    def agree(self, ok: bool) -> bool:
        if self.group is None:
            return ok
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(ok)], dtype=torch.int64)
        dist.all_reduce(t, group=self.group, op=dist.ReduceOp.MIN)
        return bool(int(t[0]))

    def same(self, values: list[int]) -> bool:
        if self.group is None:
            return True
        import torch
        import torch.distributed as dist

        t = torch.tensor(values + [-x for x in values], dtype=torch.int64)
        dist.all_reduce(t, group=self.group, op=dist.ReduceOp.MAX)
        n = len(values)
        return all(int(t[i]) == -int(t[n + i]) for i in range(n))

    def check(self, tensors, layout, man: dict, which: str, alt: str | None = None) -> list[str]:
        """Tensors whose group-summed digest is not the manifest's ``which`` (nor ``alt``) digest."""
        if self.group is None:
            return []
        import torch
        import torch.distributed as dist

        from . import digest as D

        names = sorted(man["tensors"])
        mine = slice_digests(tensors, layout, man["tensors"])
        limbs = torch.from_numpy(np.stack([D.to_limbs(mine.get(n, D.ZERO)) for n in names]))
        dist.all_reduce(limbs, group=self.group)
        summed = {n: D.from_limbs(limbs[i].numpy()) for i, n in enumerate(names)}
        bad = group_check(summed, man, which)
        return bad if alt is None else sorted(set(bad) & set(group_check(summed, man, alt)))


def _at_version(man: dict, blobs: Mapping[int, bytes], tensors, layout: Layout) -> bool:
    """Whether every cell of the version meeting this rank's slices is at its target (read-only)."""
    parts = [read_part(b, f"version {man['version']} part {r}") for r, b in sorted(blobs.items())]
    try:
        todo, _ = _plan(parts, tensors, layout, owners_only=False, require_cover=True)
    except (BaseMismatchError, VerificationError, FormatError, UsageError):
        return False
    return not todo


def sync_sharded(store: Store | str, tensors, layout: Layout | None = None, *, state_path: str,
                 to_version: int | None = None, group=None, adopt: bool = True,
                 public_key: str | None = None) -> ShardSyncReport:
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
    """
    t0 = time.perf_counter()
    store = open_store(store) if isinstance(store, str) else store
    verifier = None
    if public_key is not None:
        verifier = Verifier(public_key)
    tensors, _ = _module_tensors(tensors)
    g = _Group(group)
    h = head(store)
    target = h if to_version is None else to_version
    if target < 1 or target > h:
        raise StreamError(f"{store.url}: no committed version {target} (head is {h})")
    cur = held_version(state_path)
    held = (held_state(state_path) or {}).get("stream_id")
    store_ident = shard_stream_identity(store)
    ident = held or store_ident
    if held is not None and store_ident is not None and held != store_ident:
        raise StreamIdentityError(f"{store.url}: holds stream {store_ident}, {state_path} records stream {held} "
                                  "(store wiped and republished, or another run's store?)")
    start = cur[0] if cur else 0
    if not g.same([start, target]):
        raise UsageError("the ranks of the TP group hold different versions or sync to different ones")
    if cur and cur[0] > target:
        raise StreamError(f"{state_path}: holds version {cur[0]}, ahead of {target}")
    if cur and cur[0] == target:
        return ShardSyncReport(start, target, cur[1], "none", 0, seconds=time.perf_counter() - t0)
    fetched = 0
    cache: dict[int, tuple[ShardCommit, dict, dict[int, bytes]]] = {}

    def stage(v: int) -> tuple[ShardCommit, dict, dict[int, bytes]]:
        nonlocal fetched, layout
        if v not in cache:
            rec = load_shard_commit(store, v)
            if verifier is not None:
                check_record_signature(rec.signature, rec.signed_bytes(), verifier, f"{store.url}/{commit_key(v)}")
            check_identity(rec, ident, f"{store.url}/{commit_key(v)}")
            man = load_manifest(store, rec)
            fetched += rec.manifest.bytes
            layout = _layout_for(layout, tensors, man)
            blobs = {r: _get_checked(store, rec.parts[r], f"rank {r} part of version {v}")
                     for r in needed_ranks(man, layout)}
            fetched += sum(len(b) for b in blobs.values())
            cache[v] = (rec, man, blobs)
        return cache[v]

    route = "chain"
    if cur is None:
        first = target
        while first > 1 and not load_shard_commit(store, first).keyframe:
            first -= 1
        route = "keyframe"
        if adopt:  # tensors loaded by another path: find the version they hold, newest first
            found, err = None, None
            try:
                for v in range(target, first - 1, -1):
                    rec, man, blobs = stage(v)
                    if _at_version(man, blobs, tensors, layout):
                        found = rec
                        break
            except DeltaRefitError as e:
                err = e
            if not g.agree(err is None):
                raise err if err is not None else StreamError(f"{store.url}: another rank of the group could not "
                                                              "stage the versions it needs")
            fv = found.version if found is not None else 0
            if g.same([fv]) and found is not None:  # the group adopts only a version every member holds
                record_version(state_path, found.version, found.fingerprint, store.url, stream_id=ident)
                cur, route = (found.version, found.fingerprint), "adopted"
                first = found.version + 1
    else:
        first = cur[0] + 1
    try:
        recs = {v: stage(v)[0] for v in range(first, target + 1)}
        for v, rec in recs.items():  # the chain must link up, starting from what this rank holds
            if cur is None and v == first:
                continue
            parent = recs[v - 1].fingerprint if v - 1 in recs else cur[1]
            if rec.parent != parent:
                raise StreamError(f"{store.url}: version {v} applies to {str(rec.parent)[:16]}…, not to "
                                  f"{str(parent)[:16]}… held at version {v - 1}: broken chain")
        err = None
    except DeltaRefitError as e:
        err = e
    if not g.agree(err is None):
        raise err if err is not None else StreamError(f"{store.url}: another rank of the group refused the route")
    rep = ShardSyncReport(start, cur[0] if cur else 0, cur[1] if cur else None, route, fetched)
    for v in range(first, target + 1):
        rec, man, blobs = cache[v]
        # A kill after apply and before the record leaves tensors at the target: accepted (apply skips them).
        bad = [] if man["keyframe"] else g.check(tensors, layout, man, "base", "target")
        if bad:
            raise BaseMismatchError(f"version {v}: the TP group's base digests differ from the version's for "
                                    f"{len(bad)} tensors (e.g. {bad[0]}): refusing the version, nothing written")
        err = None
        try:
            rep.applied.append(apply_version(man, blobs, tensors, layout))
        except DeltaRefitError as e:
            err = e
        if not g.agree(err is None):
            raise err if err is not None else VerificationError(
                f"version {v}: another rank of the group refused it; this rank's slices hold it, not recorded")
        bad = g.check(tensors, layout, man, "target")
        if bad:
            raise VerificationError(f"version {v}: the TP group's target digests differ for {len(bad)} tensors "
                                    f"(e.g. {bad[0]}); not recorded")
        record_version(state_path, v, rec.fingerprint, store.url, stream_id=ident)
        rep.version, rep.fingerprint = v, rec.fingerprint
        rep.versions_applied.append(v)
    rep.bytes_fetched = fetched
    rep.seconds = time.perf_counter() - t0
    return rep


# ------------------------------------------------------------------------------------- retention


def retain_sharded(store: Store | str, *, keep_from: int | None = None, orphan_grace: float = 3600.0,
                   dry_run: bool = False) -> list[str]:
    """Delete objects of a sharded stream nobody can need; returns the keys deleted.

    Kept: every commit record; the manifest and parts of every version from ``min(keep_from, newest
    keyframe)`` on (``keep_from``: the oldest version a rollout rank still holds; default the head),
    so trainers and late joiners can rebuild from the keyframe and every holder can follow the chain.
    Deleted: older committed objects, and objects of attempts no record names (dead or losing publishes)
    for versions already committed, or, for later versions, once older than ``orphan_grace`` seconds
    (a store without timestamps keeps those: they may be an upload in progress)."""
    store = open_store(store) if isinstance(store, str) else store
    h = head(store)
    recs = {v: load_shard_commit(store, v) for v in list_versions(store)}
    keyframes = [v for v, r in recs.items() if r.keyframe]
    cut = min(h if keep_from is None else keep_from, keyframes[-1] if keyframes else 0)
    referenced = {p.key: v for v, r in recs.items() for p in (r.manifest, *r.parts)}
    mtime = store.mtime if MTIME in store.capabilities else None
    deleted = []
    for key in store.list("v/"):
        parts = key.split("/")
        if len(parts) < 4 or not parts[1].isdigit():
            continue  # commit records
        v = int(parts[1])
        if key in referenced:
            if v < cut:
                deleted.append(key)
        elif v <= h or (mtime is not None and time.time() - mtime(key) > orphan_grace):
            deleted.append(key)
    if not dry_run:
        for key in deleted:
            store.delete(key)
    return deleted
