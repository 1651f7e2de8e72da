"""Peer codecs the benchmark compares against, each encoding the same base -> target pair.

Contract: every ``encode_*`` / measuring function returns a :class:`PeerResult` with the exact number
of bytes that would be shipped (``nbytes``; None when the peer is unavailable) and the wall seconds of
the encode (files are read from wherever they are, usually the page cache). Every function works
tensor by tensor (memory O(tensor)); none raises for a missing optional library.

* ``full``: raw bytes of all target tensors (the denominator of every ratio).
* ``zstd_full``: the whole target checkpoint file(s) through streaming zstd level 1 with
  ``threads`` worker threads (python ``zstandard``; 0 or 1 = single-threaded).
* ``nemo``: NeMo-RL-style sparse XOR patch. Per tensor (sorted by name): ``x = b ^ t`` on the
  unsigned bit patterns; the changed positions (sorted) are delta-encoded (first position, then
  gaps) into the smallest of uint16/uint32/uint64 that holds every gap; the stream is
  ``gaps || x[positions]`` through zstd level 1 (single-threaded). Record framing:
  ``<QBQ`` = (changed count, gap width in bytes, frame length) then the frame (absent if 0 changes).
* ``trl``: TRL-style sparse patch. Per tensor: changed flat indices as int32 (int64 when the tensor
  has 2**31 elements or more) and the new values, each through zstd level 1. Framing: ``<QBQQ`` =
  (changed count, index width, index frame length, value frame length) then both frames.
* ``zipnn``/``zipnn_delta``: ZipNN on each target tensor, and ZipNN's own XOR delta mode against the
  base tensor, if ``import zipnn`` works; each tensor is decompressed again and the result says
  whether it round-tripped (``verified``), so a broken install cannot pass silently.

``decode_nemo`` / ``decode_trl`` rebuild the target from the base and the written stream; the tests
and the benchmark use them to prove that the byte counts are honest.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import BinaryIO

import numpy as np
import zstandard

from ._st import TensorInfo, checkpoint_files, checkpoint_tensor_bytes, iter_pair, read_raw, tensor_index

log = logging.getLogger(__name__)

ZSTD_LEVEL = 1
_NEMO_HDR = struct.Struct("<QBQ")
_TRL_HDR = struct.Struct("<QBQQ")


@dataclass
class PeerResult:
    name: str
    nbytes: int | None
    seconds: float | None
    available: bool = True
    verified: bool | None = None  # None: not checked
    note: str = ""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class _Counter:
    """A write-only sink that only counts bytes."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, b: bytes) -> int:
        self.n += len(b)
        return len(b)


def full(target_path: str) -> PeerResult:
    return PeerResult("full", checkpoint_tensor_bytes(target_path), 0.0, note="raw tensor bytes")


REPEATS = 5  # timed runs per measurement; the best counts (a shared machine only ever slows one down)


def zstd_full(target_path: str, threads: int, repeats: int = REPEATS) -> PeerResult:
    """Whole checkpoint file(s) through streaming zstd -1 (``threads`` workers; <= 1: single-threaded);
    the best of ``repeats`` runs."""
    workers = threads if threads > 1 else 0
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=workers)
    dt = float("inf")
    for _ in range(repeats):
        sink = _Counter()
        t0 = time.perf_counter()
        for f in checkpoint_files(target_path):
            with open(f, "rb") as fin:
                cctx.copy_stream(fin, sink, read_size=1 << 20, write_size=1 << 20)
        dt = min(dt, time.perf_counter() - t0)
    how = f"zstandard {zstandard.__version__}, {workers} worker threads" if workers else "single-threaded"
    return PeerResult("zstd_full", sink.n, dt, note=f"level {ZSTD_LEVEL}, {how}")


def _gap_dtype(max_gap: int) -> np.dtype:
    for dt in (np.uint16, np.uint32, np.uint64):
        if max_gap <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError("gap too large")


def nemo_tensor(b: np.ndarray, t: np.ndarray, cctx: zstandard.ZstdCompressor) -> bytes:
    """One NeMo-style record (header + frame) for a tensor pair of equal unsigned dtype."""
    x = np.bitwise_xor(b.ravel(), t.ravel())
    pos = np.flatnonzero(x)
    if pos.size == 0:
        return _NEMO_HDR.pack(0, 0, 0)
    gaps = np.diff(pos, prepend=0)  # first entry: the first position itself
    gdt = _gap_dtype(int(gaps.max()))
    frame = cctx.compress(gaps.astype(gdt).tobytes() + x[pos].tobytes())
    return _NEMO_HDR.pack(pos.size, gdt.itemsize, len(frame)) + frame


def trl_tensor(b: np.ndarray, t: np.ndarray, cctx: zstandard.ZstdCompressor) -> bytes:
    """One TRL-style record (header + index frame + value frame)."""
    t = t.ravel()
    idx = np.flatnonzero(b.ravel() != t)
    if idx.size == 0:
        return _TRL_HDR.pack(0, 0, 0, 0)
    idt = np.dtype(np.int32) if t.size < 2**31 else np.dtype(np.int64)
    fi = cctx.compress(idx.astype(idt).tobytes())
    fv = cctx.compress(t[idx].tobytes())
    return _TRL_HDR.pack(idx.size, idt.itemsize, len(fi), len(fv)) + fi + fv


def _encode_sparse(kind: str, base_path: str, target_path: str, out_path: str) -> PeerResult:
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    fn = nemo_tensor if kind == "nemo" else trl_tensor
    t0 = time.perf_counter()
    with open(out_path, "wb") as out:
        out.writelines(fn(b, t, cctx) for _info, b, t in iter_pair(base_path, target_path))
    dt = time.perf_counter() - t0
    return PeerResult(kind, os.path.getsize(out_path), dt, note=f"zstd level {ZSTD_LEVEL}, single-threaded")


def encode_nemo(base_path: str, target_path: str, out_path: str) -> PeerResult:
    return _encode_sparse("nemo", base_path, target_path, out_path)


def encode_trl(base_path: str, target_path: str, out_path: str) -> PeerResult:
    return _encode_sparse("trl", base_path, target_path, out_path)


def _read_exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError("patch stream truncated")
    return data


def decode_nemo(base_path: str, patch_path: str) -> Iterator[tuple[TensorInfo, np.ndarray]]:
    """Rebuild each target tensor (sorted by name) from the base and a NeMo-style stream."""
    dctx = zstandard.ZstdDecompressor()
    with open(patch_path, "rb") as f:
        for info in tensor_index(base_path).values():
            n, width, flen = _NEMO_HDR.unpack(_read_exact(f, _NEMO_HDR.size))
            raw = read_raw(info)
            if n:
                gdt = np.dtype(f"<u{width}")
                data = dctx.decompress(_read_exact(f, flen), max_output_size=n * (width + raw.itemsize))
                gaps = np.frombuffer(data[: n * width], dtype=gdt)
                xs = np.frombuffer(data[n * width :], dtype=raw.dtype)
                pos = np.cumsum(gaps, dtype=np.int64)
                raw[pos] ^= xs
            yield info, raw
        if f.read(1):
            raise ValueError("trailing bytes in NeMo-style stream")


def decode_trl(base_path: str, patch_path: str) -> Iterator[tuple[TensorInfo, np.ndarray]]:
    """Rebuild each target tensor (sorted by name) from the base and a TRL-style stream."""
    dctx = zstandard.ZstdDecompressor()
    with open(patch_path, "rb") as f:
        for info in tensor_index(base_path).values():
            n, width, li, lv = _TRL_HDR.unpack(_read_exact(f, _TRL_HDR.size))
            raw = read_raw(info)
            if n:
                idx = np.frombuffer(
                    dctx.decompress(_read_exact(f, li), max_output_size=n * width), f"<i{width}"
                )
                vals = np.frombuffer(
                    dctx.decompress(_read_exact(f, lv), max_output_size=n * raw.itemsize), raw.dtype
                )
                raw[idx] = vals
            yield info, raw
        if f.read(1):
            raise ValueError("trailing bytes in TRL-style stream")


def verify_decoded(decoded: Iterator[tuple[TensorInfo, np.ndarray]], target_path: str) -> bool:
    """True when every decoded tensor equals the target's raw bytes (and all are present)."""
    ti = tensor_index(target_path)
    seen = 0
    for info, raw in decoded:
        if info.name not in ti or not np.array_equal(raw, read_raw(ti[info.name])):
            log.error("decoded tensor %s differs from the target", info.name)
            return False
        seen += 1
    return seen == len(ti)


_ZIPNN_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def zipnn(base_path: str, target_path: str, threads: int, *, delta: bool) -> PeerResult:
    """ZipNN per target tensor (``delta``: its XOR delta mode against the base tensor), verified."""
    name = "zipnn_delta" if delta else "zipnn"
    try:
        import zipnn as zn  # type: ignore[import-not-found]
    except Exception as e:
        return PeerResult(name, None, None, available=False, note=f"zipnn not importable: {e}")
    try:
        from importlib.metadata import version as _dist_version

        version = _dist_version("zipnn")
    except Exception:
        version = getattr(zn, "__version__", "?")
    try:
        total = 0
        seconds = 0.0
        ok = True
        coders: dict[str, object] = {}
        for info, b, t in iter_pair(base_path, target_path):
            zdt = _ZIPNN_DTYPES.get(info.dtype, "bfloat16")
            key = zdt
            if key not in coders:
                kw: dict[str, object] = {"input_format": "byte", "bytearray_dtype": zdt, "threads": threads}
                if delta:
                    kw["delta_compressed_type"] = "byte"
                coders[key] = zn.ZipNN(**kw)
            z = coders[key]
            tb, bb = t.tobytes(), b.tobytes()
            t0 = time.perf_counter()
            c = z.compress(tb, delta_second_data=bb) if delta else z.compress(tb)  # type: ignore[attr-defined]
            seconds += time.perf_counter() - t0
            total += len(c)
            back = z.decompress(c, delta_second_data=bb) if delta else z.decompress(c)  # type: ignore[attr-defined]
            if bytes(back) != tb:
                ok = False
        note = f"zipnn {version}, threads={threads}"
        if not ok:
            note += "; decompress did NOT return the input (round trip failed)"
            log.warning("%s: %s", name, note)
        return PeerResult(name, total, seconds, verified=ok, note=note)
    except Exception as e:
        log.warning("%s failed: %s", name, e)
        return PeerResult(name, None, None, available=False, note=f"zipnn {version} failed: {e}")


def run_peers(
    base_path: str, target_path: str, work_dir: str, threads: int, *, verify: bool = True
) -> dict[str, PeerResult]:
    """All peers on one pair; sparse patches are written under ``work_dir`` and (``verify``) decoded."""
    os.makedirs(work_dir, exist_ok=True)
    out: dict[str, PeerResult] = {"full": full(target_path), "zstd_full": zstd_full(target_path, threads)}
    for kind, enc, dec in (("nemo", encode_nemo, decode_nemo), ("trl", encode_trl, decode_trl)):
        path = os.path.join(work_dir, f"{kind}.patch")
        r = enc(base_path, target_path, path)
        if verify:
            r.verified = verify_decoded(dec(base_path, path), target_path)
            if not r.verified:
                raise AssertionError(
                    f"{kind}-style patch does not decode to the target: byte count dishonest"
                )
        os.remove(path)
        out[kind] = r
    out["zipnn"] = zipnn(base_path, target_path, threads, delta=False)
    out["zipnn_delta"] = zipnn(base_path, target_path, threads, delta=True)
    return out
