"""The hostile-delta corpus shared by every apply target's tests.

Crafting helpers (hand-built chunk payloads, garbled ULP payloads, truncation and bit-flip offsets)
used by ``test_hostile.py`` (the full corpus against a checkpoint file, with the CLI) and ``CASES``, a
representative subset run against every apply target by ``test_apply_targets.py``. A case is a bad
delta for the good base, or the good delta for a bad base (``edit`` of the base tensors the target
holds); either way every target must refuse it with ``exc`` and a message matching ``patterns``
(``PATH`` stands for the delta file's path), and write nothing.

Edits go through ``_pairs.Delta``: *damaged* files (truncated, bit-flipped: the hashes catch them)
and *crafted* ones (every offset and hash recomputed, so only a semantic check can refuse them).
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import zstandard
from _pairs import Delta, section_spans, write_pair, zstd_frame

import deltarefit
from deltarefit import format as fmt
from deltarefit.codec.chunk import DENSE_XOR, OVERWRITE, SPARSE_XOR
from deltarefit.errors import (
    BaseMismatchError,
    DecodeError,
    FormatError,
    IntegrityError,
    LimitError,
    VerificationError,
)
from deltarefit.integrity import SEGMENT_BYTES

ELEMS = SEGMENT_BYTES // 2  # bf16 elements in a full chunk
L0 = "layers.0.weight"  # 256x1024 bf16: one (short) chunk of 262144 elements
BIG = "big.weight"  # 1536x1024 bf16: three full chunks
PATH = "<delta path>"  # in a case's patterns: the crafted delta file's path


def make_pair(d: Path) -> dict:
    """The base/target pair of ``_pairs.write_pair`` in ``d``, its delta, and both as tensors."""
    base, target = write_pair(d)
    delta = str(d / "good.delta")
    # Format version 1 (ulp chunks): the corpus below garbles ulp payloads; additive digests too (every target
    # reads them or not).
    deltarefit.encode(base, target, delta, sums=True, format_version=1)
    with open(delta, "rb") as f:
        data = f.read()
    return {"dir": d, "base": base, "target": target, "delta": delta, "data": data,
            "tensors": safetensors.torch.load_file(base), "target_tensors": safetensors.torch.load_file(target)}


def other_pair(pair: dict, seed: int) -> tuple[str, str, str]:
    """(base, target, delta) of another pair with the same names, dtypes and shapes (made once)."""
    key = f"other-{seed}"
    if key not in pair:
        d = pair["dir"] / key
        d.mkdir()
        b, t = write_pair(d, seed=seed)
        deltarefit.encode(b, t, str(d / "d.delta"), sums=True, format_version=1)
        pair[key] = (b, t, str(d / "d.delta"))
    return pair[key]


def write_bytes(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def bf16_chunk(tensors: dict[str, torch.Tensor], name: str, ci: int) -> np.ndarray:
    u = tensors[name].contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
    return u[ci * ELEMS:(ci + 1) * ELEMS].copy()


def zc(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw)


def rec(r: fmt.ChunkRecord, **kw) -> fmt.ChunkRecord:
    return replace(r, **kw)


def sparse_xor(b: np.ndarray, t: np.ndarray, width: int = 4, last_pos: int | None = None,
               zero_xor_at: int | None = None) -> tuple[bytes, int, int]:
    """(payload, decoded_len, n_changed) of a SPARSE_XOR chunk built by hand from base/target bits;
    ``last_pos`` moves the last change to that element index (the gap before it grows)."""
    pos = np.flatnonzero(b != t)
    gaps = np.diff(pos, prepend=-1) - 1
    if last_pos is not None:
        gaps[-1] = last_pos - pos[-2] - 1
    xor = b[pos] ^ t[pos]
    if zero_xor_at is not None:
        xor[zero_xor_at] = 0
    raw = bytes([width]) + gaps.astype(f"<u{width}").tobytes() + xor.astype("<u2").tobytes()
    return zc(raw), len(raw), pos.size


def with_sparse(pair: dict, **kw) -> Delta:
    """The good delta with L0's chunk as a hand-built SPARSE_XOR chunk (``sparse_xor`` options)."""
    d = Delta.parse(pair["data"])
    k = d.record_of(L0)
    b, t = bf16_chunk(pair["tensors"], L0, 0), bf16_chunk(pair["target_tensors"], L0, 0)
    pay, dlen, n = sparse_xor(b, t, **kw)
    d.records[k] = rec(d.records[k], encoding=SPARSE_XOR, decoded_len=dlen, n_changed=n)
    d.payloads[k] = pay
    return d


# (section, fraction of the way into it); a fraction of -1 means "one byte before its end".
TRUNCATIONS = [
    ("empty", 0), ("header", 1), ("header", 7), ("header", 8), ("header", 50), ("header", 95),
    ("payload", 0), ("payload", 0.5), ("payload", -1), ("manifest", 0), ("manifest", 0.5),
    ("table", 0), ("table", 0.5), ("table", -1),
]


def truncation_offset(data: bytes, section: str, where: float) -> int:
    if section == "empty":
        return 0
    if section == "header":
        return int(where)
    b, e = section_spans(data)[section]
    return e - 1 if where == -1 else b + int(where * (e - b))


def flip_offsets(data: bytes) -> list[tuple[str, int]]:
    """(field, byte offset) of the bytes the bit-flip cases flip."""
    s = section_spans(data)
    r0 = s["table"][0]
    rl = s["table"][1] - fmt.RECORD_SIZE  # last record
    pb, pe = s["payload"]
    mb, me = s["manifest"]
    return [
        ("magic", 0), ("magic", 7), ("version", 8), ("flags", 10), ("header_size", 12), ("payload_off", 16),
        ("payload_len", 24), ("manifest_off", 32), ("manifest_len", 40), ("table_off", 48), ("table_len", 56),
        ("index_hash", 64), ("header_hash", 80), ("header_hash", 95),
        ("payload", pb), ("payload", (pb + pe) // 2), ("payload", pe - 1),
        ("manifest", mb), ("manifest", (mb + me) // 2), ("manifest", me - 1),
        ("record.tensor_index", r0), ("record.n_changed", r0 + 12), ("record.payload_hash", r0 + 32),
        ("record.pre_hash", r0 + 48), ("record.post_hash", rl + 79),
    ]


def ulp_variants(p: bytes) -> dict[str, bytes]:
    """An ULP payload truncated or garbled in named ways (range-coder length, bytes, tails)."""
    rc_len = struct.unpack_from("<I", p)[0]
    raw_at = 4 + rc_len
    mid = (raw_at + len(p)) // 2
    return {
        "cut-1": p[:-1], "cut-half": p[: len(p) // 2], "cut-to-9": p[:9], "cut-to-4": p[:4], "empty": b"",
        "rc_len-0": struct.pack("<I", 0) + p[4:], "rc_len-huge": struct.pack("<I", 0xFFFFFFFF) + p[4:],
        "rc_len-short": struct.pack("<I", rc_len - 3) + p[4:], "rc_len-long": struct.pack("<I", rc_len + 3) + p[4:],
        "rc-byte": p[:20] + bytes([p[20] ^ 0x5A]) + p[21:],
        "rc-last": p[:raw_at - 1] + bytes([p[raw_at - 1] ^ 0x80]) + p[raw_at:],
        "raw-first": p[:raw_at] + bytes([p[raw_at] ^ 0x01]) + p[raw_at + 1:],
        "raw-mid": p[:mid] + bytes([p[mid] ^ 0x10]) + p[mid + 1:],
        "trailing-0": p + b"\0", "trailing-ff": p + b"\xff" * 7,
        "zeros": bytes(len(p)), "ones": b"\xff" * len(p),
        "swap-halves": p[:4] + p[raw_at:] + p[4:raw_at],
    }


# ------------------------------------------------------------------------------------------ the corpus


@dataclass(frozen=True)
class Case:
    id: str
    exc: type | tuple[type, ...]
    patterns: tuple[str, ...]  # regexes the message must match; PATH: the delta's path, escaped
    craft: Callable[[dict, Path], str] | None = None  # -> the delta to apply; None: the good delta
    edit: Callable[[dict[str, torch.Tensor], dict], None] | None = None  # the base the target holds

    def delta(self, pair: dict, ddir: Path) -> str:
        return self.craft(pair, ddir) if self.craft else pair["delta"]

    def regexes(self, delta: str) -> list[str]:
        return [re.escape(delta) if p == PATH else p for p in self.patterns]


def _edited(edit: Callable[[Delta], None]) -> Callable[[dict, Path], str]:
    def craft(pair: dict, ddir: Path) -> str:
        d = Delta.parse(pair["data"])
        edit(d)
        return d.write(ddir / "c.delta")

    return craft


def _bytes(f: Callable[[bytes], bytes]) -> Callable[[dict, Path], str]:
    return lambda pair, ddir: write_bytes(ddir / "c.delta", f(pair["data"]))


def _truncated(section: str, where: float):
    return _bytes(lambda data: data[:truncation_offset(data, section, where)])


def _flipped(field: str, nth: int = 0):
    """The good delta with one bit flipped at the ``nth`` offset of ``field`` in ``flip_offsets``
    (the bit ``test_hostile.test_bit_flip`` flips there)."""

    def f(data: bytes) -> bytes:
        offs = flip_offsets(data)
        i = [j for j, (w, _) in enumerate(offs) if w == field][nth]
        bad = bytearray(data)
        bad[offs[i][1]] ^= 1 << (i % 8)
        return bytes(bad)

    return _bytes(f)


def _lie_target_digest(d: Delta) -> None:
    """A patched tensor's target digest lies, the fingerprints recomputed: every chunk decodes to its
    post-image, so only the plan's post-image digest can refuse it before writing."""
    d.tensor(L0)[1]["target"]["digest"] = "cd" * 32
    d.refingerprint()


def _lie_target_fingerprint(d: Delta) -> None:
    d.manifest["target_fingerprint"] = "cd" * 32


def _post_is_pre(d: Delta) -> None:
    k = d.record_of(BIG, 1)
    d.records[k] = rec(d.records[k], post_hash=d.records[k].pre_hash)


def _count_lies(d: Delta) -> None:
    k = d.record_of(L0)
    d.records[k] = rec(d.records[k], n_changed=d.records[k].n_changed - 1)
    d.tensor(L0)[1]["changed"] -= 1


def _ulp(variant: str):
    def edit(d: Delta) -> None:
        k = d.record_of(BIG, 1)
        d.payloads[k] = ulp_variants(d.payloads[k])[variant]

    return edit


def _ulp_decoded_len(d: Delta) -> None:
    k = d.record_of(L0)
    d.records[k] = rec(d.records[k], decoded_len=16)


def _base_digest(d: Delta) -> None:
    d.tensor(L0)[1]["base"]["digest"] = "ab" * 32
    d.refingerprint()


def _foreign_payload(pair: dict, ddir: Path) -> str:
    """L0's chunk payload from a delta of another pair (counts adjusted): consistent, decodes to other bytes."""
    d = Delta.parse(pair["data"])
    d2 = Delta.load(other_pair(pair, 3)[2])
    k, k2 = d.record_of(L0), d2.record_of(L0)
    d.payloads[k] = d2.payloads[k2]
    d.tensor(L0)[1]["changed"] += d2.records[k2].n_changed - d.records[k].n_changed
    d.records[k] = rec(d.records[k], n_changed=d2.records[k2].n_changed)
    return d.write(ddir / "c.delta")


def _sparse_wrong_values(pair: dict, ddir: Path) -> str:
    d = with_sparse(pair)
    k = d.record_of(L0)
    raw = bytearray(zstandard.ZstdDecompressor().decompress(d.payloads[k]))
    raw[-1] ^= 0x01 if raw[-1] != 0x01 else 0x03
    d.payloads[k] = zc(bytes(raw))
    return d.write(ddir / "c.delta")


def _dense_wrong_count(pair: dict, ddir: Path) -> str:
    d = Delta.parse(pair["data"])
    k = d.record_of(BIG, 1)
    b1, t1 = bf16_chunk(pair["tensors"], BIG, 1), bf16_chunk(pair["target_tensors"], BIG, 1)
    d.records[k] = rec(d.records[k], encoding=DENSE_XOR, decoded_len=SEGMENT_BYTES,
                       n_changed=d.records[k].n_changed + 1)
    d.tensor(BIG)[1]["changed"] += 1
    d.payloads[k] = zc((b1 ^ t1).tobytes())
    return d.write(ddir / "c.delta")


def _zstd_huge(d: Delta) -> None:
    k = d.record_of(L0)
    d.records[k] = rec(d.records[k], encoding=OVERWRITE, decoded_len=256 * 1024 * 2)
    d.payloads[k] = zstd_frame(b"\x04" + bytes(63), 1 << 40)


def _delta_of_other_pair(pair: dict, ddir: Path) -> str:
    return other_pair(pair, 1)[2]


def _one_element(name: str, elem: int):
    def edit(ts: dict, pair: dict) -> None:
        ts[name].view(torch.int16).reshape(-1)[elem] ^= 0x10

    return edit


def _other_target(ts: dict, pair: dict) -> None:
    ts.clear()
    ts.update(safetensors.torch.load_file(other_pair(pair, 2)[1]))


WRONG_TARGET = (IntegrityError, VerificationError)

CASES: list[Case] = [
    # crafted, consistent, and lying about the target: all the plan needs to refuse them is there
    Case("lying-target-digest", WRONG_TARGET, (PATH, "(fingerprint|digest)"), _edited(_lie_target_digest)),
    Case("lying-target-fingerprint", WRONG_TARGET, (PATH, "fingerprint"), _edited(_lie_target_fingerprint)),
    Case("record-post-is-pre", WRONG_TARGET, (PATH, "(fingerprint|digest)"), _edited(_post_is_pre)),
    # damaged files
    Case("truncated-header", FormatError, (PATH, "truncated header"), _truncated("header", 50)),
    Case("truncated-payload", FormatError, (PATH, "truncated or appended"), _truncated("payload", 0.5)),
    Case("truncated-table", FormatError, (PATH, "truncated or appended"), _truncated("table", -1)),
    Case("appended", FormatError, (PATH, "appended"), _bytes(lambda data: data + b"\0")),
    Case("flip-header-hash", IntegrityError, (PATH, "header hash mismatch"), _flipped("header_hash")),
    Case("flip-manifest", IntegrityError, (PATH, "manifest/table hash mismatch"), _flipped("manifest", 1)),
    Case("flip-record-post-hash", IntegrityError, (PATH, "manifest/table hash mismatch"),
         _flipped("record.post_hash")),
    Case("flip-payload", IntegrityError, (PATH, "payload hash mismatch"), _flipped("payload", 1)),
    # crafted chunks: only decoding (and the post-image hash) can tell
    Case("count-lies", (DecodeError, VerificationError), (PATH, re.escape(f"tensor {L0!r} chunk 0")),
         _edited(_count_lies)),
    Case("foreign-payload", (DecodeError, VerificationError), (PATH, re.escape(f"tensor {L0!r} chunk 0")),
         _foreign_payload),
    Case("ulp-cut-half", (DecodeError, VerificationError), (PATH, re.escape(f"tensor {BIG!r} chunk 1")),
         _edited(_ulp("cut-half"))),
    Case("ulp-raw-mid", (DecodeError, VerificationError), (PATH, re.escape(f"tensor {BIG!r} chunk 1")),
         _edited(_ulp("raw-mid"))),
    Case("ulp-rc-byte", (DecodeError, VerificationError), (PATH, re.escape(f"tensor {BIG!r} chunk 1")),
         _edited(_ulp("rc-byte"))),
    Case("ulp-with-decoded-len", DecodeError, (PATH, "decoded length"), _edited(_ulp_decoded_len)),
    Case("sparse-wrong-values", VerificationError, (PATH, "post-image"), _sparse_wrong_values),
    Case("sparse-past-chunk", DecodeError, (PATH, "beyond the chunk"),
         lambda pair, ddir: with_sparse(pair, last_pos=256 * 1024).write(ddir / "c.delta")),
    Case("dense-wrong-count", DecodeError, (PATH, re.escape(f"tensor {BIG!r} chunk 1"), "changed elements"),
         _dense_wrong_count),
    Case("zstd-huge-content-size", LimitError, (PATH, str(1 << 40)), _edited(_zstd_huge)),
    # another base
    Case("manifest-base-digest", BaseMismatchError, (re.escape(f"tensor {L0!r}"),), _edited(_base_digest)),
    Case("delta-of-other-pair", BaseMismatchError, ("wrong base",), _delta_of_other_pair),
    Case("base-is-other-target", BaseMismatchError, ("wrong base",), edit=_other_target),
    Case("base-element-untouched-tensor", BaseMismatchError, (r"tensor 'frozen\.bias'",),
         edit=_one_element("frozen.bias", 7)),
    Case("base-element-untouched-chunk", BaseMismatchError, (r"tensor 'embed\.weight'",),
         edit=_one_element("embed.weight", ELEMS + 12345)),
    Case("base-element-patched-chunk", BaseMismatchError, (re.escape(f"tensor {BIG!r}"),),
         edit=_one_element(BIG, 5)),
    Case("base-missing-tensor", BaseMismatchError, (r"tensor 'proj\.f16'", "missing"),
         edit=lambda ts, pair: ts.pop("proj.f16")),
    Case("base-extra-tensor", BaseMismatchError, ("'lm_head.extra'",),
         edit=lambda ts, pair: ts.__setitem__("lm_head.extra", torch.zeros(16, dtype=torch.bfloat16))),
    Case("base-dtype", BaseMismatchError, (re.escape(f"tensor {L0!r}"), re.escape("F16[256, 1024]")),
         edit=lambda ts, pair: ts.__setitem__(L0, ts[L0].view(torch.float16))),
    Case("base-shape", BaseMismatchError, (re.escape(f"tensor {L0!r}"), re.escape("BF16[512, 512]")),
         edit=lambda ts, pair: ts.__setitem__(L0, ts[L0].reshape(512, 512))),
]
assert len({c.id for c in CASES}) == len(CASES)
assert all(os.sep not in c.id for c in CASES)
