"""Inside a cluster: broadcast a version's parts over a torch.distributed process group.

One rank (``src``) reads the stream's store; every rank of the group gets the commit records and the
encoded parts it needs by ``broadcast`` (gloo on CPU, NCCL on GPU), and applies them to its own state:
a checkpoint on its local disk, or a dict of tensors / a module in its memory. Only encoded bytes cross
the fabric, once per rank, and no rank holds more than one broadcast chunk of a part in memory.

Protocol (every rank calls ``broadcast_sync`` with the same ``src`` and ``chunk_bytes``):

1. all ranks ``all_gather`` what they hold: a version number (or -1) and its fingerprint, as fixed-size
   byte tensors (nothing pickled crosses ranks);
2. ``src`` broadcasts a header (status, length) and a JSON manifest: the commit records from the
   oldest version any rank needs up to the target, and the parts to send (the deltas; the newest
   keyframe's files when a rank holds nothing). A failure on ``src`` travels in the header, so every
   rank raises the same error instead of hanging in the next collective;
3. each part travels in chunks of ``chunk_bytes``; every rank writes it to a local mirror of the stream
   and checks its size and BLAKE3 against the record before anything is applied;
4. each rank applies what it lacks (a checkpoint through the stream subscriber, with its routing,
   crash safety and verified fingerprints; tensors through ``apply_to_tensors``), then all ranks
   ``all_reduce`` a failure flag and ``all_gather`` their fingerprints: a rank that failed, or that
   ended anywhere but the target, fails the call on every rank.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass

import blake3
import numpy as np

from ..codec.history import DEPTH as HISTORY_DEPTH
from ..errors import BroadcastError, DeltaRefitError, UsageError
from ..io.fsutil import fsync_dir
from ..storage.base import PATH_OF, Store, open_store
from ..storage.local import LocalStore
from ..stream.chain import newest_keyframe, sync_target
from ..stream.records import CommitRecord, Part, StreamError, commit_key, head, load_commit, parse_commit
from .collectives import broadcast_bytes

FP_BYTES = 256  # a fingerprint's hex (64 chars), or a failure's line (``_brief``); padded with NUL
DEFAULT_CHUNK = 16 << 20


@dataclass
class BroadcastReport:
    rank: int
    from_version: int | None
    version: int
    fingerprint: str
    bytes_received: int
    versions_applied: list[int]
    seconds: float


def _dist():
    import torch
    import torch.distributed as dist

    return torch, dist


def _encode_fp(version: int | None, fp: str | None):
    torch, _ = _dist()
    buf = np.zeros(8 + FP_BYTES, dtype=np.uint8)
    buf[:8] = np.frombuffer(np.int64(-1 if version is None else version).tobytes(), dtype=np.uint8)
    raw = (fp or "").encode()[:FP_BYTES]
    buf[8:8 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return torch.from_numpy(buf)


def _decode_fp(t) -> tuple[int | None, str]:
    b = t.cpu().numpy().tobytes()
    v = int(np.frombuffer(b[:8], dtype=np.int64)[0])
    return (None if v < 0 else v), b[8:].rstrip(b"\0").decode(errors="replace")


def _brief(line: str, limit: int = FP_BYTES) -> str:
    """``line`` in at most ``limit`` bytes of UTF-8: its start and its end (where the reason is, after
    the path that names the place), joined by "..."."""
    raw = line.encode()
    if len(raw) <= limit:
        return line
    head = raw[:limit // 4].decode(errors="ignore")
    tail = raw[-(limit - len(head.encode()) - 3):].decode(errors="ignore")
    return f"{head}...{tail}"


def _all_gather_bytes(t, group, device):
    torch, dist = _dist()
    t = t.to(device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return out


def _bcast_blob(data: bytes | None, status: int, group, src: int, device) -> tuple[int, bytes]:
    """Broadcast (status, bytes) from ``src``; returns them on every rank."""
    got = broadcast_bytes(bytes([status]) + data if data is not None else None, src, group, device)
    return got[0], got[1:]


def _plan(store: Store, held: list[int | None], to_version: int | None) -> tuple[list[CommitRecord], list[Part]]:
    """Records from the oldest version any rank needs to the target, and the parts to send. The records
    of the versions the ranks hold, and of the two before each, go too where the store still has them:
    a subscriber following a history stream checks its book against that lineage (``stream.history``)."""
    target = sync_target(store.url, head(store), to_version)
    for v in held:
        if v is not None and v > target:
            raise StreamError(f"a rank holds version {v}, ahead of {target}")
    first = min((v + 1 for v in held if v is not None), default=target + 1)
    kf = None
    if any(v is None for v in held):  # a rank with nothing starts from the newest keyframe
        kf = newest_keyframe(lambda v: load_commit(store, v), target)
        first = min(first, kf)
    recs = [load_commit(store, v) for v in range(first, target + 1)]
    lineage = {v - k for v in held if v is not None for k in range(HISTORY_DEPTH) if 1 <= v - k < first}
    older = []
    for v in sorted(lineage):
        try:
            older.append(load_commit(store, v))
        except StreamError:  # retired from the store: that subscriber's book then starts over (a route)
            continue
    recs = older + recs
    # Deltas after the oldest version a rank holds (or after the keyframe, for ranks holding nothing).
    after = min([v for v in held if v is not None] + ([kf] if kf is not None else []))
    parts: list[Part] = []
    for r in recs:
        if r.version == kf:
            parts += [p for _, p in r.keyframe]
        if r.version > after and r.delta is not None:
            parts.append(r.delta)
    return recs, list({p.key: p for p in parts}.values())


def _send_part(store: Store, part: Part, group, src: int, rank: int, mirror: str, chunk: int, device) -> int:
    """Stream one part from ``src`` to every rank's mirror; checked against its record on every rank."""
    torch, dist = _dist()
    dest = LocalStore(mirror).path_of(part.key)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = dest + ".partial"
    src_file = None
    if rank == src:
        # a local store: read its file, no copy
        path = store.path_of(part.key) if PATH_OF in store.capabilities else None
        if path is None or not os.path.exists(path):
            store.get_to(part.key, tmp)  # an object store: download once on src, then broadcast
            path = tmp
        src_file = open(path, "rb")
    h = blake3.blake3()
    buf = torch.empty(min(chunk, max(part.bytes, 1)), dtype=torch.uint8, device=device)
    try:
        with open(tmp + ".rx" if rank == src else tmp, "wb") as out:
            for off in range(0, part.bytes, chunk):
                n = min(chunk, part.bytes - off)
                view = buf[:n]
                if src_file is not None:
                    data = src_file.read(n)
                    if len(data) != n:
                        raise StreamError(f"{store.url}/{part.key}: part is shorter than its record")
                    view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                dist.broadcast(view, src, group=group)
                host = view.cpu().numpy()
                h.update(host)
                out.write(host.tobytes())
    finally:
        if src_file is not None:
            src_file.close()
    if rank == src:
        os.replace(tmp + ".rx", tmp)
    if os.path.getsize(tmp) != part.bytes or h.hexdigest() != part.blake3:
        raise StreamError(f"rank {rank}: part {part.key} does not match its commit record (size or BLAKE3)")
    os.replace(tmp, dest)
    return part.bytes


def broadcast_sync(group=None, *, src: int = 0, store: Store | str | None = None, checkpoint: str | None = None,
                   tensors: dict | None = None, held: tuple[int, str] | None = None, to_version: int | None = None,
                   mirror: str, chunk_bytes: int = DEFAULT_CHUNK, device: str = "cpu",
                   threads: int | None = None, history=None) -> BroadcastReport:
    """Bring every rank of ``group`` to version ``to_version`` (default: the head of ``store`` on ``src``).

    Every rank passes exactly one target: ``checkpoint`` (a path; its version is kept beside it as with
    ``deltarefit sync``) or ``tensors`` (a dict of CPU tensors updated in place; ``held`` says which
    version it holds). Only ``src`` needs ``store``. ``mirror`` is a local directory for received parts.
    ``device`` is where broadcast buffers live: ``"cpu"`` for gloo, ``"cuda"`` for NCCL.
    ``history`` (``tensors`` targets): the tensors' history book, a ``HistoryBook`` or its directory,
    whose tip is the held version. A delta's ``ulp_hist`` chunks decode against it, and it advances with
    each version verified; without one, such a delta is refused by name (a ``checkpoint`` keeps its book
    beside it, as ``deltarefit sync`` does).
    Raises ``BroadcastError`` on every rank when any rank fails.
    """
    _, dist = _dist()
    t0 = time.perf_counter()
    rank = dist.get_rank(group)
    if (checkpoint is None) == (tensors is None):
        raise UsageError("broadcast_sync: give exactly one of checkpoint= or tensors=")
    if history is not None and tensors is None:
        raise UsageError("broadcast_sync: history= is the book of tensors= (a checkpoint keeps its own beside it)")
    if isinstance(history, (str, os.PathLike)):
        from ..history_book import HistoryBook

        history = HistoryBook(history)
    from ..stream.subscriber import Subscriber

    os.makedirs(mirror, exist_ok=True)
    mstore = LocalStore(mirror)
    sub = None
    if checkpoint is not None:
        sub = Subscriber(mstore, checkpoint, threads=threads)
        held = sub.current()
    mine = held
    gathered = [_decode_fp(t) for t in _all_gather_bytes(_encode_fp(*(mine or (None, None))), group, device)]
    st, recs, keys, by_key = _share_plan(store, [v for v, _ in gathered], to_version, group, src, rank, device)
    received, failure = _mirror_parts(st, keys, by_key, recs, mstore, mirror, group, src, rank, chunk_bytes,
                                      device)
    target = recs[-1] if recs else None
    applied: list[int] = []
    version, fp = mine if mine else (None, "")
    if not failure and target is not None and (mine is None or mine[0] < target.version):
        try:
            if sub is not None:
                rep = sub.sync(to_version=target.version)
                applied, version, fp = rep.versions_applied, rep.version, rep.fingerprint
            else:
                version, fp, applied = _apply_tensors(mstore, recs, mine, tensors, threads, history)
        except DeltaRefitError as e:
            failure = f"rank {rank}: {e}"
    _fail_together(failure, version, fp, target, group, device)
    shutil.rmtree(os.path.join(mirror, "v"), ignore_errors=True)  # parts are applied: the mirror is scratch
    return BroadcastReport(rank, mine[0] if mine else None, version if version is not None else 0, fp, received,
                           applied, time.perf_counter() - t0)


def _share_plan(store: Store | str | None, held: list[int | None], to_version: int | None, group, src: int,
                rank: int, device) -> tuple[Store | None, list[CommitRecord], list[str], dict[str, Part]]:
    """Step 2: ``src`` plans from its store and broadcasts the manifest, or its failure (raised on every
    rank). Returns the store (on ``src``; None elsewhere), the records, the keys of the parts to send,
    and every part the records name, by key."""
    st = None
    status, manifest = 0, None
    if rank == src:
        try:
            if store is None:
                raise UsageError("broadcast_sync: the src rank needs store=")
            st = open_store(store) if isinstance(store, str) else store
            recs, parts = _plan(st, held, to_version)
            manifest = json.dumps({"records": [json.loads(r.to_bytes()) for r in recs],
                                   "parts": [p.key for p in parts]}).encode()
        except DeltaRefitError as e:
            status, manifest = 1, f"rank {src}: {e}".encode()
    status, blob = _bcast_blob(manifest, status, group, src, device)
    if status:
        raise BroadcastError(blob.decode())
    m = json.loads(blob)
    recs = [parse_commit(json.dumps(r).encode(), f"broadcast record from rank {src}") for r in m["records"]]
    by_key = {p.key: p for r in recs for p in [r.delta, r.catchup, *(p for _, p in r.keyframe)] if p is not None}
    return st, recs, m["parts"], by_key


def _mirror_parts(st: Store | None, keys: list[str], by_key: dict[str, Part], recs: list[CommitRecord],
                  mstore: LocalStore, mirror: str, group, src: int, rank: int, chunk_bytes: int,
                  device) -> tuple[int, str]:
    """Step 3: every part into this rank's mirror, then the records, so the mirror is a consistent
    stream. Returns the bytes received and this rank's failure ("" when none): it is not raised here,
    so that every rank still reaches the collectives that fail them together."""
    received = 0
    try:
        for key in keys:
            received += _send_part(st, by_key[key], group, src, rank, mirror, chunk_bytes, device)
        for r in recs:  # records after their parts, as in any store: the mirror is a consistent stream
            mstore.put(commit_key(r.version), r.to_bytes())
        fsync_dir(mirror)
    except (DeltaRefitError, OSError) as e:
        return received, f"rank {rank}: {e}"
    return received, ""


def _fail_together(failure: str, version: int | None, fp: str, target: CommitRecord | None, group,
                   device) -> None:
    """Step 4's end: all ranks reduce a failure flag and gather their end states; raises
    ``BroadcastError`` on every rank if any rank failed or ended anywhere but ``target``."""
    torch, dist = _dist()
    flag = torch.tensor([1 if failure else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, group=group)
    ends = [_decode_fp(t) for t in _all_gather_bytes(_encode_fp(version, fp if not failure else _brief(failure)),
                                                     group, device)]
    if int(flag.item()):
        raise BroadcastError(failure or "; ".join(f"rank {i}: {e[1]}" for i, e in enumerate(ends)
                                                  if e[1] != (target.fingerprint if target else e[1]))
                             or "another rank failed")
    if target is not None and any(e != (target.version, target.fingerprint) for e in ends):
        bad = [i for i, e in enumerate(ends) if e != (target.version, target.fingerprint)]
        raise BroadcastError(f"ranks {bad} did not end at version {target.version} ({target.fingerprint[:16]}…)")


def _apply_tensors(mstore: Store, recs: list[CommitRecord], mine, tensors: dict, threads, history):
    from ..apply.tensors import apply_to_tensors

    if mine is None:
        raise UsageError("broadcast_sync: a tensors= target must say which version it holds (held=)")
    version, fp, applied = mine[0], mine[1], []
    if history is not None and history.tip not in (None, fp):
        raise StreamError(f"the history book given describes {history.tip[:16]}…, the tensors hold version "
                          f"{version} ({fp[:16]}…)")
    for r in recs:
        if r.version <= version:
            continue
        if r.delta is None or r.parent != fp:
            raise StreamError(f"version {r.version} does not apply to the held version {version} ({fp[:16]}…)")
        rep = apply_to_tensors(mstore.path_of(r.delta.key), tensors, threads=threads, history=history)
        if rep.target_fingerprint != r.fingerprint:
            raise StreamError(f"after version {r.version}: fingerprint {rep.target_fingerprint[:16]}…, "
                              f"the record says {r.fingerprint[:16]}…")
        version, fp = r.version, r.fingerprint
        applied.append(version)
    return version, fp, applied
