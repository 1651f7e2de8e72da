"""A version stream in a local (or network-mounted POSIX) directory: the embedded default."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable

from ..io.fsutil import fsync_dir
from ..transport.ratelimit import TokenBucket
from .base import (
    GET_RANGE,
    MTIME,
    PATH_OF,
    SET_PROGRESS,
    SWEEP_TEMPS,
    StoreBase,
    StoreError,
    check_key,
    check_range,
    local_write_error,
)


class LocalStore(StoreBase):
    """Objects are files under ``root``. ``put`` writes a temp file, fsyncs and renames it into place;
    ``create`` links a complete temp file to the key (``link`` fails if the key exists), so a
    conditional create is atomic and a reader never sees a partial commit record.

    Optional operations: all of them (``mtime`` is the file's; ``sweep_temps`` removes temp files)."""

    capabilities = frozenset({GET_RANGE, MTIME, SWEEP_TEMPS, PATH_OF, SET_PROGRESS})

    def __init__(self, root: str, *, rate: float | None = None, create: bool = True) -> None:
        """``create=False``: the directory must exist already (readers: a mistyped path is an error,
        not a new empty store)."""
        self.root = os.path.abspath(root)
        # Link emulation: file copies in and out of the store are paced to ``rate`` bytes/s (one bucket
        # for the store: its transfers share the emulated link). None: as fast as the disk goes.
        self._bucket = TokenBucket(rate) if rate else None
        self._progress: Callable[[int], None] | None = None
        self.url = self.root
        if not create:
            if not os.path.isdir(self.root):
                why = "not a directory" if os.path.exists(self.root) else "no such directory"
                raise StoreError(f"{self.root}: no store here ({why}); nothing was written; check the path (a trainer's first "
                                 f"'deltarefit publish {self.root} CHECKPOINT' creates the store)")
            return
        if os.path.lexists(self.root) and not os.path.isdir(self.root):
            raise StoreError(f"{self.root}: not a store: a file is there, not a directory; nothing was written. "
                             "STORE names a directory (the first publish creates it) or s3://bucket/prefix")
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{self.root}: cannot create store directory ({e.strerror})") from None

    def set_progress(self, progress: Callable[[int], None] | None) -> None:
        """Call ``progress(n)`` as each ``n`` bytes of a part go in or out of the store (a progress bar)."""
        self._progress = progress

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def path_of(self, key: str) -> str:
        """The file that holds ``key`` (readers on this host may open it instead of copying it)."""
        return self._path(key)

    def _tmp(self, path: str) -> str:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Unique per call: threads sharing this object may write the same key at once.
        return f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"

    def _write_tmp(self, path: str, data: bytes) -> str:
        tmp = self._tmp(path)
        _write_file(tmp, data)
        return tmp

    def put(self, key: str, data: bytes) -> None:
        self._put(key, lambda tmp: _write_file(tmp, data))

    def put_file(self, key: str, src: str) -> None:
        self._put(key, lambda tmp: self._copy(src, tmp))

    def _copy(self, src: str, dest: str) -> None:
        if self._bucket is None and self._progress is None:
            shutil.copyfile(src, dest)
            return
        with open(src, "rb") as fi, open(dest, "wb") as fo:
            # 64 KiB steps when paced: the temp then grows (and its mtime moves, which retention's
            # sweep of unfinished uploads goes by) as a real upload's does, not once per MiB
            while b := fi.read(1 << 16 if self._bucket is not None else 1 << 20):
                if self._bucket is not None:
                    self._bucket.take(len(b))
                fo.write(b)
                if self._progress is not None:
                    self._progress(len(b))

    def _put(self, key: str, fill) -> None:
        """Fill a temp file beside the key, fsync it, rename it over the key: whole or nothing."""
        path = self._path(key)
        tmp = self._tmp(path)
        try:
            fill(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(path))
        except OSError as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise StoreError(f"{path}: write failed ({e.strerror})") from None

    def create(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        try:
            tmp = self._write_tmp(path, data)
        except OSError as e:
            raise StoreError(f"{path}: write failed ({e.strerror})") from None
        try:
            os.link(tmp, path)  # atomic: fails with EEXIST if another writer got there first
            fsync_dir(os.path.dirname(path))
            return True
        except FileExistsError:
            return False
        except OSError as e:
            raise StoreError(f"{path}: create failed ({e.strerror})") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _open_object(self, key: str):
        """The file of ``key``, opened to read; ``KeyError`` if there is none (a directory is a prefix
        of keys, not an object). Anything but a regular file is refused naming it: a FIFO another
        local user planted at a key (a stream's ``HEAD``, a commit record) is opened non-blocking, so
        it cannot hang the reader, and is never read."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise KeyError(key) from None
        except OSError as e:
            raise StoreError(f"{path}: read failed ({e.strerror})") from None
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            os.close(fd)
            raise KeyError(key)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise StoreError(f"{path}: not a regular file (a FIFO or a device, planted by another user?); "
                             "remove it")
        return os.fdopen(fd, "rb")

    def get(self, key: str) -> bytes:
        path = self._path(key)
        with self._open_object(key) as f:
            try:
                return f.read()
            except OSError as e:
                raise StoreError(f"{path}: read failed ({e.strerror})") from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``key`` from ``start`` (fewer at the end of the object), paced like the
        other transfers when the store emulates a link."""
        path = self._path(key)
        check_range(key, start, length)
        with self._open_object(key) as f:
            try:
                data = os.pread(f.fileno(), length, start)
            except OSError as e:
                raise StoreError(f"{path}: read failed ({e.strerror})") from None
        if self._bucket is not None:
            self._bucket.take(len(data))
        return data

    def get_to(self, key: str, dest: str) -> None:
        path = self._path(key)
        if not os.path.isfile(path):
            raise KeyError(key)
        tmp = f"{dest}.tmp-{os.getpid()}"
        try:
            self._copy(path, tmp)
            os.replace(tmp, dest)
        except OSError as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            local = local_write_error(e, dest)
            if local is not None:
                raise local from None
            raise StoreError(f"{path}: copy to {dest} failed ({e.strerror})") from None

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def _stat(self, key: str) -> os.stat_result:
        """The file of ``key``; ``KeyError`` if there is none (a directory is a prefix, not an object)."""
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            raise KeyError(key) from None
        if not stat.S_ISREG(st.st_mode):
            raise KeyError(key)
        return st

    def size(self, key: str) -> int:
        return self._stat(key).st_size

    def mtime(self, key: str) -> float:
        return self._stat(key).st_mtime

    def list(self, prefix: str = "") -> list[str]:
        # Keys are matched as string prefixes (as object stores do): walk the deepest whole directory.
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self._path(head) if head else self.root
        out: list[str] = []
        if not os.path.isdir(base):
            return out
        for d, _, files in os.walk(base):
            for f in files:
                if ".tmp-" in f:
                    continue  # an unfinished write, never an object
                out.append(os.path.relpath(os.path.join(d, f), self.root).replace(os.sep, "/"))
        return sorted(k for k in out if k.startswith(prefix))

    def sweep_temps(self, older_than: float, *, prefix: str = "", dry_run: bool = False) -> list[str]:
        """Remove unfinished writes (``*.tmp-*``) older than ``older_than`` seconds under ``prefix``
        (a directory key ending in ``/``, or the whole store): a writer killed mid-upload leaves one,
        and ``list`` never shows them. Returns their paths relative to the root; ``dry_run``: only
        those, nothing removed."""
        removed = []
        cutoff = time.time() - older_than
        top = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        for d, _, files in os.walk(top):
            for f in files:
                p = os.path.join(d, f)
                if ".tmp-" in f:
                    with contextlib.suppress(FileNotFoundError):
                        if os.path.getmtime(p) <= cutoff:
                            if not dry_run:
                                os.unlink(p)
                            removed.append(os.path.relpath(p, self.root).replace(os.sep, "/"))
        return sorted(removed)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StoreError(f"{path}: delete failed ({e.strerror})") from None


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
