"""Hostile deltas and wrong checkpoints: every one is refused with the right error, and nothing is written.

For each bad input the checkpoint's sha256 must be unchanged and no journal or temp file may remain.
Errors must be ``DeltaRefitError`` subclasses (never IndexError, struct.error, ValueError...) whose
message names what is wrong and where (file, tensor, chunk).

Corrupt files come in two kinds: *damaged* (truncated, bit-flipped, appended to: the hashes catch them)
and *crafted* (edited, then every offset and hash recomputed with ``_pairs.Delta``, so only a semantic
check can refuse them).
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch
import zstandard
from _hostile import (
    BIG,
    ELEMS,
    L0,
    TRUNCATIONS,
    bf16_chunk,
    make_pair,
    sparse_xor,
    write_bytes,
    zc,
)
from _hostile import flip_offsets as _flip_offsets
from _hostile import rec as _rec
from _hostile import truncation_offset as _offset
from _hostile import ulp_variants as _ulp_variants
from _hostile import with_sparse as _with_sparse
from _pairs import (
    Delta,
    fix_header_hash,
    leftovers,
    section_spans,
    sha,
    write_pair,
    write_tensors,
    zstd_frame,
)

import deltarefit
from deltarefit import format as fmt
from deltarefit.codec.chunk import DENSE_XOR, OVERWRITE, SPARSE_XOR, ULP
from deltarefit.errors import (
    BaseMismatchError,
    DecodeError,
    DeltaRefitError,
    FormatError,
    IntegrityError,
    LimitError,
    UnsupportedVersionError,
    VerificationError,
)
from deltarefit.integrity import SEGMENT_BYTES, seg_hash


@pytest.fixture(autouse=True)
def _watchdog():
    """A hang is a failure: dump every thread's stack and exit if one test runs past 60 s."""
    faulthandler.dump_traceback_later(60, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture
def ckpt(pair, tmp_path):
    """A fresh copy of the base checkpoint, alone in its own directory."""
    d = tmp_path / "ck"
    d.mkdir()
    p = str(d / "model.safetensors")
    shutil.copyfile(pair["base"], p)
    return p


@pytest.fixture
def ddir(tmp_path):
    d = tmp_path / "deltas"
    d.mkdir()
    return d


def refused(delta: str, ckpt: str, exc: type[BaseException] | tuple, *patterns: str) -> DeltaRefitError:
    """apply(delta, ckpt) must raise ``exc`` (a DeltaRefitError subclass) whose message matches every
    pattern, leave the checkpoint's bytes as they were and leave no journal or temp file."""
    before = sha(ckpt)
    listing = sorted(os.listdir(os.path.dirname(ckpt)))
    try:
        deltarefit.apply(delta, ckpt)
    except Exception as e:
        err = e
    else:
        raise AssertionError(f"apply accepted a bad delta {delta}")
    assert isinstance(err, DeltaRefitError), f"raised {type(err).__name__}, not a DeltaRefitError: {err!r}"
    assert isinstance(err, exc), f"raised {type(err).__name__}: {err}"
    msg = str(err)
    for p in patterns:
        assert re.search(p, msg), f"message {msg!r} does not match {p!r}"
    assert sha(ckpt) == before, f"checkpoint bytes changed although apply raised {type(err).__name__}: {msg}"
    assert leftovers(ckpt) == [], f"left behind: {leftovers(ckpt)}"
    assert sorted(os.listdir(os.path.dirname(ckpt))) == listing
    return err


# ------------------------------------------------------------------------------- sanity of the tools


def test_surgery_roundtrip_and_good_delta_applies(pair, ckpt, ddir):
    """The parser/serializer reproduces the encoder's file bit for bit, and the unedited delta applies:
    every refusal below is about the edit, not about the re-serialization."""
    d = Delta.parse(pair["data"])
    assert d.to_bytes() == pair["data"]
    assert {r.encoding for r in d.records} == {ULP}
    p = d.write(ddir / "same.delta")
    rep = deltarefit.apply(p, ckpt)
    assert rep.chunks_applied == len(d.records)
    assert sha(ckpt) == sha(pair["target"])
    assert leftovers(ckpt) == []


def test_handmade_sparse_and_dense_chunks_apply(pair, ckpt, ddir):
    """Positive control for the crafted cases: correct hand-built SPARSE_XOR, DENSE_XOR and OVERWRITE
    payloads (hashes recomputed) apply and give the target bit for bit."""
    d = Delta.parse(pair["data"])
    b, t = bf16_chunk(pair["tensors"], L0, 0), bf16_chunk(pair["target_tensors"], L0, 0)
    k = d.record_of(L0)
    pay, dlen, _n = sparse_xor(b, t)
    d.records[k] = _rec(d.records[k], encoding=SPARSE_XOR, decoded_len=dlen)
    d.payloads[k] = pay
    k1 = d.record_of(BIG, 1)
    b1, t1 = bf16_chunk(pair["tensors"], BIG, 1), bf16_chunk(pair["target_tensors"], BIG, 1)
    d.records[k1] = _rec(d.records[k1], encoding=DENSE_XOR, decoded_len=SEGMENT_BYTES)
    d.payloads[k1] = zc((b1 ^ t1).tobytes())
    k2 = d.record_of(BIG, 2)
    d.records[k2] = _rec(d.records[k2], encoding=OVERWRITE, decoded_len=SEGMENT_BYTES)
    d.payloads[k2] = zc(bf16_chunk(pair["target_tensors"], BIG, 2).tobytes())
    deltarefit.apply(d.write(ddir / "hand.delta"), ckpt)
    assert sha(ckpt) == sha(pair["target"])


# ----------------------------------------------------------------------------------------- truncation

@pytest.mark.parametrize(("section", "where"), TRUNCATIONS, ids=[f"{s}-{w}" for s, w in TRUNCATIONS])
def test_truncated(pair, ckpt, ddir, section, where):
    data = pair["data"]
    n = _offset(data, section, where)
    p = write_bytes(ddir / "t.delta", data[:n])
    err = refused(p, ckpt, FormatError, re.escape(p))
    with pytest.raises(FormatError):
        deltarefit.inspect(p)
    if n < 8:
        assert "bad magic" in str(err)
    elif n < fmt.HEADER_SIZE:
        assert "truncated header" in str(err)
    else:
        assert "truncated or appended" in str(err)


# ----------------------------------------------------------------------------------------- bit flips


def _record_at(d: Delta, payload_off: int) -> tuple[str, fmt.ChunkRecord]:
    for r in d.records:
        if r.payload_offset <= payload_off < r.payload_offset + r.payload_len:
            return d.manifest["tensors"][r.tensor_index]["name"], r
    raise AssertionError(payload_off)


@pytest.mark.parametrize("i", range(25))
def test_bit_flip(pair, ckpt, ddir, i):
    data = pair["data"]
    what, off = _flip_offsets(data)[i]
    bad = bytearray(data)
    bad[off] ^= 1 << (i % 8)
    p = write_bytes(ddir / f"flip-{what}.delta", bytes(bad))
    if what == "magic":
        refused(p, ckpt, FormatError, re.escape(p), "bad magic")
    elif what == "version":
        refused(p, ckpt, UnsupportedVersionError, re.escape(p), "format version")
    elif what in ("manifest",) or what.startswith("record"):
        refused(p, ckpt, IntegrityError, re.escape(p), "manifest/table hash mismatch")
    elif what == "payload":
        name, r = _record_at(Delta.parse(data), off - fmt.HEADER_SIZE)
        refused(p, ckpt, IntegrityError, re.escape(p), re.escape(f"tensor {name!r} chunk {r.chunk_index}"),
                "payload hash mismatch")
    else:
        refused(p, ckpt, IntegrityError, re.escape(p), "header hash mismatch")
    if what != "payload":  # inspect reads everything but the payloads
        with pytest.raises(FormatError):
            deltarefit.inspect(p)


# --------------------------------------------------------------------------- appended, magic, version


@pytest.mark.parametrize("extra", [b"\0", b"x" * 4096, "copy"])
def test_appended(pair, ckpt, ddir, extra):
    data = pair["data"]
    p = write_bytes(ddir / "a.delta", data + (data if extra == "copy" else extra))
    refused(p, ckpt, FormatError, re.escape(p), "appended")


@pytest.mark.parametrize("version", [0, 3, 0xFFFF])
def test_unknown_version(pair, ckpt, ddir, version):
    """The header hash is fixed up, so the version check itself must be what refuses the file."""
    bad = fix_header_hash(pair["data"][:8] + struct.pack("<H", version) + pair["data"][10:])
    p = write_bytes(ddir / "v.delta", bad)
    refused(p, ckpt, UnsupportedVersionError, re.escape(p), f"format version {version} is not supported")


@pytest.mark.parametrize("magic", [b"DRDELTA\x01", b"drdelta\x00", b"\x00" * 8, b"PK\x03\x04\x14\x00\x00\x00"])
def test_bad_magic(pair, ckpt, ddir, magic):
    p = write_bytes(ddir / "m.delta", fix_header_hash(magic + pair["data"][8:]))
    refused(p, ckpt, FormatError, re.escape(p), "bad magic")


def test_checkpoint_given_as_delta(pair, ckpt, ddir):
    other = shutil.copyfile(pair["base"], ddir / "other.safetensors")
    refused(str(other), ckpt, FormatError, "bad magic")
    assert sha(other) == sha(pair["base"])


def test_missing_or_directory_delta(ckpt, ddir):
    refused(str(ddir / "nope.delta"), ckpt, FormatError, "cannot open")
    refused(str(ddir), ckpt, FormatError, "cannot open")


# ---------------------------------------------------------------------------------------- wrong base


def _variant(pair, ckpt, edit) -> str:
    """Rewrite the working checkpoint as the base tensors after ``edit(dict)``."""
    ts = {k: v.clone() for k, v in pair["tensors"].items()}
    edit(ts)
    write_tensors(ckpt, ts)
    return ckpt


def test_wrong_base_other_checkpoint(pair, ckpt, ddir, tmp_path):
    """A delta made for another checkpoint with the same names, dtypes and shapes."""
    d = tmp_path / "other"
    d.mkdir()
    b, t = write_pair(d, seed=1)
    p = str(ddir / "other.delta")
    deltarefit.encode(b, t, p)
    refused(p, ckpt, BaseMismatchError, "wrong base")


def test_wrong_base_target_of_other_delta(pair, ckpt, ddir, tmp_path):
    """The checkpoint is the *target* of another pair: still neither this delta's base nor its target."""
    d = tmp_path / "other"
    d.mkdir()
    _b, t = write_pair(d, seed=2)
    shutil.copyfile(t, ckpt)
    refused(pair["delta"], ckpt, BaseMismatchError, "wrong base")


@pytest.mark.parametrize(("name", "elem"), [("frozen.bias", 7), ("embed.weight", ELEMS + 12345), (BIG, 5)])
def test_wrong_base_one_element(pair, ckpt, name, elem):
    """One element differs from the base: in a tensor the delta does not touch, in an untouched chunk of a
    patched tensor (the base digest must catch it), and in a chunk the delta patches."""

    def edit(ts):
        iv = ts[name].view(torch.int16).reshape(-1)
        iv[elem] ^= 0x10

    _variant(pair, ckpt, edit)
    refused(pair["delta"], ckpt, BaseMismatchError, re.escape(f"tensor {name!r}"))


def test_wrong_base_missing_tensor(pair, ckpt):
    _variant(pair, ckpt, lambda ts: ts.pop("proj.f16"))
    refused(pair["delta"], ckpt, BaseMismatchError, re.escape("tensor 'proj.f16'"), "missing")


def test_wrong_base_extra_tensor(pair, ckpt):
    _variant(pair, ckpt, lambda ts: ts.__setitem__("lm_head.extra", torch.zeros(16, dtype=torch.bfloat16)))
    refused(pair["delta"], ckpt, BaseMismatchError, "'lm_head.extra'")


@pytest.mark.parametrize("how", ["dtype", "shape"])
def test_wrong_base_dtype_or_shape(pair, ckpt, how):
    """Same bytes, other dtype (BF16 -> F16) or other shape: refused on metadata, not on bytes."""

    def edit(ts):
        ts[L0] = ts[L0].view(torch.float16) if how == "dtype" else ts[L0].reshape(512, 512)

    _variant(pair, ckpt, edit)
    found = "F16[256, 1024]" if how == "dtype" else "BF16[512, 512]"
    refused(pair["delta"], ckpt, BaseMismatchError, re.escape(f"tensor {L0!r}"), re.escape(found))


# ---------------------------------------------------------------------- crafted but consistent: records


def test_crafted_n_changed_beyond_chunk(pair, ckpt, ddir):
    d = Delta.parse(pair["data"])
    k = d.record_of(L0)
    n = 256 * 1024
    d.records[k] = _rec(d.records[k], n_changed=n + 1)
    d.tensor(L0)[1]["changed"] = n + 1  # keep the manifest's sum consistent: the per-chunk check must fire
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, FormatError, re.escape(p), re.escape(f"tensor {L0!r} chunk 0"), f"{n + 1} changed elements")


def test_crafted_n_changed_zero(pair, ckpt, ddir):
    d = Delta.parse(pair["data"])
    k = d.record_of(L0)
    d.tensor(L0)[1]["changed"] -= d.records[k].n_changed
    d.records[k] = _rec(d.records[k], n_changed=0)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, FormatError, re.escape(p), "0 changed elements")


def test_crafted_n_changed_lies_within_range(pair, ckpt, ddir):
    """A plausible but wrong count (manifest adjusted too): the decoder must notice."""
    d = Delta.parse(pair["data"])
    k = d.record_of(L0)
    d.records[k] = _rec(d.records[k], n_changed=d.records[k].n_changed - 1)
    d.tensor(L0)[1]["changed"] -= 1
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, (DecodeError, VerificationError), re.escape(p), re.escape(f"tensor {L0!r} chunk 0"))


@pytest.mark.parametrize("ci", [3, 1 << 31, 0xFFFFFFFF])
def test_crafted_chunk_index_out_of_range(pair, ckpt, ddir, ci):
    d = Delta.parse(pair["data"])
    k = d.record_of(BIG, 2)
    d.records[k] = _rec(d.records[k], chunk_index=ci)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, FormatError, re.escape(p), re.escape(f"tensor {BIG!r} chunk {ci}"), "beyond")


def test_crafted_chunk_index_repeated(pair, ckpt, ddir):
    d = Delta.parse(pair["data"])
    k = d.record_of(BIG, 1)
    d.records[k] = _rec(d.records[k], chunk_index=0)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, FormatError, re.escape(p), "out of order")


def test_crafted_record_names_other_tensor(pair, ckpt, ddir):
    d = Delta.parse(pair["data"])
    k = d.record_of(L0)
    d.records[k] = _rec(d.records[k], tensor_index=d.records[k].tensor_index + 1)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, FormatError, re.escape(p), "record names tensor")


@pytest.mark.parametrize("enc", [0, 6, 255])
def test_crafted_unknown_encoding(pair, ckpt, ddir, enc):
    d = Delta.parse(pair["data"])
    k = d.record_of(L0)
    d.records[k] = _rec(d.records[k], encoding=enc)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, FormatError, re.escape(p), f"encoding {enc}")


def test_crafted_ulp_hist_chunk_without_its_history(pair, ckpt, ddir):
    """A chunk relabelled ``ulp_hist`` (encoding 5), every hash consistent: the rollout holds no
    history, so the chunk names one it cannot have, and nothing is written."""
    d = Delta.parse(pair["data"])
    k = d.record_of(L0)
    d.records[k] = _rec(d.records[k], encoding=5)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, DecodeError, re.escape(p), "none is held here")


def test_crafted_reserved_bytes(pair, ckpt, ddir):
    d = Delta.parse(pair["data"])
    raw = bytearray(d.to_bytes())
    tab = section_spans(bytes(raw))["table"][0]
    raw[tab + 9] = 1  # first reserved byte of record 0
    d2 = bytes(raw)
    s = section_spans(d2)
    idx = seg_hash(d2[s["manifest"][0]:])
    d2 = fix_header_hash(d2[:64] + idx + d2[80:])
    p = write_bytes(ddir / "c.delta", d2)
    refused(p, ckpt, FormatError, "reserved bytes", re.escape(p))


def test_crafted_payload_offsets_overlap(pair, ckpt, ddir):
    """Records whose payloads overlap (hashes right, offsets lying): the layout check must refuse it."""
    d = Delta.parse(pair["data"])
    d.keep_records = True
    k = d.record_of(BIG, 1)
    d.records[k] = _rec(d.records[k], payload_offset=d.records[k].payload_offset - 1)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, FormatError, re.escape(p), "holes or overlap")


def test_crafted_payload_over_limit(pair, ckpt, ddir):
    d = Delta.parse(pair["data"])
    k = d.record_of(L0)
    d.payloads[k] = bytes(256 * 1024 * 2 + 256 * 1024 * 2 // 64 + 4097)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, LimitError, re.escape(p), "exceeds the limit")


@pytest.mark.parametrize("enc", [SPARSE_XOR, DENSE_XOR, OVERWRITE])
def test_crafted_decoded_len_over_limit(pair, ckpt, ddir, enc):
    d = Delta.parse(pair["data"])
    k = d.record_of(L0)
    d.records[k] = _rec(d.records[k], encoding=enc, decoded_len=0xFFFFFFFF)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, LimitError, re.escape(p), "decoded bytes")


def test_crafted_ulp_with_decoded_len(pair, ckpt, ddir):
    d = Delta.parse(pair["data"])
    k = d.record_of(L0)
    d.records[k] = _rec(d.records[k], decoded_len=16)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, DecodeError, re.escape(p), "decoded length")


@pytest.mark.parametrize("enc", [SPARSE_XOR, DENSE_XOR, OVERWRITE])
def test_crafted_ulp_payload_relabelled(pair, ckpt, ddir, enc):
    """An ULP payload under a zstd encoding: not a zstd frame."""
    d = Delta.parse(pair["data"])
    k = d.record_of(L0)
    d.records[k] = _rec(d.records[k], encoding=enc, decoded_len=1 if enc == SPARSE_XOR else 256 * 1024 * 2)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, (DecodeError, LimitError), re.escape(p), re.escape(f"tensor {L0!r} chunk 0"))


# -------------------------------------------------------------------- crafted: sparse / dense payloads


@pytest.mark.parametrize("last", [256 * 1024, 256 * 1024 + 1, 1 << 20, (1 << 32) - 2])
def test_crafted_sparse_positions_past_chunk(pair, ckpt, ddir, last):
    """The last position lies at or past the chunk's 262144 elements (up to the u32 gap limit)."""
    d = _with_sparse(pair, last_pos=last)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, DecodeError, re.escape(p), re.escape(f"tensor {L0!r} chunk 0"), "beyond the chunk")


def test_crafted_sparse_lists_unchanged_element(pair, ckpt, ddir):
    p = _with_sparse(pair, zero_xor_at=100).write(ddir / "c.delta")
    refused(p, ckpt, DecodeError, re.escape(p), "unchanged element")


@pytest.mark.parametrize("width", [0, 3, 8])
def test_crafted_sparse_bad_width(pair, ckpt, ddir, width):
    d = _with_sparse(pair)
    k = d.record_of(L0)
    raw = zstandard.ZstdDecompressor().decompress(d.payloads[k])
    d.payloads[k] = zc(bytes([width]) + raw[1:])
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, DecodeError, re.escape(p), "layout does not match")


def test_crafted_sparse_short_layout(pair, ckpt, ddir):
    """The frame is fine but holds fewer bytes than n_changed entries need."""
    d = _with_sparse(pair)
    k = d.record_of(L0)
    raw = zstandard.ZstdDecompressor().decompress(d.payloads[k])[:-2]
    d.payloads[k] = zc(raw)
    d.records[k] = _rec(d.records[k], decoded_len=len(raw))
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, DecodeError, re.escape(p), "layout does not match")


def test_crafted_sparse_wrong_values(pair, ckpt, ddir):
    """Positions fine, one XOR value wrong: decodes, but misses the post-image hash."""
    d = _with_sparse(pair)
    k = d.record_of(L0)
    raw = bytearray(zstandard.ZstdDecompressor().decompress(d.payloads[k]))
    raw[-1] ^= 0x01 if raw[-1] != 0x01 else 0x03
    d.payloads[k] = zc(bytes(raw))
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, VerificationError, re.escape(p), "post-image")


@pytest.mark.parametrize("enc", [SPARSE_XOR, DENSE_XOR, OVERWRITE])
def test_crafted_zstd_huge_content_size(pair, ckpt, ddir, enc):
    """A chunk's zstd frame declares 1 TiB of content: refused from the frame header, nothing allocated."""
    d = Delta.parse(pair["data"])
    k = d.record_of(L0)
    dlen = 64 if enc == SPARSE_XOR else 256 * 1024 * 2
    d.records[k] = _rec(d.records[k], encoding=enc, decoded_len=dlen)
    d.payloads[k] = zstd_frame(b"\x04" + bytes(63), 1 << 40)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, LimitError, re.escape(p), re.escape(f"tensor {L0!r} chunk 0"), str(1 << 40))


@pytest.mark.parametrize("enc", [DENSE_XOR, OVERWRITE])
def test_crafted_dense_wrong_count(pair, ckpt, ddir, enc):
    """A correct dense image with a record count off by one."""
    d = Delta.parse(pair["data"])
    k = d.record_of(BIG, 1)
    b1, t1 = bf16_chunk(pair["tensors"], BIG, 1), bf16_chunk(pair["target_tensors"], BIG, 1)
    d.records[k] = _rec(d.records[k], encoding=enc, decoded_len=SEGMENT_BYTES, n_changed=d.records[k].n_changed + 1)
    d.tensor(BIG)[1]["changed"] += 1
    d.payloads[k] = zc(((b1 ^ t1) if enc == DENSE_XOR else t1).tobytes())
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, DecodeError, re.escape(p), re.escape(f"tensor {BIG!r} chunk 1"), "changed elements")


def test_crafted_zstd_frame_lies_about_size(pair, ckpt, ddir):
    """The frame declares the right size but holds less: a decode error, not a short buffer."""
    d = Delta.parse(pair["data"])
    k = d.record_of(L0)
    d.records[k] = _rec(d.records[k], encoding=OVERWRITE, decoded_len=256 * 1024 * 2)
    d.payloads[k] = zstd_frame(bytes(1000), 256 * 1024 * 2)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, DecodeError, re.escape(p), "zstd frame")


# --------------------------------------------------------------------------- crafted: ULP payloads


ULP_VARIANTS = list(_ulp_variants(b"\x10\0\0\0" + bytes(range(40))))


@pytest.mark.parametrize("variant", ULP_VARIANTS)
def test_crafted_ulp_garbled(pair, ckpt, ddir, variant):
    """An ULP payload truncated or garbled, its payload hash recomputed: DecodeError or VerificationError
    (never a crash, an IndexError or a hang)."""
    d = Delta.parse(pair["data"])
    k = d.record_of(BIG, 1)
    d.payloads[k] = _ulp_variants(d.payloads[k])[variant]
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, (DecodeError, VerificationError), re.escape(p), re.escape(f"tensor {BIG!r} chunk 1"))


@pytest.mark.parametrize("name", ["norm.f32", "proj.f16", "proj.f8", "steps.i32"])
def test_crafted_ulp_fuzz(pair, ckpt, ddir, name):
    """Seeded random mutations of one ULP payload per dtype (flips, cuts, inserts, overwrites)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    d0 = Delta.parse(pair["data"])
    k = d0.record_of(name)
    good = d0.payloads[k]
    before = sha(ckpt)
    for trial in range(10):
        p = bytearray(good)
        op = trial % 4
        i = int(rng.integers(0, len(p)))
        if op == 0:
            p[i] ^= 1 << int(rng.integers(0, 8))
        elif op == 1:
            del p[i:]
        elif op == 2:
            p[i:i] = rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8).tobytes()
        else:
            j = min(len(p), i + int(rng.integers(1, 64)))
            p[i:j] = rng.integers(0, 256, j - i, dtype=np.uint8).tobytes()
        if bytes(p) == good:
            continue
        d = d0.copy()
        d.payloads[k] = bytes(p)
        path = d.write(ddir / f"fuzz-{trial}.delta")
        refused(path, ckpt, (DecodeError, VerificationError), re.escape(f"tensor {name!r} chunk 0"))
    assert sha(ckpt) == before


# ------------------------------------------------------------------------------ crafted: manifest


def _man(pair, edit) -> Delta:
    d = Delta.parse(pair["data"])
    edit(d)
    return d


def _set(key: str, value):
    def edit(d: Delta):
        d.manifest[key] = value

    return edit


def _tensor_set(name: str, *keys_value):
    *keys, value = keys_value

    def edit(d: Delta):
        obj = d.tensor(name)[1]
        for k in keys[:-1]:
            obj = obj[k]
        obj[keys[-1]] = value

    return edit


def _manifest_raw(raw: bytes):
    def edit(d: Delta):
        d.manifest_raw = raw

    return edit


def _dup_name(d: Delta):
    """List the record-less 'frozen.bias' entry twice (record numbering stays consistent)."""
    ts = d.manifest["tensors"]
    i = d.tensor("frozen.bias")[0]
    ts.insert(i + 1, dict(ts[i]))


def _drop_tensors(d: Delta):
    del d.manifest["tensors"]


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


MANIFESTS = [
    ("list", _manifest_raw(b"[]"), FormatError, "not a deltarefit.delta"),
    ("string", _manifest_raw(b'"deltarefit.delta"'), FormatError, "not a deltarefit.delta"),
    ("null", _manifest_raw(b"null"), FormatError, "not a deltarefit.delta"),
    ("not-json", _manifest_raw(b"{not json"), FormatError, "not valid JSON"),
    ("not-utf8", _manifest_raw(b'{"a":"\xff\xfe"}'), FormatError, "not valid JSON"),
    ("empty", _manifest_raw(b""), FormatError, "not valid JSON"),
    ("wrong-format", _set("format", "safetensors"), FormatError, "not a deltarefit.delta"),
    ("wrong-version", _set("version", 2), FormatError, "manifest says version 2, the header 1"),
    ("segment-bytes", _set("segment_bytes", 1 << 16), FormatError, "segment size"),
    ("base-fp-not-hex", _set("base_fingerprint", "zz" * 32), FormatError, "base_fingerprint"),
    ("target-fp-short", _set("target_fingerprint", "ab"), FormatError, "target_fingerprint"),
    ("no-tensors", _drop_tensors, FormatError, "no tensor list"),
    ("tensors-dict", _set("tensors", {}), FormatError, "no tensor list"),
    ("bad-dtype", _tensor_set(L0, "base", "dtype", "BF17"), FormatError, "unsupported dtype 'BF17'"),
    ("dtype-null", _tensor_set(L0, "target", "dtype", None), FormatError, "unsupported dtype None"),
    ("dtype-list", _tensor_set(L0, "base", "dtype", ["BF16"]), FormatError, "unsupported dtype"),
    ("dtype-object", _tensor_set(L0, "base", "dtype", {"a": 1}), FormatError, "unsupported dtype"),
    ("negative-shape", _tensor_set(L0, "base", "shape", [256, -1024]), FormatError, "bad shape"),
    ("float-shape", _tensor_set(L0, "base", "shape", [256.0, 1024]), FormatError, "bad shape"),
    ("bool-shape", _tensor_set(L0, "base", "shape", [True, 1024]), FormatError, "bad shape"),
    ("huge-shape", _tensor_set(L0, "base", "shape", [1 << 47, 1 << 47]), (FormatError,), "(limit|shape)"),
    ("shape-not-list", _tensor_set(L0, "base", "shape", "256x1024"), FormatError, "bad shape"),
    ("too-many-dims", _tensor_set(L0, "base", "shape", [1] * 65), FormatError, "bad shape"),
    ("name-twice", _dup_name, FormatError, "listed twice"),
    ("name-not-string", _tensor_set(L0, "name", 7), FormatError, "expected an object with a name"),
    ("op-unknown", _tensor_set(L0, "op", "xor"), FormatError, "unknown op 'xor'"),
    ("op-same-with-records", _tensor_set(L0, "op", "same"), FormatError, "op 'same'"),
    ("first-wrong", _tensor_set(L0, "first", 0), FormatError, "chunk records start at"),
    ("count-negative", _tensor_set(L0, "count", -1), FormatError, "non-negative"),
    ("changed-wrong", _tensor_set(L0, "changed", 1), FormatError, "manifest says 1"),
    ("digest-not-hex", _tensor_set(L0, "base", "digest", "g" * 64), FormatError, "not hex"),
    ("target-missing", _tensor_set(L0, "target", None), FormatError, "needs base"),
    ("dtype-changed-by-patch", _tensor_set(L0, "target", "dtype", "F16"), FormatError, "cannot change dtype"),
    ("big-int", _manifest_raw(b'{"format":' + b"1" * 5000 + b"}"), FormatError, "JSON"),
    ("deep-nesting", _manifest_raw(_deep(100000)), FormatError, "JSON"),
]


@pytest.mark.parametrize(
    ("edit", "exc", "pattern"),
    [pytest.param(m[1], m[2], m[3], id=m[0])
     for m in MANIFESTS],
)
def test_crafted_manifest(pair, ckpt, ddir, edit, exc, pattern):
    p = _man(pair, edit).write(ddir / "c.delta")
    refused(p, ckpt, exc, re.escape(p), pattern)


@pytest.mark.parametrize("how", ["shape", "base-digest"])
def test_crafted_manifest_semantic_base(pair, ckpt, ddir, how):
    """Consistent manifests describing another base: a tensor's shape (same bytes), or its base digest."""
    d = Delta.parse(pair["data"])
    t = d.tensor(L0)[1]
    if how == "shape":
        t["base"]["shape"] = t["target"]["shape"] = [512, 512]
    else:
        t["base"]["digest"] = "ab" * 32
        d.refingerprint()
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, BaseMismatchError, re.escape(f"tensor {L0!r}"))


@pytest.mark.parametrize("how", ["target_fingerprint", "base_fingerprint", "tensor-target-digest",
                                 "record-post-is-pre"])
def test_crafted_wrong_target_is_refused_before_writing(pair, ckpt, ddir, how):
    """Chunks that decode to their post-images but a manifest whose target they do not give (a fingerprint
    that its digests do not make; a tensor target digest, fingerprint recomputed; a record claiming its
    chunk is already done): the plan has every hash it needs to refuse these before writing."""
    d = Delta.parse(pair["data"])
    if how.endswith("fingerprint"):
        d.manifest[how] = "cd" * 32
    elif how == "tensor-target-digest":
        d.tensor(L0)[1]["target"]["digest"] = "cd" * 32
        d.refingerprint()
    else:
        k = d.record_of(BIG, 1)
        d.records[k] = _rec(d.records[k], post_hash=d.records[k].pre_hash)
    p = d.write(ddir / "c.delta")
    # A manifest that contradicts itself is a corrupt delta (caught on read); one that is consistent
    # but wrong about the checkpoint is caught by the plan. Either way, before writing.
    refused(p, ckpt, (IntegrityError, VerificationError), re.escape(p), "(fingerprint|digest)")


# ------------------------------------------------------------------------- crafted: header and frame


def test_crafted_manifest_frame_huge_content_size(pair, ckpt, ddir):
    d = Delta.parse(pair["data"])
    d.manifest_frame = zstd_frame(json.dumps(d.manifest).encode(), 1 << 40)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, LimitError, re.escape(p), "manifest expands to")


@pytest.mark.parametrize("frame", [b"", b"\x28\xb5\x2f\xfd", b"{}", "short-frame"])
def test_crafted_manifest_frame_broken(pair, ckpt, ddir, frame):
    d = Delta.parse(pair["data"])
    if frame == "short-frame":
        raw = json.dumps(d.manifest).encode()
        frame = zstd_frame(raw[:100], len(raw))
    d.manifest_frame = frame
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, FormatError, re.escape(p), "manifest")


@pytest.mark.parametrize(("field", "value", "exc", "pattern"), [
    ("flags", 0, FormatError, "unknown header flags"),
    ("flags", 0xFFFF, FormatError, "unknown header flags"),
    ("header_size", 128, FormatError, "size 128"),
    ("man_len", (256 << 20) + 1, LimitError, "manifest declares"),
    ("tab_len", 81, LimitError, "chunk table"),
    ("tab_len", 80 * ((1 << 26) + 1), LimitError, "chunk table"),
    ("pay_len", 1 << 62, FormatError, "section layout"),
    ("pay_off", 0, FormatError, "section layout"),
    ("idx_hash", b"\0" * 16, IntegrityError, "manifest/table hash"),
])
def test_crafted_header(pair, ckpt, ddir, field, value, exc, pattern):
    """Header fields edited with the header hash fixed up: the field's own check must refuse it."""
    d = Delta.parse(pair["data"])
    if field in d.header:
        d.header[field] = value
    else:
        d.extra[field] = value
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, exc, re.escape(p), pattern)


# --------------------------------------------------------------------------------------- the CLI


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, DELTAREFIT_NO_PROGRESS="1")
    return subprocess.run([sys.executable, "-m", "deltarefit", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


def _cli_refused(delta: str, ckpt: str, code: int, *patterns: str) -> None:
    before = sha(ckpt)
    r = cli("apply", delta, ckpt)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deltarefit: error: "), r.stderr
    for p in patterns:
        assert re.search(p, lines[0]), (p, lines[0])
    assert sha(ckpt) == before
    assert leftovers(ckpt) == []


def test_cli_truncated(pair, ckpt, ddir):
    p = write_bytes(ddir / "t.delta", pair["data"][: len(pair["data"]) // 2])
    _cli_refused(p, ckpt, 3, re.escape(p), "truncated")


def test_cli_unknown_version(pair, ckpt, ddir):
    p = write_bytes(ddir / "v.delta", fix_header_hash(pair["data"][:8] + struct.pack("<H", 9) + pair["data"][10:]))
    _cli_refused(p, ckpt, 3, "format version 9")


def test_cli_wrong_base(pair, ckpt):
    _variant(pair, ckpt, lambda ts: ts.pop(BIG))
    _cli_refused(pair["delta"], ckpt, 5, re.escape(f"tensor {BIG!r}"), "wrong base")


def test_cli_garbled_ulp(pair, ckpt, ddir):
    d = Delta.parse(pair["data"])
    k = d.record_of(BIG, 0)
    d.payloads[k] = d.payloads[k][:-7]
    p = d.write(ddir / "c.delta")
    _cli_refused(p, ckpt, 3, re.escape(f"tensor {BIG!r} chunk 0"))


def test_cli_arguments_swapped(pair, ckpt):
    """`apply CKPT DELTA`: told as swapped arguments (by what each path is) before anything is opened for
    writing; neither file is touched."""
    before = sha(pair["delta"])
    _cli_refused(ckpt, pair["delta"], 2, "the arguments look swapped", "is a delta", "nothing was done")
    assert sha(pair["delta"]) == before


# ------------------------------------------------------------------- structural deltas (add/remove/replace)


@pytest.fixture(scope="module")
def spair(pair):
    """A delta from the base that adds 'new.weight' (2 chunks), removes 'frozen.bias' and re-types
    'proj.f16' to F32 (replace)."""
    d = pair["dir"]
    t2 = dict(pair["target_tensors"])
    t2["new.weight"] = (torch.randn(700, 1024, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    del t2["frozen.bias"]
    t2["proj.f16"] = t2["proj.f16"].float()
    target = write_tensors(d / "target2.safetensors", t2)
    delta = str(d / "structural.delta")
    deltarefit.encode(pair["base"], target, delta, format_version=1)
    with open(delta, "rb") as f:
        data = f.read()
    ops = {t["name"]: t["op"] for t in Delta.parse(data).manifest["tensors"]}
    assert (ops["new.weight"], ops["frozen.bias"], ops["proj.f16"]) == ("add", "remove", "replace")
    return {"target": target, "delta": delta, "data": data, "fp": deltarefit.fingerprint(target)}


def test_structural_good_delta_applies(spair, ckpt, ddir):
    p = Delta.parse(spair["data"]).write(ddir / "s.delta")
    rep = deltarefit.apply(p, ckpt)
    assert sorted(rep.structural) == ["frozen.bias", "new.weight", "proj.f16"]
    assert deltarefit.fingerprint(ckpt) == spair["fp"]
    assert leftovers(ckpt) == []


def test_structural_wrong_base_removed_tensor_differs(pair, spair, ckpt):
    def edit(ts):
        ts["frozen.bias"].view(torch.int16)[3] ^= 1

    _variant(pair, ckpt, edit)
    refused(spair["delta"], ckpt, BaseMismatchError, "'frozen.bias'")


def test_structural_wrong_base_replaced_tensor_missing(pair, spair, ckpt):
    _variant(pair, ckpt, lambda ts: ts.pop("proj.f16"))
    refused(spair["delta"], ckpt, BaseMismatchError, "'proj.f16'", "missing")


def test_structural_added_chunk_wrong_bytes(spair, ckpt, ddir):
    """The added tensor's overwrite chunk is a valid frame of the right size, but of other bytes."""
    d = Delta.parse(spair["data"])
    k = d.record_of("new.weight", 1)
    raw = bytearray(zstandard.ZstdDecompressor().decompress(d.payloads[k]))
    raw[1000] ^= 0x40
    d.payloads[k] = zc(bytes(raw))
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, VerificationError, re.escape(p), re.escape("tensor 'new.weight' chunk 1"), "post-image")


def test_structural_added_chunk_huge_content_size(spair, ckpt, ddir):
    d = Delta.parse(spair["data"])
    k = d.record_of("new.weight", 0)
    d.payloads[k] = zstd_frame(bytes(64), 1 << 40)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, LimitError, re.escape("tensor 'new.weight' chunk 0"), str(1 << 40), re.escape(p))


def test_structural_added_chunk_not_overwrite(spair, ckpt, ddir):
    d = Delta.parse(spair["data"])
    k = d.record_of("new.weight", 0)
    d.records[k] = _rec(d.records[k], encoding=ULP, decoded_len=0)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, FormatError, re.escape(p), "not allowed for op 'add'")


def test_structural_added_tensor_missing_a_chunk(spair, ckpt, ddir):
    d = Delta.parse(spair["data"])
    k = d.record_of("new.weight", 1)
    del d.records[k], d.payloads[k]
    i, t = d.tensor("new.weight")
    t["count"] -= 1
    for later in d.manifest["tensors"][i + 1:]:
        later["first"] -= 1
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, FormatError, re.escape(p), "needs all 2 chunks")


@pytest.mark.parametrize("how", ["target_fingerprint", "added-target-digest"])
def test_structural_wrong_target_is_refused_before_writing(spair, ckpt, ddir, how):
    """As above for a structural delta, whose file would be rewritten whole: refused before that."""
    d = Delta.parse(spair["data"])
    if how == "target_fingerprint":
        d.manifest["target_fingerprint"] = "cd" * 32
    else:
        d.tensor("new.weight")[1]["target"]["digest"] = "cd" * 32
        d.refingerprint()
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, (IntegrityError, VerificationError), re.escape(p), "(fingerprint|digest)")


# ------------------------------------------------------------------- manifest bounds: memory before trust


def _nested(depth: int):
    v: list = []
    for _ in range(depth - 1):
        v = [v]
    return v


def test_manifest_bomb_is_refused_before_it_expands(pair, ckpt, ddir):
    """A few KB of zstd that expand to 64 MiB of ``[[],[],...]``: refused from the frame's declared size
    (its expansion is bounded by its compressed size), in a process that stays small."""
    from deltarefit.apps.bench.hostile import measure, write_manifest_bomb

    p = str(ddir / "bomb.delta")
    size = write_manifest_bomb(p, 64 << 20)
    assert size < 16 << 10
    err = refused(p, ckpt, LimitError, re.escape(p), "manifest expands to 67108", r"1024x its compressed size")
    assert "\n" not in str(err)
    r = measure(["inspect", p])
    print(f"inspect of a {size}-byte manifest bomb: rc {r.rc}, peak RSS {r.peak_rss >> 20} MiB, {r.seconds:.2f} s")
    assert r.rc == LimitError.exit_code and "manifest expands to" in r.last_line
    assert r.peak_rss < 512 << 20  # generous: the interpreter and its imports are ~150 MiB


def test_manifest_of_dense_containers_is_refused_before_parsing(pair, ckpt, ddir):
    """Within the expansion bound, 1 MiB of ``[],`` as the tensor list (a list of 56 bytes per 3 bytes of
    text): refused by counting brackets, before json.loads builds it."""
    d = Delta.parse(pair["data"])
    man = json.dumps(d.manifest).encode()
    d.manifest_raw = man.replace(b'"tensors": [', b'"tensors": [' + b"[]," * (1 << 18) + b"[],", 1)
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, LimitError, re.escape(p), r"manifest holds \d+ JSON arrays/objects in \d+ bytes")


def test_manifest_nested_too_deep_is_refused(pair, ckpt, ddir):
    """Readers must not rely on ``stats``, but it is parsed: 9 levels of nesting are refused (real
    manifests nest 5), before parsing."""
    d = Delta.parse(pair["data"])
    d.manifest["stats"] = {"x": _nested(8)}
    p = d.write(ddir / "c.delta")
    refused(p, ckpt, LimitError, re.escape(p), "manifest nests JSON 10 levels deep, limit 8")
    d.manifest["stats"] = {"x": _nested(6)}  # 8 levels: within the limit, and applies
    p = d.write(ddir / "ok.delta")
    deltarefit.apply(p, ckpt)


def test_writer_refuses_a_manifest_readers_would_refuse(tmp_path):
    path = str(tmp_path / "w.delta")
    w = fmt.DeltaWriter(path)
    with pytest.raises(LimitError, match="manifest nests JSON"):
        w.finish({"format": "deltarefit.delta", "version": 2, "stats": _nested(20)})
    w.abort()
    assert os.listdir(tmp_path) == []


def test_a_very_compressible_real_manifest_is_within_the_bounds(tmp_path):
    """20000 unchanged tensors sharing one digest (their manifest compresses ~200:1, the most real ones
    do) are written and read back: the expansion bound leaves room."""
    from deltarefit.integrity import fingerprint_from_digests

    digest = bytes(range(32))
    names = [f"model.layers.{i // 8}.block_sparse_moe.experts.{i % 8}.w3.lora_B.weight" for i in range(20000)]
    fp = fingerprint_from_digests(dict.fromkeys(names, digest))
    meta = fmt.TensorMeta("BF16", (4096, 16), digest)
    tensors = [fmt.TensorEntry(n, "same", meta, meta, 0, 0, 0).to_json() for n in sorted(names)]
    man = {"format": "deltarefit.delta", "version": fmt.VERSION, "segment_bytes": SEGMENT_BYTES,
           "hash": "blake3-128", "base_fingerprint": fp, "target_fingerprint": fp, "tensors": tensors, "stats": {}}
    path = str(tmp_path / "same.delta")
    w = fmt.DeltaWriter(path)
    w.finish(man)
    with fmt.DeltaReader(path) as r:
        head = fmt.HEADER.unpack(open(path, "rb").read(fmt.HEADER_SIZE))
        ratio = len(json.dumps(man, separators=(",", ":"), sort_keys=True)) / head[7]
        print(f"manifest of {len(names)} tensors: expansion {ratio:.0f}:1 (limit {fmt.MANIFEST_EXPANSION}:1)")
        assert len(r.tensors) == 20000 and ratio > 100
