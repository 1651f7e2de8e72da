"""Durable file writes: the one place that knows how to make a rename survive a crash."""

from __future__ import annotations

import os

from .errors import FileSystemError


def fsync_dir(d: str) -> None:
    """fsync a directory, so a rename or link inside it is durable."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes, *, durable: bool = True, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` whole or not at all: temp file, fsync, rename, fsync the directory.
    Never truncates the old file (a reader may have it mapped). ``durable=False`` skips the fsyncs, for
    a cache whose reader detects a file torn by a power loss. ``mode``: permission bits of the new file
    (default: as the umask gives)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):  # a full disk fails the write or the close, with no path
            raise FileSystemError.of(f"{path}: cannot write", e) from None
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_new(path: str, data: bytes, *, mode: int = 0o600) -> None:
    """Create ``path`` (refused with ``FileExistsError`` if it exists) holding ``data``, or leave no file:
    a key half-written by a full disk would be kept, and refuse every rerun as existing."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError as e:
        os.unlink(path)
        raise FileSystemError.of(f"{path}: cannot write", e) from None
