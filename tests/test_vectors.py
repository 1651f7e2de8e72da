"""Golden vectors: the delta format (FORMAT.md v1) pinned byte for byte.

Each vector in tests/vectors (written by ``scripts/make_vectors.py``, described in ``tests/_vectors.py``)
holds a base and a target checkpoint (or the recipe that rebuilds them), the exact bytes of the delta
between them, both fingerprints, every tensor's BLAKE3 digest and additive digest, and the encoding of
every chunk record. These tests hold every implementation of the format to those bytes:

(a) the encoder, with the native kernels (AVX-512 scan where the machine has it, and the portable one)
    and with numba's (switched in-process, and by ``DELTAREFIT_KERNELS=numba`` in a subprocess), writes
    the stored delta exactly;
(b) applying the stored delta to the base, with numba's decoder and with each of the native decoder's
    positions passes, gives the target's bytes and its stored fingerprint;
(c) the device-split encoder (``deltarefit.gpu.encode`` on CPU tensors) writes the stored delta, for
    every vector it can write (it takes no ``sums``);
(d) the stored fingerprints, tensor digests and additive digests are what ``deltarefit.integrity`` and
    ``deltarefit.integrity.additive`` compute from the bits, and what the delta's manifest says;
(e) the stored deltas parse (``DeltaReader``) to the stored ops and per-chunk encodings, and the vectors
    together cover every encoding, op and dtype, a multi-segment tensor, and special float values in
    ulp chunks, so a vector that silently stopped exercising what it is for fails.

A change of the format, or of what the encoder chooses, therefore shows up as a failure here and, once
intended, as a change of tests/vectors in review: regenerate with
``PYTHONPATH=src python scripts/make_vectors.py`` and review the diff (FORMAT.md says the same). The
deltas also hold zstd frames (the manifest, non-ulp payloads) and the encoder's version string
(``stats.encoder``): a new libzstd that compresses differently, or a version bump, changes them too;
the failure message names the versions the vectors were made with.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard
from _vectors import DELTA, VECTORS_DIR, checkpoints, load, vector_names

import deltarefit
from deltarefit.checkpoint import open_checkpoint
from deltarefit.codec import chunk as C
from deltarefit.codec import native as NAT
from deltarefit.dtypes import DTYPES
from deltarefit.encode import additive_digests
from deltarefit.errors import DeltaRefitError
from deltarefit.format import HEADER, OPS, DeltaReader
from deltarefit.integrity import additive as additive
from deltarefit.integrity import fingerprint_from_digests, tensor_digest

NAMES = vector_names()
N = NAT.ext
REGENERATE = "an intended format change? regenerate with PYTHONPATH=src python scripts/make_vectors.py (FORMAT.md)"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stored_delta(name: str) -> bytes:
    return (VECTORS_DIR / name / DELTA).read_bytes()


def _section(want: bytes, off: int) -> str:
    """Which section of the delta ``want`` holds byte ``off``."""
    pay_off, man_off, tab_off = (HEADER.unpack(want[:HEADER.size])[k] for k in (4, 6, 8))
    if off < pay_off:
        return "header"
    if off < man_off:
        return "payload"
    if off < tab_off:
        return "manifest"
    return f"chunk table (record {(off - tab_off) // 80})"


def check_delta_bytes(name: str, got: bytes, how: str) -> None:
    """Raise AssertionError, saying where, unless ``got`` is the vector's stored delta byte for byte."""
    want = stored_delta(name)
    if got == want:
        return
    diff = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    made = load(name)["made_with"]
    here = {"deltarefit": deltarefit.__version__, "zstandard": zstandard.__version__,
            "libzstd": ".".join(map(str, zstandard.ZSTD_VERSION))}
    versions = "" if made == here else f"; made with {made}, running {here}"
    if (made.get("zstandard"), made.get("libzstd")) != (here["zstandard"], here["libzstd"]):
        # Another compressor writes other zstd frames (the manifest, non-ulp payloads) for the same
        # content: not a format change. The stored bytes still pin the format for every decoder
        # (test_applying_the_stored_delta_gives_the_target), which no compressor update changes.
        pytest.skip(f"vector {name}, {how}: differs at byte {diff}{versions}: a zstd frame of another compressor")
    raise AssertionError(f"vector {name}, {how}: delta of {len(got)} bytes differs from the stored {len(want)} "
                         f"first at byte {diff} ({_section(want, min(diff, len(want) - 1))}){versions}; "
                         f"{REGENERATE}")


def chunk_table(delta_path: str | os.PathLike[str]) -> tuple[dict[str, str], list[list]]:
    """(op per tensor, [tensor name, chunk_index, encoding name, n_changed] per record) of a delta."""
    with DeltaReader(os.fspath(delta_path)) as r:
        return ({e.name: e.op for e in r.tensors},
                [[r.tensors[c.tensor_index].name, c.chunk_index, C.ENCODING_NAMES[c.encoding], c.n_changed]
                 for c in r.records])


def check_chunk_table(v: dict, delta_path: str | os.PathLike[str]) -> None:
    """Raise AssertionError unless the delta's ops and chunk records are those stored in vector ``v``."""
    name = v["name"]
    ops, chunks = chunk_table(delta_path)
    want_ops = {t: m["op"] for t, m in v["tensors"].items()}
    assert ops == want_ops, f"vector {name}: ops {ops}, stored {want_ops}; {REGENERATE}"
    assert chunks == v["chunks"], f"vector {name}: chunk records {chunks}, stored {v['chunks']}; {REGENERATE}"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """name -> (base path, target path): stored files, or files rebuilt once from a recipe."""
    root = tmp_path_factory.mktemp("vector-pairs")
    return {n: checkpoints(n, root / n) for n in NAMES}


@pytest.fixture(params=["native", "native-portable", "numba"])
def kernels(request, monkeypatch):
    """The codec kernels an encode runs with (the scan's AVX-512 path is off in native-portable)."""
    if request.param.startswith("native"):
        if N is None:
            pytest.skip("the native kernels were not built here (pip install -e . builds them where a C compiler is)")
        monkeypatch.setattr(NAT, "USE_NATIVE", True)
        was = N.use_simd(request.param == "native")
        yield request.param
        N.use_simd(was)
    else:
        monkeypatch.setattr(NAT, "USE_NATIVE", False)
        yield request.param


DECODERS = ["numba"] + ([f"native-{k}" for k in N.decode_kernels()] if N is not None else [])


@pytest.fixture(params=DECODERS)
def decoder(request, monkeypatch):
    """The ulp decoder an apply runs with: numba's, or the native one with a given positions pass."""
    if request.param == "numba":
        monkeypatch.setattr(NAT, "USE_NATIVE", False)
        yield request.param
        return
    monkeypatch.setattr(NAT, "USE_NATIVE", True)
    N.decode_kernel(request.param.removeprefix("native-"))
    yield request.param
    N.decode_kernel("auto")  # the default: the fastest this machine runs


def _copy(src: str, dst: Path) -> str:
    shutil.copyfile(src, dst)
    return str(dst)


# ------------------------------------------------------------------------------------- (a) encode


@pytest.mark.parametrize("name", NAMES)
def test_encoding_writes_the_stored_delta(name, pairs, kernels, tmp_path):
    base, target = pairs[name]
    out = tmp_path / "out.drd"
    deltarefit.encode(base, target, str(out), threads=2, sums=load(name)["sums"], format_version=1)
    check_delta_bytes(name, out.read_bytes(), f"encode with {kernels} kernels")


_SUBPROCESS = r"""
import hashlib, json, os, shutil, sys
from deltarefit.codec import native as NAT
import deltarefit
assert not NAT.USE_NATIVE, "DELTAREFIT_KERNELS=numba did not switch the native kernels off"
out = {}
for name, base, target, sums, work in json.loads(sys.argv[1]):
    d = os.path.join(work, "numba.drd")
    deltarefit.encode(base, target, d, threads=1, sums=sums, format_version=1)  # one thread: the same bytes as two
    ck = shutil.copyfile(base, os.path.join(work, "applied.safetensors"))
    deltarefit.apply(os.path.join(sys.argv[2], name, "delta.drd"), ck, threads=2)
    out[name] = [hashlib.sha256(open(d, "rb").read()).hexdigest(), deltarefit.fingerprint(ck)]
print(json.dumps(out))
"""


def test_numba_forced_by_the_environment_writes_and_applies_every_vector(pairs, tmp_path):
    # The switch a user has (DELTAREFIT_KERNELS=numba, read at import): one process for all vectors.
    jobs = []
    for n in NAMES:
        (tmp_path / n).mkdir()
        jobs.append([n, *pairs[n], load(n)["sums"], str(tmp_path / n)])
    env = dict(os.environ, DELTAREFIT_KERNELS="numba")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(C.__file__).parents[2]), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", _SUBPROCESS, json.dumps(jobs), str(VECTORS_DIR)], env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for n in NAMES:
        v = load(n)
        if got[n][0] != _sha(stored_delta(n)):
            check_delta_bytes(n, (tmp_path / n / "numba.drd").read_bytes(), "encode under DELTAREFIT_KERNELS=numba")
        assert got[n][1] == v["target_fingerprint"], n


# -------------------------------------------------------------------------------------- (b) apply


def _tensor_bytes(path: str) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    with open_checkpoint(path) as ck:
        return {n: (i.dtype, tuple(i.shape), ck.raw(n).tobytes()) for n, i in ck.tensors.items()}


@pytest.mark.parametrize("name", NAMES)
def test_applying_the_stored_delta_gives_the_target(name, pairs, decoder, tmp_path):
    v = load(name)
    base, target = pairs[name]
    ck = _copy(base, tmp_path / "ck.safetensors")
    deltarefit.apply(str(VECTORS_DIR / name / DELTA), ck, threads=2)
    got, want = _tensor_bytes(ck), _tensor_bytes(target)
    assert sorted(got) == sorted(want), name
    for t in want:
        assert got[t] == want[t], f"vector {name}, tensor {t!r}: applied with {decoder}, differs from the target"
    if all(m["op"] in ("same", "patch") for m in v["tensors"].values()):
        # patched in place: the file is the target file (both were written with one layout)
        assert Path(ck).read_bytes() == Path(target).read_bytes()
    assert deltarefit.fingerprint(ck) == v["target_fingerprint"]


# ------------------------------------------------------------------------------- (c) device split


DEVICE = [n for n in NAMES if "device_split" not in load(n)]


def test_only_vectors_with_additive_digests_are_outside_the_device_split():
    assert [n for n in NAMES if n not in DEVICE] == [n for n in NAMES if load(n)["sums"]]
    assert DEVICE, "no vector is checked against the device-split encoder"


@pytest.mark.parametrize("name", DEVICE)
@pytest.mark.parametrize("native", [True, False], ids=["native", "numba"])
def test_the_device_split_writes_the_stored_delta(name, native, pairs, monkeypatch, tmp_path):
    pytest.importorskip("torch", reason="torch is in the test extra: pip install -e '.[test]' (make test installs it)")
    from safetensors.torch import load_file

    from deltarefit.gpu.encode import encode_tensors

    if native and N is None:
        pytest.skip("the native kernels were not built here (pip install -e . builds them where a C compiler is)")
    monkeypatch.setattr(NAT, "USE_NATIVE", native)
    base, target = (load_file(p) for p in pairs[name])
    out = tmp_path / "dev.drd"
    encode_tensors(base, target, str(out), threads=2, batch_segments=2, format_version=1)
    check_delta_bytes(name, out.read_bytes(), f"device-split encode on CPU tensors ({'native' if native else 'numba'})")


# ------------------------------------------------------------------------------ (d) fingerprints


def _side(v: dict, side: str) -> dict[str, dict]:
    return {t: m[side] for t, m in v["tensors"].items() if m[side] is not None}


@pytest.mark.parametrize("name", NAMES)
def test_fingerprints_and_digests_are_those_of_the_bits(name, pairs):
    v = load(name)
    for side, path in zip(("base", "target"), pairs[name], strict=True):
        want = _side(v, side)
        with open_checkpoint(path) as ck:
            assert sorted(ck.tensors) == sorted(want), (name, side)
            digests = {}
            for t, meta in want.items():
                info = ck.tensors[t]
                assert (info.dtype, list(info.shape)) == (meta["dtype"], meta["shape"]), (name, side, t)
                raw = ck.raw(t)
                digests[t] = tensor_digest(info.dtype, info.shape, raw)
                assert digests[t].hex() == meta["digest"], (name, side, t)
                bits = raw.view(DTYPES[info.dtype].uint).reshape(info.shape)
                assert additive.to_hex(additive.full_digest(t, info.dtype, bits)) == meta["sum"], (name, side, t)
            # the encoder's own additive pass (one partial sum per segment) agrees
            sums = additive_digests([(ck, t) for t in want], threads=2)
            assert [s.hex() for s in sums] == [want[t]["sum"] for t in want], (name, side)
        assert fingerprint_from_digests(digests) == v[f"{side}_fingerprint"], (name, side)
        assert deltarefit.fingerprint(path) == v[f"{side}_fingerprint"], (name, side)


@pytest.mark.parametrize("name", NAMES)
def test_the_stored_files_and_manifest_agree_with_the_vector(name):
    v = load(name)
    for f, h in v["files"].items():
        assert _sha((VECTORS_DIR / name / f).read_bytes()) == h, f"vector {name}: {f} was edited"
    with DeltaReader(str(VECTORS_DIR / name / DELTA)) as r:
        assert (r.base_fingerprint, r.target_fingerprint) == (v["base_fingerprint"], v["target_fingerprint"])
        assert r.manifest["version"] == v["format_version"] == 1
        for e in r.tensors:
            for side in ("base", "target"):
                meta, want = getattr(e, side), v["tensors"][e.name][side]
                if want is None:
                    assert meta is None, (name, e.name, side)
                    continue
                assert (meta.dtype, list(meta.shape), meta.digest.hex()) == \
                    (want["dtype"], want["shape"], want["digest"]), (name, e.name, side)
                # sums=True: every same/patch tensor carries its additive digest, no other tensor does
                carries = v["sums"] and e.op in ("same", "patch")
                assert (meta.sum.hex() if meta.sum is not None else None) == (want["sum"] if carries else None), \
                    (name, e.name, side)


# --------------------------------------------------------------------------- (e) chunk encodings


@pytest.mark.parametrize("name", NAMES)
def test_the_stored_delta_has_the_stored_chunk_encodings(name):
    check_chunk_table(load(name), VECTORS_DIR / name / DELTA)


def test_the_vectors_cover_the_format():
    vs = [load(n) for n in NAMES]
    chunks = [c for v in vs for c in v["chunks"]]
    # ulp_hist needs a history beside the delta: it has its chunk-level vector (test below); the whole-delta
    # vectors are of format version 1, whose encodings they cover all of: ulp2 and ulp2_hist (format version 2)
    # have chunk-level vectors (tests/vectors/ulp2, tests/test_ulp2_vectors.py)
    assert {c[2] for c in chunks} | {"ulp_hist", "ulp2", "ulp2_hist"} == set(C.ENCODING_NAMES.values())
    assert {v["format_version"] for v in vs} == {1}
    assert (VECTORS_DIR / "chunk_ulp_hist" / "chunk.json").is_file()
    assert {m["op"] for v in vs for m in v["tensors"].values()} == set(OPS)
    dts = {s["dtype"] for v in vs for m in v["tensors"].values() for s in (m["base"], m["target"]) if s}
    assert dts == set(DTYPES)
    # every dtype in a patched chunk, and ulp chunks of every dtype
    ulp_dts = {vs[i]["tensors"][c[0]]["base"]["dtype"] for i, v in enumerate(vs) for c in v["chunks"] if c[2] == "ulp"}
    assert ulp_dts == set(DTYPES)
    assert any(c[1] > 0 for c in chunks), "no record with chunk_index > 0"
    assert {v["sums"] for v in vs} == {True, False}
    assert any("generated" in v for v in vs)


def _float_class(dt: str, bits: np.ndarray) -> set[str]:
    d = DTYPES[dt]
    b = bits.astype(np.uint64)
    sign = b >> np.uint64(d.bits - 1)
    exp = (b >> np.uint64(d.man_bits)) & np.uint64((1 << d.exp_bits) - 1)
    man = b & np.uint64((1 << d.man_bits) - 1)
    top = exp == (1 << d.exp_bits) - 1
    out = set()
    if dt == "F8_E4M3":  # no inf; NaN is S.1111.111 only
        nan = top & (man == (1 << d.man_bits) - 1)
        inf = np.zeros_like(nan)
    else:
        nan, inf = top & (man != 0), top & (man == 0)
    for what, m in (("nan", nan), ("inf", inf), ("-0", (sign == 1) & (exp == 0) & (man == 0)),
                    ("subnormal", (exp == 0) & (man != 0))):
        if m.any():
            out.add(what)
    return out


def test_ulp_chunks_hold_changed_special_values():
    # NaN payloads, inf, -0.0 and subnormals among the changed elements (before or after) of ulp chunks,
    # for every float dtype (fp8 E4M3 has no inf)
    seen = {}
    for n in NAMES:
        v = load(n)
        if "generated" in v:
            continue
        ulp = {c[0] for c in v["chunks"] if c[2] == "ulp"}
        with open_checkpoint(str(VECTORS_DIR / n / "base.safetensors")) as b, \
                open_checkpoint(str(VECTORS_DIR / n / "target.safetensors")) as t:
            for name in ulp:
                dt = b.tensors[name].dtype
                if DTYPES[dt].kind != "float":
                    continue
                bb, tb = b.raw(name).view(DTYPES[dt].uint), t.raw(name).view(DTYPES[dt].uint)
                ch = bb != tb
                seen.setdefault(dt, set()).update(_float_class(dt, bb[ch]) | _float_class(dt, tb[ch]))
    for dt in ("BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2"):
        want = {"nan", "-0", "subnormal"} | ({"inf"} if dt != "F8_E4M3" else set())
        assert want <= seen.get(dt, set()), (dt, seen.get(dt))


def test_the_vectors_stay_small():
    total = sum(p.stat().st_size for p in VECTORS_DIR.rglob("*") if p.is_file())
    assert total < 512 << 10, total


# ---------------------------------------------------------------------------- the checks can fail


def test_a_flipped_byte_fails_every_check(tmp_path):
    # The comparisons above are not vacuous: one flipped byte in any section of a stored delta fails the
    # byte comparison (naming the section), is refused by the reader, and is refused by apply with the
    # checkpoint left as it was.
    name = "ulp_floats"
    want = stored_delta(name)
    (_, _, _, _, pay_off, _, man_off, _, tab_off, _, _, _) = HEADER.unpack(want[:HEADER.size])
    for off, section in ((20, "header"), (pay_off + 5, "payload"), (man_off + 3, "manifest"),
                         (tab_off + 12, "chunk table")):
        bad = bytearray(want)
        bad[off] ^= 0x01
        with pytest.raises(AssertionError, match=f"first at byte {off} \\({section}"):
            check_delta_bytes(name, bytes(bad), "a flipped byte")
        path = tmp_path / f"{off}.drd"
        path.write_bytes(bad)
        ck = _copy(str(VECTORS_DIR / name / "base.safetensors"), tmp_path / f"{off}.safetensors")
        before = Path(ck).read_bytes()
        with pytest.raises(DeltaRefitError):
            deltarefit.apply(str(path), ck, threads=2)
        assert Path(ck).read_bytes() == before
        assert deltarefit.fingerprint(ck) == load(name)["base_fingerprint"]
    with pytest.raises(AssertionError, match="differs from the stored"):
        check_delta_bytes(name, want[:-1], "a truncated delta")


def test_a_delta_that_stops_exercising_its_encoding_fails():
    # A delta whose records name other encodings than the vector stores (as when the encoder starts
    # coding a vector's chunks otherwise) fails the chunk-table check: here the stored sparse_xor
    # vector's records held against the dense vector's delta, and one record's encoding changed.
    v = load("sparse_xor")
    v["chunks"][0][2] = "ulp"
    with pytest.raises(AssertionError, match="chunk records"):
        check_chunk_table(v, VECTORS_DIR / "sparse_xor" / DELTA)
    with pytest.raises(AssertionError, match="ops"):
        check_chunk_table(load("sparse_xor"), VECTORS_DIR / "dense" / DELTA)


def test_header_fields_of_a_stored_delta():
    # The fixed header as FORMAT.md lays it out, read with struct alone.
    data = stored_delta("structure")
    magic, ver, flags, hsize, pay_off, pay_len, man_off, man_len, tab_off, tab_len = \
        struct.unpack_from("<8sHHIQQQQQQ", data)
    assert (magic, ver, flags, hsize, pay_off) == (b"DRDELTA\0", 1, 1, 96, 96)
    assert man_off == pay_off + pay_len and tab_off == man_off + man_len and tab_off + tab_len == len(data)
    assert tab_len == 80 * len(load("structure")["chunks"])


def test_an_encoder_that_chooses_otherwise_fails(monkeypatch, pairs, tmp_path):
    # An encoder change that keeps the format but codes chunks otherwise (here: whole-chunk encodings
    # never tried) writes other bytes and other chunk encodings, and both checks say so.
    monkeypatch.setattr(C, "DENSE_TRY_FRACTION", 2.0)
    out = tmp_path / "other.drd"
    deltarefit.encode(*pairs["dense"], str(out), threads=2, format_version=1)
    with pytest.raises(AssertionError, match="differs from the stored"):
        check_delta_bytes("dense", out.read_bytes(), "encode that never tries dense encodings")
    with pytest.raises(AssertionError, match="chunk records"):
        check_chunk_table(load("dense"), out)


# --------------------------------------------------------------------------- (f) encoding 5, chunk level


def _hist_vector():
    from deltarefit.codec import history as H

    d = VECTORS_DIR / "chunk_ulp_hist"
    meta = json.loads((d / "chunk.json").read_text())
    for dt_name, m in meta["chunks"].items():
        dt = DTYPES[dt_name]
        vs = [np.frombuffer((d / f"{dt_name}_v{i}.bin").read_bytes(), dt.uint.newbyteorder("<")).astype(dt.uint)
              for i in range(5)]
        payload = (d / f"{dt_name}_payload.bin").read_bytes()
        assert hashlib.sha256(payload).hexdigest() == m["payload_sha256"], f"{dt_name}: payload was edited"
        moves = [H.moves_of_images(dt, a, b) for a, b in itertools.pairwise(vs[:4])][::-1]
        yield dt_name, dt, vs, payload, m, H.History.from_moves(vs[3].size, moves)


@pytest.mark.parametrize("kernels", ["native", "numba"])
def test_the_ulp_hist_vector_encodes_and_decodes_byte_for_byte(kernels, monkeypatch):
    if kernels == "native" and N is None:
        pytest.skip("the native kernels were not built here (pip install -e . builds them where a C compiler is)")
    monkeypatch.setattr(NAT, "USE_NATIVE", kernels == "native")
    for dt_name, dt, vs, payload, m, hist in _hist_vector():
        assert hist.id.hex() == m["history_id"], (dt_name, REGENERATE)
        enc = C.encode_hist(dt, vs[3], vs[4], hist)
        assert (enc.encoding, enc.n_changed, enc.payload) == (C.ULP_HIST, m["n_changed"], payload), \
            (dt_name, REGENERATE)
        p = C.decode_chunk(dt, vs[3], C.ULP_HIST, payload, m["n_changed"], 0, dt_name, hist)
        img = vs[3].copy()
        p.apply_to(img)
        assert np.array_equal(img, vs[4]), dt_name
