"""Names deltarefit keeps for itself beside a checkpoint (a sync's staging directory, a keyframe
install's temporaries), checked without following a symbolic link before anything is written there.

Another local user who can write the checkpoint's directory may plant a symlink at such a name (to a
directory of their choosing, where the staged parts would land and stay), a FIFO, or a directory of
their own. Each is refused as a planted lock file is (``io.locks``): ``CheckpointError``, one line
naming the path and what lies there, and nothing is written through it or removed (it is not ours).
"""

from __future__ import annotations

import errno
import os
import stat

from ..errors import CheckpointError


def _refusal(path: str, what: str, why: str) -> CheckpointError:
    return CheckpointError(f"{what} {path} is {why}; remove it and run again")


def check_beside(path: str, what: str, *, directory: bool | None) -> os.stat_result | None:
    """What lies at ``path`` (``lstat``: a link is never followed), or None where nothing does; refused
    (``CheckpointError`` naming ``what`` and the path) where it is a symbolic link, or not a directory
    (``directory=True``), not a regular file (``False``), neither (``None``), or a directory owned by
    another user (who could swap what is written inside)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise _refusal(path, what, "a symbolic link (planted by another user?)")
    is_dir, is_reg = stat.S_ISDIR(st.st_mode), stat.S_ISREG(st.st_mode)
    if directory is True and not is_dir:
        raise _refusal(path, what, "not a directory")
    if directory is False and not is_reg:
        raise _refusal(path, what, "not a regular file")
    if directory is None and not (is_dir or is_reg):
        raise _refusal(path, what, "not a regular file or a directory")
    if is_dir and st.st_uid != os.geteuid():
        raise _refusal(path, what, f"a directory owned by another user (uid {st.st_uid})")
    return st


def own_dir(path: str, what: str) -> str:
    """The directory ``path``, made (mode 0700; its parent must exist) or checked (``check_beside``)
    without following a link planted there: a directory of this user's, where what is written stays
    under the name given. Returns ``path``."""
    try:
        os.mkdir(path, 0o700)  # never follows a link at the name: EEXIST instead
        return path
    except FileExistsError:
        pass
    except OSError as e:
        if e.errno != errno.EEXIST:
            raise
    check_beside(path, what, directory=True)
    return path


def own_dir_in(path: str, what: str) -> str:
    """``own_dir`` of ``path`` once its parents exist (made as ``os.makedirs`` makes them): the last level,
    the one deltarefit keeps its files in, is this user's directory, never a link another user planted
    there (a publisher's state directory inside a store other users can write). Returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return own_dir(path, what)

