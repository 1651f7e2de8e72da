"""A live engine's parameters as an apply target: checkpoint tensors placed in parameters by affine pieces.

An inference engine does not hold checkpoint tensors as they are on disk. A ``q_proj`` is rows of a
fused ``qkv_proj``, a weight may be stored transposed, an embedding padded to a multiple of 64 rows.
``LiveTarget`` is the ``apply.SegmentTarget`` over such a layout: for every checkpoint tensor, a list of
``Placement`` (a parameter and a ``geometry.projection.Piece`` saying which elements of the checkpoint
tensor live where in it). The applier then runs its one protocol over it unchanged:

* a segment is read by gathering its elements from the parameters (a slice where the piece is a
  contiguous run of both, which is every piece of a Llama layout at tensor parallel size 1), so base
  and post-image checks hash exactly what the engine computes with;
* a write scatters only the elements the patch names (O(changed elements)) into every placement of
  them (an owner and its replicas), then reads the segment back for the applier's post-image check.

Each checkpoint tensor must be covered whole by owner pieces that do not overlap, unless it is
``shared``: held in parts by the processes of a group (tensor-parallel workers), each element owned by
exactly one of them. A shared tensor's segment is assembled by summing, over the group (``group``),
each process's owned elements with zeros elsewhere, so every process hashes, decodes and checks the
whole segment, and writes only its own elements. A target with shared tensors is ``collective``: the
applier then drives it in one fixed order and asks the group to ``agree`` after every step.

A held-digest plan does less: a segment of a shared tensor that one process holds whole
(``chunk_roles``: "mine" there, "other" everywhere else) is read, decoded and written by that process
alone (``read_own``, ``write_own``), and the group adds up those segments' digest moves
(``group_sum``). A segment split between processes ("group") is decoded once, by the process
``split_owner`` names (the split segments of the target dealt round the group): it is assembled there
alone (``assemble_window``, a window of them at a time: in memory the group's processes share, where
they share a host, else by a sum to that process), decoded and its digest move taken there, and its
changes are sent to the group (``share_window``), where each process writes and reads back its own
elements (``write_split``).

``group``: a ``shard.group.Group`` (a vLLM worker's is ``engines.vllm.group.WorkerGroup``): ``rank`` and
``size``, and the collective calls ``reduce_in_place(a)`` (a sum over the group), ``sum_to(a, dst)``,
``broadcast(a, src)``, ``agree(ok)`` and ``shared_buffer(nbytes)`` (memory every process maps, or None).

``Placement`` and the runs a piece maps are ``engines.placement``; ``TargetUnion``, ``state_through`` and
``apply_live``, ``engines.union`` (both answered here too).

Parameters may be on any torch device; CPU parameters are read and written through numpy views of
their memory, others through torch indexing (one gathered segment crosses to the host per read).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from ..codec import elements
from ..codec.chunk import Patch
from ..dtypes import dtype as lookup_dtype
from ..errors import UsageError
from ..geometry.projection import intersect_boxes
from ..integrity import SEGMENT_BYTES, n_segments
from ..shard.group import ALONE, Group, agree_each, sum_and_agree
from .placement import (
    RESULT_BYTES,
    SPLIT_AHEAD,
    SPLIT_WINDOW_MAX,
    Placement,
    _Flat,
    _Info,
    _pack_changes,
    _unpack_changes,
    contiguous_run,
    owned_in,
    row_local,
    row_runs,
)
from .union import TargetUnion, apply_live, digest_through, state_through

__all__ = ["LiveTarget", "Placement", "TargetUnion", "apply_live", "contiguous_run", "digest_through", "state_through"]


class LiveTarget:
    """``apply.SegmentTarget`` over engine parameters holding checkpoint tensors through ``Placement`` s.

    ``specs``: checkpoint tensor name -> (safetensors dtype name, shape), for the tensors placed.
    ``split_ahead``: split segments a held-digest plan keeps in flight per process (module docstring),
    which must be the same in every process of the group.
    ``params``: parameter name -> torch tensor (the live storage). Refuses, with nothing written, a
    layout that does not cover a tensor exactly once by owner pieces, or whose parameter dtype differs.
    """

    def __init__(self, params: Mapping[str, object], layout: Mapping[str, Sequence[Placement]],
                 specs: Mapping[str, tuple[str, Sequence[int]]], *, shared: Sequence[str] = (),
                 group: object | None = None, split_ahead: int = 0) -> None:
        if shared and group is None:
            raise UsageError("shared tensors need their group (module docstring)")
        self.shared = set(shared)
        self.collective = bool(self.shared)
        self._group: Group = group if group is not None else ALONE
        self._ahead = split_ahead or SPLIT_AHEAD
        self.tensors: dict[str, _Info] = {}
        self._flat: dict[str, _Flat] = {}
        self._place: dict[str, list[tuple[Placement, tuple[int, int, int] | None]]] = {}
        for name, places in layout.items():
            dt_name, shape = specs[name]
            shape = tuple(int(d) for d in shape)
            dt = lookup_dtype(dt_name)
            numel = math.prod(shape)
            self.tensors[name] = _Info(dt_name, shape, numel * dt.itemsize)
            owners = [pl for pl in places if pl.piece.owner]
            if name not in self.shared and sum(pl.piece.count for pl in owners) != numel:
                raise UsageError(f"tensor {name!r}: its placements cover {sum(pl.piece.count for pl in owners)} of "
                                 f"{numel} elements; a live target needs each tensor whole on this worker")
            for i, a in enumerate(owners):
                for b in owners[i + 1:]:
                    if intersect_boxes(a.piece.box(), b.piece.box()) is not None:
                        raise UsageError(f"tensor {name!r}: placements in {a.param!r} and {b.param!r} overlap")
            for pl in places:
                if pl.piece.name != name or pl.piece.shape != shape:
                    raise UsageError(f"placement of {name!r} in {pl.param!r} is a piece of "
                                     f"{pl.piece.name!r}{list(pl.piece.shape)}")
                if pl.param not in params:
                    raise UsageError(f"tensor {name!r}: no parameter {pl.param!r}")
                if pl.param not in self._flat:
                    t = params[pl.param]
                    if t.element_size() != dt.itemsize or tuple(t.shape) != pl.piece.local_shape:
                        raise UsageError(f"parameter {pl.param!r} is {t.dtype}{list(t.shape)}; tensor {name!r} "
                                         f"({dt_name}) is placed in it as {list(pl.piece.local_shape)}")
                    self._flat[pl.param] = _Flat(pl.param, t, np.dtype(dt.uint))
            self._place[name] = [(pl, contiguous_run(pl.piece)) for pl in sorted(places, key=lambda p: not p.piece.owner)]
        self._roles = self._whole_holders() if self.shared else {}
        # The split segments, dealt round the group in (name, segment) order: each is decoded by one process.
        self._split_owner: dict[tuple[str, int], int] = {}
        for name in sorted(self._roles):
            for ci, role in enumerate(self._roles[name]):
                if role == "group":
                    self._split_owner[(name, ci)] = len(self._split_owner) % group.size
        # Where the group's workers share a host, split segments are assembled in memory they all map
        # (``split_window`` slots, used in turn): each writes its own elements, and no bytes cross a socket.
        # A window's segments and the changes decoded from them, one slot each.
        self._slots: np.ndarray | None = None
        self._results: np.ndarray | None = None
        if self._split_owner and hasattr(group, "shared_buffer"):
            w = self.split_window
            mem = group.shared_buffer(w * (SEGMENT_BYTES + RESULT_BYTES))
            if mem is not None:
                self._slots = mem[:w * SEGMENT_BYTES]
                self._results = mem[w * SEGMENT_BYTES:]

    def _whole_holders(self) -> dict[str, list[str]]:
        """Per shared tensor, per segment: "mine" (this process owns every element), "other" (another
        process does) or "group" (split between processes). One collective call, at construction."""
        names = sorted(self.shared)
        mine = [[owned_in(self._place[name], a, b) == b - a for a, b in self._ranges(name)] for name in names]
        flags = np.array([m for per in mine for m in per], np.int64)
        if flags.size:  # the same size in every process: the same shared tensors
            self._group.reduce_in_place(flags)  # each element has exactly one owner: at most one process holds a segment whole
        out, i = {}, 0
        for name, per in zip(names, mine, strict=True):
            out[name] = ["mine" if m else "other" if f else "group" for m, f in zip(per, flags[i:i + len(per)],
                                                                                   strict=True)]
            i += len(per)
        return out

    def _ranges(self, name: str) -> list[tuple[int, int]]:
        """``_range`` of every segment of ``name``: (first, end) checkpoint elements."""
        return [self._range(name, ci)[:2] for ci in range(n_segments(self.tensors[name].nbytes))]

    def chunk_roles(self, name: str) -> list[str] | None:
        """Per segment of a shared tensor, who holds it (see ``_whole_holders``); None for a tensor this
        process holds whole. A segment held whole by one process is read, decoded and written there alone
        (``read_own``, ``write_own``), with no collective call: the applier's held-digest plan then adds
        up the group's digest moves (``group_sum``)."""
        return self._roles.get(name)

    def group_sum(self, moved: np.ndarray, ok: bool) -> tuple[np.ndarray, bool]:
        """(the sum over the group of ``moved``, two uint64 lanes added modulo 2**64; whether every
        process reported ``ok``): a collective call."""
        return sum_and_agree(self._group, moved, ok)

    def _range(self, name: str, ci: int) -> tuple[int, int, np.dtype]:
        info = self.tensors[name]
        dt = lookup_dtype(info.dtype)
        per = SEGMENT_BYTES // dt.itemsize
        a = ci * per
        return a, min(info.nbytes // dt.itemsize, a + per), np.dtype(dt.uint)

    def agree(self, ok: bool) -> bool:
        """Whether every process of the group reports ``ok`` (a collective call)."""
        return self._group.agree(ok)

    def agree_each(self, flags: np.ndarray) -> np.ndarray:
        """Per entry of ``flags`` (bools, the same length in every process), whether every process of the
        group reports it true (one collective call)."""
        return agree_each(self._group, flags)

    @property
    def rank(self) -> int:
        """This process's rank in its group (0 without one)."""
        return self._group.rank

    @property
    def size(self) -> int:
        """How many processes its group has (1 without one)."""
        return self._group.size

    @property
    def split_window(self) -> int:
        """How many split segments a held-digest plan keeps in flight (assembled, not yet shared): the same
        in every process of the group, whatever threads each applies with, since it fixes the order of
        the collective calls."""
        return max(self.size, min(SPLIT_WINDOW_MAX, self._ahead * self.size))

    @property
    def split_assembly(self) -> str | None:
        """Where split segments are assembled: "shared memory", "gloo" (a sum to the decoder over the
        group), or None (this target has none)."""
        if not self._split_owner:
            return None
        return "shared memory" if self._slots is not None else "gloo"

    def split_owner(self, name: str, ci: int) -> int:
        """The rank that decodes segment ``ci`` of ``name``, a segment split between processes
        (``chunk_roles`` "group")."""
        return self._split_owner[(name, ci)]

    def assemble_window(self, name: str, items: Sequence[tuple[int, int]]) -> list[np.ndarray | None]:
        """Segments of shared tensor ``name``, ``(ci, owner)`` each (at most ``split_window`` of them),
        assembled each at its ``owner`` alone: its bytes there, None in every other process. A collective
        step: through the group's shared memory where its processes share a host (each writes its own
        elements into the window's slots, then one agreement), else a sum to the owner per segment. The
        owner's bytes stay valid until the next window is assembled."""
        if self._slots is None:
            return [self._summed(name, ci, owner) for ci, owner in items]
        if len(items) > self.split_window:
            raise UsageError(f"a window of {len(items)} segments; the group's window is {self.split_window}")
        out = []
        for k, (ci, owner) in enumerate(items):
            a, b, uint = self._range(name, ci)
            buf = self._slots[k * SEGMENT_BYTES:k * SEGMENT_BYTES + (b - a) * uint.itemsize]
            self._gather(name, ci, True, into=buf.view(uint))  # every element is owned by exactly one process
            out.append(buf if self.rank == owner else None)
        self._group.agree(True)  # every part written before any owner reads its slot
        return out

    def share_window(self, name: str, items: Sequence[tuple[int, int, tuple[np.ndarray, np.ndarray] | None]]
                     ) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """``share_changes`` of a window (``assemble_window``'s): ``(ci, owner, changes)`` each, the changes
        given by the owner (None where its decode or check failed), received by every process. Through
        the shared memory, one agreement for the window (changes too large for their slot are then
        broadcast, in order); else a broadcast per segment."""
        if self._results is None:
            return [self.share_changes(name, ci, owner, ch) for ci, owner, ch in items]
        slots = []
        for k, (ci, owner, ch) in enumerate(items):
            slot = self._results[k * RESULT_BYTES:(k + 1) * RESULT_BYTES]
            slots.append(slot)
            if self.rank != owner:
                continue
            head = slot[:16].view(np.int64)
            item = self._range(name, ci)[2].itemsize
            if ch is None:
                head[:] = (0, 0)  # refused
            elif 16 + ch[0].size * (4 + item) > RESULT_BYTES:
                head[:] = (2, 0)  # sent by broadcast below
            else:
                n = ch[0].size
                _pack_changes(slot[16:16 + n * (4 + item)], ch[0], ch[1])
                head[:] = (1, n)
        self._group.agree(True)  # every owner's changes written before anyone reads them
        out: list[tuple[np.ndarray, np.ndarray] | None] = []
        for (ci, owner, ch), slot in zip(items, slots, strict=True):
            state, n = (int(x) for x in slot[:16].view(np.int64))
            if state == 2:
                out.append(self.share_changes(name, ci, owner, ch))
            elif state != 1:
                out.append(None)
            elif self.rank == owner:
                out.append(ch)
            else:  # copied out: the slot is the next window's
                out.append(_unpack_changes(slot[16:], self._sent(name, ci, owner, n), self._range(name, ci)[2]))
        return out

    def _summed(self, name: str, ci: int, owner: int | None = None) -> np.ndarray | None:
        """Segment ``ci`` of shared tensor ``name`` (bytes) summed over the group: at every process, or at
        ``owner`` alone (None elsewhere). Each process adds its owned elements, zero elsewhere, as 64-bit
        lanes: each byte comes from exactly one process, so the sum has no carry and is the segment
        (and 8 bytes per lane cost gloo less than one per byte)."""
        a, b, uint = self._range(name, ci)
        nbytes = (b - a) * uint.itemsize
        lanes = np.zeros(-(-nbytes // 8), np.int64)
        self._gather(name, ci, True, into=lanes.view(np.uint8)[:nbytes].view(uint))
        if owner is None:
            self._group.reduce_in_place(lanes)
        else:
            self._group.sum_to(lanes, owner)
            if self.rank != owner:
                return None
        return lanes.view(np.uint8)[:nbytes]

    def share_changes(self, name: str, ci: int, owner: int, changes: tuple[np.ndarray, np.ndarray] | None
                      ) -> tuple[np.ndarray, np.ndarray] | None:
        """Rank ``owner``'s decoded changes of segment ``ci`` of ``name`` (positions in the segment, target
        bits; None where its decode or check failed) sent to every process of the group (a collective
        call): the changes, or None in every process when the owner had none."""
        uint = self._range(name, ci)[2]
        head = np.zeros(2, np.int64)
        if self.rank == owner and changes is not None:
            head[:] = (1, changes[0].size)
        self._group.broadcast(head, owner)
        if head[0] != 1:
            return None
        n = self._sent(name, ci, owner, int(head[1]))
        body = np.empty(n * (4 + uint.itemsize), np.uint8)
        if self.rank == owner:
            _pack_changes(body, changes[0], changes[1])
        self._group.broadcast(body, owner)
        if self.rank == owner:  # its own arrays, as decoded
            return changes
        return _unpack_changes(body, n, uint)

    def _sent(self, name: str, ci: int, owner: int, n: int) -> int:
        """``n``, the count of changes rank ``owner`` sent for segment ``ci`` of ``name``, checked."""
        a, b, _ = self._range(name, ci)
        if not 0 <= n <= b - a:
            raise UsageError(f"tensor {name!r} segment {ci}: rank {owner} sent {n} changes for {b - a} elements")
        return n

    def write_split(self, name: str, ci: int, pos: np.ndarray, new: np.ndarray) -> bool:
        """Write the changes of split segment ``ci`` of ``name`` (``share_changes``) that land in this
        process's placements, here alone; whether every element written reads back as written."""
        lands = list(self._landing(name, pos + self._range(name, ci)[0]))
        for flat, sel, loc in lands:
            flat.put(loc, new[sel])
        return all(np.array_equal(flat.take(loc), new[sel]) for flat, sel, loc in lands)

    def _whole_run(self, name: str, a: int, b: int, own: bool = False) -> np.ndarray | None:
        """The elements ``[a, b)`` of tensor ``name`` as a view of the one CPU parameter run holding them,
        when the tensor has a single placement (no replica to write too) and is not shared, or ``own``
        (a segment of a shared tensor that this process holds whole)."""
        places = self._place[name]
        if (name in self.shared and not own) or len(places) != 1:
            return None
        return self._run_view(*places[0], a, b)

    def _run_view(self, pl: Placement, run: tuple[int, int, int] | None, a: int, b: int) -> np.ndarray | None:
        """Checkpoint elements ``[a, b)`` as a view of ``pl``'s CPU parameter, when its run holds them all."""
        if run is None or not (run[0] <= a and b <= run[0] + run[2]) or not self._flat[pl.param].cpu:
            return None
        l0 = run[1] + a - run[0]
        return self._flat[pl.param].np[l0:l0 + b - a]

    def read_segment(self, name: str, ci: int) -> np.ndarray:
        """Segment ``ci`` of ``name``; of a shared tensor, assembled over the group (a collective call)."""
        if name not in self.shared:
            return self._gather(name, ci, False)
        return self._summed(name, ci)

    def read_own(self, name: str, ci: int) -> np.ndarray:
        """Segment ``ci`` of ``name``, which this process holds whole (``chunk_roles``), read here alone."""
        self._check_own(name, ci)
        return self._gather(name, ci, False)

    def _check_own(self, name: str, ci: int) -> None:
        roles = self._roles.get(name)
        if roles is not None and roles[ci] != "mine":
            raise UsageError(f"tensor {name!r} segment {ci}: not held whole by this process ({roles[ci]})")

    def _gather(self, name: str, ci: int, zeros: bool, into: np.ndarray | None = None) -> np.ndarray:
        """The elements of segment ``ci`` this process owns; the others zero (``zeros``, a shared
        tensor's part, in ``into`` when given: zeros of the segment's uint dtype) or absent (every
        element owned here). Uint elements, or bytes for a view."""
        a, b, uint = self._range(name, ci)
        if not zeros:
            for pl, run in self._place[name]:
                # One run of one CPU parameter holds the whole segment: its memory, not a copy (the
                # applier reads it before writing and again after).
                view = self._run_view(pl, run, a, b) if pl.piece.owner else None
                if view is not None:
                    return view.view(np.uint8)
        out = into if into is not None else np.zeros(b - a, uint) if zeros else np.empty(b - a, uint)
        for pl, run in self._place[name]:
            if not pl.piece.owner:
                continue
            flat = self._flat[pl.param]
            if run is not None:
                c0, l0, n = run
                lo, hi = max(a, c0), min(b, c0 + n)
                if lo < hi:
                    out[lo - a:hi - a] = flat.read_run(l0 + lo - c0, hi - lo)
                continue
            runs = row_runs(pl.piece, a, b)
            if runs is not None:
                for c, lo, n in zip(*(x.tolist() for x in runs), strict=True):
                    out[c - a:c - a + n] = flat.read_run(lo, n)
                continue
            loc = pl.piece.to_local(np.arange(a, b, dtype=np.int64))
            m = loc >= 0
            if m.any():
                out[m] = flat.take(loc[m])
        return out if zeros else out.view(np.uint8)

    def write_segment(self, name: str, ci: int, region: np.ndarray, view: np.ndarray, patch: Patch) -> np.ndarray:
        """Scatter ``patch`` into every placement of its elements; the segment read back (of a shared
        tensor, over the group: a collective call)."""
        whole = self._scatter(name, ci, patch)
        return whole if whole is not None else self.read_segment(name, ci)

    def write_own(self, name: str, ci: int, region: np.ndarray, view: np.ndarray, patch: Patch) -> np.ndarray:
        """``write_segment`` of a segment this process holds whole (``read_own``), here alone."""
        self._check_own(name, ci)
        whole = self._scatter(name, ci, patch, own=True)
        return whole if whole is not None else self._gather(name, ci, False)

    def _scatter(self, name: str, ci: int, patch: Patch, own: bool = False) -> np.ndarray | None:
        """Write ``patch``'s elements; the segment's memory when one CPU run holds it, else None."""
        a, b, _ = self._range(name, ci)
        if patch.dense is not None:
            pos, vals = np.arange(b - a, dtype=np.int64), patch.dense
        elif patch.positions is not None and patch.positions.size:
            pos, vals = patch.positions.astype(np.int64, copy=False), patch.values
        else:
            return None
        whole = self._whole_run(name, a, b, own)
        if whole is not None:  # one run of one CPU parameter holds the segment and nothing else does
            elements.put(whole, pos, vals)
            return whole.view(np.uint8)
        for flat, sel, loc in self._landing(name, pos + a):
            flat.put(loc, vals[sel])
        return None

    def _landing(self, name: str, ck: np.ndarray) -> Iterator[tuple[_Flat, np.ndarray, np.ndarray]]:
        """Per placement of ``name`` holding any of checkpoint elements ``ck``: (its parameter, which of
        ``ck`` it holds, where they are in it)."""
        for pl, run in self._place[name]:
            if run is not None:
                c0, l0, n = run
                sel = (ck >= c0) & (ck < c0 + n)
                loc = ck[sel] - c0 + l0
            else:
                loc = row_local(pl.piece, ck)
                if loc is None:
                    loc = pl.piece.to_local(ck)
                sel = loc >= 0
                loc = loc[sel]
            if loc.size:
                yield self._flat[pl.param], sel, loc
