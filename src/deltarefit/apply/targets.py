"""What an apply target is: the ``TensorTarget`` and ``SegmentTarget`` protocols that every target of the
one apply protocol (``protocol``) implements, and ``RawSegments``, the segment access over a
``TensorTarget``."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..codec.chunk import Patch
from ..integrity import SEGMENT_BYTES


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
