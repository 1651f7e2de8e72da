"""Encode a delta between two checkpoints: stream chunk by chunk, write the delta file atomically.

Memory beyond the mapped checkpoints is O(threads x chunk). Tensors are visited in sorted name order
and chunks are written in order whatever the thread count, so the same pair always gives the same
bytes, whether the checkpoints are single files or sharded directories.

This module drives an encode (``encode``, ``encode_checkpoints``): it makes the works (``encode.work``),
runs them on the pool (``encode.pipeline``), writes each chunk's record as its result arrives and each
tensor's manifest entry after its last, and reports. ``known_hashes`` and ``additive_digests`` take a
checkpoint's segment hashes and additive digests on the same pool.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..checkpoint.read import Checkpoint, open_checkpoint
from ..codec.chunk import ENCODING_NAMES, HIST_ENCODINGS
from ..errors import UnsupportedVersionError, UsageError
from ..format import RELEASE, VERSION, ZERO_HASH, DeltaWriter, TensorEntry, check_version
from ..history_book import HistoryBook, MovesRecorder
from ..integrity import SEGMENT_BYTES, fingerprint_from_digests, segment_hashes
from ..known import KnownHashes
from .pipeline import _ordered, _pools, default_threads
from .work import PatchWorks, _host_patch_works, _Job, _jobs, _SumMoves, loaded, tensor_meta, uint_view

log = logging.getLogger(__package__)  # "deltarefit.encode", as before the package


@dataclass
class EncodeReport:
    path: str
    base_fingerprint: str
    target_fingerprint: str
    delta_bytes: int
    full_bytes: int  # raw tensor bytes of the target checkpoint
    changed_elements: int
    total_elements: int  # elements of the target checkpoint
    seconds: float
    encodings: dict[str, int] = field(default_factory=dict)  # chunk count per encoding
    # The target's segment hashes (per tensor, the 16-byte hashes concatenated): the next encode's
    # KnownHashes once the target has become the base. O(bytes / 64 Ki).
    target_hashes: dict[str, bytes] = field(default_factory=dict, repr=False)
    base_hashes_known: bool = False  # the base's segment hashes came from KnownHashes, not a hash pass
    # ``sums=True``: the additive digests of the target's tensors (those in both checkpoints), which the
    # next encode takes as its base's (``KnownHashes.sums``) instead of a pass over it.
    target_sums: dict[str, bytes] = field(default_factory=dict, repr=False)
    # With a history book or recorder: this version's moves, for ``HistoryBook.commit``.
    moves: MovesRecorder | None = field(default=None, repr=False)

    @property
    def ratio(self) -> float:
        return self.full_bytes / max(self.delta_bytes, 1)

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / max(self.total_elements, 1)


def known_hashes(path: str, *, threads: int | None = None) -> KnownHashes:
    """Hash every segment of the checkpoint at ``path`` (a full read) into a ``KnownHashes``."""
    with open_checkpoint(path) as ck:
        identity = ck.identity()
        names = list(ck.tensors)
        hashes = _pools.get(threads or default_threads()).map(lambda n: b"".join(segment_hashes(ck.raw(n))), names)
        return KnownHashes(identity, dict(zip(names, hashes, strict=True)))


def encode_checkpoints(
    base: Checkpoint, target: Checkpoint, out: str, *, threads: int | None = None,
    progress: Callable[[int], None] | None = None, patch_works: PatchWorks | None = None,
    base_hashes: Mapping[str, bytes] | None = None, durable: bool = True, sums: bool = False,
    base_sums: Mapping[str, bytes] | None = None, history: HistoryBook | None = None,
    moves: MovesRecorder | None = None, format_version: int = VERSION,
) -> EncodeReport:
    """Write the delta taking ``base`` to ``target`` to ``out``. ``progress`` gets the target's bytes
    scanned (their sum is the target's size).

    ``base_hashes``: the base's segment hashes (``KnownHashes.hashes``), trusted: the caller vouches
    that they are the hashes of the bytes ``base`` holds now (``encode`` checks the files' identity).
    Tensors they cover are not hashed on the base side (with ``patch_works``, those outside them), and
    an unchanged segment not at all. Wrong
    hashes cannot make a rollout accept wrong bytes (the delta's post hashes are the target's own,
    and every apply verifies them), but they would bind the delta to a base it does not fit.
    ``durable=False``: no fsync of ``out`` (see ``DeltaWriter``), for a delta staged for upload.
    ``sums=True``: the entries of tensors in both checkpoints also carry their additive digests
    (``additive_digests``, base and target), so a target that tracks the digest of what it holds (a
    live engine) checks a patch in O(changed elements); it costs a pass over those tensors of ``base``
    (none where ``base_sums`` has them), and the target's are the base's moved by the changes the host
    scan found (with ``patch_works``, a pass over the changed tensors of ``target``). ``base_sums``: the
    base's additive digests where known (``KnownHashes.sums``), trusted as ``base_hashes`` are; wrong
    ones make held-digest applies refuse the delta as one for another base, never accept wrong bytes.

    ``base`` and ``target`` need only ``tensors`` (name -> info with dtype, shape, nbytes) and
    ``raw(name)``; ``patch_works`` replaces the host scan of tensors present in both (the GPU encoder
    scans on the device and hands over compact changes). Tensors are generated lazily, so the scan of
    one tensor overlaps with the entropy coding of the previous ones on the pool.

    ``history``: a ``HistoryBook`` whose tip is ``base``: chunks are also coded against it (encoding 5,
    kept where smaller), and the delta is refused (``UsageError``, nothing kept) if the base turns out
    to be another checkpoint. ``moves``: records this version's moves, for the caller to commit to
    its book once the version is published (with ``history``, it defaults to a fresh recorder,
    returned in the report).

    ``format_version``: the delta's format version (FORMAT.md, "Versions"): 2 (the default) codes sparse
    float and integer chunks with ``ulp2`` (and ``ulp2_hist`` against a history) where smaller; 1 writes
    exactly the bytes version 1 writers wrote, for readers that know only version 1. ``patch_works``
    must code chunks for the same version (a chunk of an encoding the version lacks refuses the delta)."""
    t0 = time.perf_counter()
    fmt = _format_version(format_version)
    threads = threads or default_threads()
    names = sorted(set(base.tensors) | set(target.tensors), key=lambda n: n.encode("utf-8"))
    sum_moves = _SumMoves() if sums and patch_works is None else None
    if history is not None or moves is not None:
        if patch_works is not None:
            raise UsageError("a history book needs the host scan (no patch_works)")
        moves = moves if moves is not None else MovesRecorder()
        works = _host_patch_works(base, target, base_hashes, (history or _NoBook(), moves), sum_moves, fmt)
    else:
        works = patch_works or _host_patch_works(base, target, base_hashes, sums=sum_moves, fmt=fmt)
    if moves is not None:
        for name in names:
            bi, tinfo = base.tensors.get(name), target.tensors.get(name)
            if bi is None or tinfo is None or (bi.dtype, bi.shape) != (tinfo.dtype, tinfo.shape):
                moves.reset(name)
    writer = DeltaWriter(out, durable=durable)
    try:
        jobs = _jobs(base, target, names, works, base_hashes)
        with contextlib.closing(_ordered(_pools.get(threads), jobs, 4 * threads)) as results:
            got = _collect(results, writer, progress)
        entries = got.entries
        target_sums: dict[str, bytes] = {}
        if sums:
            entries = _with_sums(entries, base, target, threads, base_sums or {}, sum_moves)
            target_sums = {e.name: e.target.sum for e in entries if e.target is not None and e.target.sum}
        total_elems = sum(math.prod(t.shape) for t in target.tensors.values())
        full_bytes = sum(t.nbytes for t in target.tensors.values())
        bfp, tfp = fingerprint_from_digests(got.base_digests), fingerprint_from_digests(got.target_digests)
        if history is not None and history.tip not in (None, bfp) and any(got.counts.get(e) for e in HIST_ENCODINGS):
            raise UsageError(f"history book {history.path} describes checkpoint {history.tip}, the base is {bfp}")
        manifest = {
            "format": "deltarefit.delta", "version": fmt, "segment_bytes": SEGMENT_BYTES, "hash": "blake3-128",
            "base_fingerprint": bfp, "target_fingerprint": tfp,
            "tensors": [e.to_json() for e in entries],
            "stats": {"changed_elements": got.changed, "target_elements": total_elems,
                      "target_bytes": full_bytes, "encoder": f"deltarefit {RELEASE}"},
        }
        size = writer.finish(manifest)
    except BaseException:
        writer.abort()
        raise
    dt = time.perf_counter() - t0
    log.info("encoded %s: %d bytes (%.1fx), %.2f%% changed, %.2f s", out, size, full_bytes / max(size, 1),
             100 * got.changed / max(total_elems, 1), dt)
    return EncodeReport(out, bfp, tfp, size, full_bytes, got.changed, total_elems, dt,
                        {ENCODING_NAMES[e]: c for e, c in got.counts.items()}, got.target_hashes,
                        base_hashes is not None and patch_works is None, target_sums, moves)


def _format_version(v: object) -> int:
    """``v`` if it is a format version this build writes (1 or 2), else ``UsageError``."""
    try:
        return check_version(v, "format_version")
    except UnsupportedVersionError as e:
        raise UsageError(f"{e} (asked to write it)") from None


class _NoBook:
    """The history of an empty book: none for every chunk."""

    def history(self, name: str, ci: int, n: int) -> None:
        return None


@dataclass
class _Collected:
    """What the encode loop gathers from the workers' results, in tensor order."""

    entries: list[TensorEntry] = field(default_factory=list)
    base_digests: dict[str, bytes] = field(default_factory=dict)
    target_digests: dict[str, bytes] = field(default_factory=dict)
    target_hashes: dict[str, bytes] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=lambda: dict.fromkeys(ENCODING_NAMES, 0))  # by encoding id
    changed: int = 0


def _collect(results: Iterator[tuple[_Job, int, object]], writer: DeltaWriter,
             progress: Callable[[int], None] | None) -> _Collected:
    """Write each chunk's record as its result arrives, and each tensor's manifest entry after its last."""
    got = _Collected()
    add_chunk = writer.add_chunk
    # The loop runs on the thread that also feeds the workers, once per MiB and once per tensor:
    # it stays lean (a record is one struct.pack; see DeltaWriter.add_chunk).
    for job, k, res in results:
        if k <= 0:
            job.first = writer.n_records
        if k >= 0:
            pre, post, enc = res
            if job.op == "patch":
                job.pre.append(pre)
                job.post.append(post)
                ci = k
            elif k < job.n_base:
                job.pre.append(pre)
                enc = None
            else:
                job.post.append(post)
                ci = k - job.n_base
                pre = ZERO_HASH
            if enc is not None:
                add_chunk(job.ti, ci, enc.encoding, enc.n_changed, enc.payload, enc.decoded_len, pre, post)
                got.counts[enc.encoding] += 1
                job.changed += enc.n_changed
            if progress:  # the target's bytes behind this result (their sum: the target's size)
                tk = k if job.op == "patch" else k - job.n_base
                if tk >= 0 and job.target is not None:
                    progress(min(SEGMENT_BYTES, job.target.nbytes - tk * SEGMENT_BYTES))
            if k != len(job.works) - 1:
                continue
        _finish_entry(got, writer, job)
    return got


def _finish_entry(got: _Collected, writer: DeltaWriter, job: _Job) -> None:
    """A job's last result is in: its manifest entry, and its digests."""
    bmeta = tensor_meta(job.base, job.pre) if job.base is not None else None
    tmeta = tensor_meta(job.target, job.post) if job.target is not None else None
    count = writer.n_records - job.first
    if bmeta:
        got.base_digests[job.name] = bmeta.digest
    if tmeta:
        got.target_digests[job.name] = tmeta.digest
        got.target_hashes[job.name] = b"".join(job.post)
    got.entries.append(TensorEntry(job.name, "same" if job.op == "patch" and count == 0 else job.op, bmeta, tmeta,
                                   job.changed, job.first, count))
    got.changed += job.changed
    job.works = []  # drop the views


def _with_sums(entries: list[TensorEntry], base: Checkpoint, target: Checkpoint, threads: int,
               known: Mapping[str, bytes], moved: _SumMoves | None = None) -> list[TensorEntry]:
    """The entries with their additive digests: the base's known or taken by a pass over it; the
    target's, of a patched tensor, the base's moved by its changes where the scan recorded them, else
    by a pass over the target."""
    kept = [e for e in entries if e.op in ("same", "patch")]
    todo = [e.name for e in kept if e.name not in known]
    patched = [e.name for e in kept if e.op == "patch"]
    passes = [n for n in patched if moved is None or n not in moved.moved]
    got = additive_digests([(base, n) for n in todo] + [(target, n) for n in passes], threads=threads)
    bsum = {**{e.name: known[e.name] for e in kept if e.name in known}, **dict(zip(todo, got, strict=False))}
    tsum = dict(zip(passes, got[len(todo):], strict=True))
    tsum.update({n: moved.target_sum(n, bsum[n]) for n in patched if n not in tsum})
    return [replace(e, base=replace(e.base, sum=bsum[e.name]),
                    target=replace(e.target, sum=tsum.get(e.name, bsum[e.name]))) if e.name in bsum else e
            for e in entries]


def additive_digests(tensors: list[tuple[Checkpoint, str]], *, threads: int | None = None) -> list[bytes]:
    """The additive digest (``integrity.additive``, 16 bytes) of each (checkpoint, tensor name), one
    segment per pool task."""
    from ..integrity import additive

    items = []
    for k, (ck, name) in enumerate(tensors):
        info = ck.tensors[name]
        seed = additive.seeds(name, info.dtype, info.shape)
        u = uint_view(loaded(ck.raw(name)), info.dtype)  # a lazy target's whole tensor: the rare pass
        per = SEGMENT_BYTES // u.itemsize
        items += [(k, seed, a, u[a:a + per]) for a in range(0, u.size, per)]
    parts = _pools.get(threads or default_threads()).map(lambda it: additive.partial_run(it[1], it[2], it[3]), items)
    acc = [additive.ZERO.copy() for _ in tensors]
    for (k, *_), p in zip(items, parts, strict=True):
        acc[k] = additive.add(acc[k], p)
    return [np.asarray(a, "<u8").tobytes() for a in acc]


def encode(base: str, target: str | Any, out: str, *, threads: int | None = None,
           progress: Callable[[int], None] | None = None, known_base: KnownHashes | None = None,
           durable: bool = True, sums: bool = False, history: HistoryBook | None = None,
           format_version: int = VERSION) -> EncodeReport:
    """Encode the delta from checkpoint ``base`` to checkpoint ``target`` into the file ``out``.
    ``history``: code against this book's history of ``base`` too (``encode_checkpoints``); the
    report's ``moves`` then go to ``history.commit`` once the delta is delivered.
    ``known_base``: the base's segment hashes, used only while the opened base files still have the
    identity they were taken with (otherwise the base is hashed as usual). ``durable=False``: no fsync
    of ``out``, for a delta staged for upload (the store makes its own copy durable). ``target`` may also
    be an object with the ``Checkpoint`` surface ``encode_checkpoints`` reads (``stream.served.ServedTensors``:
    a trainer's weights in memory), used as it is. ``format_version``: 2 (default) or 1 (``encode_checkpoints``)."""
    _format_version(format_version)  # refused before anything is opened
    opened = open_checkpoint(target) if isinstance(target, (str, os.PathLike)) else contextlib.nullcontext(target)
    with open_checkpoint(base) as b, opened as t:
        same = known_base is not None and known_base.identity == b.identity()
        known = known_base.hashes if same else None
        if known_base is not None and known is None:
            log.info("%s: its files changed since its hashes were taken; hashing it again", base)
        return encode_checkpoints(b, t, out, threads=threads, progress=progress, base_hashes=known,
                                  durable=durable, sums=sums, base_sums=known_base.sums if same else None,
                                  history=history, format_version=format_version)


