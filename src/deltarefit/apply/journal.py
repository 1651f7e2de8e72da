"""The apply journal: one fixed slot per writer thread, holding the patch of the chunk that thread is
writing, so that a chunk torn by a kill mid-write is restored by the next run (FORMAT.md, "Applying")."""

from __future__ import annotations

import contextlib
import os
import struct

import numpy as np

from ..codec.chunk import Patch
from ..dtypes import dtype
from ..errors import CheckpointError, FileSystemError
from ..integrity import SEGMENT_BYTES, seg_hash
from ..io.fsutil import open_regular
from .host import _post_image

JOURNAL_MAGIC = b"DRJRNL01"
_JHEAD = struct.Struct("<8s32sIIBIQ16s16s")  # magic, target fp, tensor idx, chunk idx, kind, n, len, post, hash
SLOT_BYTES = _JHEAD.size + SEGMENT_BYTES  # a record's body never exceeds one segment (see write)


class Journal:
    """Fixed slots, one per writer thread, each holding the patch of the chunk that thread is writing.

    Only a chunk whose slot record is complete (hash-checked) can be torn, because its region is
    written only after the record; replaying the record's target values over it is idempotent.
    """

    # ``write`` reads the chunk's pre-image (a dense-ish patch is recorded as its post-image).
    needs_pre = True

    def __init__(self, path: str, target_fp: str) -> None:
        self.path = path
        self.fp = bytes.fromhex(target_fp)

    def read(self) -> dict[tuple[int, int], tuple[bytes, int, int, bytes]]:
        """Complete records for this delta's target: (tensor idx, chunk idx) -> (post hash, kind, n, body)."""
        out: dict[tuple[int, int], tuple[bytes, int, int, bytes]] = {}
        if not os.path.lexists(self.path):
            return out
        with os.fdopen(open_regular(self.path, os.O_RDONLY, what="apply journal"), "rb") as f:
            while True:
                head = f.read(SLOT_BYTES)
                if len(head) < _JHEAD.size:
                    break
                magic, fp, ti, ci, kind, n, ln, post, h = _JHEAD.unpack_from(head)
                body = head[_JHEAD.size:_JHEAD.size + ln]
                if magic != JOURNAL_MAGIC or fp != self.fp or len(body) != ln or seg_hash(body) != h:
                    continue  # an empty, stale or half-written slot: its chunk was never touched
                out[(ti, ci)] = (post, kind, n, body)
        return out

    def open_for_write(self, slots: int, *, record_bytes: int = SEGMENT_BYTES) -> None:
        """Open the journal for ``slots`` writer threads and allocate their slots on disk (room for a record
        of ``record_bytes`` in each) before the first write into the checkpoint: a full disk (or quota)
        is then refused here, with every byte of the checkpoint as it was, rather than after some chunks
        were written. Raises ``CheckpointError`` where the journal cannot be created (a planted link, a
        missing directory), ``FileSystemError`` where it cannot be allocated (disk full): one line naming it."""
        existed = os.path.lexists(self.path)
        try:
            # Not through a symlink, and only a regular file: another local user's planted link would make
            # this run (root, perhaps) overwrite whatever it points to.
            self._fd = open_regular(self.path, os.O_RDWR | os.O_CREAT, what="apply journal")
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot create the apply journal ({e.strerror}); nothing "
                                  "written to the checkpoint") from None
        self.slots = slots
        need = _JHEAD.size + min(record_bytes, SEGMENT_BYTES)
        try:
            for i in range(slots):
                os.posix_fallocate(self._fd, i * SLOT_BYTES, need)
            os.fsync(self._fd)
        except OSError as e:
            os.close(self._fd)
            self._fd = None
            if not existed:  # an older journal may hold records a torn chunk needs: kept
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            raise FileSystemError.of(f"{self.path}: cannot allocate the apply journal ({slots * need:,} bytes); "
                                     "nothing written to the checkpoint, free space and run again", e) from None

    @staticmethod
    def record(patch: Patch, pre: np.ndarray) -> tuple[int, int, bytes]:
        """(kind, n, body) of a chunk's patch as the journal keeps it (``_journal_patch`` reads it back);
        ``pre`` is the chunk's current (pre-image) elements."""
        if patch.dense is None and patch.positions.size * (4 + patch.values.itemsize) > pre.nbytes:
            # A dense-ish sparse patch would outgrow its slot (and spill into the next one): record
            # the whole post-image instead, which is never larger than a segment.
            patch = Patch(None, None, _post_image(pre, patch))
        if patch.dense is not None:
            return 1, patch.dense.size, patch.dense.tobytes()
        return 0, patch.positions.size, patch.positions.astype("<u4").tobytes() + patch.values.tobytes()

    def write(self, slot: int, ti: int, ci: int, post: bytes, patch: Patch, pre: np.ndarray) -> None:
        """Journal a chunk's patch; ``pre`` is the chunk's current (pre-image) elements."""
        kind, n, body = self.record(patch, pre)
        if len(body) > SEGMENT_BYTES:
            raise AssertionError(f"journal record of {len(body)} bytes exceeds its slot")  # a bug, not bad input
        head = _JHEAD.pack(JOURNAL_MAGIC, self.fp, ti, ci, kind, n, len(body), post, seg_hash(body))
        rec = head + body
        try:
            n = os.pwrite(self._fd, rec, slot * SLOT_BYTES)
        except OSError as e:
            n, why = -1, e.strerror
        else:
            why = "short write"
        if n != len(rec):  # the chunk is not written without its whole record
            raise CheckpointError(f"{self.path}: cannot write the apply journal ({why}); the checkpoint holds "
                                  "whole chunks only, run again once this is fixed")

    def remove(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None
        if os.path.lexists(self.path):
            os.unlink(self.path)


def _journal_patch(rec: tuple[bytes, int, int, bytes], dt_name: str, n_elems: int) -> Patch | None:
    """A journal record as a patch for a chunk of ``n_elems`` elements, or None if it cannot be one."""
    _, kind, n, body = rec
    dt = dtype(dt_name)
    if kind == 1:
        if len(body) != n_elems * dt.itemsize:
            return None
        return Patch(None, None, np.frombuffer(body, dt.uint))
    if kind != 0 or not 0 < n <= n_elems or len(body) != n * (4 + dt.itemsize):
        return None
    pos = np.frombuffer(body, "<u4", n).astype(np.int64)
    if np.any(np.diff(pos) <= 0) or pos[-1] >= n_elems:
        return None
    return Patch(pos, np.frombuffer(body, dt.uint, n, 4 * n), None)


def journal_path(checkpoint_path: str) -> str:
    p = os.path.abspath(checkpoint_path)
    return os.path.join(p, ".deltarefit-journal") if os.path.isdir(p) else p + ".deltarefit-journal"
