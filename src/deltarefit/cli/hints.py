"""Arguments given in the wrong order, told by what the paths are, before any work: ``check_order``.

A store is a directory holding ``HEAD`` or ``v/`` (or an ``s3://`` URL); a delta starts with the format's
magic; a checkpoint is a ``.safetensors`` file or a directory holding one. Each probe reads at most a few
bytes, never follows a FIFO (``O_NONBLOCK``), and says nothing where it cannot tell: the command's own
checks then refuse what is wrong, as before.
"""

from __future__ import annotations

import os

from ..errors import DeltaRefitError, UsageError
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
