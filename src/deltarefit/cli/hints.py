"""Arguments given in the wrong order, told by what the paths are, before any work: ``check_order``.

A store is a directory holding ``HEAD`` or ``v/`` (or an ``s3://`` URL); a delta starts with the format's
magic; a checkpoint is a ``.safetensors`` file or a directory holding one. Each probe reads at most a few
bytes, never follows a FIFO (``O_NONBLOCK``), and says nothing where it cannot tell: the command's own
checks then refuse what is wrong, as before.
"""

from __future__ import annotations

import os

from ..errors import CheckpointError, DeltaRefitError, FormatError, UsageError
from ..format.layout import MAGIC
from ..io.fsutil import open_input


def _regular_head(path: str, n: int) -> bytes | None:
    """The first ``n`` bytes of a regular file at ``path`` (``open_input``: a FIFO never hangs the probe,
    a symlink is not followed); None for anything else or an unreadable file."""
    try:
        fd = open_input(path, what="argument", error=DeltaRefitError, follow=False)
    except DeltaRefitError:
        return None
    try:
        return os.read(fd, n)
    except OSError:
        return None
    finally:
        os.close(fd)


def kind(path: str) -> str | None:
    """``"store"``, ``"delta"``, ``"checkpoint"`` or None (cannot tell) for ``path``."""
    if "://" in path:
        return "store"
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "HEAD")) or os.path.isdir(os.path.join(path, "v")):
            return "store"
        try:
            names = os.listdir(path)
        except OSError:
            return None
        return "checkpoint" if any(n.endswith(".safetensors") for n in names) else None
    head = _regular_head(path, 8)
    if head is None:
        return None
    if head == MAGIC:
        return "delta"
    if path.endswith(".safetensors") and len(head) == 8:
        return "checkpoint"
    return None


def check_order(command: str, usage: str, given: tuple[tuple[str, str], tuple[str, str]]) -> None:
    """Refuse, in one line, two arguments that look swapped: ``given`` is ``((expected kind, path), (expected
    kind, path))`` in the command's order. Swapped: one is surely of the other's expected kind, and the
    other is of the first's or cannot be told (a store not created yet). Two of one kind tell nothing."""
    (w0, p0), (w1, p1) = given
    k0, k1 = kind(p0), kind(p1)
    if not ((k0 == w1 and k1 in (w0, None)) or (k1 == w0 and k0 in (w1, None))):
        return
    said = ", ".join(f"{p} is a {k}" for p, k in ((p0, k0), (p1, k1)) if k is not None)
    raise UsageError(f"{command}: the arguments look swapped ({said}); nothing was done. Usage: {usage}")


_WHAT = {"delta": "a delta", "checkpoint": "a checkpoint", "store": "a version store"}
# What to do with a path of each kind, told when it was given where another kind goes.
_USE = {
    "delta": "a delta is applied with 'deltarefit apply {p} CHECKPOINT' and read with 'deltarefit inspect {p}'",
    "checkpoint": "'deltarefit fingerprint {p}' names its weights; a delta comes from 'deltarefit encode BASE "
                  "TARGET -o OUT'",
    "store": "a checkpoint follows it with 'deltarefit sync {p} CHECKPOINT'; 'deltarefit log {p}' lists its versions",
}


def check_kinds(command: str, usage: str, given: tuple[tuple[str, str | None], ...]) -> None:
    """Refuse, in one line, an argument that is surely of another kind than its place takes: ``given`` is
    ``((expected kind, path), ...)``; a path that cannot be told passes (the command's own checks refuse
    it, as before). A directory where a delta file goes is refused too. The error is the one the place's
    own check raises (a checkpoint's ``CheckpointError``, a delta's ``FormatError``): the exit code is
    the same, the words tell what the path is and what to do with it."""
    for want, p in given:
        if p is None:
            continue
        k = kind(p)
        err = CheckpointError if want == "checkpoint" else FormatError
        if k is None and want == "delta" and os.path.isdir(p):
            raise err(f"{command}: {p} is a directory, not a delta file; nothing was done. Usage: {usage} "
                      "(a delta is the file 'deltarefit encode BASE TARGET -o FILE' writes)")
        if k is not None and k != want:
            plain = " (not a safetensors file)" if want == "checkpoint" and k == "delta" else ""
            raise err(f"{command}: {p} is {_WHAT[k]}, not {_WHAT[want]}{plain}; nothing was done. Usage: {usage}; "
                      f"{_USE[k].format(p=p)}")
