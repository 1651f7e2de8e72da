"""Numba kernels of the ULP-context codec: a binary range coder and the chunk encode/decode loops.

The import path the codec's callers use (``from deltarefit.codec import kernels as K``); the kernels
live in modules by role: ``encode_kernels`` (the scan and the coder), ``decode_kernels`` (the four
decoder parts, ``ulp_decode`` and ``scatter``), and ``primitives`` (the range coder, raw bit stream and
keys both share). Pure functions over numpy arrays; they release the GIL, so chunks run in parallel on
threads. The bitstream is specified in FORMAT.md ("Encoding 1: ulp").

Decoders never trust their input: every count, context id, rank and length is checked, reading past
the end of the payload is detected, and failures come back as negative status codes (see ``STATUS``).
Importing this module imports numba: ``codec.chunk`` reaches it lazily, through its ``K`` proxy.
"""

from __future__ import annotations

from .constants import KIND_FLOAT, KIND_INT, KIND_UINT, STATUS
from .decode_kernels import (
    hist_decode,
    hist_positions,
    hist_tables,
    scatter,
    ulp_apply_deltas,
    ulp_decode,
    ulp_decode_deltas,
    ulp_decode_groups,
    ulp_deltas_core,
    ulp_groups_core,
    ulp_positions,
)
from .encode_kernels import hist_scan, ulp_encode_changes, ulp_encode_core, ulp_scan
from .primitives import MAX_UNARY, MOVE_BITS, PROB_BITS, PROB_INIT, TOP, U64

__all__ = [
    "KIND_FLOAT", "KIND_INT", "KIND_UINT", "MAX_UNARY", "MOVE_BITS", "PROB_BITS", "PROB_INIT", "STATUS", "TOP",
    "U64", "hist_decode", "hist_positions", "hist_scan", "hist_tables", "scatter", "ulp_apply_deltas", "ulp_decode", "ulp_decode_deltas", "ulp_decode_groups",
    "ulp_deltas_core", "ulp_encode_changes", "ulp_encode_core", "ulp_groups_core", "ulp_positions", "ulp_scan",
]
