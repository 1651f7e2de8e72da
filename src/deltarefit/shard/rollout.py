"""Rollout side: apply a sharded version in place into the slices a rank holds.

``apply_version(manifest, blobs, tensors, layout)`` writes a version into a rank's local tensors
(torch tensors, e.g. ``module.state_dict()`` values, or numpy arrays) in its own layout: whole HF
tensors, a tensor-parallel slice (column-parallel = rows, row-parallel = columns), or a fused
``qkv_proj`` holding the rank's rows of q, k and v. Each cell of each part is intersected with the
rank's pieces; cells it holds are applied, the others are never read.

Protocol (memory O(chunk) beyond the model: one chunk of indices, base bits and decoded patch):

1. Every part must match the manifest's size and BLAKE3 and parse (bounds-checked) for this version.
2. Plan, read-only: every cell that meets a piece must lie inside it (else the rank's slice is not
   aligned to the version's cells: refused); every element of every piece must be covered. Each such
   cell's current additive digest (over the rank's bits at the cell's checkpoint indices) must equal
   the cell's base (to do) or target (already done: idempotent). Every chunk to do is decoded and the
   cell's post-image digest computed and compared with the cell's target. Any failure raises
   (``BaseMismatchError`` / ``VerificationError`` / ``FormatError``) with nothing written.
3. Write: decode again, scatter target bits through the piece's index map; then re-digest each cell
   from memory and require its target digest.

A wrong map (a piece that claims other elements than it holds) reads the wrong bits in step 2, so the
cell digests do not match and nothing is written. ``slice_digests`` + an all-reduce over the rank's
tensor-parallel group then checks the group's sum against the manifest's per-tensor digests (before
apply: base; after: target), which also catches slices nobody covers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..codec.chunk import decode_chunk, decode_new
from ..dtypes import dtype as lookup_dtype
from ..errors import BaseMismatchError, UsageError, VerificationError
from ..geometry.projection import Box, Piece, box_indices, intersect_boxes
from ..integrity import additive as D
from .budget import header_budget
from .names import Layout
from .part import Cell, Part, TensorPart, check_blob, read_part

__all__ = ["ApplyStats", "apply_parts", "apply_version", "apply_version_to_module", "bits_view", "group_check",
           "needed_ranks", "slice_digests"]


@dataclass
class ApplyStats:
    cells: int  # cells of this rank that were applied
    skipped: int  # cells already at their target
    written: int  # elements written
    seconds: float


def bits_view(t) -> np.ndarray:
    """A writable numpy uint view sharing ``t``'s memory (torch CPU contiguous tensor or numpy array)."""
    try:
        import torch

        if isinstance(t, torch.Tensor):
            from ..apply.tensors import _check_tensor, _raw_view

            _check_tensor("tensor", t)
            raw = _raw_view(t)
            return raw.view(f"<u{t.element_size()}").reshape(tuple(t.shape))
    except ImportError:  # pragma: no cover
        pass
    a = np.asarray(t)
    if not a.flags.c_contiguous or not a.flags.writeable:
        raise UsageError("numpy targets must be writable and C-contiguous")
    return a.view(f"<u{a.dtype.itemsize}")


@dataclass
class _Job:
    part: Part
    tp: TensorPart
    cell: Cell
    piece: Piece
    flat: np.ndarray  # the local tensor's flat uint view
    seed: np.ndarray
    step: int


def _cell_indices(job: _Job, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    return box_indices(job.cell.box, job.piece, a, b)


def _cell_digest(job: _Job) -> np.ndarray:
    acc = D.ZERO.copy()
    for a in range(0, job.cell.box.count, job.step):
        flat, loc = _cell_indices(job, a, min(job.cell.box.count, a + job.step))
        acc = D.add(acc, D.partial(job.seed, flat, job.flat[loc]))
        del flat, loc
    return acc


def _patches(job: _Job, where: str):
    """Yield (local indices, checkpoint flat indices, base bits, decoded Patch or new bits) per chunk."""
    dt = lookup_dtype(job.tp.dtype)
    for ch in job.cell.chunks:
        flat, loc = _cell_indices(job, ch.first, ch.first + ch.count)
        base = job.flat[loc]
        w = f"{where} chunk @{ch.first}"
        data = job.part.payload_of(ch)
        if job.part.keyframe:
            patch = decode_new(dt, ch.count, ch.encoding, data, w)
        else:
            patch = decode_chunk(dt, base, ch.encoding, data, ch.n_changed, ch.decoded_len, w)
        yield loc, flat, base, patch
        # Memory hazard: the generator frame would keep this chunk's arrays alive while the next
        # chunk's are built (two chunks' worth); drop them first.
        del flat, loc, base, patch, data


def _post_digest(job: _Job, cur: np.ndarray, where: str) -> np.ndarray:
    acc = cur.copy()
    for _loc, flat, base, p in _patches(job, where):
        if isinstance(p, np.ndarray):  # keyframe chunk: the whole new image
            acc = D.add(D.sub(acc, D.partial(job.seed, flat, base)), D.partial(job.seed, flat, p))
        elif p.dense is not None:
            acc = D.add(D.sub(acc, D.partial(job.seed, flat, base)), D.partial(job.seed, flat, p.dense))
        elif p.positions is not None and p.positions.size:
            f = flat[p.positions]
            acc = D.add(D.sub(acc, D.partial(job.seed, f, base[p.positions])), D.partial(job.seed, f, p.values))
        del _loc, flat, base, p  # before the generator builds the next chunk's arrays
    return acc


def _plan(parts: Sequence[Part], tensors: Mapping[str, object], layout: Layout, owners_only: bool,
          require_cover: bool) -> tuple[list[_Job], int]:
    views: dict[str, np.ndarray] = {}
    by_name: dict[str, list[tuple[str, Piece]]] = {}
    for lname, lt in layout.items():
        if lname not in tensors:
            raise UsageError(f"layout names {lname!r}, which this rank does not hold")
        v = bits_view(tensors[lname])
        if tuple(v.shape) != lt.shape:
            raise UsageError(f"{lname!r} has shape {tuple(v.shape)}, its layout says {lt.shape}")
        views[lname] = v.reshape(-1)
        for p in lt.pieces:
            if p.count and (p.owner or not owners_only):
                by_name.setdefault(p.name, []).append((lname, p))
    covered = {(ln, id(p)): 0 for ps in by_name.values() for ln, p in ps}
    jobs: list[_Job] = []
    skipped = 0
    for part in parts:
        for tp in part.tensors:
            for lname, p in by_name.get(tp.name, []):
                if p.shape != tp.shape:
                    raise BaseMismatchError(f"{tp.name}: version shape {list(tp.shape)}, rank holds {list(p.shape)}")
                dt = lookup_dtype(tp.dtype)
                if views[lname].dtype.itemsize != dt.itemsize:
                    raise BaseMismatchError(f"{lname!r}: holds {views[lname].dtype.itemsize}-byte elements, "
                                            f"version's {tp.name} is {tp.dtype}")
                seed = D.seeds(tp.name, tp.dtype, tp.shape)
                pbox = p.box()
                for cell in tp.cells:
                    common = intersect_boxes(cell.box, pbox)
                    if common is None:
                        continue
                    if common.count != cell.box.count:
                        raise UsageError(
                            f"{tp.name}: cell {cell.box.to_json()} of rank {part.header['rank']}'s part is only "
                            f"partly in this rank's slice {pbox.to_json()} ({lname!r}); publish with cuts that "
                            "include this layout (names.cuts_from_layouts)")
                    covered[(lname, id(p))] += cell.box.count
                    jobs.append(_Job(part, tp, cell, p, views[lname], seed,
                                     max(1, (1 << 20) // dt.itemsize)))
    if require_cover:
        for ps in by_name.values():
            for lname, p in ps:
                if covered[(lname, id(p))] != p.count:
                    raise BaseMismatchError(f"{p.name}: the version covers {covered[(lname, id(p))]} of the "
                                            f"{p.count} elements {lname!r} holds")
    todo = []
    for j in jobs:
        where = f"{j.tp.name} cell {j.cell.box.to_json()} (part of rank {j.part.header['rank']})"
        cur = _cell_digest(j)
        tgt = D.from_hex(j.cell.target)
        if np.array_equal(cur, tgt):
            skipped += 1
            continue
        if j.cell.base is not None and not np.array_equal(cur, D.from_hex(j.cell.base)):
            raise BaseMismatchError(f"{where}: this rank's bits are neither the version's base nor its target "
                                    "(wrong base, or a wrong shard/fusion map); nothing written")
        if not np.array_equal(_post_digest(j, cur, where), tgt):
            raise VerificationError(f"{where}: decoded chunks do not give the cell's target digest; nothing written")
        todo.append(j)
    return todo, skipped


def apply_parts(parts: Sequence[Part], tensors: Mapping[str, object], layout: Layout, *,
                owners_only: bool = False, require_cover: bool = False) -> ApplyStats:
    """Apply parsed parts into ``tensors`` (see the module docstring; plan first, then write)."""
    t0 = time.perf_counter()
    todo, skipped = _plan(parts, tensors, layout, owners_only, require_cover)
    written = 0
    for j in todo:
        where = f"{j.tp.name} cell {j.cell.box.to_json()}"
        for loc, _flat, _base, p in _patches(j, where):
            if isinstance(p, np.ndarray):
                j.flat[loc] = p
                written += loc.size
            elif p.dense is not None:
                j.flat[loc] = p.dense
                written += loc.size
            elif p.positions is not None and p.positions.size:
                j.flat[loc[p.positions]] = p.values
                written += p.positions.size
            # Memory hazard: drop this chunk's arrays before the generator builds the next chunk's.
            del loc, _flat, _base, p
        if not np.array_equal(_cell_digest(j), D.from_hex(j.cell.target)):
            raise VerificationError(f"{where}: written cell does not hash to its target")
    return ApplyStats(len(todo), skipped, written, time.perf_counter() - t0)


def needed_ranks(manifest: dict, layout: Layout) -> list[int]:
    """The trainer ranks whose parts this rollout rank needs (the others never meet its slices)."""
    boxes: dict[str, list] = {}
    for lt in layout.values():
        for p in lt.pieces:
            if p.count:
                boxes.setdefault(p.name, []).append(p.box())
    return parts_needed(manifest, boxes)


def apply_version(manifest: dict, blobs: Sequence[bytes | memoryview | None] | Mapping[int, bytes | memoryview],
                  tensors: Mapping[str, object], layout: Layout) -> ApplyStats:
    """Apply one version into this rank's tensors. ``blobs``: every rank's part in rank order, or
    ``{rank: part}`` holding at least ``needed_ranks(manifest, layout)`` (missing ones: None/absent);
    a part the rank's slices need but that was not given is refused before anything is written."""
    if manifest.get("format") != "deltarefit.shard_version":
        raise UsageError("not a sharded version manifest")
    given = dict(blobs) if isinstance(blobs, Mapping) else dict(enumerate(blobs))
    if any(not isinstance(r, int) or not 0 <= r < manifest["world"] for r in given):
        raise UsageError(f"part ranks {sorted(given)} outside the version's world of {manifest['world']}")
    parts = []
    for r in sorted(given):
        blob = given[r]
        if blob is None:
            continue
        check_blob(manifest, r, blob)
        pt = read_part(blob, f"version {manifest['version']} part {r}", max_header=header_budget(manifest, r))
        if pt.version != manifest["version"] or pt.header["rank"] != r:
            raise UsageError(f"part {r} is rank {pt.header['rank']} of version {pt.version}")
        parts.append(pt)
    missing = sorted(set(needed_ranks(manifest, layout)) - {pt.header["rank"] for pt in parts})
    if missing:
        raise UsageError(f"version {manifest['version']}: this rank's slices need the parts of ranks {missing}")
    return apply_parts(parts, tensors, layout, require_cover=True)


def apply_version_to_module(manifest: dict, blobs: Sequence[bytes], module, layout: Layout | None = None
                            ) -> ApplyStats:
    """``apply_version`` into a torch module's ``state_dict`` tensors (identity layout by default)."""
    import torch

    from .names import identity_layout

    with torch.no_grad():
        sd = {n: v.detach() for n, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
        if layout is None:
            missing = sorted(set(manifest["tensors"]) - set(sd))
            if missing:
                raise UsageError(f"the module has no tensor {missing[0]!r} (and {len(missing) - 1} more) of the "
                                 "version; pass a layout that maps its parameters")
            layout = identity_layout({n: tuple(v.shape) for n, v in sd.items() if n in manifest["tensors"]})
        return apply_version(manifest, blobs, sd, layout)


def slice_digests(tensors: Mapping[str, object], layout: Layout, meta: Mapping[str, Mapping]
                  ) -> dict[str, np.ndarray]:
    """``{checkpoint tensor: digest of the elements this rank owns}`` (owner pieces only), from memory.

    ``meta`` gives each tensor's dtype and shape (a manifest's ``tensors``). Summed over a group that
    owns every element once, this equals the tensor's digest.
    """
    out: dict[str, np.ndarray] = {}
    for lname, lt in layout.items():
        flat = bits_view(tensors[lname]).reshape(-1)
        for p in lt.pieces:
            if not p.owner or p.count == 0:
                continue
            m = meta[p.name]
            seed = D.seeds(p.name, m["dtype"], p.shape)
            box = p.box()
            step = max(1, (1 << 20) // flat.dtype.itemsize)
            acc = out.get(p.name, D.ZERO.copy())
            for a in range(0, box.count, step):
                f, loc = box_indices(box, p, a, min(box.count, a + step))
                acc = D.add(acc, D.partial(seed, f, flat[loc]))
                del f, loc
            out[p.name] = acc
    return out


def group_check(summed: Mapping[str, np.ndarray], manifest: dict, which: str = "target") -> list[str]:
    """Names whose group-summed digest differs from the manifest's ``which`` digest (empty: verified)."""
    bad = []
    for name, ent in manifest["tensors"].items():
        want = ent[which]
        if want is None:
            continue
        got = summed.get(name, D.ZERO)
        if not np.array_equal(got, D.from_hex(want)):
            bad.append(name)
    return bad


def parts_needed(manifest: dict, boxes: dict[str, list[Box]]) -> list[int]:
    """Ranks whose parts meet any of ``boxes`` (``{tensor: [Box]}``, e.g. a rollout layout's piece
    boxes): the only parts that rank has to fetch."""
    need = []
    for ent in manifest["parts"]:
        for name, bb in ent.get("covers", {}).items():
            for box in boxes.get(name, ()):
                if all(lo <= ap.last and ap.off < hi for (lo, hi), ap in zip(bb, box.aps, strict=True)):
                    need.append(ent["rank"])
                    break
            else:
                continue
            break
    return need
