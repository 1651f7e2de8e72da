"""The encode's worker pool: works run in batches on a pool of threads that lives between encodes, and
their results come back in order (``_ordered``), whatever the thread count, so that the same pair
always gives the same bytes.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait

from ..integrity import SEGMENT_BYTES
from .work import Work, _Job


def default_threads() -> int:
    """The encoder's (and an apply's) thread count when none is given: the CPUs this process may use, 1 to 8."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


# Works are batched up to this many checkpoint bytes per pool task: a task costs two thread wake-ups
# and a few lock round trips, as much as hashing and coding a few KiB, and real checkpoints hold many
# tiny tensors (biases, norms). Full segments still go one per task.
BATCH_BYTES = 1 << 20


def _seg_sizes(nbytes: int) -> list[int]:
    n, last = divmod(nbytes, SEGMENT_BYTES)
    return [SEGMENT_BYTES] * n + ([last] if last else [])


def _work_sizes(job: _Job) -> list[int]:
    """Checkpoint bytes behind each of ``job``'s works (segments of the base, then of the target)."""
    if job.op == "patch":
        return _seg_sizes(job.target.nbytes)
    return (_seg_sizes(job.base.nbytes) if job.base is not None else []) + \
        (_seg_sizes(job.target.nbytes) if job.target is not None else [])


def _run_batch(items: list[tuple[_Job, int, Work | None]]) -> list[tuple[_Job, int, object]]:
    return [(job, k, w() if w is not None else None) for job, k, w in items]


def _ordered(pool: ThreadPoolExecutor, jobs: Iterator[_Job], window: int) -> Iterator[tuple[_Job, int, object]]:
    """Run every job's works on the pool in batches (``BATCH_BYTES``), at most ``window`` batches in
    flight, yielding ``(job, k, result)`` in order; a job with no works yields ``(job, -1, None)`` once.
    A failing work raises from here, in order, and ends the iteration. However the iteration ends, no
    batch of it is left running (the pool outlives the encode, the checkpoints it reads may not)."""
    batches: deque[Future] = deque()
    cur: list[tuple[_Job, int, Work | None]] = []
    cur_bytes = 0
    try:
        for job in jobs:
            items = list(zip(range(len(job.works)), job.works, _work_sizes(job), strict=True)) or [(-1, None, 0)]
            for k, w, size in items:
                cur.append((job, k, w))
                cur_bytes += size
                if cur_bytes >= BATCH_BYTES:
                    batches.append(pool.submit(_run_batch, cur))
                    cur, cur_bytes = [], 0
                    while len(batches) >= window:
                        yield from batches.popleft().result()
        if cur:
            batches.append(pool.submit(_run_batch, cur))
        while batches:
            yield from batches.popleft().result()
    finally:
        for f in batches:
            f.cancel()
        wait(batches)


# The encoder's worker threads live between encodes, one pool per thread count: a fresh pool per encode
# cost 2 ms of a 34 ms encode of the real 3.5% pair (thread start-up, and each thread's scratch buffers
# faulted in again). Each thread keeps its scratch buffers, O(chunk), for the life of the process.
class _Pools:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_threads: dict[int, ThreadPoolExecutor] = {}

    def get(self, threads: int) -> ThreadPoolExecutor:
        with self.lock:
            pool = self.by_threads.get(threads)
            if pool is None:
                pool = self.by_threads[threads] = ThreadPoolExecutor(threads, thread_name_prefix=f"encode-{threads}")
            return pool


_pools = _Pools()
# A forked child has none of the parent's threads (and maybe a lock held by one): it starts afresh.
os.register_at_fork(after_in_child=_pools.__init__)
