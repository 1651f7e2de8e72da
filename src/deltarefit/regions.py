"""What an apply target is, and the host's region operations: the ``TensorTarget`` and ``SegmentTarget``
protocols that every target of the one apply protocol (``applier``) implements, and what the applier
does with a segment held in host memory (decode a chunk against it, build and hash its post-image, move
its additive digest)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from . import elements
from .codec.chunk import ULP_HIST, Patch, decode_chunk, decode_new, scratch_array
from .dtypes import dtype
from .encode import uint_view
from .format import ChunkRecord, DeltaReader, TensorEntry
from .history_book import HistoryBook
from .integrity import SEGMENT_BYTES, seg_hash


class TensorTarget(Protocol):
    """What apply needs of a place holding tensors (a checkpoint, a dict of torch tensors).

    ``raw`` gives a tensor's bytes in checkpoint (row-major safetensors) order as one writable uint8
    array. A target whose tensors are not laid out that way (a live engine's parameters, where a
    checkpoint tensor may be rows of a fused parameter) implements ``SegmentTarget`` instead.
    """

    tensors: dict  # name -> object with .dtype (str), .shape (tuple), .nbytes (int)

    def raw(self, name: str) -> np.ndarray: ...


class SegmentTarget(Protocol):
    """A target read and written one segment at a time, in checkpoint coordinates.

    ``read_segment`` returns the bytes of segment ``ci`` of tensor ``name`` as they are now (a view or a
    gathered copy): its *region*. ``write_segment`` writes ``patch`` (target bits in segment element
    coordinates) into the tensor's storage; ``view`` is ``region`` seen as the dtype's unsigned integers
    (or as ``region_view`` below gives it), which the target may patch in place. It returns the
    segment's region as it is after the write, read back from the storage, which the applier hashes
    against the post-image. Only elements the patch names are written.

    Regions are host numpy bytes unless the target also has the region hooks (all optional; each one
    missing is the host's ``HOST_REGIONS`` method), for a target whose bytes live elsewhere (device
    memory) and are best hashed and decoded there:

    * ``hash_region(region) -> bytes``: the segment hash (``integrity.seg_hash``) of a region;
    * ``hash_segments(name) -> list[bytes]``: every segment hash of a tensor at once (then the plan
      reads only the regions of chunks it must decode);
    * ``region_view(region, dtype name)``: what ``decode_region``, ``post_image_hash`` and
      ``write_segment`` get as ``view``;
    * ``decode_region(delta, entry, record, view) -> patch``: a chunk decoded against its base view;
      the patch is the target's own (``positions`` and ``dense`` as in ``codec.chunk.Patch``);
    * ``post_image_hash(view, patch) -> bytes``: the hash ``view`` would have with ``patch`` applied,
      without writing it.

    The protocol (what is checked, and when) is the applier's alone. A journal needs host regions.
    """

    tensors: dict

    def read_segment(self, name: str, ci: int) -> np.ndarray: ...

    def write_segment(self, name: str, ci: int, region: np.ndarray, view: np.ndarray, patch: Patch) -> np.ndarray: ...


class RawSegments:
    """``SegmentTarget`` over a ``TensorTarget``: segments are slices of ``raw``, patched in place, or, where
    the target has ``write_raw(name, offset, data)`` (a checkpoint's files), written whole from their
    checked post-images through it (``write_image``)."""

    def __init__(self, target: TensorTarget) -> None:
        self.target = target
        self.tensors = target.tensors

    def read_segment(self, name: str, ci: int) -> np.ndarray:
        off = ci * SEGMENT_BYTES
        return self.target.raw(name)[off:off + SEGMENT_BYTES]

    @property
    def writes_images(self) -> bool:
        """Whether ``write_image`` is the cheaper write (a target that writes through its file)."""
        return hasattr(self.target, "write_raw")

    def write_image(self, name: str, ci: int, region: np.ndarray, image: np.ndarray) -> np.ndarray:
        """Write segment ``ci``'s whole post-image ``image`` (checked by the plan) through the target's
        file (``Checkpoint.write_raw``); the region, which now reads the new bytes."""
        self.target.write_raw(name, ci * SEGMENT_BYTES, image)
        return region

    def write_segment(self, name: str, ci: int, region: np.ndarray, view: np.ndarray, patch: Patch) -> np.ndarray:
        patch.apply_to(view)
        if not np.may_share_memory(view, region):  # misaligned data was patched in a copy
            region[:] = view.view(np.uint8)
        return region


def segments_of(target: TensorTarget | SegmentTarget) -> SegmentTarget:
    """The segment access the applier uses for ``target``."""
    return target if hasattr(target, "read_segment") else RawSegments(target)


def _where(e: TensorEntry, r: ChunkRecord | None = None) -> str:
    return f"tensor {e.name!r}" + (f" chunk {r.chunk_index}" if r is not None else "")


def _decode(delta: DeltaReader, e: TensorEntry, r: ChunkRecord, base_seg: np.ndarray | None,
            history: HistoryBook | None = None) -> Patch:
    """Decode a chunk against its base segment, or (``base_seg`` None) a chunk of a new tensor. An
    ``ulp_hist`` chunk takes its history from ``history`` (refused without one, or with another)."""
    where = f"{delta.path}: {_where(e, r)}"
    payload = delta.read_payload(r, _where(e, r))
    if base_seg is None:
        dt = dtype(e.target.dtype)
        n = min(SEGMENT_BYTES, e.target.nbytes - r.chunk_index * SEGMENT_BYTES) // dt.itemsize
        return Patch(None, None, decode_new(dt, n, r.encoding, payload, where))
    hist = None
    if r.encoding == ULP_HIST and history is not None:
        hist = history.history(e.name, r.chunk_index, base_seg.size)
    return decode_chunk(dtype(e.base.dtype), base_seg, r.encoding, payload, r.n_changed, r.decoded_len, where, hist)


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
    from .shard import digest as additive

    seed = additive.seeds(e.name, e.base.dtype, e.base.shape)
    return additive.move(seed, r.chunk_index * (SEGMENT_BYTES // view.itemsize), view, pos, new)


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
