"""A vLLM worker's tensor-parallel group (``WorkerGroup``): the ``shard.group.Group`` the live engine and
its collective target use, over the CPU group (gloo) vLLM keeps beside the device one, with memory the
workers of one host share (``shared_buffer``) and the engine's two group steps at build
(``union`` of reload reasons, ``target``)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

from ...errors import DeltaRefitError
from ...io.fsutil import open_regular
from ...io.locks import owned_temp
from ...shard.group import TorchGroup
from ..live import SPLIT_AHEAD, LiveTarget

__all__ = ["SHM_PREFIX", "WorkerGroup"]

SHM_PREFIX = "deltarefit-tp-"  # a tensor-parallel group's shared-memory file (``WorkerGroup.shared_buffer``)


class WorkerGroup(TorchGroup):
    """The worker's tensor-parallel group as the live target needs it (``live.LiveTarget``'s ``group``):
    sums, minima, agreement, a sum to one worker and a broadcast from one (gloo, on the CPU group vLLM
    keeps beside the device one). One worker (``cpu_group`` None): every call is the identity."""

    @classmethod
    def of_tp(cls) -> WorkerGroup:
        try:
            from vllm.distributed.parallel_state import get_tp_group

            g = get_tp_group()
        except (ImportError, AssertionError):  # not vLLM, or no group initialized: one worker
            return cls(None)
        return cls(g.cpu_group if g.world_size > 1 else None)

    def shared_buffer(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` of memory that every worker of the group maps (a file in ``/dev/shm``, its pages
        reserved up front, so a full tmpfs refuses here instead of faulting later; its name removed once
        every worker has it open), or None in every worker where any of them cannot map it (no
        ``/dev/shm``, or workers on different hosts). A collective call."""
        import mmap

        if self.pg is None:
            return None
        token = np.zeros(256, np.uint8)  # path length, path, 16 check bytes at the end
        fd, path, ok = -1, "", True
        if self.rank == 0:
            try:
                # Locked while this worker lives: a worker killed before the unlink below leaves the
                # file (and its memory), which the next group's first worker removes.
                path, fd = owned_temp(SHM_PREFIX, "/dev/shm", directory=False)
                os.posix_fallocate(fd, 0, nbytes)
                check = os.urandom(16)
                os.pwrite(fd, check, 0)
                raw = path.encode()
                token[0], token[1:1 + len(raw)], token[240:] = len(raw), np.frombuffer(raw, np.uint8), \
                    np.frombuffer(check, np.uint8)
            except OSError:
                ok = False
        try:
            try:
                ok = self.agree(ok)
                if ok:
                    self.broadcast(token, 0)
                    if self.rank != 0:
                        try:
                            path = bytes(token[1:1 + int(token[0])]).decode()
                            fd = open_regular(path, os.O_RDWR, what="shared buffer")
                            ok = os.fstat(fd).st_size >= nbytes and os.pread(fd, 16, 0) == token[240:].tobytes()
                        except (OSError, UnicodeDecodeError, DeltaRefitError):
                            ok = False
                    ok = self.agree(ok)
            finally:  # every worker has it open, or nobody will use it (a peer failed): no name is left behind
                if self.rank == 0 and path:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
            return np.frombuffer(mmap.mmap(fd, nbytes), np.uint8) if ok else None
        finally:
            if fd >= 0:
                os.close(fd)  # the mapping keeps the memory

    def union(self, reasons: dict[str, str], names: list[str]) -> dict[str, str]:
        """``reasons`` extended by every name another worker of the group has reasons for."""
        flags = self.max(np.array([n in reasons for n in names], np.int64))
        return {n: reasons.get(n, "another worker of its tensor-parallel group reloads it")
                for n, f in zip(names, flags, strict=True) if f}

    def target(self, params: Any, placed: dict, specs: dict, shared: set[str], split_ahead: int = SPLIT_AHEAD
               ) -> LiveTarget:
        if not shared:
            return LiveTarget(params, placed, specs)
        return LiveTarget(params, placed, specs, shared=sorted(shared), group=self, split_ahead=split_ahead)
