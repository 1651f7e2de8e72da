"""The work of an encode, tensor by tensor: per segment of each tensor, a callable (``Work``) that hashes it
and codes its change, and per tensor the ``_Job`` that holds them in order (``_jobs``).

A tensor in both checkpoints with the same dtype and shape is patched segment by segment
(``_host_patch_works``, or the GPU encoder's ``patch_works``); one added, removed or re-typed has its
base segments hashed (or their hashes known) and its target segments overwritten. Works only compute:
``encode.pipeline`` runs them on the pool, ``encode.encoder`` writes their results in order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from ..checkpoint.read import Checkpoint, TensorInfo
from ..codec.chunk import EncodedChunk, encode_overwrite, encode_raw, encode_with_changes, encode_with_moves
from ..codec.chunk import uint_view as chunk_uint_view
from ..dtypes import dtype
from ..errors import UsageError
from ..format import ZERO_HASH, TensorMeta
from ..history_book import HistoryBook, MovesRecorder
from ..integrity import SEG_HASH_BYTES, SEGMENT_BYTES, n_segments, seg_hash, tensor_digest_from_segments


def uint_view(raw: np.ndarray, dt_name: str) -> np.ndarray:
    """View raw bytes as unsigned integers of the dtype's width (copying only if misaligned)."""
    return chunk_uint_view(raw, dtype(dt_name))


def _segments(nbytes: int) -> Iterator[tuple[int, int]]:
    yield from enumerate(range(0, nbytes, SEGMENT_BYTES))


# A work item returns (pre_hash, post_hash, encoded chunk or None).
Work = Callable[[], tuple[bytes, bytes, EncodedChunk | None]]


class _SumMoves:
    """How each patched tensor's additive digest moves, chunk by chunk, as the host scan finds its
    changes: the target's digest is then the base's moved by them (``integrity.additive`` is additive), in
    O(changed elements), instead of a pass over the target. A tensor is listed once its jobs are made,
    so a listed tensor's every changed chunk adds its move (from the pool's threads)."""

    def __init__(self) -> None:
        self.moved: dict[str, list[np.ndarray]] = {}

    def start(self, name: str, dt_name: str, shape: tuple[int, ...]) -> tuple[_SumMoves, str, np.ndarray]:
        from ..integrity import additive

        self.moved[name] = []
        return self, name, additive.seeds(name, dt_name, shape)

    def add(self, name: str, seed: np.ndarray, start: int, bu: np.ndarray, pos: np.ndarray,
            new: np.ndarray) -> None:
        from ..integrity import additive

        self.moved[name].append(additive.move(seed, start, bu, pos.astype(np.int64), new))

    def target_sum(self, name: str, base_sum: bytes) -> bytes:
        from ..integrity import additive

        total = np.frombuffer(base_sum, "<u8").astype(np.uint64)
        for m in self.moved[name]:
            total = additive.add(total, m)
        return np.asarray(total, "<u8").tobytes()


def loaded(x):
    """A segment as an array: one a target hands over lazily (``stream.served``: converted, or copied off
    a device, on first use, so a tensor's served bytes never all sit on the host at once) loaded now."""
    load = getattr(x, "load", None)
    return x if load is None else load()


def _patch_work(dt_name: str, b: np.ndarray, t: np.ndarray, known_pre: bytes | None = None,
                hist: tuple[HistoryBook, MovesRecorder, str, int] | None = None,
                sums: tuple[_SumMoves, str, np.ndarray, int] | None = None, fmt: int = 2) -> Work:
    """One segment of a tensor in both checkpoints; ``known_pre``: the base segment's hash, if known;
    ``hist``: (book, recorder, tensor name, chunk index) to code against the book's history of the
    segment and record its moves; ``sums``: (recorder, tensor name, digest seed, the segment's first
    flat index) to record how the segment's changes move the tensor's additive digest; ``fmt``: the
    delta's format version (1: encodings 1-5 only, as version 1 writers coded; 2: the ``ulp2`` family)."""
    dt = dtype(dt_name)
    t_in = t

    def run() -> tuple[bytes, bytes, EncodedChunk | None]:
        # The scan goes first: it is compute-bound, so it hides the reads of the two segments from main
        # memory, and the hashes after it read them from cache (scan then hash took 31 ms on the real
        # 3.5% pair where hash then scan took 36, one thread). A segment with no change is hashed once,
        # or not at all when its base hash is known.
        t = loaded(t_in)
        if hist is None and sums is None:
            enc = encode_raw(dt, b, t, fmt=fmt)
        else:
            bu, tu = uint_view(b, dt_name), uint_view(t, dt_name)
            seen = None if sums is None else (lambda pos, _old, new: sums[0].add(*sums[1:], bu, pos, new))
            if hist is None:
                enc, pos, old, new = encode_with_changes(dt, bu, tu, fmt=fmt)
                if enc is not None and seen is not None:
                    seen(pos, old, new)
            else:
                book, rec, name, ci = hist
                enc, moves = encode_with_moves(dt, bu, tu, book.history(name, ci, bu.size), seen, fmt=fmt)
                rec.add(name, ci, moves)
        pre = seg_hash(b) if known_pre is None else known_pre
        return pre, pre if enc is None else seg_hash(t), enc

    return run


def _overwrite_work(dt_name: str, t_in: np.ndarray) -> Work:
    def run() -> tuple[bytes, bytes, EncodedChunk | None]:
        t = loaded(t_in)
        return ZERO_HASH, seg_hash(t), encode_overwrite(uint_view(t, dt_name))

    return run


def _known_work(h: bytes) -> Work:
    def run() -> tuple[bytes, bytes, EncodedChunk | None]:
        return h, h, None

    return run


def _hash_work(b: np.ndarray) -> Work:
    def run() -> tuple[bytes, bytes, EncodedChunk | None]:
        h = seg_hash(b)
        return h, h, None

    return run


def tensor_meta(info: TensorInfo, segs: list[bytes]) -> TensorMeta:
    """A tensor's manifest entry (dtype, shape, digest) from its segment hashes."""
    return TensorMeta(info.dtype, info.shape, tensor_digest_from_segments(info.dtype, info.shape, info.nbytes, segs))


@dataclass
class _Job:
    """One tensor's share of the work; results arrive in order and are folded in by ``_fold``."""

    ti: int
    name: str
    op: str
    base: TensorInfo | None
    target: TensorInfo | None
    works: list[Work]
    n_base: int = 0  # for add/remove/replace: how many leading works hash base segments
    pre: list[bytes] = field(default_factory=list)
    post: list[bytes] = field(default_factory=list)
    changed: int = 0
    first: int = 0


# Per tensor present in both checkpoints with the same dtype and shape: one work item per segment.
PatchWorks = Callable[[str, TensorInfo, TensorInfo], list[Work]]


def _known_segments(known: Mapping[str, bytes] | None, name: str, info: TensorInfo) -> list[bytes] | None:
    segs = known.get(name) if known is not None else None
    if segs is None:
        return None
    n = n_segments(info.nbytes)
    if len(segs) != n * SEG_HASH_BYTES:
        raise UsageError(f"known base hashes of tensor {name!r}: {len(segs) / SEG_HASH_BYTES:g} segments, the base "
                         f"holds {n}")
    return [segs[i:i + SEG_HASH_BYTES] for i in range(0, len(segs), SEG_HASH_BYTES)]


def _host_patch_works(base: Checkpoint, target: Checkpoint, known: Mapping[str, bytes] | None,
                      hist: tuple[HistoryBook, MovesRecorder] | None = None,
                      sums: _SumMoves | None = None, fmt: int = 2) -> PatchWorks:
    def works(name: str, bi: TensorInfo, tinfo: TensorInfo) -> list[Work]:
        braw, traw = base.raw(name), target.raw(name)
        pre = _known_segments(known, name, bi)
        per = SEGMENT_BYTES // dtype(bi.dtype).itemsize
        s = None if sums is None else sums.start(name, bi.dtype, bi.shape)
        return [_patch_work(bi.dtype, braw[o:o + SEGMENT_BYTES], traw[o:o + SEGMENT_BYTES],
                            None if pre is None else pre[ci], None if hist is None else (*hist, name, ci),
                            None if s is None else (*s, ci * per), fmt)
                for ci, o in _segments(bi.nbytes)]

    return works


def _jobs(base: Checkpoint, target: Checkpoint, names: list[str], patch_works: PatchWorks,
          known: Mapping[str, bytes] | None = None) -> Iterator[_Job]:
    for ti, name in enumerate(names):
        bi, tinfo = base.tensors.get(name), target.tensors.get(name)
        if bi is not None and tinfo is not None and (bi.dtype, bi.shape) == (tinfo.dtype, tinfo.shape):
            yield _Job(ti, name, "patch", bi, tinfo, patch_works(name, bi, tinfo))
            continue
        op = "replace" if bi is not None and tinfo is not None else "add" if tinfo is not None else "remove"
        works = []
        if bi is not None:
            pre = _known_segments(known, name, bi)
            if pre is not None:
                works += [_known_work(h) for h in pre]
            else:
                braw = base.raw(name)
                works += [_hash_work(braw[o:o + SEGMENT_BYTES]) for _, o in _segments(bi.nbytes)]
        n_base = len(works)
        if tinfo is not None:
            traw = target.raw(name)
            works += [_overwrite_work(tinfo.dtype, traw[o:o + SEGMENT_BYTES]) for _, o in _segments(tinfo.nbytes)]
        yield _Job(ti, name, op, bi, tinfo, works, n_base)
