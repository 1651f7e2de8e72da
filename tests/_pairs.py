"""Helpers shared by the hostile-input and crash tests: realistic checkpoint pairs as real safetensors
files, file hashes, a raw safetensors writer, and a parser/re-serializer for delta files that lets a test
edit the manifest, the chunk records or the payload and write a *consistent* file back (every offset and
hash recomputed, mirroring ``DeltaWriter.finish``), so that only a semantic check can refuse it.

Nothing here imports deltarefit's writers: files are built independently of the code under test.
"""

from __future__ import annotations

import copy
import glob
import hashlib
import json
import os
import struct
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import safetensors.torch
import torch
import zstandard

from deltarefit import format as fmt
from deltarefit.integrity import seg_hash

# ---------------------------------------------------------------------------------------- file helpers


def sha(path: str | os.PathLike[str]) -> str:
    """sha256 hex of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 22)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def journal_of(ckpt: str | os.PathLike[str]) -> str:
    return os.fspath(ckpt) + ".deltarefit-journal"


def leftovers(ckpt: str | os.PathLike[str]) -> list[str]:
    """Journal or temp files an apply may have left next to a single-file checkpoint."""
    p = os.fspath(ckpt)
    out = [journal_of(p)] if os.path.exists(journal_of(p)) else []
    d = os.path.dirname(os.path.abspath(p))
    out += sorted(glob.glob(os.path.join(d, "*.tmp-*")))
    return out


# ------------------------------------------------------------------------------ writing checkpoints

_ST_DTYPE = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def write_raw_safetensors(path: str | os.PathLike[str], tensors: dict[str, tuple[str, tuple[int, ...], Any]]) -> None:
    """Write ``{name: (safetensors dtype, shape, raw bytes or ndarray)}`` as a standard safetensors file.

    Written by hand (8-byte length, JSON header padded to 8, data in the given order), so big test files
    cost one pass over their bytes and no dtype conversion.
    """
    header: dict[str, Any] = {}
    off = 0
    blobs = []
    for name, (dt, shape, data) in tensors.items():
        mv = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)) if isinstance(data, np.ndarray) \
            else memoryview(data)
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + mv.nbytes]}
        off += mv.nbytes
        blobs.append(mv)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.writelines(blobs)


def _bump(t: torch.Tensor, change: float, g: torch.Generator) -> torch.Tensor:
    """A copy of ``t`` with about ``change`` of its elements moved by +-1 or +-2 in its integer view
    (+-1/+-2 ulp for floats), computed on the bit pattern so nothing is rounded."""
    iv = t.contiguous().view(_INT_VIEW[t.element_size()]).clone().reshape(-1)
    n = iv.numel()
    k = max(1, round(change * n))
    idx = torch.randperm(n, generator=g)[:k]
    step = torch.randint(1, 3, (k,), generator=g) * (torch.randint(0, 2, (k,), generator=g) * 2 - 1)
    iv[idx] = (iv[idx].to(torch.int64) + step).to(iv.dtype)  # int64 then back: wraps like the bit pattern does
    return iv.view(t.dtype).reshape(t.shape)


def _randn(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, scale: float = 0.02) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def pair_tensors(*, n_tensors: int = 4, shape: tuple[int, ...] = (256, 1024), change: float = 0.03,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base, target) tensor dicts: ``n_tensors`` of ``dtype``/``shape`` plus F32, F16, F8_E4M3 and I32
    tensors, one BF16 tensor spanning three 1 MiB chunks, one spanning two chunks of which only the first
    changes (``embed.weight``), and one that does not change at all (``frozen.bias``)."""
    g = torch.Generator().manual_seed(seed)
    base: dict[str, torch.Tensor] = {}
    for i in range(n_tensors):
        if dtype.is_floating_point:
            base[f"layers.{i}.weight"] = _randn(shape, dtype, g)
        else:
            base[f"layers.{i}.weight"] = torch.randint(-1000, 1000, shape, generator=g).to(dtype)
    base["big.weight"] = _randn((1536, 1024), torch.bfloat16, g)  # 3 MiB: three chunks
    base["norm.f32"] = 1.0 + _randn((4096,), torch.float32, g, 0.1)
    base["proj.f16"] = _randn((128, 512), torch.float16, g, 0.1)
    base["proj.f8"] = _randn((256, 256), torch.float8_e4m3fn, g, 1.0)
    base["steps.i32"] = torch.randint(-(1 << 20), 1 << 20, (2048,), generator=g, dtype=torch.int32)
    base["frozen.bias"] = _randn((1024,), torch.bfloat16, g)
    base["embed.weight"] = _randn((1024, 1024), torch.bfloat16, g)  # 2 MiB: two chunks
    target = {k: (v.clone() if k == "frozen.bias" else _bump(v, change, g)) for k, v in base.items()}
    target["embed.weight"] = torch.cat([target["embed.weight"][:512], base["embed.weight"][512:]])  # chunk 1 same
    return base, target


def write_tensors(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor]) -> str:
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, os.fspath(path))
    return os.fspath(path)


def write_pair(dir: str | os.PathLike[str], *, n_tensors: int = 4, shape: tuple[int, ...] = (256, 1024),
               change: float = 0.03, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> tuple[str, str]:
    """Write ``base.safetensors`` and ``target.safetensors`` into ``dir``; see ``pair_tensors``."""
    base, target = pair_tensors(n_tensors=n_tensors, shape=shape, change=change, dtype=dtype, seed=seed)
    d = os.fspath(dir)
    return (write_tensors(os.path.join(d, "base.safetensors"), base),
            write_tensors(os.path.join(d, "target.safetensors"), target))


def write_big_pair(dir: str | os.PathLike[str], *, mib: int = 96, n_tensors: int = 8, change: float = 0.03,
                   seed: int = 0) -> tuple[str, str]:
    """A large BF16 pair (``mib`` MiB over ``n_tensors`` tensors) built with numpy in one pass."""
    rng = np.random.default_rng(seed)
    per = (mib << 20) // 2 // n_tensors
    cols = 4096
    rows = per // cols
    base: dict[str, tuple[str, tuple[int, ...], Any]] = {}
    target: dict[str, tuple[str, tuple[int, ...], Any]] = {}
    for i in range(n_tensors):
        f = rng.standard_normal(rows * cols, dtype=np.float32) * np.float32(0.02)
        b = (f.view(np.uint32) >> 16).astype(np.uint16)  # truncate to bf16 bit patterns
        t = b.copy()
        k = int(change * b.size)
        idx = rng.choice(b.size, k, replace=False)
        step = rng.integers(1, 3, k, dtype=np.int16) * rng.choice(np.array([-1, 1], np.int16), k)
        t[idx] = (t[idx].view(np.int16) + step).view(np.uint16)
        base[f"model.layers.{i}.mlp.weight"] = ("BF16", (rows, cols), b)
        target[f"model.layers.{i}.mlp.weight"] = ("BF16", (rows, cols), t)
    d = os.fspath(dir)
    bp, tp = os.path.join(d, "base.safetensors"), os.path.join(d, "target.safetensors")
    write_raw_safetensors(bp, base)
    write_raw_safetensors(tp, target)
    return bp, tp


def st_dtype(t: torch.Tensor) -> str:
    return _ST_DTYPE[t.dtype]


# ---------------------------------------------------------------------------------- delta surgery


@dataclass
class Delta:
    """A parsed delta file; edit any field, then ``to_bytes``/``write`` gives a consistent file.

    ``payloads`` holds each record's payload bytes (in table order); on serialization the records'
    ``payload_offset``, ``payload_len`` and ``payload_hash`` are recomputed from them unless
    ``keep_records`` is set. ``manifest`` is a JSON value, or ``manifest_raw`` bytes (pre-compression)
    override it; ``manifest_frame`` overrides the compressed section entirely.
    """

    header: dict[str, Any]
    manifest: Any
    records: list[fmt.ChunkRecord]
    payloads: list[bytes]
    manifest_raw: bytes | None = None
    manifest_frame: bytes | None = None
    keep_records: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, data: bytes) -> Delta:
        (magic, ver, flags, hsize, pay_off, _pay_len, man_off, man_len, tab_off, tab_len, _idx_hash,
         _head_hash) = fmt.HEADER.unpack_from(data, 0)
        header = {"magic": magic, "version": ver, "flags": flags, "header_size": hsize}
        frame = data[man_off:man_off + man_len]
        man = json.loads(zstandard.ZstdDecompressor().decompress(frame) if _zstd_manifest() else frame)
        records = []
        for i in range(tab_len // fmt.RECORD_SIZE):
            (ti, ci, enc, _r1, _r2, nch, poff, plen, dlen, ph, pre, post) = fmt.RECORD.unpack_from(
                data, tab_off + i * fmt.RECORD_SIZE)
            records.append(fmt.ChunkRecord(ti, ci, enc, nch, poff, plen, dlen, ph, pre, post))
        payloads = [data[pay_off + r.payload_offset:pay_off + r.payload_offset + r.payload_len] for r in records]
        return cls(header, man, records, payloads)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Delta:
        with open(path, "rb") as f:
            return cls.parse(f.read())

    def copy(self) -> Delta:
        return copy.deepcopy(self)

    def tensor(self, name: str) -> tuple[int, dict[str, Any]]:
        """(index, manifest entry) of a tensor."""
        for i, t in enumerate(self.manifest["tensors"]):
            if t["name"] == name:
                return i, t
        raise KeyError(name)

    def record_of(self, name: str, k: int = 0) -> int:
        """Table index of the ``k``-th record of tensor ``name``."""
        _, t = self.tensor(name)
        assert t["count"] > k, f"{name} has {t['count']} records"
        return t["first"] + k

    def refingerprint(self) -> Delta:
        """Recompute the manifest's base/target fingerprints from its tensor digests (after a test edited a
        digest), so the delta stays self-consistent."""
        from deltarefit.integrity import fingerprint_from_digests

        for side in ("base", "target"):
            digests = {t["name"]: bytes.fromhex(t[side]["digest"]) for t in self.manifest["tensors"] if t.get(side)}
            self.manifest[f"{side}_fingerprint"] = fingerprint_from_digests(digests)
        return self

    def to_bytes(self) -> bytes:
        recs = self.records
        if not self.keep_records:
            recs, off = [], 0
            for r, p in zip(self.records, self.payloads, strict=True):
                recs.append(replace(r, payload_offset=off, payload_len=len(p), payload_hash=seg_hash(p)))
                off += len(p)
        payload = b"".join(self.payloads)
        if self.manifest_frame is not None:
            man = self.manifest_frame
        else:
            man = self.manifest_raw if self.manifest_raw is not None else json.dumps(
                self.manifest, separators=(",", ":"), sort_keys=True).encode("utf-8")
            if _zstd_manifest():
                man = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(man)
        table = b"".join(r.pack() for r in recs)
        h = self.header
        pay_off = fmt.HEADER_SIZE
        man_off = pay_off + len(payload)
        fields = {"pay_off": pay_off, "pay_len": len(payload), "man_off": man_off, "man_len": len(man),
                  "tab_off": man_off + len(man), "tab_len": len(table), "idx_hash": seg_hash(man + table)}
        fields.update(self.extra)  # a test may force any header field (the header hash is still fixed up)
        head = fmt.HEADER.pack(h["magic"], h["version"], h["flags"], h["header_size"], fields["pay_off"],
                               fields["pay_len"], fields["man_off"], fields["man_len"], fields["tab_off"],
                               fields["tab_len"], fields["idx_hash"], fmt.ZERO_HASH)
        head = head[:-16] + seg_hash(head[:-16])
        return head + payload + man + table

    def write(self, path: str | os.PathLike[str]) -> str:
        with open(path, "wb") as f:
            f.write(self.to_bytes())
        return os.fspath(path)


def _zstd_manifest() -> bool:
    """Whether this build's format compresses the manifest (mirrors DeltaWriter.finish)."""
    return bool(getattr(fmt, "FLAG_MANIFEST_ZSTD", 0))


def fix_header_hash(data: bytes) -> bytes:
    """Recompute the header's own hash after a test edited header fields."""
    head = data[:fmt.HEADER_SIZE]
    head = head[:-16] + seg_hash(head[:-16])
    return head + data[fmt.HEADER_SIZE:]


def section_spans(data: bytes) -> dict[str, tuple[int, int]]:
    """Byte ranges [begin, end) of each section of a well-formed delta file."""
    (_m, _v, _f, _h, pay_off, pay_len, man_off, man_len, tab_off, tab_len, _i, _hh) = fmt.HEADER.unpack_from(data, 0)
    return {"header": (0, fmt.HEADER_SIZE), "payload": (pay_off, pay_off + pay_len),
            "manifest": (man_off, man_off + man_len), "table": (tab_off, tab_off + tab_len)}


def zstd_frame(data: bytes, declared_size: int) -> bytes:
    """A single-segment zstd frame holding ``data`` as one raw block but declaring ``declared_size``
    bytes of content in its header (8-byte Frame_Content_Size field)."""
    assert len(data) < 1 << 21
    fhd = 0b11_1_0_0_0_00  # FCS field 8 bytes, single segment, no checksum, no dictionary
    block = struct.pack("<I", (len(data) << 3) | 1)[:3]  # last block, raw, size
    return struct.pack("<I", 0xFD2FB528) + bytes([fhd]) + struct.pack("<Q", declared_size) + block + data
