"""Durable file writes: the one place that knows how to make a rename survive a crash."""

from __future__ import annotations

import os


def fsync_dir(d: str) -> None:
    """fsync a directory, so a rename or link inside it is durable."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all: temp file, fsync, rename, fsync the directory.
    Never truncates the old file (a reader may have it mapped)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))
