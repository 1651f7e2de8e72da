"""What the encoder and the decoder of one chunk share: the encodings' numbers, the encoded chunk and the
decoded ``Patch``, the context a float's exponent selects, the bound on a payload, per-thread scratch
arrays, and numba's kernels imported on first use.

Encodings (numbers are part of the format, see FORMAT.md):

* ``ULP``         positions grouped by the base's exponent, rice-coded gaps per group, signed ulp
                  distances, all through an adaptive binary range coder (primitives.py; the kernels in
                  encode_kernels.py and decode_kernels.py).
* ``SPARSE_XOR``  zstd( u8 width | position gaps as uint{8,16,32} | XOR values ) (the NeMo-RL layout).
* ``DENSE_XOR``   zstd( base XOR target ) over the whole chunk.
* ``OVERWRITE``   zstd( target ) over the whole chunk; also used for added or re-typed tensors.
* ``ULP_HIST``    ``ULP`` with each context split by the element's previous change (FORMAT.md,
                  "Encoding 5: ulp_hist").
* ``ULP2``        format version 2's ulp class: the changed decisions and the distances as symbols of
                  static per-chunk tables in interleaved rANS lanes (FORMAT.md, "Format version 2";
                  ``codec.ulp2``, kernels in ``ulp2_kernels``).
* ``ULP2_HIST``   ``ULP2`` with encoding 5's history states as contexts and per-state sign probabilities.

No I/O, and no coding: ``codec.chunk`` encodes, ``codec.decode`` decodes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from ..dtypes import DType
from . import elements  # Patch's scatter: native, without the GIL (numpy's holds it)
from .constants import KIND_FLOAT, KIND_INT, KIND_UINT


class _Numba:
    """``codec.kernels`` (numba), imported on first use: a process whose chunks all run on the native
    kernels (a CLI apply of bf16 weights) never pays numba's import and its kernels' first calls."""

    def __getattr__(self, name: str):
        from . import kernels

        return getattr(kernels, name)


K = _Numba()

ULP = 1
SPARSE_XOR = 2
DENSE_XOR = 3
OVERWRITE = 4
ULP_HIST = 5
ULP2 = 6
ULP2_HIST = 7
ENCODING_NAMES = {ULP: "ulp", SPARSE_XOR: "sparse_xor", DENSE_XOR: "dense_xor", OVERWRITE: "overwrite",
                  ULP_HIST: "ulp_hist", ULP2: "ulp2", ULP2_HIST: "ulp2_hist"}
HIST_ENCODINGS = (ULP_HIST, ULP2_HIST)  # the encodings coded against the stream's history (they need it to decode)

_tls = threading.local()


def scratch_array(name: str, n: int, dt: np.dtype) -> np.ndarray:
    """A per-thread reusable array of at least ``n`` entries (its first ``n`` returned). Hazard: the
    next call with the same name on the same thread reuses the memory, so results in it must be used
    or copied first. Fresh multi-MiB arrays per chunk cost a page fault per touched page and an unmap
    (about 20% of the scan over a real pair)."""
    key = (name, np.dtype(dt).str)
    bufs = getattr(_tls, "scratch", None)
    if bufs is None:
        bufs = _tls.scratch = {}
    a = bufs.get(key)
    if a is None or a.size < n:
        a = bufs[key] = np.empty(max(n, 1), dt)
    return a[:n]


@dataclass(frozen=True)
class EncodedChunk:
    encoding: int
    payload: bytes
    n_changed: int
    decoded_len: int  # bytes the zstd stage expands to (0 for ULP)


@dataclass(frozen=True)
class Patch:
    """Decoded chunk: either sparse (positions, values) or a full dense image of the chunk."""

    positions: np.ndarray | None  # sorted int64 element indices
    values: np.ndarray | None  # target bits at those positions (uint view of the dtype)
    dense: np.ndarray | None  # the whole target chunk (uint view)
    # The additive digest's move by these changes, where the decoder was asked for it and took it in its
    # pass (``decode_chunk(digest=)``); None otherwise (the caller moves the digest itself).
    moved: np.ndarray | None = None

    def apply_to(self, view: np.ndarray) -> None:
        """Write the target bits into ``view`` (the chunk's elements, same uint dtype). Idempotent."""
        if self.dense is not None:
            view[:] = self.dense
        elif self.positions is not None and self.positions.size:
            elements.put(view, self.positions, self.values)


def _kind(dt: DType) -> int:
    return {"float": KIND_FLOAT, "int": KIND_INT}.get(dt.kind, KIND_UINT)


def _ctx(dt: DType) -> tuple[int, int, int]:
    """(shift, mask, n_contexts) selecting a float's exponent field; a single context otherwise."""
    if dt.kind == "float":
        return dt.man_bits, (1 << dt.exp_bits) - 1, 1 << dt.exp_bits
    return 0, 0, 1


def max_payload_len(dt: DType, n: int) -> int:
    """Hard limit on one chunk's payload: never more than a zstd'd overwrite could need, plus slack."""
    return n * dt.itemsize + n * dt.itemsize // 64 + 4096
