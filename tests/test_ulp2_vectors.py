"""The chunk-level golden vectors of encodings 6 and 7 (tests/vectors/ulp2, written by
``scripts/make_vectors.py``): every encoder writes each stored payload byte for byte, every decoder
decodes it to the stored target, and the chunk codec keeps the smallest of them."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from _ulp2 import decode, encode

from deltarefit.codec import chunk as C
from deltarefit.codec import native, ulp2
from deltarefit.codec import ulp2_kernels as K2
from deltarefit.codec.history import HIST_ID_BYTES, History
from deltarefit.dtypes import DTYPES, dtype

VECTORS = json.loads((Path(__file__).parent / "vectors" / "ulp2" / "vectors.json").read_text())["chunks"]
NATIVE = native.kernel("ulp2_encode") is not None
KERNELS = [("numba", K2.ulp2_encode, K2.ulp2_decode)]
if NATIVE:
    KERNELS.append(("native", native.kernel("ulp2_encode"), native.kernel("ulp2_decode")))


def _arrays(v):
    dt = dtype(v["dtype"])
    base = np.frombuffer(base64.b64decode(v["base"]), dt.uint.newbyteorder("<")).astype(dt.uint)
    target = np.frombuffer(base64.b64decode(v["target"]), dt.uint.newbyteorder("<")).astype(dt.uint)
    hist = None
    if v["states"] is not None:
        st = np.frombuffer(base64.b64decode(v["states"]), np.uint8)
        pos = np.flatnonzero(st)
        hist = History(v["n"], pos, st[pos])
        assert hist.id.hex() == v["history_id"]
    return dt, base, target, hist


def test_the_vectors_cover_every_dtype_case_encoding_and_variant():
    assert {v["dtype"] for v in VECTORS} == set(DTYPES)
    assert {v["case"] for v in VECTORS} == {"sparse", "full", "empty"}
    keys = {k for v in VECTORS for k in v["payloads"]}
    assert keys == {"ulp2_v0", "ulp2_v1", "ulp2_hist_v0", "ulp2_hist_v1"}
    assert any(v["n_changed"] == v["n"] for v in VECTORS)


@pytest.mark.skipif(not NATIVE, reason="the native extension here has no ulp2_encode/ulp2_decode (built by _ulp2.c)")
def test_the_native_kernels_are_among_those_checked():
    assert [k[0] for k in KERNELS] == ["numba", "native"]


@pytest.mark.parametrize("kernels", KERNELS, ids=[k[0] for k in KERNELS])
def test_every_kernel_writes_and_decodes_every_stored_payload(kernels):
    _, enc, dec = kernels
    for v in VECTORS:
        dt, base, target, hist = _arrays(v)
        want_pos = np.flatnonzero(base != target)
        assert want_pos.size == v["n_changed"]
        for key, b64 in v["payloads"].items():
            payload = base64.b64decode(b64)
            variant = int(key[-1])
            states = hist.states().copy() if key.startswith("ulp2_hist") else None
            m, got = encode(enc, dt, base, target, states, variant)
            assert (m, got or b"") == (v["n_changed"], payload), (v["dtype"], v["case"], key)
            if m == 0:
                continue
            s, pos, val = decode(dec, dt, base, states, payload, m)
            assert s == 0 and np.array_equal(pos, want_pos) and np.array_equal(val, target[want_pos]), key


def test_the_chunk_codec_keeps_the_smallest_stored_payload_and_decodes_it():
    for v in VECTORS:
        dt, base, target, hist = _arrays(v)
        p = {k: base64.b64decode(b) for k, b in v["payloads"].items()}
        if v["n_changed"] == 0:
            assert ulp2.encode_ulp2(dt, base, target, hist) is None
            continue
        plain = min((p["ulp2_v0"], p["ulp2_v1"]), key=len)  # (min keeps the first, variant 0, on a tie)
        got = ulp2.encode_ulp2(dt, base, target)
        assert got.encoding == C.ULP2 and got.payload == plain
        if hist is not None:
            h = min((p["ulp2_hist_v0"], p["ulp2_hist_v1"]), key=len)
            got = ulp2.encode_ulp2(dt, base, target, hist)
            want = (C.ULP2_HIST, hist.id + h) if HIST_ID_BYTES + len(h) < len(plain) else (C.ULP2, plain)
            assert (got.encoding, got.payload) == want
        patch = C.decode_chunk(dt, base, got.encoding, got.payload, got.n_changed, 0, "vector", hist)
        out = base.copy()
        patch.apply_to(out)
        assert np.array_equal(out, target)
