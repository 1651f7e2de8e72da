"""The host's region operations of the one apply protocol (``protocol``): what the applier does with a
segment held in host memory (decode a chunk against it, build and hash its post-image, move its additive
digest)."""

from __future__ import annotations

import functools

import numpy as np

from ..codec import elements
from ..codec.chunk import HIST_ENCODINGS, Patch, decode_chunk, decode_new, scratch_array
from ..dtypes import dtype
from ..encode import uint_view
from ..format import ChunkRecord, DeltaReader, TensorEntry
from ..history_book import HistoryBook
from ..integrity import SEGMENT_BYTES, seg_hash
from .targets import RawSegments, SegmentTarget, TensorTarget, segments_of  # noqa: F401 (the old path deltarefit.regions had them)


def _where(e: TensorEntry, r: ChunkRecord | None = None) -> str:
    return f"tensor {e.name!r}" + (f" chunk {r.chunk_index}" if r is not None else "")


def _decode(delta: DeltaReader, e: TensorEntry, r: ChunkRecord, base_seg: np.ndarray | None,
            history: HistoryBook | None = None, *, digest: bool = False) -> Patch:
    """Decode a chunk against its base segment, or (``base_seg`` None) a chunk of a new tensor. An
    ``ulp_hist`` chunk takes its history from ``history`` (refused without one, or with another).
    ``digest``: the decoder also takes the move of the tensor's additive digest in its pass where it can
    (``Patch.moved``; ``_moved_by`` falls back to a pass of its own)."""
    where = f"{delta.path}: {_where(e, r)}"
    payload = delta.read_payload(r, _where(e, r))
    if base_seg is None:
        dt = dtype(e.target.dtype)
        n = min(SEGMENT_BYTES, e.target.nbytes - r.chunk_index * SEGMENT_BYTES) // dt.itemsize
        return Patch(None, None, decode_new(dt, n, r.encoding, payload, where))
    hist = None
    if r.encoding in HIST_ENCODINGS and history is not None:
        hist = history.history(e.name, r.chunk_index, base_seg.size)
    dg = None
    if digest:
        start, seed = _digest_at(e, r, base_seg.itemsize)
        dg = (start, int(seed[0]), int(seed[1]))
    return decode_chunk(dtype(e.base.dtype), base_seg, r.encoding, payload, r.n_changed, r.decoded_len, where, hist,
                        digest=dg)


def held_decode(decode):
    """The decode a held-digest plan calls: ``decode`` (``_decode``, or a partial of it) asking the decoder
    to take the digest's move in its pass (``digest=True``); a target's own region decode as it is (its
    chunks' moves are taken after, ``_moved_by``)."""
    base = decode.func if isinstance(decode, functools.partial) else decode
    return functools.partial(decode, digest=True) if base is _decode else decode


def _changes(patch: Patch, view: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions, target bits) of the elements ``patch`` changes in ``view`` (a dense patch: where
    it differs)."""
    if patch.dense is not None:
        pos = np.flatnonzero(patch.dense != view)
        return pos, patch.dense[pos]
    return patch.positions, patch.values


def _patched_copy(view: np.ndarray, patch: Patch) -> np.ndarray:
    """``view`` with ``patch`` applied, in this thread's scratch buffer (not a write to any target)."""
    img = scratch_array("post-image", view.size, view.dtype)
    if patch.dense is not None:
        img[:] = patch.dense
        return img
    img[:] = view
    if patch.positions is not None and patch.positions.size:
        elements.put(img, patch.positions, patch.values)
    return img


def _moved(e: TensorEntry, r: ChunkRecord, view: np.ndarray, pos: np.ndarray, new: np.ndarray) -> np.ndarray:
    """How chunk ``r``'s changes (``pos`` in it, from ``view[pos]`` to ``new``) move tensor ``e``'s
    additive digest."""
    from ..integrity import additive

    start, seed = _digest_at(e, r, view.itemsize)
    return additive.move(seed, start, view, pos, new)


def _digest_at(e: TensorEntry, r: ChunkRecord, itemsize: int) -> tuple[int, np.ndarray]:
    """(chunk ``r``'s first element index in tensor ``e``, ``e``'s additive-digest seeds)."""
    from ..integrity import additive

    return r.chunk_index * (SEGMENT_BYTES // itemsize), additive.seeds(e.name, e.base.dtype, e.base.shape)


def _moved_by(e: TensorEntry, r: ChunkRecord, view: np.ndarray, patch: Patch, pos: np.ndarray,
              new: np.ndarray) -> np.ndarray:
    """``_moved`` of a chunk's changes ``(pos, new)``, decoded as ``patch`` against ``view``: the move its
    decoder took in its pass where it did (``Patch.moved``), else a pass over them."""
    if patch.moved is not None:
        return patch.moved
    return _moved(e, r, view, pos, new)


def _post_image(seg: np.ndarray, patch: Patch) -> np.ndarray:
    img = seg.copy()
    patch.apply_to(img)
    return img


def _post_image_hash(seg: np.ndarray, patch: Patch) -> bytes:
    """Hash of ``seg`` with ``patch`` applied, built in this thread's scratch buffer (a fresh MiB per
    chunk costs page faults and an unmap)."""
    img = scratch_array("post-image", seg.size, seg.dtype)
    img[:] = seg
    patch.apply_to(img)
    return seg_hash(img)


class HostRegions:
    """The region hooks of a ``SegmentTarget`` whose regions are host numpy bytes (see its docstring)."""

    hash_region = staticmethod(seg_hash)
    region_view = staticmethod(uint_view)
    decode_region = staticmethod(_decode)
    post_image_hash = staticmethod(_post_image_hash)


HOST_REGIONS = HostRegions()


def _seg_len(nbytes: int, ci: int) -> int:
    return min(SEGMENT_BYTES, nbytes - ci * SEGMENT_BYTES)


def _patch_bytes(patch) -> int:
    """Memory a decoded patch holds (about 10 bytes per position of a sparse one)."""
    return patch.dense.nbytes if patch.dense is not None else len(patch.positions) * 10
