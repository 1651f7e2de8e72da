"""Additive tensor digests: combinable across any partition of a tensor's elements.

``digest(T) = ( sum_i h_0(i, b_i) mod 2^64 , sum_i h_1(i, b_i) mod 2^64 )`` over the elements of a
checkpoint tensor, ``i`` the checkpoint flat index and ``b_i`` the element's bits, with

    h_l(i, b) = mix(mix(i XOR s_l) XOR (b * 0x9E3779B97F4A7C15))

where ``mix`` is the splitmix64 finalizer (a bijection of 64-bit words) and ``(s_0, s_1)`` are two
64-bit seeds from BLAKE3 of the tensor's name, dtype and shape. Because it is a sum, the digests of the
parts of any partition add up to the digest of the whole: trainer ranks (one partition) all-reduce a
few bytes to the tensor digest, rollout ranks (another partition) all-reduce theirs to the same value,
and no rank ever holds the whole tensor. A part's contribution is computed in O(chunk) memory.

What it is for: accidental errors. A wrong map (an element read from or written to the wrong place),
a lost or duplicated chunk, a torn write, a bit flip: each changes some terms of the sum by
pseudo-random 64-bit amounts, so a mismatch is missed with probability about 2^-64 per lane (2^-128
for both, heuristically). What it is NOT for: an adversary. Sums of a known function are easy to
steer (pick elements whose terms cancel), so it gives no collision resistance. Integrity and
authenticity of what travels come from BLAKE3 over each transported part (named with size in the
version manifest) and an optional Ed25519 signature over the manifest.

Digests are 16 bytes, written as 32 hex digits (lane 0 little-endian, then lane 1). All-reducing
them with integer collectives that might not wrap modulo 2^64 is done through ``to_limbs`` /
``from_limbs`` (eight 16-bit limbs in int64, exact for up to 2^47 contributors).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence

import blake3
import numpy as np

_DOMAIN = b"deltarefit.additive.v1\0"
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_G = np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)

ZERO = np.zeros(2, np.uint64)


def seeds(name: str, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """The two lane seeds of a checkpoint tensor (a different tensor gives unrelated digests); a
    read-only array."""
    return _seeds(name, dtype, tuple(int(d) for d in shape))


@functools.lru_cache(maxsize=4096)  # asked once per chunk applied: a hash per call showed in profiles
def _seeds(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    h = blake3.blake3(_DOMAIN)
    b = name.encode("utf-8")
    h.update(struct.pack("<I", len(b)) + b + dtype.encode("ascii") + b"\0" + struct.pack("<I", len(shape)))
    for d in shape:
        h.update(struct.pack("<Q", int(d)))
    out = np.frombuffer(h.digest(16), "<u8").astype(np.uint64)
    out.flags.writeable = False
    return out


def _mix(x: np.ndarray) -> np.ndarray:
    # splitmix64 finalizer, in place on a fresh uint64 array (numpy wraps uint64 arithmetic)
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


def _native():
    """The native kernel (``codec._native.digest``) where it was built and is not switched off
    (``DELTAREFIT_KERNELS=numba``); None otherwise."""
    from ..codec import native

    return native.kernel("digest")


def _numba_kernels():
    """(partial kernel, run kernel) in numba (``_additive_numba``): the fallback where no native kernel was
    built, imported on first use so that importing this module never imports numba."""
    from . import _additive_numba

    return _additive_numba.partial_kernel, _additive_numba.run_kernel


def _sums(flat: np.ndarray | None, start: int, bits: np.ndarray, seed: np.ndarray, force_numba: bool = False
          ) -> np.ndarray:
    """The two lanes' sums of ``bits`` (unsigned, contiguous) at ``flat`` (int64) or ``start, start + 1, ...``."""
    nat = None if force_numba else _native()
    if nat is not None:
        a0, a1 = nat(flat, int(start), bits, bits.dtype.itemsize, int(seed[0]), int(seed[1]))
    elif flat is None:
        a0, a1 = _numba_kernels()[1](np.int64(start), bits, np.uint64(seed[0]), np.uint64(seed[1]))
    else:
        a0, a1 = _numba_kernels()[0](flat, bits, np.uint64(seed[0]), np.uint64(seed[1]))
    return np.array([a0, a1], np.uint64)


def partial_run(seed: np.ndarray, start: int, bits: np.ndarray) -> np.ndarray:
    """Contribution of consecutive elements at checkpoint flat indices ``start, start + 1, ...``."""
    bits = np.ascontiguousarray(np.asarray(bits).reshape(-1))
    if bits.dtype.kind not in "ui":
        bits = bits.view(f"<u{bits.dtype.itemsize}")
    return _sums(None, start, bits.view(f"<u{bits.dtype.itemsize}"), seed)


def change(seed: np.ndarray, flat: np.ndarray, old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """How the digest moves when the elements at ``flat`` go from bits ``old`` to bits ``new``."""
    return sub(partial(seed, flat, new), partial(seed, flat, old))


def move(seed: np.ndarray, start: int, view: np.ndarray, pos: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``change(seed, start + pos, view[pos], new)``: how the digest moves when the elements at ``pos`` of
    ``view`` (a flat unsigned array whose element 0 is checkpoint flat index ``start``) become ``new``.
    One native call without the GIL where it was built (no gathered copies), else ``change``."""
    from ..codec import elements

    nat = elements.native_for(view, pos, new)
    if nat is not None:
        a0, a1 = nat.digest_move(view, pos, new, view.dtype.itemsize, int(start), int(seed[0]), int(seed[1]))
        return np.array([a0, a1], np.uint64)
    elements.check_positions(pos, view.size, "digest_move")
    return change(seed, pos + start, view[pos], new)


def partial(seed: np.ndarray, flat: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """Contribution (2 lanes, uint64) of elements at checkpoint flat indices ``flat`` holding ``bits``."""
    flat = np.ascontiguousarray(np.asarray(flat, np.int64).reshape(-1))
    bits = np.ascontiguousarray(np.asarray(bits).reshape(-1))
    if bits.dtype.kind not in "ui":
        bits = bits.view(f"<u{bits.dtype.itemsize}")
    if flat.size != bits.size:
        raise ValueError(f"{flat.size} indices for {bits.size} elements")
    return _sums(flat, 0, bits.view(f"<u{bits.dtype.itemsize}"), seed)


_BLOCK = 1 << 16


def _partial_numpy(seed: np.ndarray, flat: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """The reference definition in plain numpy (tests compare the compiled kernel with it)."""
    flat, bits = np.asarray(flat).reshape(-1), np.asarray(bits).reshape(-1)
    out = np.zeros(2, np.uint64)
    for a in range(0, flat.size, _BLOCK):
        b = bits[a:a + _BLOCK].astype(np.uint64) * _G
        f = flat[a:a + _BLOCK].astype(np.uint64)
        sums = np.empty(2, np.uint64)
        for lane in range(2):
            x = _mix(f ^ seed[lane])
            x ^= b
            sums[lane] = _mix(x).sum(dtype=np.uint64)
        out += sums  # array addition wraps silently (numpy scalar addition would warn)
    return out


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (np.asarray(a, np.uint64) + np.asarray(b, np.uint64)).astype(np.uint64)


def sub(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (np.asarray(a, np.uint64) - np.asarray(b, np.uint64)).astype(np.uint64)


def to_hex(d: np.ndarray) -> str:
    return np.asarray(d, "<u8").tobytes().hex()


def from_hex(s: str) -> np.ndarray:
    raw = bytes.fromhex(s)
    if len(raw) != 16:
        raise ValueError(f"an additive digest is 32 hex digits, got {len(s)}")
    return np.frombuffer(raw, "<u8").astype(np.uint64)


def to_limbs(ds: np.ndarray) -> np.ndarray:
    """int64 limbs (shape ``(..., 8)``) of digests (shape ``(..., 2)``): sum limbs, then ``from_limbs``."""
    d = np.asarray(ds, np.uint64)
    sh = np.arange(4, dtype=np.uint64) * np.uint64(16)
    limbs = (d[..., :, None] >> sh) & np.uint64(0xFFFF)
    return limbs.reshape(*d.shape[:-1], 8).astype(np.int64)


def from_limbs(limbs: np.ndarray) -> np.ndarray:
    x = np.asarray(limbs, np.int64).reshape(*np.shape(limbs)[:-1], 2, 4).astype(np.uint64)
    sh = np.arange(4, dtype=np.uint64) * np.uint64(16)
    return (x << sh).sum(axis=-1, dtype=np.uint64)


def full_digest(name: str, dtype: str, bits: np.ndarray, chunk: int = 1 << 20) -> np.ndarray:
    """Digest of a whole tensor held in one place (e.g. a full export used as an independent check)."""
    shape = tuple(int(d) for d in np.shape(bits))
    s = seeds(name, dtype, shape)
    flat = np.asarray(bits).reshape(-1)
    acc = ZERO.copy()
    for a in range(0, flat.size, chunk):
        acc = add(acc, partial_run(s, a, flat[a:a + chunk]))
    return acc
