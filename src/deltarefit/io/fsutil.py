"""Durable file writes: the one place that knows how to make a rename survive a crash."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable

from ..errors import DeltaRefitError, FileSystemError


def fsync_dir(d: str) -> None:
    """fsync a directory, so a rename or link inside it is durable."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fs_error(e: OSError, where: str, doing: str) -> FileSystemError:
    """A filesystem fault (full disk, read-only, permission denied...) as the one-line ``FileSystemError``
    the CLI prints: the file it hit (``where`` when the error names none), what was being done, why. One
    that a lower layer already named (the journal, a staged part, a version record) is kept as it is."""
    if isinstance(e, FileSystemError):
        return e
    return FileSystemError.of(f"{os.fsdecode(e.filename) if e.filename else where}: {doing}", e)


def open_regular(path: str, flags: int, mode: int = 0o644, *, what: str = "") -> int:
    """``os.open`` of a file deltarefit owns beside a checkpoint or in a shared directory, refusing what
    another local user may have planted there: never through a symlink (``O_NOFOLLOW``), and only a
    regular file (opened ``O_NONBLOCK``, so that a FIFO cannot hang the open, then checked by
    ``fstat``). Raises ``CheckpointError`` naming the path (``what``: what the file is, for the
    message); other ``OSError`` pass through."""
    import errno
    import fcntl
    import stat

    from ..errors import CheckpointError

    label = f"{what} {path}" if what else path
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{label} is a symbolic link (planted by another user?); remove it and run "
                                  "again") from None
        if e.errno == errno.ENXIO:  # a FIFO without a reader, opened for writing
            raise CheckpointError(f"{label} is not a regular file (a FIFO?); remove it and run again") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{label} is not a regular file; remove it and run again")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)  # regular: moot, but plain
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: str, limit: int, *, what: str, error: type[DeltaRefitError] | None = None,
               follow: bool = True) -> bytes:
    """The bytes of ``path``: a regular file of at most ``limit`` bytes (a key, a small state file), read
    the way every input named by a path is: opened ``O_NONBLOCK`` (a FIFO cannot hang the open), refused
    unless ``fstat`` says a regular file (a FIFO, a device such as ``/dev/zero``, a directory), and read
    no further than ``limit + 1`` bytes, so a file past the limit costs no more than the limit. A
    symlink is followed (a key is often a mounted secret's link) unless ``follow=False``. Refusals are one
    line of ``error`` (default ``UsageError``) naming ``what`` and the path."""
    from ..errors import UsageError

    err = error or UsageError
    fd = open_input(path, what=what, error=err, follow=follow)
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            raise err(f"{path}: {what} of {st.st_size} bytes, more than the {limit} it may have")
        data = read_capped(fd, limit)
    except OSError as e:
        raise err(f"{path}: cannot read {what} ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise err(f"{path}: {what} of more than the {limit} bytes it may have")
    return data


def open_input(path: str, *, what: str, error: type[DeltaRefitError], follow: bool = True) -> int:
    """A read-only descriptor of ``path``, an input a command reads (a delta, a key, a state file): opened
    ``O_NONBLOCK`` (a FIFO cannot hang the open, and is refused) and only when ``fstat`` says a regular
    file; a symlink followed unless ``follow=False``. Refusals are one line of ``error`` naming ``what`` and
    the path."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    except OSError as e:
        raise error(f"{path}: cannot open {what} ({e.strerror or e})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{path}: cannot open {what}: not a regular file (a FIFO, a device or a directory)")
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_capped(fd: int, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of the open file ``fd`` from where it stands: more than ``limit`` tells
    the caller the file is past its cap, having read no more than that (a file that grows while read
    included)."""
    chunks, got = [], 0
    while got <= limit:
        b = os.read(fd, limit + 1 - got)
        if not b:
            break
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def create_temp(tmp: str, mode: int = 0o644) -> int:
    """Create the temp file ``tmp`` (``NAME.tmp-PID``) for writing, exclusively and without following
    a symlink: one left by a dead run of this pid, or planted there, is removed (the name, never what it
    points to) and the file made afresh; a name that is taken again meanwhile is refused."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(tmp, flags, mode)
    except FileExistsError:
        os.unlink(tmp)
        return os.open(tmp, flags, mode)


def write_atomic(path: str, data: bytes, *, durable: bool = True, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` whole or not at all: temp file, fsync, rename, fsync the directory.
    Never truncates the old file (a reader may have it mapped). ``durable=False`` skips the fsyncs, for
    a cache whose reader detects a file torn by a power loss. ``mode``: permission bits of the new file
    (default: as the umask gives)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with os.fdopen(create_temp(tmp), "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.lexists(tmp):
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


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    import ctypes

    try:
        f = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    f.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    f.restype = ctypes.c_int
    return f


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing the range's dirty pages to the disk, without waiting (``sync_file_range`` with
    ``SYNC_FILE_RANGE_WRITE``): a later fsync then waits only for what is still in flight. Not a
    durability step (it neither waits nor writes metadata); a no-op where the call is missing or
    fails."""
    f = _sync_file_range()
    if f is not None:
        f(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; its errors change nothing the fsync does

