"""The machinery of the filesystem-fault cases (``bench.fs_faults``): a tmpfs mounted per case and
filled, remounted read-only or stripped of its write bits, and the ``python -m deltarefit`` child run
over it (without ``CAP_DAC_OVERRIDE`` when asked, so that root obeys file permissions too) with its exit
code, output, peak resident memory and wall time. Mounting needs root (``mount_refusal`` says why not).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .peak import _MEASURED, read_peak  # the child reports its own peak (VmHWM)
from .relay import ENV

MIB = 1 << 20


def mount_refusal() -> str | None:
    """None where this process can mount a tmpfs (root, and a kernel that lets it); else why not."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    d = tempfile.mkdtemp(prefix="deltarefit-mnt-")
    try:
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", d], capture_output=True, text=True,
                           check=False)
        if p.returncode != 0:
            return f"mount -t tmpfs refused: {p.stderr.strip() or p.returncode}"
        subprocess.run(["umount", d], check=False)
        return None
    except OSError as e:
        return f"mount not available: {e}"
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(d)


@contextlib.contextmanager
def tmpfs(path: str, size: int) -> Iterator[str]:
    """A tmpfs of ``size`` bytes mounted at ``path`` (created) for the duration."""
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def remount(path: str, mode: str) -> None:
    """Remount the tmpfs at ``path`` ``ro`` or ``rw``."""
    subprocess.run(["mount", "-o", f"remount,{mode}", path], check=True)


def fill(path: str, leave: int) -> str:
    """Fill the filesystem of ``path`` with a file ``path/.filler`` until about ``leave`` bytes are free."""
    filler = os.path.join(path, ".filler")
    st = os.statvfs(path)
    n = max(0, st.f_bavail * st.f_frsize - leave)
    with open(filler, "wb") as f:
        block = b"\0" * MIB
        while n > 0:
            try:
                n -= f.write(block[:min(n, MIB)])
            except OSError:
                break
    return filler


_DAC_CAPS = ("dac_override", "dac_read_search", "fowner")  # capability numbers 1, 2, 3


def _drop_dac() -> None:
    """In the child, before exec: drop the capabilities that let root ignore file permissions, so a
    directory without its write bit refuses root too (EACCES, as for any other user). Used where
    ``setpriv`` is missing (a ``preexec_fn`` is not safe in a parent with threads)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def unprivileged_argv(argv: list[str]) -> tuple[list[str], Callable[[], None] | None]:
    """``argv`` run without the DAC capabilities when this process is root: (argv, preexec_fn)."""
    if os.geteuid() != 0:
        return argv, None
    setpriv = shutil.which("setpriv")
    if setpriv:
        return [setpriv, "--bounding-set", ",".join(f"-{c}" for c in _DAC_CAPS), "--", *argv], None
    return argv, _drop_dac


def deny(path: str, *, files_only: bool = False) -> list[tuple[str, int]]:
    """Take the write bit off ``path`` and everything under it (``files_only``: off the files, the
    directories stay writable); the modes to give back."""
    modes = []
    for d, _dirs, files in os.walk(path):
        for p in [*([] if files_only else [d]), *(os.path.join(d, f) for f in files)]:
            m = os.lstat(p).st_mode & 0o7777
            modes.append((p, m))
            os.chmod(p, m & ~0o222)
    return modes


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    peak_rss: int
    seconds: float


def cli(args: list[str], *, unprivileged: bool = False, timeout: float = 120.0) -> Run:
    """``python -m deltarefit ARGS`` in a child (without DAC capabilities if ``unprivileged`` and root):
    exit code, output, its peak RSS and wall time."""
    with tempfile.TemporaryDirectory(prefix="deltarefit-measure-") as d:
        peak_file = os.path.join(d, "peak")
        argv, pre = [sys.executable, "-c", _MEASURED, peak_file, *args], None
        if unprivileged:
            argv, pre = unprivileged_argv(argv)
        t0 = time.perf_counter()
        try:
            p = subprocess.run(argv, capture_output=True, env=ENV, timeout=timeout, preexec_fn=pre, check=False)
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = -9, e.stdout or b"", e.stderr or b""
        seconds = time.perf_counter() - t0
        peak = read_peak(peak_file)
    return Run(rc, out.decode(errors="replace"), err.decode(errors="replace"), peak, seconds)


def sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def sha_or_none(path: str) -> str | None:
    try:
        return sha(path)
    except OSError:
        return None
