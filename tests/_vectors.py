"""The golden vectors of tests/vectors: where they live, how to read one, and the recipe that rebuilds the
checkpoints of a vector whose tensors are too large to store (shared by ``scripts/make_vectors.py``,
which writes the vectors, and ``tests/test_vectors.py``, which checks them).

A vector is a directory ``tests/vectors/<name>/`` holding

* ``vector.json``: what the vector is for, how its delta was written (``sums``), the base and target
  fingerprints, per tensor its dtype, shape, BLAKE3 tensor digest and additive digest (base and target),
  the manifest's ``op`` per tensor, and per chunk record (tensor name, chunk_index, encoding name,
  n_changed); plus the sha256 of every stored file;
* ``delta.drd``: the delta's exact bytes (deltarefit.encode of base -> target);
* ``base.safetensors`` / ``target.safetensors``: the two checkpoints, unless ``vector.json`` has a
  ``generated`` recipe (below): then the test rebuilds them from it and checks them against the stored
  fingerprints and digests before anything else.

Generated tensors (``synth_pair``) take their bits from BLAKE3's extendable output keyed by a label, so
they depend on nothing but BLAKE3 and the integer arithmetic written here (no RNG stream of a library).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import blake3
import numpy as np
from _pairs import write_raw_safetensors

VECTORS_DIR = Path(__file__).parent / "vectors"
DELTA = "delta.drd"
_XOF_DOMAIN = b"deltarefit.vectors.v1\0"

# A stored tensor: (safetensors dtype, shape, bits as the dtype's unsigned integers, flat).
Tensors = dict[str, tuple[str, tuple[int, ...], np.ndarray]]


def vector_names() -> list[str]:
    return sorted(p.parent.name for p in VECTORS_DIR.glob("*/vector.json"))


def load(name: str) -> dict[str, Any]:
    with open(VECTORS_DIR / name / "vector.json", encoding="utf-8") as f:
        return json.load(f)


def xof(label: str, n: int) -> bytes:
    """``n`` bytes of BLAKE3's extendable output of ``"deltarefit.vectors.v1\\0" || label``."""
    return blake3.blake3(_XOF_DOMAIN + label.encode("utf-8")).digest(n)


def _xof_u(label: str, n: int, dt: str) -> np.ndarray:
    return np.frombuffer(xof(label, n * np.dtype(dt).itemsize), dt).copy()


def synth_pair(recipe: dict[str, Any]) -> tuple[Tensors, Tensors]:
    """(base, target) of a generated vector. ``recipe["tensors"]`` lists, per tensor, ``name``, ``dtype``
    (BF16 or F32), ``shape``, ``first_changed`` (no element before this flat index changes) and
    ``rate_256`` (an element at or past it changes when its pick byte is below this).

    Base bits: sign and mantissa from ``xof(name + "/base")``, the exponent field forced into eight
    values around 2^-9 .. 2^-2 (like trained weights). Target: each changed element moves by +1 or -1
    in its integer view (one ulp), the direction from ``xof(name + "/sign")``, which elements from
    ``xof(name + "/pick")``."""
    base: Tensors = {}
    target: Tensors = {}
    for t in recipe["tensors"]:
        name, dt, shape = t["name"], t["dtype"], tuple(t["shape"])
        n = int(np.prod(shape, dtype=np.int64))
        if dt == "BF16":
            u = _xof_u(name + "/base", n, "<u2")
            b = (u & np.uint16(0x807F)) | ((((u >> np.uint16(7)) & np.uint16(7)) + np.uint16(118)) << np.uint16(7))
        elif dt == "F32":
            u = _xof_u(name + "/base", n, "<u4")
            b = (u & np.uint32(0x807FFFFF)) | ((((u >> np.uint32(23)) & np.uint32(7)) + np.uint32(118))
                                               << np.uint32(23))
        else:
            raise ValueError(f"recipe dtype {dt} is not one synth_pair makes")
        pick = np.frombuffer(xof(name + "/pick", n), np.uint8)
        sign = np.frombuffer(xof(name + "/sign", n), np.uint8) & 1
        idx = np.flatnonzero(pick < t["rate_256"])
        idx = idx[idx >= t["first_changed"]]
        tg = b.copy()
        step = np.where(sign[idx] == 1, 1, -1).astype(np.int64)
        tg[idx] = (tg[idx].astype(np.int64) + step).astype(b.dtype)  # exponents 118..125: never wraps
        base[name] = (dt, shape, b)
        target[name] = (dt, shape, tg)
    return base, target


def write_checkpoint(path: str | os.PathLike[str], tensors: Tensors) -> str:
    """A single safetensors file holding ``tensors`` (in their given order)."""
    write_raw_safetensors(path, {k: (dt, shape, bits) for k, (dt, shape, bits) in tensors.items()})
    return os.fspath(path)


def checkpoints(name: str, into: str | os.PathLike[str]) -> tuple[str, str]:
    """Paths of the vector's base and target checkpoint files: the stored ones, or for a generated
    vector files written into ``into`` from its recipe."""
    v = load(name)
    d = VECTORS_DIR / name
    if "generated" not in v:
        return str(d / "base.safetensors"), str(d / "target.safetensors")
    base, target = synth_pair(v["generated"])
    os.makedirs(into, exist_ok=True)
    return (write_checkpoint(Path(into) / "base.safetensors", base),
            write_checkpoint(Path(into) / "target.safetensors", target))
