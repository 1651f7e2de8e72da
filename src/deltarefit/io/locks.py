"""Exclusive access to what a run writes (a checkpoint, a publisher's state), and what dead runs leave.

One writer at a time: ``exclusive(path, what)`` takes an ``fcntl.flock`` on the lock file ``path``
without waiting; a second run is refused at once with ``LockedError`` (one line naming the holder's
pid and host, read from the lock file). The kernel drops a flock when its holder's file is closed,
so a run killed by any signal, ``kill -9`` included, never leaves a lock held. The holder removes the
lock file before it lets go; a killed holder leaves it (unlocked) for the next run, which takes it
over. A run that locked a file the holder removed meanwhile sees that the path no longer names its
file, and starts again on the new one: two runs never hold two different files of one path.

Within one process the lock is re-entrant for the thread that holds it (a sync holds the checkpoint
and calls apply on it); another thread of the same process is refused like another process.

A checkpoint is locked under every name that reaches it (``checkpoint_lock``): the lock file beside
the path given, the one beside the path it resolves to, and a flock on its inode (``exclusive_file``),
so that a symlink alias or a hard link of a checkpoint in use is refused too, naming the holder's pid.
Lock files are opened without following symlinks and must be regular files (another local user may
plant a symlink or a FIFO at the name).

Leftovers: a run killed mid-write leaves ``NAME.tmp-PID`` temp files (``fsutil.write_atomic``,
``checkpoint.write_safetensors``). ``remove_dead_temps`` removes those of a naming pattern whose PID
is not a live process; it is called by a run that holds the lock of the place they are in. Scratch
that belongs to no lock (an engine's staging directory, a shared-memory file of a tensor-parallel
group) is made by ``owned_temp``, which holds a flock on it for the owner's life, so that
``sweep_abandoned`` removes only what a dead owner left, whichever pid namespace it ran in.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import itertools
import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..errors import CheckpointError, FileSystemError, LockedError

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".deltarefit-lock"

_held_lock = threading.Lock()
_held: dict[object, tuple[int, int, int]] = {}  # key -> (owner thread id, depth, fd)


def lock_path_beside(path: str) -> str:
    """The lock file of a checkpoint (a file or a directory): beside it, so that replacing the
    checkpoint (a keyframe renamed over a directory) never replaces its lock."""
    return os.path.abspath(path).rstrip(os.sep) + LOCK_SUFFIX


def _holder(fd: int) -> str:
    try:
        data = os.pread(fd, 4096, 0)
        d = json.loads(data)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(d["since"])))
        return f"pid {int(d['pid'])} on {d['host']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return "another process"  # it has the lock but has not written its name yet


def _flock_holders(st: os.stat_result) -> list[int]:
    """Pids holding a flock on the inode ``st`` (from ``/proc/locks``; empty where it cannot be read)."""
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids: list[int] = []
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in itertools.islice(f, 100_000):
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 00:2b:56789 0 EOF" (blocked waiters carry "->")
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want and parts[4].isdigit():
                    pids.append(int(parts[4]))
    except OSError:
        pass
    return pids


@contextlib.contextmanager
def _reentrant(key: object, what: str, take: Callable[[], int], *, stamp: bool) -> Iterator[None]:
    """Hold the lock that ``take()`` acquires (returns its fd) for the block, re-entrant for this thread
    under ``key``; ``stamp``: write this run's pid and host into the lock file. On the way out the fd is
    closed (the kernel drops the flock) after ``release``'s unlink for lock files."""
    me = threading.get_ident()
    with _held_lock:
        held = _held.get(key)
        if held is not None:
            if held[0] != me:
                raise LockedError(f"{what} is in use by another thread of this process (pid {os.getpid()}); "
                                  f"wait for it to finish")
            _held[key] = (me, held[1] + 1, held[2])
    if held is not None:
        try:
            yield
        finally:
            with _held_lock:
                t, depth, fd = _held[key]
                _held[key] = (t, depth - 1, fd)
        return
    fd = take()
    if stamp:
        try:
            label = json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "since": time.time()}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, label, 0)
        except OSError:
            pass  # the lock holds without its label; a refused run then says "another process"
    with _held_lock:
        _held[key] = (me, 1, fd)
    try:
        yield
    finally:
        with _held_lock:
            del _held[key]  # re-entrant holders (same thread) have unwound before this
        if stamp and isinstance(key, str):
            with contextlib.suppress(OSError):
                os.unlink(key)  # while still locked: a run that opened it meanwhile sees it gone and retries
        os.close(fd)  # releases the flock


@contextlib.contextmanager
def exclusive(path: str, what: str) -> Iterator[None]:
    """Hold the exclusive lock ``path`` (created if missing) for the block; ``what`` names the
    locked thing in the refusal. Raises ``LockedError`` at once if another run holds it."""
    key = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    with _reentrant(key, what, lambda: _acquire(key, what), stamp=True):
        yield


@contextlib.contextmanager
def exclusive_file(path: str, what: str) -> Iterator[None]:
    """Hold an exclusive flock on the file or directory ``path`` itself (its inode, whichever name,
    symlink or hard link, reaches it) for the block, if it exists; ``LockedError`` naming the holders'
    pids (``/proc/locks``) if another run holds it. Opened non-blocking and refused unless a regular
    file or a directory, so a FIFO planted there cannot hang the run."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        yield  # nothing to lock yet: the path lock beside it serializes its creation
        return
    except OSError as e:
        raise CheckpointError(f"{what}: cannot open {path} to lock it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise CheckpointError(f"{what}: {path} is not a regular file or a directory")
    except BaseException:
        os.close(fd)
        raise

    def take() -> int:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pids = [p for p in _flock_holders(st) if p != os.getpid()]
            os.close(fd)
            who = f"pid {', '.join(map(str, sorted(set(pids))))}" if pids else "another process"
            raise LockedError(f"{what} is in use by another deltarefit run ({who}, through another name of the "
                              f"same file: device {st.st_dev} inode {st.st_ino}); wait for it to finish or stop "
                              "it, then run again") from None
        except OSError as e:
            os.close(fd)
            raise CheckpointError(f"{what}: cannot lock {path} ({e.strerror})") from None
        return fd

    key = ("inode", st.st_dev, st.st_ino)
    with _held_lock:
        mine = key in _held
    if mine:
        os.close(fd)  # re-entered: the fd that holds it is the first one
    with _reentrant(key, what, take, stamp=False):
        yield


def _acquire(path: str, what: str) -> int:
    """Open and flock the lock file; an fd whose file ``path`` still names, or ``LockedError``. The
    lock file is opened without following a symlink and non-blocking, and must be a regular file: a
    symlink or FIFO planted there by another local user is refused, never written through."""
    for _ in range(100):  # each retry means a holder let go meanwhile: a few at most
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except FileNotFoundError as e:
            d = os.path.dirname(path)
            err = FileSystemError.of(f"{what}: its directory {d} does not exist", e)
            err.args = (f"{err}; nothing was written; create it first: mkdir -p {d}",)
            raise err from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointError(f"{what}: its lock file {path} is a symbolic link (planted by another "
                                      "user?); remove it and run again") from None
            # read-only, permission denied, disk full: the filesystem's fault (exit 12), not the checkpoint's
            raise FileSystemError.of(f"{what}: cannot create its lock file {path}", e) from None
        try:
            st0 = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            raise FileSystemError.of(f"{what}: cannot stat its lock file {path}", e) from None
        if not stat.S_ISREG(st0.st_mode):
            os.close(fd)
            raise CheckpointError(f"{what}: its lock file {path} is not a regular file; remove it and run again")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise LockedError(f"{what} is in use by another deltarefit run ({holder}; lock {path}); wait for "
                              "it to finish or stop it, then run again") from None
        except OSError as e:
            os.close(fd)
            raise FileSystemError.of(f"{what}: cannot lock {path}", e) from None
        try:
            st, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the holder removed this file as it let go: lock the one the path names now
    raise LockedError(f"{what}: could not take its lock {path} (it keeps changing)")


@contextlib.contextmanager
def checkpoint_lock(checkpoint_path: str, what: str | None = None) -> Iterator[None]:
    """The exclusive lock of a checkpoint (file or directory) that apply, check and sync hold: a second
    run on it is refused with ``LockedError`` naming the holder's pid, whichever name it came by.

    Three locks: the lock file beside the path as given, the one beside the path it resolves to
    (through symlinks), and a flock on the checkpoint's inode itself (a hard link or bind mount).
    The lock files stay correct across a rename over the checkpoint (a keyframe install, a structural
    rewrite: the new inode is not flocked, but every name that reaches it goes through one of them);
    the inode flock covers names of one file that no path comparison relates. A directory holding one
    weight file and no index is that file's checkpoint too (``checkpoint.read.sole_weight_file``): the
    file's inode is flocked as well, so a run naming the file and one naming the directory exclude
    each other."""
    from ..checkpoint.read import sole_weight_file

    what = what or f"checkpoint {checkpoint_path}"
    given = lock_path_beside(checkpoint_path)
    real = lock_path_beside(os.path.realpath(checkpoint_path))
    with contextlib.ExitStack() as stack:
        stack.enter_context(exclusive(given, what))
        if real != given:
            stack.enter_context(exclusive(real, what))
        stack.enter_context(exclusive_file(checkpoint_path, what))
        one = sole_weight_file(checkpoint_path)
        if one is not None:
            stack.enter_context(exclusive_file(one, what))
        yield


F = TypeVar("F", bound=Callable[..., Any])


def locked_method(lock_of: Callable[[Any], Any]) -> Callable[[F], F]:
    """Method decorator: run the method inside ``exclusive(*lock_of(self))`` where ``lock_of`` gives
    (lock file, what), or inside the context manager ``lock_of(self)`` gives (``checkpoint_lock``)."""

    def deco(method: F) -> F:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            lock = lock_of(self)
            with exclusive(*lock) if isinstance(lock, tuple) else lock:
                return method(self, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return deco


# ----------------------------------------------------------------------------------------- leftovers


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a reused pid reads as alive: the safe direction)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def remove_dead_temps(directory: str, pattern: re.Pattern[str]) -> list[str]:
    """Remove the files in ``directory`` whose name matches ``pattern`` (its group ``pid`` the writer's
    pid) and whose writer is no live process other than this one; returns their paths. The caller
    holds the lock of what they belong to, so no live deltarefit run is writing them."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = pattern.fullmatch(name)
        if m is None:
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid() or pid_alive(pid):
            continue
        p = os.path.join(directory, name)
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            if os.path.isfile(p) and not os.path.islink(p):
                os.unlink(p)
                removed.append(p)
    return removed


def temp_pattern(*names: str) -> re.Pattern[str]:
    """Temp files ``NAME.tmp-PID`` (``write_atomic``/``write_safetensors`` naming) of the given names;
    a name may be a regular expression (escape literal names with ``re.escape``)."""
    return re.compile(rf"(?:{'|'.join(names)})\.tmp-(?P<pid>[0-9]+)")


def remove_dead_temps_beside(path: str, suffixes: str | None = None) -> list[str]:
    """``remove_dead_temps`` of the one file ``path``: the ``path.tmp-PID`` temps its killed writers
    (``write_atomic``) left; with ``suffixes`` (a regular expression), those of ``path`` + a suffix it
    matches too (files kept beside it)."""
    p = os.path.abspath(path)
    name = re.escape(os.path.basename(p)) + (f"(?:{suffixes})?" if suffixes else "")
    return remove_dead_temps(os.path.dirname(p), temp_pattern(name))


OWNER = ".owner"  # the lock file inside an owned temp directory


def owned_temp(prefix: str, parent: str | None = None, *, directory: bool = True) -> tuple[str, int]:
    """A new temp directory (or, ``directory=False``, an empty file) named ``prefix...`` in ``parent``
    (default: the system's temp directory), and a file descriptor holding an exclusive flock on it
    (on its ``.owner`` file, for a directory). Closing the descriptor, or the owner's death, releases
    it. It is made under a hidden name and renamed to its own once locked, so ``sweep_abandoned``
    never sees it unlocked; what dead owners of the prefix left there is swept first."""
    import tempfile

    parent = parent or tempfile.gettempdir()
    for gone in sweep_abandoned(parent, prefix):
        log.info("removed %s, left by an owner that died", gone)
    if directory:
        hidden = tempfile.mkdtemp(prefix="." + prefix, dir=parent)
        fd = os.open(os.path.join(hidden, OWNER), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    else:
        fd, hidden = tempfile.mkstemp(prefix="." + prefix, dir=parent)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path = os.path.join(parent, os.path.basename(hidden)[1:])
        os.rename(hidden, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            if directory:
                import shutil

                shutil.rmtree(hidden)
            else:
                os.unlink(hidden)
        raise
    return path, fd


def sweep_abandoned(parent: str, prefix: str) -> list[str]:
    """Remove the ``owned_temp`` entries named ``prefix...`` in ``parent`` whose owner is gone (their
    flock can be taken); returns their paths. A directory without its ``.owner`` file (not made by
    ``owned_temp``) is left alone; a file of the prefix is taken for one of ours, so its prefix must be
    this project's alone."""
    import shutil

    removed: list[str] = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        p = os.path.join(parent, name)
        is_dir = os.path.isdir(p) and not os.path.islink(p)
        try:
            # Non-blocking: a FIFO of the prefix (anyone can make one in /tmp or /dev/shm) must not hang
            # the open; only a regular file can be one of ours.
            fd = os.open(os.path.join(p, OWNER) if is_dir else p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its owner lives
        try:
            if is_dir:
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
            removed.append(p)
        finally:
            os.close(fd)
    return removed
