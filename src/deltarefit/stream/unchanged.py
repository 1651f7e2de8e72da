"""What a publisher checks before it commits: that the version decodes to what it hashed.

A publisher's input may change while it is published (a trainer thread writing the tensors
``publish_tensors`` was given, a checkpoint file rewritten in place under ``deltarefit publish``): the
encoder reads each segment to code it and again to hash it, the upload reads a keyframe's files once
more. Nothing is committed that was not checked first:

- a staged delta (and a catch-up delta) is decoded against the base it was coded against, every chunk's
  post-image hash and every tensor's digest checked (``apply.files.check``): a delta that misses what
  was hashed is refused;
- a keyframe uploaded from the caller's files must find them as they were before the first read
  (device, inode, size, modification and change times), after the upload.

Either refusal is ``InputChangedError`` ("the input changed while it was published; nothing
committed"). ``undecodable`` is the same check on a committed record, for the ways out
(``Publisher.quarantine_head``, ``reset_baseline``) to set aside a version whose delta does not decode.
"""

from __future__ import annotations

import os

from ..errors import DecodeError, InputChangedError, VerificationError

CHANGED = "the input changed while it was published; nothing committed"


def check_decodes(delta: str, base: str, *, source: object, threads: int | None = None, history=None) -> None:
    """Raise ``InputChangedError`` unless the staged ``delta`` decodes, against ``base`` (and the history
    book it was coded against), to the target digests it names (what the encoder hashed)."""
    from ..apply.files import check

    try:
        check(delta, base, threads=threads, history=history)
    except (VerificationError, DecodeError) as e:
        raise InputChangedError(f"{source}: {CHANGED} (its delta does not decode to what was hashed: "
                                f"{str(e).splitlines()[0]})") from None


class InputGuard:
    """A publish's input as it was before its first read: the files' identities (device, inode, size,
    modification and change times: what any write to a file, or a file renamed over it, changes), none
    for tensors in memory (a keyframe of those is streamed into a private file first)."""

    def __init__(self, checkpoint: object) -> None:
        from .attempts import _checkpoint_files

        self.source = checkpoint if isinstance(checkpoint, str) else "tensors"
        self.paths = [p for _, p in _checkpoint_files(checkpoint)] if isinstance(checkpoint, str) else []
        self.before = self._identities()

    def _identities(self) -> list[tuple[int, ...]]:
        out = []
        for p in self.paths:
            st = os.stat(p)
            out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return out

    def check(self) -> None:
        """Raise ``InputChangedError`` if any file is not the one found before the first read."""
        try:
            now = self._identities()
        except FileNotFoundError:
            now = []
        if now != self.before:
            raise InputChangedError(f"{self.source}: {CHANGED} (a file was written or replaced while it was "
                                    "hashed and uploaded)")


def undecodable(delta: str, base: str, *, threads: int | None = None, history=None) -> str | None:
    """Why a committed ``delta`` does not decode against ``base`` (the version before it, verified), or
    None where it does. A base that is not the delta's base is no reason: that is the base's fault."""
    from ..apply.files import check

    try:
        check(delta, base, threads=threads, history=history)
    except (VerificationError, DecodeError) as e:
        return f"its delta does not decode against the version before it ({str(e).splitlines()[0]})"
    return None
