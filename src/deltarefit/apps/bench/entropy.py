"""Empirical conditional entropy bound H(D | base exponent, tensor) of a bf16 checkpoint pair.

Contract:

* ``D`` is the signed ulp distance ``key(t) - key(b)`` between the base and target bit patterns, with
  the monotone key of :func:`ulp_key`: ``0xFFFF - u`` for negative patterns, ``u + 0x8000`` for
  positive ones. The key maps bf16 bit patterns onto ``0..0xFFFF`` in value order with ``-0.0 -> 0x7FFF``
  and ``+0.0 -> 0x8000``, so -0.0 and +0.0 are 1 apart and a sign crossing costs no extra distance.
  (The brief for this module wrote the positive branch as ``u + 0x10000``; that leaves a gap of 0x8000
  codes between the two signs, so -0.0 and +0.0 would be 0x8001 apart, contradicting the stated
  property; the gap-free key is used here.)
* For each tensor and each bf16 exponent value ``e = (b >> 7) & 0xFF`` of the base, the empirical
  distribution of ``D`` over the ``n_e`` elements of that context (``D = 0`` included) contributes
  ``n_e * H_e`` bits; :func:`entropy_bound` returns the sum over all contexts and tensors.
* Tensors that are not ``BF16`` contribute ``0`` bits when identical, else the empirical entropy of
  their XOR patterns (one context per tensor) times their element count.
* This is a zeroth-order bound for codecs that model ``D`` per (tensor, exponent) context without
  model cost: real codecs pay for their tables and may beat it with richer context (positions,
  neighbours). It is a reference point, not a theorem about every codec.

Memory is O(tensor); only the changed elements are sorted.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import numpy as np

from ._st import iter_pair

log = logging.getLogger(__name__)

_D_OFFSET = 1 << 17  # |D| <= 0xFFFF < 2**17


def ulp_key(u: np.ndarray) -> np.ndarray:
    """Monotone key of bf16 bit patterns (uint16) as int32 in ``0..0xFFFF``; -0.0/+0.0 are 1 apart."""
    u = u.astype(np.int32)
    return np.where(u & 0x8000, 0xFFFF - u, u + 0x8000).astype(np.int32)


def ulp_unkey(k: np.ndarray) -> np.ndarray:
    """Inverse of :func:`ulp_key` (int keys in ``0..0xFFFF`` -> uint16 patterns)."""
    k = k.astype(np.int32)
    return np.where(k < 0x8000, 0xFFFF - k, k - 0x8000).astype(np.uint16)


def ulp_distance(b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Signed ulp distance ``key(t) - key(b)`` (int32) between two uint16 bf16 pattern arrays."""
    return ulp_key(t) - ulp_key(b)


def _xlog2x(c: np.ndarray) -> float:
    c = c[c > 0].astype(np.float64)
    return float(np.sum(c * np.log2(c)))


def bf16_tensor_bits(b: np.ndarray, t: np.ndarray) -> float:
    """``sum_e n_e * H(D | e)`` for one bf16 tensor given as uint16 patterns."""
    b = b.ravel()
    t = t.ravel()
    e = ((b >> 7) & 0xFF).astype(np.int64)
    n_e = np.bincount(e, minlength=256)
    changed = b != t
    if not changed.any():
        return 0.0
    ec = e[changed]
    d = ulp_distance(b[changed], t[changed]).astype(np.int64)
    _, cnt = np.unique((ec << 18) | (d + _D_OFFSET), return_counts=True)
    zeros = n_e - np.bincount(ec, minlength=256)
    return max(0.0, _xlog2x(n_e) - _xlog2x(cnt) - _xlog2x(zeros))


def other_tensor_bits(b: np.ndarray, t: np.ndarray) -> float:
    """Entropy bound for a non-bf16 tensor: 0 when identical, else ``n * H(XOR)``."""
    if np.array_equal(b, t):
        return 0.0
    _, cnt = np.unique(np.bitwise_xor(b.ravel(), t.ravel()), return_counts=True)
    return max(0.0, _xlog2x(np.array([cnt.sum()])) - _xlog2x(cnt))


@dataclass
class EntropyBound:
    bound_bits: float
    full_bits: int  # 8 * raw tensor bytes of the target
    changed_elements: int
    total_elements: int
    per_tensor_bits: dict[str, float] = field(default_factory=dict)

    @property
    def bound_bytes(self) -> float:
        return self.bound_bits / 8

    @property
    def ratio(self) -> float:
        """``full_bits / bound_bits`` (inf for identical checkpoints)."""
        return self.full_bits / self.bound_bits if self.bound_bits > 0 else float("inf")

    @property
    def bits_per_changed(self) -> float:
        return self.bound_bits / self.changed_elements if self.changed_elements else 0.0

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d.pop("per_tensor_bits")
        d.update(ratio=self.ratio, bound_bytes=self.bound_bytes, bits_per_changed=self.bits_per_changed)
        return d


def entropy_bound(base_path: str, target_path: str) -> EntropyBound:
    """H(D | base exponent, tensor) summed over a checkpoint pair; see the module docstring."""
    total_bits = 0.0
    full_bits = changed = total = 0
    per: dict[str, float] = {}
    for info, b, t in iter_pair(base_path, target_path):
        bits = bf16_tensor_bits(b, t) if info.dtype == "BF16" else other_tensor_bits(b, t)
        per[info.name] = bits
        total_bits += bits
        full_bits += 8 * info.nbytes
        changed += int(np.count_nonzero(b != t))
        total += b.size
    log.debug("entropy bound %s: %.0f bits for %d changed of %d", target_path, total_bits, changed, total)
    return EntropyBound(total_bits, full_bits, changed, total, per)
