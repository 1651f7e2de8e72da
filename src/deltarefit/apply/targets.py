"""What an apply target is: the ``TensorTarget`` and ``SegmentTarget`` protocols that every target of the
one apply protocol (``protocol``) implements, the optional capabilities a ``SegmentTarget`` may add
(``RegionHooks``, ``HistoryDecoding``, ``ImageWrites``, ``CollectiveTarget``, ``SplitSegments``),
``RawSegments``, the segment access over a ``TensorTarget``, and ``Capabilities``: what one target can
do, found once (``capabilities``) for the ``Applier``, which reads its fields and never asks the target.

The targets: ``files.Checkpoint`` and ``tensors._TorchTarget`` (``TensorTarget``, through
``RawSegments``), ``gpu.apply.DeviceTensors`` (region hooks, history decoding), ``engines.live.LiveTarget``
and ``engines.live.TargetUnion`` (collective, split segments).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..codec.chunk import Patch
from ..errors import UsageError
from ..integrity import SEGMENT_BYTES


class TensorTarget(Protocol):
    """What apply needs of a place holding tensors (a checkpoint, a dict of torch tensors).

    ``raw`` gives a tensor's bytes in checkpoint (row-major safetensors) order as one writable uint8
    array. A target whose tensors are not laid out that way (a live engine's parameters, where a
    checkpoint tensor may be rows of a fused parameter) implements ``SegmentTarget`` instead.
    Optional: ``write_raw(name, offset, data)``, a write through the target's file (``RawSegments``
    then writes whole checked post-images through it).
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
    The optional capabilities below (``RegionHooks``, ``HistoryDecoding``, ``ImageWrites``,
    ``CollectiveTarget``, ``SplitSegments``) are found once per apply by ``capabilities``.
    """

    tensors: dict

    def read_segment(self, name: str, ci: int) -> np.ndarray: ...

    def write_segment(self, name: str, ci: int, region: np.ndarray, view: np.ndarray, patch: Patch) -> np.ndarray: ...


# -- optional capabilities of a SegmentTarget (each found by ``capabilities``, never asked of a target again)

# The region hooks (``SegmentTarget``'s docstring). Each one a target lacks is ``host.HOST_REGIONS``'s; a
# target with any of them has regions that are not host memory, which a journal and held digests refuse.
REGION_HOOKS = ("hash_region", "region_view", "decode_region", "post_image_hash")


class RegionHooks(Protocol):
    """Optional: a target whose regions live elsewhere (device memory) and are hashed and decoded there."""

    def hash_region(self, region: Any) -> bytes:
        """The segment hash (``integrity.seg_hash``) of ``region``."""

    def hash_segments(self, name: str) -> list[bytes]:
        """Every segment hash of tensor ``name`` at once (the plan then reads only the regions it decodes).
        Optional on its own."""

    def region_view(self, region: Any, dt_name: str) -> Any:
        """What ``decode_region``, ``post_image_hash`` and ``write_segment`` get as ``view``."""

    def decode_region(self, delta: Any, entry: Any, record: Any, view: Any) -> Any:
        """Chunk ``record`` of ``entry`` decoded against its base ``view``: the target's own patch."""

    def post_image_hash(self, view: Any, patch: Any) -> bytes:
        """The hash ``view`` would have with ``patch`` applied, without writing it."""


class HistoryDecoding(Protocol):
    """Optional, with region hooks: a target given the history book itself, which decodes ``ulp_hist``
    chunks against it and records each decoded chunk's moves (``gpu.apply.DeviceTensors``)."""

    decodes_history: bool


class ImageWrites(Protocol):
    """Optional, host regions only: a target that writes a chunk's whole checked post-image through its
    file, cheaper than patching pages the plan mapped read-only (``RawSegments`` over a checkpoint)."""

    writes_images: bool

    def write_image(self, name: str, ci: int, region: np.ndarray, image: np.ndarray) -> np.ndarray:
        """Write segment ``ci``'s whole post-image ``image``; the region, which now reads the new bytes."""


class CollectiveTarget(Protocol):
    """Optional: a target whose segments are assembled from parts several processes hold
    (``collective = True``). The applier drives it in one fixed order on the calling thread, so that every
    process makes the same collective calls in the same order."""

    collective: bool

    def agree(self, ok: bool) -> bool:
        """Whether every process of the group reports ``ok`` (a collective call)."""

    def agree_each(self, flags: np.ndarray) -> np.ndarray:
        """Per entry of ``flags``, whether every process reports it true (one collective call). Optional
        for the agreement itself (``agree`` is used without it); required by split segments."""

    def chunk_roles(self, name: str) -> list[str] | None:
        """Optional. Per segment of a shared tensor, "mine" (held whole here), "other" (held whole by
        another process) or "group" (split between processes); None for a tensor held whole here."""

    def read_own(self, name: str, ci: int) -> np.ndarray:
        """Segment ``ci`` ("mine"), read here alone. Required with ``chunk_roles``."""

    def write_own(self, name: str, ci: int, region: np.ndarray, view: np.ndarray, patch: Patch) -> np.ndarray:
        """``write_segment`` of a segment held here whole, here alone. Required with ``chunk_roles``."""

    def group_sum(self, moved: np.ndarray, ok: bool) -> tuple[np.ndarray, bool]:
        """(the group's sum of the additive digest moves ``moved``; whether every process reported ``ok``).
        Required with ``chunk_roles``."""


class SplitSegments(Protocol):
    """Optional, with ``chunk_roles``: segments split between the group's processes ("group"), each decoded
    by one process (``split_owner``), which sends the others its changes."""

    split_window: int  # split segments in flight at a time: the same in every process of the group

    def split_owner(self, name: str, ci: int) -> int:
        """The rank that decodes split segment ``ci`` of ``name``."""

    def assemble_window(self, name: str, items: list[tuple[int, int]]) -> list[np.ndarray | None]:
        """Segments ``(ci, owner)`` assembled each at its owner alone (None elsewhere): a collective step."""

    def share_window(self, name: str, items: list) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """``(ci, owner, changes)`` each: the owner's changes (None where it failed), received by all."""

    def write_split(self, name: str, ci: int, pos: np.ndarray, new: np.ndarray) -> bool:
        """Write the changes landing in this process's placements; whether they read back as written."""


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


@dataclass(frozen=True)
class Capabilities:
    """What one target can do, found once (``capabilities``) for an ``Applier``, whose code reads these
    fields and never asks the target with ``hasattr``. The four region operations are the target's hooks
    or ``host.HOST_REGIONS``'s."""

    hash_region: Callable[[Any], bytes]
    region_view: Callable[[Any, str], Any]
    decode_region: Callable[..., Any]
    post_image_hash: Callable[[Any, Any], bytes]
    hash_segments: Callable[[str], list[bytes]] | None  # ``RegionHooks.hash_segments``, where it has it
    # Host regions (no region hook at all): a journal, held digests and a history book kept by the applier
    # need them; a written region is checked against the post-image built again (not re-hashed).
    host: bool
    writes_images: bool  # ``ImageWrites`` (host regions only)
    decodes_history: bool  # ``HistoryDecoding``: the target records the decoded chunks' moves itself
    collective: bool  # ``CollectiveTarget``
    agree_each: Callable[[np.ndarray], np.ndarray] | None
    chunk_roles: Callable[[str], list[str] | None] | None  # collective targets only
    # Held-digest plans decode a segment split between the processes in one of them (``SplitSegments``):
    # only where the journal, if any, keeps records without pre-images.
    split: bool


def capabilities(segs: SegmentTarget, host_regions: object, *, journal: object | None = None,
                 held: bool = False, history: bool = False) -> Capabilities:
    """``segs``' capabilities, and the refusals of what it cannot do (``UsageError``, before anything is
    read): a ``journal``, ``held`` digests and a ``history`` book kept by the applier all need host
    regions. ``history`` is not refused where the target decodes against the book itself. The region
    operations ``segs`` lacks are ``host_regions``' (``host.HOST_REGIONS``, which imports this module)."""
    hooks = [getattr(segs, h, None) for h in REGION_HOOKS]
    hash_segments = getattr(segs, "hash_segments", None)
    host = all(h is None for h in hooks) and hash_segments is None
    decodes_history = bool(getattr(segs, "decodes_history", False))
    if not host:
        if journal is not None:
            raise UsageError("a journal needs a target with host regions (journal records are host patches)")
        if held:
            raise UsageError("held digests need a target with host regions")
        if history and not decodes_history:
            raise UsageError("a history book needs a target with host regions")
    collective = bool(getattr(segs, "collective", False))
    roles = getattr(segs, "chunk_roles", None) if collective else None
    split = (roles is not None and hasattr(segs, "split_owner")
             and (journal is None or not getattr(journal, "needs_pre", True)))
    hash_region, region_view, decode_region, post_image_hash = (
        h if h is not None else getattr(host_regions, name) for h, name in zip(hooks, REGION_HOOKS, strict=True))
    return Capabilities(hash_region, region_view, decode_region, post_image_hash, hash_segments, host,
                        host and bool(getattr(segs, "writes_images", False)), decodes_history, collective,
                        getattr(segs, "agree_each", None), roles, split)
