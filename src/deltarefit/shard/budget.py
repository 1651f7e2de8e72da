"""What a part's header may need, from what the version manifest says the part covers: a bound on the
header tighter than ``part.MAX_HEADER`` for the parts of small slices (``read_part(max_header=)``)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..dtypes import dtype as lookup_dtype
from ..errors import FormatError
from .part import MAX_HEADER

# A header is also bounded by what the version manifest says its part covers (``header_budget``): a
# fixed 64 KiB, 16 KiB per tensor covered (its name, dtype and shape, and up to 60 cells of 250 bytes),
# and 64 bytes per chunk of MIN_CHUNK_BYTES its covering boxes could hold (a chunk lists 7 integers in
# about 45 bytes; ``ShardPublisher`` cuts chunks of at least MIN_CHUNK_BYTES, 1 MiB by default). The 1T
# MoE rank of ``part.MAX_HEADER``'s arithmetic: 64 KiB + 1,000 x 16 KiB + 64 x 8 GB / 64 KiB = 24 MB,
# so the cap binds (a real header of it is 2.4 MB); a part covering 10 tensors of 64 MiB of bf16 gets
# 64 KiB + 160 KiB + 64 x 10,240 = 0.9 MiB.
HEADER_FIXED_BUDGET = 64 << 10
HEADER_TENSOR_BUDGET = 16 << 10
HEADER_CHUNK_BUDGET = 64
MIN_CHUNK_BYTES = 64 << 10


def header_budget(manifest: Mapping, rank: int) -> int:
    """The most header bytes the part of ``rank`` may need, from what the version manifest declares it
    covers (its tensors, and the boxes of their cells: see ``HEADER_TENSOR_BUDGET``), at most
    ``MAX_HEADER``; ``MAX_HEADER`` where the manifest does not say (no entry, no covers)."""
    try:
        ent = next((p for p in manifest["parts"] if p["rank"] == rank), None)
        covers = ent["covers"] if ent is not None else None
        if not isinstance(covers, Mapping):  # a dict, or a manifest read as bytes (``manifest._Covers``)
            return MAX_HEADER
        total = HEADER_FIXED_BUDGET
        for name, bb in covers.items():
            itemsize = lookup_dtype(manifest["tensors"][name]["dtype"]).itemsize
            nbytes = math.prod(int(hi) - int(lo) for lo, hi in bb) * itemsize
            total += HEADER_TENSOR_BUDGET + HEADER_CHUNK_BUDGET * -(-nbytes // MIN_CHUNK_BYTES)
            if total >= MAX_HEADER:
                return MAX_HEADER
        return total
    except (KeyError, TypeError, ValueError, AttributeError, FormatError):
        return MAX_HEADER  # a manifest that does not say: the absolute cap
