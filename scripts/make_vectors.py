"""Write the golden vectors of tests/vectors (FORMAT.md v1, pinned byte for byte by tests/test_vectors.py).

The whole-delta vectors are deltas of format version 1 (``FORMAT_VERSION``): encoded with
``format_version=1``, they pin the bytes a version 1 writer writes, which every later reader reads.

    PYTHONPATH=src python scripts/make_vectors.py [--out tests/vectors] [--check]

Run it only on an intended change of the delta format or of the encoder's choices (and review the
vectors' diff: every changed delta, fingerprint or chunk encoding is a change a reader of the format
sees). ``--check`` writes nothing and says whether the stored vectors are what it would write.

Everything is deterministic: the small vectors' tensors come from ``numpy.random.default_rng`` with
the fixed seeds below and are stored as safetensors files; the large one (``multiseg``) is rebuilt by
``tests/_vectors.synth_pair`` from BLAKE3 output (its recipe is stored, its checkpoints are not).
Deltas are encoded with the native kernels, and must come out the same with numba's (checked here
before anything is written). The intended encoding of every changed tensor is stated below and the
script refuses to write a vector whose delta did not choose it, so each vector keeps exercising what
it is for.

The vectors:

* ``ulp_floats``: BF16, F16, F32, F64, F8_E4M3, F8_E5M2 tensors of trained-weight-like values moved by
  a few ulps, each with special values changed among them (NaN payloads of either sign, inf to NaN,
  -inf to -max, +0 to -0, -0 to the smallest subnormal, subnormal steps, the largest subnormal to the
  smallest normal, max to inf; the fp8 formats their own NaN/inf rules) and some left unchanged:
  every chunk ``ulp``.
* ``ulp_ints``: I8, I16, I32, I64, U8, U16, U32, U64 and BOOL tensors moved by small integer steps
  (BOOL: flips): ``ulp``.
* ``sparse_xor``: integer tensors of every width, BOOL, and float tensors whose changes are far in ulps
  (sign or exponent bit flips) at regular strides: ``sparse_xor`` (the ulp coding spends more).
* ``dense``: chunks changed densely: a constant XOR pattern on every other element or every fourth
  (``dense_xor``), and targets that are one constant (``overwrite`` inside a ``patch``).
* ``structure``: every structural op: ``same`` (one tensor with bytes, one empty), ``patch`` (a
  tensor, a 0-d scalar, a BOOL), ``add`` (with bytes, and empty), ``remove``, ``replace`` by dtype
  and by shape alone (identical bytes); a non-ASCII name; written without additive digests.
* ``structure_sums``: the same pair written with ``sums=True`` (``sum`` in base and target of every
  ``same``/``patch`` tensor).
* ``multiseg``: a BF16 tensor of three 1 MiB segments whose first does not change (records with
  chunk_index 1 and 2 only) and an F32 tensor of 1.25 MiB changed only in its short last segment.
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
import itertools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

import _vectors as V  # noqa: E402
import zstandard  # noqa: E402

import deltarefit  # noqa: E402
from deltarefit.codec import chunk as C  # noqa: E402
from deltarefit.codec import native as NAT  # noqa: E402
from deltarefit.dtypes import DTYPES  # noqa: E402
from deltarefit.format import DeltaReader  # noqa: E402
from deltarefit.integrity import additive as additive  # noqa: E402
from deltarefit.integrity import fingerprint_from_digests, tensor_digest  # noqa: E402

Tensors = V.Tensors
FLOATS = ["BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2"]
INTS = ["I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"]


# The whole-delta vectors' format version: version 1's bytes, pinned (FORMAT.md, "Versions").
FORMAT_VERSION = 1


def _u(dt: str) -> np.dtype:
    return DTYPES[dt].uint


def weights(rng: np.random.Generator, dt: str, n: int) -> np.ndarray:
    """Bits of trained-weight-like floats: random sign and mantissa, the exponent field within eight
    values below the bias (magnitudes about 2^-9 .. 2^-1)."""
    d = DTYPES[dt]
    bias = (1 << (d.exp_bits - 1)) - 1
    lo = max(1, bias - 9)
    sign = rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(d.bits - 1)
    exp = rng.integers(lo, bias, n, dtype=np.uint64, endpoint=False) << np.uint64(d.man_bits)
    man = rng.integers(0, 1 << d.man_bits, n, dtype=np.uint64)
    return (sign | exp | man).astype(_u(dt))


def bump(rng: np.random.Generator, bits: np.ndarray, rate: float, steps=(1, -1, 2, -2, 5)) -> np.ndarray:
    """A copy with a ``rate`` of the elements moved by ``steps`` in their integer view (wrapping)."""
    out = bits.copy()
    idx = rng.choice(bits.size, size=max(1, round(rate * bits.size)), replace=False)
    d = rng.choice(np.array(steps, np.int64), idx.size)
    out[idx] = (out[idx].astype(np.int64) + d).astype(np.uint64).astype(bits.dtype)
    return out


def specials(dt: str) -> tuple[list[tuple[int, int]], list[int]]:
    """(changed (base bits, target bits) pairs, unchanged bits) of special values of a float dtype."""
    d = DTYPES[dt]
    s, m = 1 << (d.bits - 1), d.man_bits
    if dt == "F8_E4M3":  # no inf; NaN is S.1111.111 only
        return ([(0x7E, 0x7F), (0xFF, 0xFE), (0x00, 0x80), (0x80, 0x01), (0x01, 0x02), (0x07, 0x08), (0x86, 0x87)],
                [0x7F, 0x80, 0x03])
    if dt == "F8_E5M2":  # inf S.11111.00, NaN S.11111.{01,10,11}
        return ([(0x7D, 0x7E), (0x7C, 0x7D), (0xFC, 0xFB), (0x00, 0x80), (0x80, 0x01), (0x01, 0x02), (0x03, 0x04),
                 (0x7B, 0x7C), (0xFF, 0xFD)],
                [0x7F, 0x7C, 0x80, 0x02])
    inf = ((1 << d.exp_bits) - 1) << m
    qnan = inf | (1 << (m - 1))
    payload = (0xABC if m > 12 else 0x5) & ((1 << (m - 1)) - 1)
    changed = [
        (qnan, qnan | 1),  # NaN payload
        (qnan, qnan | payload),  # a larger payload move
        (s | qnan, s | qnan | 3),  # negative NaN payload
        (inf, inf + 1),  # inf -> signalling NaN
        (s | inf, (s | inf) - 1),  # -inf -> -max
        (0, s),  # +0 -> -0
        (s, 1),  # -0 -> smallest subnormal
        (1, 2),  # subnormal step
        (s | ((1 << m) - 1), s | (1 << m)),  # -largest subnormal -> -smallest normal
        (inf - 1, inf),  # max -> inf
    ]
    return changed, [qnan | 5, s, 3, inf, s | inf]


def with_specials(dt: str, base: np.ndarray, target: np.ndarray, stride: int = 7) -> None:
    changed, same = specials(dt)
    for k, (b, t) in enumerate(changed):
        base[k * stride], target[k * stride] = b, t
    for k, v in enumerate(same, start=len(changed)):
        base[k * stride] = target[k * stride] = v


# ----------------------------------------------------------------------------------------- vectors
# Each builder returns (base, target, intent): intent maps a changed tensor to the encoding its every
# chunk must get.


def ulp_floats():
    rng = np.random.default_rng(101)
    base: Tensors = {}
    target: Tensors = {}
    intent = {}
    for dt in FLOATS:
        n = 2048
        b = weights(rng, dt, n)
        t = bump(rng, b, 0.03, steps=(1, -1, 1, -1, 2, -2, 3) if DTYPES[dt].itemsize > 1 else (1, -1))
        with_specials(dt, b, t)
        name = f"{dt.lower()}.weight"
        base[name], target[name] = (dt, (32, 64), b), (dt, (32, 64), t)
        intent[name] = "ulp"
    return base, target, intent


def ulp_ints():
    rng = np.random.default_rng(202)
    base: Tensors = {}
    target: Tensors = {}
    intent = {}
    for dt in INTS:
        u = _u(dt)
        signed = dt.startswith("I")
        n = 1024
        v = rng.integers(-1000 if signed else 1000, 1000 if signed else 3000, n, dtype=np.int64)
        if DTYPES[dt].itemsize == 1:
            v = rng.integers(-100 if signed else 20, 100 if signed else 220, n, dtype=np.int64)
        b = v.astype(u) if not signed else v.astype(f"<i{DTYPES[dt].itemsize}").view(u)
        t = bump(rng, b, 0.03, steps=(1, -1, 1, -1, 2, -3))
        name = f"{dt.lower()}.steps"
        base[name], target[name] = (dt, (n,), b), (dt, (n,), t)
        intent[name] = "ulp"
    b = (rng.random(4096) < 0.5).astype(np.uint8)
    t = b.copy()
    t[rng.choice(b.size, 60, replace=False)] ^= 1
    base["bool.mask"], target["bool.mask"] = ("BOOL", (64, 64), b), ("BOOL", (64, 64), t)
    intent["bool.mask"] = "ulp"
    return base, target, intent


def sparse_xor():
    rng = np.random.default_rng(303)
    base: Tensors = {}
    target: Tensors = {}
    intent = {}
    for dt in [*INTS, "BOOL", "F32", "BF16", "F64"]:
        d = DTYPES[dt]
        u = d.uint
        n = 1024
        if d.kind == "float":
            b = weights(rng, dt, n)
            mask = 1 << (d.bits - 1)  # a sign flip: about 2^(w-1) ulps away
        elif dt == "BOOL":
            b = np.zeros(n, np.uint8)
            mask = 1
        else:
            b = rng.integers(0, np.iinfo(u).max, n, dtype=u, endpoint=True)
            mask = 1 << (d.bits - 2)
        t = b.copy()
        t[5::37] ^= u.type(mask)
        name = f"{dt.lower()}.flips"
        base[name], target[name] = (dt, (n,), b), (dt, (n,), t)
        intent[name] = "sparse_xor"
    return base, target, intent


def dense():
    rng = np.random.default_rng(404)
    base: Tensors = {}
    target: Tensors = {}
    intent = {}

    def put(name, dt, b, t, enc):
        base[name], target[name] = (dt, (b.size,), b), (dt, (t.size,), t)
        intent[name] = enc

    b = weights(rng, "BF16", 2048)
    put("bf16.xor_every_2nd", "BF16", b, b ^ np.tile(np.array([0x5555, 0], np.uint16), 1024), "dense_xor")
    b = rng.integers(0, 1 << 16, 2048, dtype=np.uint16)
    put("i16.xor_every_4th", "I16", b, b ^ np.tile(np.array([0, 0x0F0F, 0, 0], np.uint16), 512), "dense_xor")
    b = weights(rng, "F64", 512)
    put("f64.xor_every_4th", "F64", b, b ^ np.tile(np.array([1 << 52, 0, 0, 0], np.uint64), 128), "dense_xor")
    b = weights(rng, "F32", 1024)
    put("f32.to_ones", "F32", b, np.full(1024, 0x3F800000, np.uint32), "overwrite")
    b = rng.integers(0, 256, 2048, dtype=np.uint8)
    put("u8.to_seven", "U8", b, np.full(2048, 7, np.uint8), "overwrite")
    b = weights(rng, "F8_E4M3", 2048)
    put("f8_e4m3.to_zero", "F8_E4M3", b, np.zeros(2048, np.uint8), "overwrite")
    return base, target, intent


def structure():
    rng = np.random.default_rng(505)
    base: Tensors = {}
    target: Tensors = {}
    w = weights(rng, "BF16", 64)
    base["a.same"] = target["a.same"] = ("BF16", (8, 8), w)
    base["b.empty_same"] = target["b.empty_same"] = ("BF16", (0, 4), np.zeros(0, np.uint16))
    p = weights(rng, "F32", 256)
    base["c.patch"], target["c.patch"] = ("F32", (16, 16), p), ("F32", (16, 16), bump(rng, p, 0.05))
    base["d.scalar"], target["d.scalar"] = ("BF16", (), np.array([0x3FC0], np.uint16)), \
        ("BF16", (), np.array([0x3FC1], np.uint16))
    m = (rng.random(100) < 0.5).astype(np.uint8)
    mt = m.copy()
    mt[[3, 50, 99]] ^= 1
    base["e.mask"], target["e.mask"] = ("BOOL", (100,), m), ("BOOL", (100,), mt)
    target["f.added"] = ("I64", (5,), np.arange(-2, 3, dtype=np.int64).view(np.uint64))
    target["g.added_empty"] = ("U8", (0,), np.zeros(0, np.uint8))
    base["h.removed"] = ("F16", (7,), weights(rng, "F16", 7))
    r = weights(rng, "F32", 10)
    base["i.retyped"] = ("F32", (10,), r)
    target["i.retyped"] = ("BF16", (10,), (r >> np.uint32(16)).astype(np.uint16))
    s = weights(rng, "BF16", 24)
    base["j.reshaped"], target["j.reshaped"] = ("BF16", (4, 6), s), ("BF16", (6, 4), s.copy())
    u = weights(rng, "F16", 32)
    base["k.ünïcode.wéight"], target["k.ünïcode.wéight"] = ("F16", (32,), u), ("F16", (32,), bump(rng, u, 0.1))
    intent = {"c.patch": "ulp", "d.scalar": "dense_xor", "e.mask": "ulp", "k.ünïcode.wéight": "ulp",
              "f.added": "overwrite", "i.retyped": "overwrite", "j.reshaped": "overwrite"}
    return base, target, intent


MULTISEG = {"tensors": [
    {"name": "big.bf16", "dtype": "BF16", "shape": [1536, 1024], "first_changed": 1 << 19, "rate_256": 8},
    {"name": "tail.f32", "dtype": "F32", "shape": [327680], "first_changed": 1 << 18, "rate_256": 5},
]}


def multiseg():
    base, target = V.synth_pair(MULTISEG)
    return base, target, {"big.bf16": "ulp", "tail.f32": "ulp"}


VECTORS = [
    ("ulp_floats", ulp_floats, False, None),
    ("ulp_ints", ulp_ints, False, None),
    ("sparse_xor", sparse_xor, False, None),
    ("dense", dense, False, None),
    ("structure", structure, False, None),
    ("structure_sums", structure, True, None),
    ("multiseg", multiseg, False, MULTISEG),
]
ABOUT = {
    "ulp_floats": "ulp chunks of every float dtype, with NaN payloads, signed zeros, subnormals and infinities "
                  "changed and unchanged",
    "ulp_ints": "ulp chunks of every integer dtype and BOOL, small steps",
    "sparse_xor": "sparse_xor chunks: integer, BOOL and float tensors with far changes at a regular stride",
    "dense": "dense_xor and overwrite chunks inside patch tensors",
    "structure": "every op (same, patch, add, remove, replace by dtype and by shape), empty and 0-d tensors, "
                 "a non-ASCII name; no additive digests",
    "structure_sums": "the structure pair written with sums=True: additive digests in the manifest",
    "multiseg": "tensors over several 1 MiB segments: records with chunk_index > 0, a short last segment; "
                "checkpoints rebuilt from the 'generated' recipe (tests/_vectors.synth_pair)",
}


def _sha(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _meta(name: str, t: tuple[str, tuple[int, ...], np.ndarray] | None) -> dict[str, Any] | None:
    if t is None:
        return None
    dt, shape, bits = t
    flat = np.ascontiguousarray(bits).reshape(-1)
    return {"dtype": dt, "shape": list(shape),
            "digest": tensor_digest(dt, shape, flat.view(np.uint8)).hex(),
            "sum": additive.to_hex(additive.full_digest(name, dt, flat.reshape(shape)))}


def _encode(base: str, target: str, out: str, sums: bool, native: bool) -> bytes:
    was = NAT.USE_NATIVE
    NAT.USE_NATIVE = native
    try:
        deltarefit.encode(base, target, out, threads=2, sums=sums, durable=False, format_version=FORMAT_VERSION)
    finally:
        NAT.USE_NATIVE = was
    return Path(out).read_bytes()


def build(name: str, fn, sums: bool, recipe: dict | None, work: Path) -> None:
    """Write vector ``name`` into ``work/final/name`` (its scratch files under ``work/name``)."""
    base, target, intent = fn()
    tmp = work / name
    tmp.mkdir(parents=True)
    bpath = V.write_checkpoint(tmp / "base.safetensors", base)
    tpath = V.write_checkpoint(tmp / "target.safetensors", target)
    delta = _encode(bpath, tpath, str(tmp / V.DELTA), sums, native=NAT.ext is not None)
    if _encode(bpath, tpath, str(tmp / "numba.drd"), sums, native=False) != delta:
        raise SystemExit(f"{name}: the numba kernels write other bytes than the native ones")
    os.unlink(tmp / "numba.drd")
    with DeltaReader(str(tmp / V.DELTA)) as r:
        ops = {e.name: e.op for e in r.tensors}
        chunks = [[r.tensors[c.tensor_index].name, c.chunk_index, C.ENCODING_NAMES[c.encoding], c.n_changed]
                  for c in r.records]
    for tname, enc in intent.items():
        got = {c[2] for c in chunks if c[0] == tname}
        if got != {enc}:
            raise SystemExit(f"{name}: tensor {tname!r} was meant to be coded {enc}, the encoder chose {sorted(got)}")
    tensors = {}
    for tname in sorted(set(base) | set(target), key=lambda s: s.encode("utf-8")):
        tensors[tname] = {"op": ops[tname], "base": _meta(tname, base.get(tname)),
                          "target": _meta(tname, target.get(tname))}
    fp = {}
    for side, ts in (("base", base), ("target", target)):
        fp[side] = fingerprint_from_digests({k: bytes.fromhex(_meta(k, v)["digest"]) for k, v in ts.items()})
    vec: dict[str, Any] = {
        "name": name, "about": ABOUT[name], "format_version": FORMAT_VERSION, "sums": sums,
        "made_with": {"deltarefit": deltarefit.__version__, "zstandard": zstandard.__version__,
                      "libzstd": ".".join(map(str, zstandard.ZSTD_VERSION))},
        "base_fingerprint": fp["base"], "target_fingerprint": fp["target"],
        "tensors": tensors, "chunks": chunks,
    }
    if recipe is not None:
        vec["generated"] = recipe
    if sums:
        vec["device_split"] = "no: deltarefit.gpu.encode.encode_tensors writes no additive digests"
    files = [V.DELTA] if recipe is not None else [V.DELTA, "base.safetensors", "target.safetensors"]
    vec["files"] = {f: _sha(tmp / f) for f in files}
    with open(tmp / "vector.json", "w", encoding="utf-8") as f:
        json.dump(vec, f, indent=1, ensure_ascii=False)
        f.write("\n")
    final = work / "final" / name
    final.mkdir(parents=True)
    for f in [*files, "vector.json"]:
        shutil.copyfile(tmp / f, final / f)
    print(f"{name:16} {len(delta):7} bytes  " + ", ".join(
        f"{e}: {sum(1 for c in chunks if c[2] == e)}" for e in C.ENCODING_NAMES.values()))


HIST_DIR = "chunk_ulp_hist"


def _momentum_chain(rng: np.random.Generator, dt: str, n: int, steps: int) -> list[np.ndarray]:
    """Versions of ``n`` weights where an element that just moved moves again with probability 0.3,
    the same way 95% of the time; others move with probability 0.03 (as AdamW steps do)."""
    d = DTYPES[dt]
    v = weights(rng, dt, n)
    out, last = [v], np.zeros(n, np.int64)
    for _ in range(steps):
        again = (last != 0) & (rng.random(n) < 0.3)
        fresh = (last == 0) & (rng.random(n) < 0.03)
        step = np.where(rng.random(n) < 0.85, 1, rng.integers(2, 6, n))
        sgn = np.where(again, np.sign(last) * np.where(rng.random(n) < 0.95, 1, -1),
                       np.where(rng.random(n) < 0.5, 1, -1))
        delta = np.where(again | fresh, sgn * step, 0)
        new = (out[-1].astype(np.int64) + np.where(out[-1].astype(np.int64) >> (d.bits - 1), -delta, delta))
        new = new.astype(np.uint64).astype(_u(dt))
        last = np.where(new != out[-1], delta, 0)
        out.append(new)
    return out


def write_hist_chunks(out: Path) -> None:
    """``chunk_ulp_hist``: encoding 5 at chunk level (a delta file alone cannot carry the history it
    needs): for BF16 and F16, five versions of a 6,000-element chunk of a momentum chain, and the
    ``ulp_hist`` payload of the last step coded against the moves of the three before it."""
    from deltarefit.codec import history as H

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20261201)
    about: dict[str, Any] = {"about": write_hist_chunks.__doc__.split("\n\n")[0], "chunks": {}}
    for dt in ("BF16", "F16"):
        d = DTYPES[dt]
        vs = _momentum_chain(rng, dt, 6_000, 4)
        moves = [H.moves_of_images(d, a, b) for a, b in itertools.pairwise(vs[:4])][::-1]
        hist = H.History.from_moves(vs[3].size, moves)
        NAT.USE_NATIVE = False
        want = C.encode_hist(d, vs[3], vs[4], hist)
        NAT.USE_NATIVE = NAT.ext is not None
        got = C.encode_hist(d, vs[3], vs[4], hist)
        assert got == want, f"{dt}: the native and numba encoders disagree"
        for i, v in enumerate(vs):
            (out / f"{dt}_v{i}.bin").write_bytes(v.astype(v.dtype.newbyteorder("<")).tobytes())
        (out / f"{dt}_payload.bin").write_bytes(want.payload)
        about["chunks"][dt] = {"n": 6_000, "n_changed": want.n_changed, "history_id": hist.id.hex(),
                               "payload_sha256": _sha(out / f"{dt}_payload.bin")}
    (out / "chunk.json").write_text(json.dumps(about, indent=1, sort_keys=True) + "\n")


ULP2_DIR = "ulp2"


def write_ulp2_vectors(out: Path) -> None:
    """``ulp2``: encodings 6 and 7 at chunk level (FORMAT.md, "Format version 2"), in ``vectors.json``:
    for every dtype the ulp class takes, a sparse chunk (40 elements, 6 changed, the widest distance among
    them where the dtype is wide) coded in both coder variants without and with a history (encoding 7), a
    chunk whose every element changed (12) in both variants, and an unchanged one (no payload). Each chunk
    holds its base and target bits (little-endian, base64), its history bytes and id where coded with
    one, and its payloads by ``<encoding>_v<variant>`` (base64). Coded by the numba kernels (the
    reference); the native ones, where built, must write the same."""
    import base64

    import _ulp2 as U2

    from deltarefit.codec import ulp2_kernels as K2

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    nat = NAT.ext is not None and getattr(NAT.ext, "ulp2_encode", None)
    chunks = []
    for i, dt in enumerate(sorted(DTYPES)):
        d = DTYPES[dt]
        for case, n, m in (("sparse", 40, 6), ("full", 12, 12), ("empty", 6, 0)):
            base, target = U2.make_pair(d, n, m, seed=20261208 + 10 * i + n + m)
            hist = U2.make_history(n, seed=20261208 + i, frac=0.3)
            states = hist.states().copy()
            payloads = {}
            for enc in ((C.ULP2, C.ULP2_HIST) if case == "sparse" else (C.ULP2,)):
                for variant in (0, 1):
                    st = states if enc == C.ULP2_HIST else None
                    got_m, payload = U2.encode(K2.ulp2_encode, d, base, target, st, variant)
                    assert got_m == m and (payload is None) == (m == 0), (dt, case)
                    if nat:
                        assert U2.encode(NAT.ext.ulp2_encode, d, base, target, st, variant) == (got_m, payload), (
                            f"{dt} {case}: the native and numba encoders disagree")
                    payloads[f"{C.ENCODING_NAMES[enc]}_v{variant}"] = b64(payload or b"")
            le = base.dtype.newbyteorder("<")
            chunks.append({"dtype": dt, "case": case, "n": n, "n_changed": m, "base": b64(base.astype(le).tobytes()),
                           "target": b64(target.astype(le).tobytes()),
                           "states": b64(states.tobytes()) if case == "sparse" else None,
                           "history_id": hist.id.hex() if case == "sparse" else None, "payloads": payloads})
    out.mkdir(parents=True, exist_ok=True)
    about = " ".join(write_ulp2_vectors.__doc__.split("\n\n")[0].split())
    body = ",\n".join(json.dumps(c, sort_keys=True, separators=(",", ":")) for c in chunks)
    (out / "vectors.json").write_text(f'{{"about":{json.dumps(about)},\n"chunks":[\n{body}]}}\n')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "vectors"))
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if the stored vectors differ")
    a = ap.parse_args()
    out = Path(a.out)
    with tempfile.TemporaryDirectory() as w:
        work = Path(w)
        for name, fn, sums, recipe in VECTORS:
            build(name, fn, sums, recipe, work)
        final = work / "final"
        write_hist_chunks(final / HIST_DIR)
        write_ulp2_vectors(final / ULP2_DIR)
        if a.check:
            bad = [n for n in [*(n for n, *_ in VECTORS), HIST_DIR, ULP2_DIR] if not (out / n).is_dir()
                   or filecmp.dircmp(final / n, out / n).diff_files or sorted(os.listdir(final / n))
                   != sorted(os.listdir(out / n))]
            print("vectors differ: " + ", ".join(bad) if bad else "vectors are up to date")
            raise SystemExit(1 if bad else 0)
        out.mkdir(parents=True, exist_ok=True)
        for name, *_ in VECTORS:
            if (out / name).exists():
                shutil.rmtree(out / name)
            shutil.copytree(final / name, out / name)
        if (out / HIST_DIR).exists():
            shutil.rmtree(out / HIST_DIR)
        shutil.copytree(final / HIST_DIR, out / HIST_DIR)
        if (out / ULP2_DIR).exists():
            shutil.rmtree(out / ULP2_DIR)
        shutil.copytree(final / ULP2_DIR, out / ULP2_DIR)
    print(f"wrote {len(VECTORS)} vectors and {HIST_DIR} to {out}")


if __name__ == "__main__":
    main()
