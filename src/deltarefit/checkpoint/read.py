"""Safetensors checkpoints as raw bit patterns over mmap: open, validate, view, modify in place, write,
fingerprint. Values are never converted; every tensor is its bytes.

Contract
--------
* A checkpoint is one ``.safetensors`` file; or a directory holding ``model.safetensors.index.json``
  (Hugging Face layout: ``{"metadata": {...}, "weight_map": {tensor: shard}}``) plus its shards; or a
  directory without an index holding one or more ``*.safetensors`` files (all of them belong to it, and a
  tensor name may appear only once). Other files in a directory are ignored. With an index, every
  ``weight_map`` entry must be in its shard; shard tensors the index does not map there are ignored.
* Headers are parsed strictly (``checkpoint.parse``): header length <= 100 MiB and inside the file, its JSON at most
  3 levels deep, with at most one array/object per 8 bytes and arrays of numbers only (checked before
  parsing, so a hostile header costs memory in proportion to its length only: see ``jsonlimits``), a
  JSON object
  (``__metadata__`` is metadata, not a tensor), known dtypes, shapes of at most 64 non-negative ints,
  ``data_offsets`` ``[begin, end]`` with ``end - begin == prod(shape) * itemsize`` inside the data
  section, no two tensors overlapping. Every failure raises ``CheckpointError`` with one line that names
  the file and, where there is one, the tensor.
* ``open_checkpoint`` maps each file (read-only, or shared-writable with ``writable=True``);
  ``Checkpoint.raw(name)`` is a 1-D ``uint8`` view of the tensor's bytes over that map, writable iff the
  checkpoint is. ``flush()`` makes writes durable (msync + fsync); ``close()`` is idempotent and views
  taken before it must not be used after it. Files are never truncated or rewritten in place.
* ``write_safetensors`` (``checkpoint.write``) streams ``TensorSource`` chunks into a standard safetensors file (readable by
  ``safetensors`` itself), data aligned to each tensor's itemsize, written to a temp file in the same
  directory and atomically renamed onto the target; memory stays O(one chunk).
* ``fingerprint_checkpoint`` returns ``(fingerprint hex, {name: tensor digest})`` as defined in
  ``integrity``, hashing segments on a thread pool.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO, Self

import numpy as np

from ..errors import CheckpointError, UsageError
from ..integrity import SEGMENT_BYTES, fingerprint_from_digests, segment_hashes, tensor_digest_from_segments
from ..io.fsutil import start_writeback
from .header import MAX_HEADER_BYTES
from .parse import HEADER_BYTES_PER_CONTAINER as HEADER_BYTES_PER_CONTAINER  # (the header's bounds, from
from .parse import HEADER_MAX_DEPTH as HEADER_MAX_DEPTH  # their earlier home)
from .parse import MAX_NDIM as MAX_NDIM
from .parse import TensorInfo, _load_json, _read_header

INDEX_MAX_DEPTH = 8  # an index nests 2-3 levels; past this bound it is refused before json.loads
INDEX_NAME = "model.safetensors.index.json"
SUFFIX = ".safetensors"
# Segments hashed per thread-pool task: a big tensor is spread over threads, small ones stay cheap.
HASH_TASK_SEGMENTS = 16


class _MappedFile:
    """One open safetensors file: its validated tensors and (if any holds bytes) its mmap."""

    def __init__(self, file: str, label: str, writable: bool) -> None:
        try:
            self.fh: BinaryIO = open(file, "r+b" if writable else "rb")
        except OSError as e:
            raise CheckpointError(f"{label}: cannot open: {e.strerror or e}") from None
        self.mm: mmap.mmap | None = None
        try:
            self.tensors = _read_header(self.fh, label, file)
            if any(t.nbytes for t in self.tensors):
                access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
                self.mm = mmap.mmap(self.fh.fileno(), 0, access=access)
                # Touching a page past EOF is SIGBUS, not an exception: refuse a file that shrank.
                end = max(t.offset + t.nbytes for t in self.tensors)
                if len(self.mm) < end:
                    raise CheckpointError(f"{label}: file shrank to {len(self.mm)} bytes while opening")
        except OSError as e:
            self.close()
            raise CheckpointError(f"{label}: cannot map: {e}") from None
        except BaseException:
            self.close()
            raise

    def flush(self) -> None:
        if self.mm is not None:
            self.mm.flush()
        os.fsync(self.fh.fileno())

    def close(self) -> None:
        if self.mm is not None:
            # Views still alive make close() raise BufferError: the mapping then stays valid until
            # the last view is dropped, which is what their holders need.
            with contextlib.suppress(BufferError):
                self.mm.close()
            self.mm = None
        self.fh.close()


class Checkpoint:
    """An open checkpoint: ``tensors`` in file (then shard) order, bytes reachable through ``raw``."""

    def __init__(self, path: str, files: list[_MappedFile], tensors: dict[str, TensorInfo], writable: bool):
        self.path = path
        self.tensors = tensors
        self.writable = writable
        self._files = {os.path.abspath(f.fh.name): f for f in files}
        self._closed = False

    def raw(self, name: str) -> np.ndarray:
        """1-D uint8 view of the tensor's bytes over the mmap (writable iff the checkpoint is)."""
        self._check_open()
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        if info.nbytes == 0:
            empty = np.zeros(0, np.uint8)
            empty.flags.writeable = self.writable
            return empty
        mm = self._files[info.file].mm
        return np.frombuffer(mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def write_raw(self, name: str, offset: int, data: np.ndarray) -> None:
        """Write ``data`` (contiguous) over the tensor's bytes from ``offset`` on, through the file
        (``pwrite``) rather than the map; ``raw`` views see it at once (one page cache). Hazard: a store
        through the map into a page it mapped read-only costs a write-protect fault, the filesystem's
        ``page_mkwrite``, per page: an apply that has just read every page of a segment through the map
        pays that on each of its pages (measured: 2-3x the time of the same scatter into pages never
        mapped), and a write of the whole segment's post-image through the file pays none of it."""
        self._check_open()
        info = self.tensors[name]
        buf = memoryview(np.ascontiguousarray(data)).cast("B")
        if not self.writable or offset < 0 or offset + len(buf) > info.nbytes:
            raise CheckpointError(f"{self.path}: tensor {name!r}: cannot write {len(buf)} bytes at {offset}")
        fd, at = self._files[info.file].fh.fileno(), info.offset + offset
        while buf:
            try:
                n = os.pwrite(fd, buf, at)
            except OSError as e:
                raise CheckpointError(f"{self.path}: tensor {name!r}: write failed: {e}") from e
            if n <= 0:
                raise CheckpointError(f"{self.path}: tensor {name!r}: write at {at} made no progress")
            buf, at = buf[n:], at + n
        # The disk gets these pages now, while the apply goes on, instead of all of them in ``flush``
        # (its fsync then waits only for the writes still in flight).
        start_writeback(fd, info.offset + offset, at - info.offset - offset)

    def identity(self) -> tuple:
        """Per file, from the open handles: (path, device, inode, size, mtime ns, ctime ns). Replacing a
        file (a new inode) or writing to it (mtime and ctime) changes it; hashes taken of the bytes
        stay valid while it does not. Hazard: timestamps are as coarse as the kernel's clock tick, so a
        write within the tick in which the identity was taken can go unseen; take it after the last
        write of one's own, as ``Publisher`` does."""
        self._check_open()
        out = []
        for path, mf in self._files.items():
            st = os.fstat(mf.fh.fileno())
            out.append((path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return tuple(out)

    def hash_with_identity(self, *, threads: int | None = None) -> tuple[str, dict[str, bytes], tuple]:
        """``fingerprint_checkpoint`` of this checkpoint, and its ``identity`` taken before the hash from
        the handles that were hashed: a write during the hash changes the identity, so it is never
        recorded for bytes the hash did not see."""
        ident = self.identity()
        fp, digests = fingerprint_checkpoint(self, threads=threads)
        return fp, digests, ident

    def files(self) -> list[str]:
        """Absolute paths of the safetensors files, in shard order."""
        return list(self._files)

    def flush(self) -> None:
        """Make writes through ``raw`` views durable (mmap flush + fsync); a no-op when read-only."""
        self._check_open()
        if not self.writable:
            return
        for file, mf in self._files.items():
            try:
                mf.flush()
            except OSError as e:
                raise CheckpointError(f"{file}: flush failed: {e}") from e

    def close(self) -> None:
        """Unmap and close every file (idempotent). Does not fsync: call ``flush`` for durability."""
        if self._closed:
            return
        self._closed = True
        for mf in self._files.values():
            mf.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self.path}: checkpoint is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "rw" if self.writable else "r"
        return f"Checkpoint({self.path!r}, {len(self.tensors)} tensors, {len(self._files)} files, {mode})"


def replaced_since(identity: tuple) -> str | None:
    """The first file of ``identity`` (``Checkpoint.identity``) whose path no longer names the inode
    that was opened (renamed over, deleted, replaced by a copy), or None. Bytes verified through an
    open handle are the path's only while this holds: check it before calling them the path's."""
    for path, dev, ino, *_ in identity:
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_dev, st.st_ino) != (dev, ino):
            return path
    return None


def modified_since(identity: tuple) -> str | None:
    """The first file of ``identity`` (``Checkpoint.identity``) whose path names an inode whose size,
    modification or change time differs from the identity's (written to by another process, ``cp``
    onto the same inode included, or its mode changed), or None. Checks the path as it is now, so
    call it after ``replaced_since``. Hazard: timestamps are as coarse as the kernel's clock tick
    (``Checkpoint.identity``)."""
    for path, _dev, _ino, size, mtime, ctime in identity:
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_size, st.st_mtime_ns, st.st_ctime_ns) != (size, mtime, ctime):
            return path
    return None


def check_not_replaced(identity: tuple, what: str) -> None:
    """Raise ``VerificationError`` (one line, naming the file) if ``replaced_since(identity)``, or if
    ``modified_since(identity)``: bytes verified (or written) through the handles are the path's only
    while nothing else wrote to its files since the identity was taken."""
    from ..errors import VerificationError

    gone = replaced_since(identity)
    if gone is not None:
        raise VerificationError(f"{gone}: {what}, but the path no longer names the file that was verified "
                                "(replaced or removed meanwhile by another process); nothing recorded, run "
                                "again")
    touched = modified_since(identity)
    if touched is not None:
        raise VerificationError(f"{touched}: {what}, but the file was modified by another process since it "
                                "was verified (size or times changed); nothing recorded, stop that process "
                                "and run again")


# A plan: (absolute file, label for messages, names the index maps to it or None for "all").
_Plan = list[tuple[str, str, set[str] | None]]


def _check_shard_name(label: str, shard: str) -> None:
    norm = os.path.normpath(shard) if shard and "\0" not in shard else ""
    if not norm or norm == "." or os.path.isabs(shard) or norm == ".." or norm.startswith(".." + os.sep):
        raise CheckpointError(f"{label}: shard name {shard!r} is not a file inside the checkpoint directory")


def _index_plan(path: str) -> _Plan:
    label = os.path.join(path, INDEX_NAME)
    try:
        with open(label, "rb") as f:
            raw = f.read(MAX_HEADER_BYTES + 1)
            size = os.fstat(f.fileno()).st_size if len(raw) > MAX_HEADER_BYTES else len(raw)
    except OSError as e:
        raise CheckpointError(f"{label}: cannot read: {e.strerror or e}") from None
    if len(raw) > MAX_HEADER_BYTES:
        raise CheckpointError(f"{label}: {size} bytes, larger than the {MAX_HEADER_BYTES >> 20} MiB limit")
    index = _load_json(raw, label, INDEX_MAX_DEPTH)
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{label}: 'weight_map' is missing or not an object of tensor -> shard file")
    by_shard: dict[str, set[str]] = {}
    for name, shard in wm.items():
        by_shard.setdefault(shard, set()).add(name)
    plan: _Plan = []
    for shard in sorted(by_shard):
        _check_shard_name(label, shard)
        file = os.path.abspath(os.path.join(path, shard))
        if not os.path.isfile(file):
            first = min(by_shard[shard])
            raise CheckpointError(f"{label}: shard {shard!r} (holding tensor {first!r}) does not exist")
        plan.append((file, os.path.join(path, shard), by_shard[shard]))
    return plan


def _dir_plan(path: str) -> _Plan:
    if os.path.isfile(os.path.join(path, INDEX_NAME)):
        return _index_plan(path)
    try:
        with os.scandir(path) as it:
            names = sorted(e.name for e in it if e.name.endswith(SUFFIX) and e.is_file())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot list: {e.strerror or e}") from None
    if not names:
        raise CheckpointError(f"{path}: no {INDEX_NAME} and no *{SUFFIX} files: not a checkpoint (nothing was "
                              f"written); name a {SUFFIX} file or a directory holding them")
    return [(os.path.abspath(os.path.join(path, n)), os.path.join(path, n), None) for n in names]


def _select(label: str, mf: _MappedFile, wanted: set[str] | None, into: dict[str, TensorInfo]) -> None:
    if wanted is not None:
        missing = sorted(wanted - {t.name for t in mf.tensors})
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(
                f"{label}: index maps tensor {missing[0]!r} to this shard but it has none{more}"
            )
    for t in mf.tensors:
        if wanted is not None and t.name not in wanted:
            continue
        if t.name in into:
            raise CheckpointError(f"{label}: tensor {t.name!r} is also in {into[t.name].file}")
        into[t.name] = t


def _not_a_checkpoint(p: str) -> str:
    """Why ``p``, neither a regular file nor a directory, is no checkpoint: missing, or what it is."""
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return f"{p}: no such checkpoint file or directory"
    except OSError as e:
        return f"{p}: cannot read the checkpoint ({e.strerror or e})"
    kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
            else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
    return f"{p}: not a checkpoint: {kind}, not a regular file or a directory"


def open_checkpoint(path: str | os.PathLike[str], *, writable: bool = False) -> Checkpoint:
    """Open and validate a checkpoint (file or directory); see the module docstring."""
    p = os.fspath(path)
    if os.path.isdir(p):
        plan = _dir_plan(p)
    elif os.path.isfile(p):
        plan = [(os.path.abspath(p), p, None)]
    else:
        raise CheckpointError(_not_a_checkpoint(p))
    files: list[_MappedFile] = []
    tensors: dict[str, TensorInfo] = {}
    try:
        for file, label, wanted in plan:
            files.append(_MappedFile(file, label, writable))
            _select(label, files[-1], wanted, tensors)
    except BaseException:
        for mf in files:
            mf.close()
        raise
    return Checkpoint(p, files, tensors, writable)


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Cheap test (no parsing): a ``.safetensors`` file, or a directory with an index or any shard."""
    p = os.fspath(path)
    if os.path.isfile(p):
        return p.endswith(SUFFIX)
    if not os.path.isdir(p):
        return False
    if os.path.isfile(os.path.join(p, INDEX_NAME)):
        return True
    try:
        with os.scandir(p) as it:
            return any(e.name.endswith(SUFFIX) and e.is_file() for e in it)
    except OSError:
        return False


def sole_weight_file(path: str | os.PathLike[str]) -> str | None:
    """The absolute path of the one ``.safetensors`` file of a directory that holds exactly one and no
    index, else None (not a directory, an index, several files, none). That directory and that file
    name the same checkpoint: its version record, and its lock, are the same whichever names it."""
    p = os.fspath(path)
    if not os.path.isdir(p) or os.path.lexists(os.path.join(p, INDEX_NAME)):
        return None
    try:
        with os.scandir(p) as it:
            names = [e.name for e in it if e.name.endswith(SUFFIX) and e.is_file()]
    except OSError:
        return None
    return os.path.abspath(os.path.join(p, names[0])) if len(names) == 1 else None


# ----------------------------------------------------------------------------------------------- hashing


def fingerprint_checkpoint(ck: Checkpoint, *, threads: int | None = None,
                           progress: Callable[[int], None] | None = None) -> tuple[str, dict[str, bytes]]:
    """``(fingerprint hex, {name: tensor digest})``; segments are hashed on ``threads`` threads.
    ``progress(n)``: told the bytes of each task as its hashes are collected (they add up to the tensors')."""
    workers = threads if threads is not None else min(32, os.cpu_count() or 1)
    if workers < 1:
        raise UsageError(f"threads must be >= 1, got {threads}")
    step = SEGMENT_BYTES * HASH_TASK_SEGMENTS
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="deltarefit-hash") as pool:
        jobs: dict[str, list[Future[list[bytes]]]] = {}
        for name in ck.tensors:
            raw = ck.raw(name)
            jobs[name] = [pool.submit(segment_hashes, raw[i : i + step]) for i in range(0, raw.size, step)]
        digests: dict[str, bytes] = {}
        for name, futures in jobs.items():
            info = ck.tensors[name]
            segs = []
            for k, fut in enumerate(futures):
                segs.extend(fut.result())
                if progress is not None:
                    progress(min(step, info.nbytes - k * step))
            digests[name] = tensor_digest_from_segments(info.dtype, info.shape, info.nbytes, segs)
    return fingerprint_from_digests(digests), digests


def carry_non_weights(src_dir: str, dst_dir: str) -> None:
    """Move into ``dst_dir`` every entry the Hugging Face directory ``src_dir`` holds beside its weights
    (config, tokenizer, subdirectories such as a repository's ``original/``, links, as they are: renamed,
    never followed) that ``dst_dir`` lacks, and give ``dst_dir`` the mode of ``src_dir``: a keyframe
    carries only weights. Weight files, their index and deltarefit's own files are not moved."""
    for name in os.listdir(src_dir):
        # ".deltarefit" anywhere: a weight file's own version record, lock or journal inside the directory
        # describes the old files, not the keyframe's.
        if (name.endswith(".safetensors") or name == INDEX_NAME or ".deltarefit" in name
                or os.path.lexists(os.path.join(dst_dir, name))):
            continue
        os.replace(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    os.chmod(dst_dir, stat.S_IMODE(os.lstat(src_dir).st_mode))
