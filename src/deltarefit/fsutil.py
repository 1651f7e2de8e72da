"""Durable file writes: the one place that knows how to make a rename survive a crash."""

from __future__ import annotations

import os
from collections.abc import Iterable


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
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def output_is_input(output: str, inputs: Iterable[str | None]) -> str | None:
    """The input that writing ``output`` would overwrite, or None: an input ``output`` names by the same
    path, a symlink or a hard link (same device and inode, when ``output`` exists), or an input
    directory (a checkpoint's, a history book's) ``output`` lies inside. ``None`` inputs are skipped."""
    try:
        out = os.stat(output)
    except OSError:
        out = None
    real_out = os.path.realpath(output)
    for i in inputs:
        if i is None:
            continue
        try:
            st = os.stat(i)
        except OSError:
            continue
        if out is not None and (out.st_dev, out.st_ino) == (st.st_dev, st.st_ino):
            return i
        if os.path.isdir(i) and real_out.startswith(os.path.realpath(i).rstrip(os.sep) + os.sep):
            return i
    return None
