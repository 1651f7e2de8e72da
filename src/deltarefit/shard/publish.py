"""Sharded publish: each trainer rank diffs only its own shard and emits its part of a version.

A ``ShardPublisher`` holds, for the rank's shard, the served bits of the last committed version (its
*baseline slice*, in the rank's local layout: ``itemsize(served)`` bytes per local element, e.g. half
the fp32 masters for bf16). ``publish`` converts the current fp32 masters chunk by chunk with the one
conversion function (``convert.to_served_bits``), compares with the baseline slice and encodes the
changes of each cell with the codec, in checkpoint coordinates. Beyond the model and the baseline
slice it uses O(chunk) memory: one chunk of indices, master values, served bits and the codec output
at a time (plus the part being built, which is small). No rank gathers a full tensor.

``commit(part)`` advances the baseline slice by applying the rank's own part to it (the same apply
path a rollout uses), so a publish whose version was not committed leaves the baseline unchanged.

Cells: a rank's region of each checkpoint tensor (the boxes of its owner pieces) is cut at ``cuts``
(``names.cuts_from_layouts`` of the rollout layouts) into cells. A rollout rank can decode a cell only
if it holds all of it (the codec needs the chunk's base bits), so cutting at every rollout slice
boundary lets every rollout rank apply exactly its cells with the base it holds.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..codec.chunk import encode_chunk, encode_overwrite
from ..dtypes import dtype as lookup_dtype
from ..errors import UsageError
from ..format.layout import check_version
from ..geometry.projection import AP, INDEX_BLOCK, Axis, Box, Piece, box_indices
from ..integrity import SEGMENT_BYTES
from ..integrity import additive as D
from .budget import MIN_CHUNK_BYTES
from .convert import FP8_BLOCK, FP8_MAX, SCALE_SUFFIX, _f32, e4m3fn_bits, fp8_block_shape, to_served_bits
from .names import Layout, LocalTensor
from .part import FORMAT_VERSION, Part, read_part, write_part

__all__ = ["PartStats", "ShardPublisher", "cells_of"]


def cells_of(box: Box, cuts: tuple[tuple[int, ...], ...] | None) -> list[Box]:
    """``box`` cut at the per-dimension boundaries ``cuts`` (sorted), in lexicographic order."""
    if cuts is None:
        return [box] if box.count else []
    per_dim = []
    for ap, cs in zip(box.aps, cuts, strict=True):
        segs = []
        for lo, hi in itertools.pairwise(cs):
            # elements off + stride*i in [lo, hi)
            i0 = max(0, -(-(lo - ap.off) // ap.stride))
            i1 = min(ap.length, -(-(hi - ap.off) // ap.stride))
            if i1 > i0:
                segs.append(AP(ap.off + ap.stride * i0, ap.stride, i1 - i0))
        per_dim.append(segs)
    return [Box(box.shape, tuple(c)) for c in itertools.product(*per_dim)]


def chunk_elems(itemsize: int, chunk_bytes: int = SEGMENT_BYTES) -> int:
    return max(1, chunk_bytes // itemsize)


def _elementwise(dtn: str):
    return lambda values, _flat: to_served_bits(values, dtn)


def _scale_piece(lname: str, p: Piece) -> tuple[str, Piece]:
    """The synthetic local tensor (name, piece) of the ``_scale_inv`` blocks a fp8 piece covers.

    The piece must be block-aligned in checkpoint coordinates (every block it touches lies in it), so
    its blocks' amax, hence their scales, are computed from this rank's elements alone."""
    if len(p.shape) not in (1, 2):
        raise UsageError(f"{p.name}: fp8 block scaling handles 1-D and 2-D tensors, not {list(p.shape)}")
    sshape = fp8_block_shape(p.shape)
    box = p.box()
    axes, local = [], []
    for d, ap in enumerate(box.aps):
        end = ap.off + ap.length
        if (ap.stride != 1 and ap.length > 1) or ap.off % FP8_BLOCK or (end % FP8_BLOCK and end != p.shape[d]):
            raise UsageError(f"{p.name}: this rank's rows/columns [{ap.off}, {end}) of dim {d} are not aligned "
                             f"to the {FP8_BLOCK}-element fp8 blocks; shard fp8 tensors on block boundaries")
        b0, b1 = ap.off // FP8_BLOCK, -(-end // FP8_BLOCK)
        axes.append(Axis(0, b1 - b0, d, b0))
        local.append(b1 - b0)
    sp = Piece(p.name + SCALE_SUFFIX, sshape, tuple(local), tuple(axes), p.owner)
    return f"{lname}#{p.name}{SCALE_SUFFIX}", sp


def _block_scales(p: Piece, mflat: np.ndarray) -> np.ndarray:
    """fp32 ``scale_inv`` of the blocks of a block-aligned fp8 piece, exactly as ``convert_fp8_blocks``:
    amax over finite elements / 448, 1.0 for an all-zero block. Works one block-row strip at a time.

    Memory hazard: a strip is 128 rows of the piece (about 20 bytes per element of it for indices and
    values), more than a chunk for very wide tensors; strips could be split by columns if that matters."""
    box = p.box()
    if len(p.shape) == 1:
        aps = [AP(0, 1, 1), box.aps[0]]
        rows_per_block = 1
    else:
        aps = list(box.aps)
        rows_per_block = FP8_BLOCK
    r_ap, c_ap = aps
    nbr = -(-r_ap.length // rows_per_block)
    nbc = -(-c_ap.length // FP8_BLOCK)
    amax = np.zeros((nbr, nbc), np.float32)
    for br in range(nbr):
        r0 = r_ap.off + br * rows_per_block
        nr = min(rows_per_block, r_ap.off + r_ap.length - r0)
        strip = Box(p.shape, (AP(r0, 1, nr), c_ap) if len(p.shape) == 2 else (c_ap,))
        _, loc = box_indices(strip, p, 0, strip.count)
        v = mflat[loc].reshape(nr, c_ap.length)
        with np.errstate(invalid="ignore"):
            a = np.where(np.isfinite(v), np.abs(v), np.float32(0))
        pad = np.zeros((nr, nbc * FP8_BLOCK), np.float32)
        pad[:, :c_ap.length] = a
        amax[br] = pad.reshape(nr, nbc, FP8_BLOCK).max(axis=(0, 2))
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    return scale.reshape(-1) if len(p.shape) == 1 else scale


def _fp8_converter(p: Piece, scale: np.ndarray):
    """Elements (values at checkpoint flat indices) -> e4m3fn bits with their block's scale_inv."""
    box = p.box()
    b0 = [ap.off // FP8_BLOCK for ap in box.aps]

    def conv(values: np.ndarray, flat: np.ndarray) -> np.ndarray:
        coords = np.unravel_index(flat, p.shape)
        if len(p.shape) == 1:
            s = scale[coords[0] // FP8_BLOCK - b0[0]]
        else:
            s = scale[coords[0] // FP8_BLOCK - b0[0], coords[1] // FP8_BLOCK - b0[1]]
        with np.errstate(invalid="ignore", over="ignore"):
            return e4m3fn_bits(values / s)  # fp32 / fp32, as convert_fp8_blocks

    return conv


@dataclass
class PartStats:
    version: int
    changed: int  # elements whose served bits changed in this rank's region
    elements: int  # elements of this rank's region
    part_bytes: int
    served_bytes: int  # bytes of this rank's region in the served dtype
    seconds: float

    @property
    def ratio(self) -> float:
        return self.served_bytes / max(self.part_bytes, 1)

    @property
    def changed_fraction(self) -> float:
        return self.changed / max(self.elements, 1)


class ShardPublisher:
    """Publishes one trainer rank's part of each version (see the module docstring).

    ``layout``: this rank's ``{param: LocalTensor}`` (``names.trainer_layout``); ``served``: the served
    dtype of every checkpoint tensor (one name, or ``{checkpoint name: dtype}``; BF16, F16, F32, or
    F8_E4M3 with 128x128 block scales published as ``<name>_scale_inv``: pieces must be block-aligned);
    ``cuts``: cell boundaries (``names.cuts_from_layouts`` of the rollout layouts), None for none.
    ``format_version``: of the parts and their chunks (2: the ``ulp2`` encodings where smaller; 1: version 1's
    encodings, for rollout ranks that read part format version 1 only).
    """

    def __init__(self, layout: Layout, served: str | Mapping[str, str] = "BF16", *,
                 cuts: Mapping[str, tuple[tuple[int, ...], ...]] | None = None, rank: int = 0, world: int = 1,
                 chunk_bytes: int = SEGMENT_BYTES, format_version: int = FORMAT_VERSION) -> None:
        self.layout = layout
        self.format_version = check_version(format_version, "format_version")
        self.rank, self.world = rank, world
        self.cuts = dict(cuts or {})
        if chunk_bytes < MIN_CHUNK_BYTES:  # readers budget a part's header by chunks of at least this size
            raise UsageError(f"chunk_bytes {chunk_bytes}: at least {MIN_CHUNK_BYTES} (budget.MIN_CHUNK_BYTES)")
        self.chunk_bytes = chunk_bytes
        self.dtypes: dict[str, str] = {}
        for lname, lt in layout.items():
            dts = {served if isinstance(served, str) else served[p.name] for p in lt.pieces}
            if len(dts) > 1:
                raise UsageError(f"parameter {lname!r} maps to checkpoint tensors of different served dtypes {dts}")
            dt = dts.pop() if dts else "BF16"
            if dt not in ("BF16", "F16", "F32", "F8_E4M3"):
                raise UsageError(f"parameter {lname!r}: served dtype {dt} is not supported by the sharded "
                                 "publisher (BF16, F16, F32, F8_E4M3)")
            self.dtypes[lname] = dt
        # fp8: every piece gets a synthetic local tensor holding the scale_inv of its blocks, published
        # as the checkpoint tensor <name>_scale_inv (F32). Synthetic names contain "#".
        self._scale_of: dict[tuple[str, int], str] = {}
        layout = dict(layout)
        for lname, lt in list(layout.items()):
            if self.dtypes[lname] != "F8_E4M3":
                continue
            for i, p in enumerate(lt.pieces):
                sname, sp = _scale_piece(lname, p)
                layout[sname] = LocalTensor(sp.local_shape, (sp,))
                self.dtypes[sname] = "F32"
                self._scale_of[(lname, i)] = sname
        self.layout = layout
        self.baseline: dict[str, np.ndarray] | None = None  # served bits of the last committed version
        self.committed_version: int | None = None

    # ------------------------------------------------------------------------------------ publish

    def publish(self, masters: Mapping[str, object], version: int) -> tuple[bytes, PartStats]:
        """This rank's part of ``version`` from its fp32 master shards ``{param: local tensor}``.

        The first publish (no committed baseline) is a keyframe: every cell overwritten.
        """
        t0 = time.perf_counter()
        keyframe = self.baseline is None
        blobs: dict[int, bytes] = {}  # id of a chunk record -> its payload (offsets fixed in header order)
        tensors: dict[str, dict] = {}
        changed = elements = served_bytes = 0
        masters = dict(masters)
        scales: dict[str, np.ndarray] = {}
        for (lname, i), sname in self._scale_of.items():
            if lname not in masters:
                raise UsageError(f"no master shard for parameter {lname!r}")
            scales[sname] = masters[sname] = _block_scales(self.layout[lname].pieces[i],
                                                           _f32(masters[lname]).reshape(-1))
        for lname, lt in self.layout.items():
            if lname not in masters:
                raise UsageError(f"no master shard for parameter {lname!r}")
            m = _f32(masters[lname])
            if tuple(m.shape) != lt.shape:
                raise UsageError(f"master {lname!r} has shape {tuple(m.shape)}, layout says {lt.shape}")
            if not m.flags.c_contiguous:
                raise UsageError(f"master {lname!r} is not contiguous")
            mflat = m.reshape(-1)
            dtn = self.dtypes[lname]
            dt = lookup_dtype(dtn)
            bflat = None if keyframe else self.baseline[lname].reshape(-1)
            step = chunk_elems(dt.itemsize, self.chunk_bytes)
            for i, p in enumerate(lt.pieces):
                if not p.owner or p.count == 0:
                    continue
                seed = D.seeds(p.name, dtn, p.shape)
                sname = self._scale_of.get((lname, i))
                conv = _elementwise(dtn) if sname is None else _fp8_converter(p, scales[sname])
                ent = tensors.setdefault(p.name, {"name": p.name, "dtype": dtn, "shape": list(p.shape), "cells": []})
                for cell in cells_of(p.box(), self.cuts.get(p.name)):
                    c = self._cell(p, cell, mflat, bflat, dt, seed, step, blobs, conv)
                    ent["cells"].append(c)
                    changed += c["changed"]
                    elements += cell.count
                    served_bytes += cell.count * dt.itemsize
        header = {"version": int(version), "rank": self.rank, "world": self.world, "keyframe": keyframe,
                  "tensors": [tensors[n] for n in sorted(tensors)]}
        payload = bytearray()
        for t in header["tensors"]:
            for c in t["cells"]:
                for ch in c["chunks"]:
                    ch[4] = len(payload)
                    payload += blobs.pop(id(ch))
        blob = write_part(header, bytes(payload), self.format_version)
        return blob, PartStats(int(version), changed, elements, len(blob), served_bytes, time.perf_counter() - t0)

    def _cell(self, p: Piece, cell: Box, mflat, bflat, dt, seed, step: int, blobs: dict[int, bytes],
              conv) -> dict:
        base_d = D.ZERO.copy()
        tgt_d = D.ZERO.copy()
        chunks = []
        changed = 0
        for a in range(0, cell.count, step):
            b = min(cell.count, a + step)
            flat, loc = box_indices(cell, p, a, b)
            tgt = np.empty(b - a, dt.uint)
            for s in range(0, b - a, INDEX_BLOCK):  # convert in blocks: no chunk-sized fp32 copy
                tgt[s:s + INDEX_BLOCK] = conv(mflat[loc[s:s + INDEX_BLOCK]], flat[s:s + INDEX_BLOCK])
            tgt_d = D.add(tgt_d, D.partial(seed, flat, tgt))
            base = None if bflat is None else bflat[loc]
            if base is not None:
                base_d = D.add(base_d, D.partial(seed, flat, base))
            # Memory hazard: free this chunk's index arrays before encoding and before the next chunk's
            # are built, or two chunks' worth are alive at once.
            del flat, loc
            enc = encode_overwrite(tgt) if base is None else encode_chunk(dt, base, tgt, fmt=self.format_version)
            del base, tgt
            if enc is None:
                continue
            rec = [a, b - a, enc.encoding, enc.n_changed, -1, len(enc.payload), enc.decoded_len]
            chunks.append(rec)
            blobs[id(rec)] = enc.payload
            changed += enc.n_changed
        return {"box": cell.to_json(), "base": None if bflat is None else D.to_hex(base_d),
                "target": D.to_hex(tgt_d), "changed": 0 if bflat is None else changed, "chunks": chunks}

    # ------------------------------------------------------------------------------------- commit

    def commit(self, part: bytes | Part) -> None:
        """Advance the baseline slice to ``part`` (this rank's own part of a committed version)."""
        from .rollout import apply_parts

        pt = part if isinstance(part, Part) else read_part(part, f"rank {self.rank} part")
        if pt.header["rank"] != self.rank:
            raise UsageError(f"rank {self.rank} cannot commit rank {pt.header['rank']}'s part")
        if self.baseline is None:
            if not pt.keyframe:
                raise UsageError("the first committed part must be a keyframe")
            self.baseline = {n: np.zeros(lt.shape, lookup_dtype(self.dtypes[n]).uint)
                             for n, lt in self.layout.items()}
        apply_parts([pt], self.baseline, self.layout, owners_only=True)
        self.committed_version = pt.version

    def baseline_bytes(self) -> int:
        return 0 if self.baseline is None else sum(a.nbytes for a in self.baseline.values())

    def partial_digests(self, part: bytes | Part, which: str = "target") -> dict[str, np.ndarray]:
        """``{checkpoint tensor: this rank's digest}`` from a part's cells (sum over ranks = the tensor's)."""
        pt = part if isinstance(part, Part) else read_part(part)
        out = {}
        for t in pt.tensors:
            acc = D.ZERO.copy()
            for c in t.cells:
                acc = D.add(acc, D.from_hex(c.target if which == "target" else c.base))
            out[t.name] = acc
        return out
