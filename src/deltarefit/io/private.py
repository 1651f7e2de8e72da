"""What deltarefit keeps in a directory other local users can write (the system's temp directory,
``/dev/shm``): private by construction, never under a name another user could have made first.

Two ways, and only these:

* a fresh directory (``tempfile.mkdtemp``, or ``io.locks.owned_temp`` for scratch a later run sweeps:
  mode 0700, a name nobody could predict), for what lives as long as one run;
* a per-user directory (``user_dir``: ``PARENT/PREFIX-UID``), made 0700 by this user, or reused only when
  ``lstat`` says it is a directory (not a symbolic link), owned by this user, and neither group nor others
  can read, write or enter it. Anything else there (a directory another user made first, one left 0777, a
  link) is refused in one line (``FileSystemError``), nothing written through it or removed.

Files inside are written by ``write_private``: a temp name opened ``O_CREAT|O_EXCL|O_NOFOLLOW`` (0600),
then renamed over the final name, so a link planted at either name is never written through.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile

from ..errors import FileSystemError
from .fsutil import create_temp


def shared_root(prefer_memory: bool = False) -> str:
    """``/dev/shm`` where ``prefer_memory`` and it is a writable directory, else the system temp directory."""
    if prefer_memory and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def user_dir_path(parent: str, prefix: str) -> str:
    """The name of this user's directory ``prefix`` in ``parent`` (``PARENT/PREFIX-UID``); nothing is made."""
    return os.path.join(os.path.abspath(parent), f"{prefix}-{os.geteuid()}")


def check_private(path: str) -> os.stat_result:
    """``lstat`` of ``path``, refused (``FileSystemError`` naming it) unless a directory (a symbolic link is
    not followed), owned by this user, and closed to group and others (no bit of 0o077)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise FileSystemError.of(f"{path}: cannot check the private directory", e) from None
    why = None
    if stat.S_ISLNK(st.st_mode):
        why = "a symbolic link (planted by another user?)"
    elif not stat.S_ISDIR(st.st_mode):
        why = "not a directory"
    elif st.st_uid != os.geteuid():
        why = f"owned by another user (uid {st.st_uid})"
    elif st.st_mode & 0o077:
        why = f"open to other users (mode {stat.S_IMODE(st.st_mode):04o}, must be 0700)"
    if why:
        raise FileSystemError(f"{path}: a private directory deltarefit keeps is {why}; remove it and run again")
    return st


def user_dir(parent: str, prefix: str) -> str:
    """This user's directory ``PARENT/PREFIX-UID``, made (0700) or reused after ``check_private``; returns
    its path. ``parent`` must exist."""
    path = user_dir_path(parent, prefix)
    try:
        os.mkdir(path, 0o700)  # never follows a link planted at the name: EEXIST instead
    except FileExistsError:
        pass
    except OSError as e:
        if e.errno != errno.EEXIST:
            raise FileSystemError.of(f"{path}: cannot make the private directory", e) from None
    check_private(path)
    return path


def write_private(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` in a private directory whole or not at all: a temp file beside it made
    ``O_CREAT|O_EXCL|O_NOFOLLOW``, then renamed over ``path`` (a link at ``path`` is replaced, never
    followed). The directory is ``check_private``-ed first."""
    check_private(os.path.dirname(os.path.abspath(path)))
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with os.fdopen(create_temp(tmp, mode), "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise FileSystemError.of(f"{path}: cannot write", e) from None
