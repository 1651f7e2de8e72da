"""The encoder's work pipeline: batched pool tasks must still yield every result in order."""

from __future__ import annotations

import importlib
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from deltarefit.checkpoint import TensorInfo
from deltarefit.integrity import SEGMENT_BYTES

E = importlib.import_module("deltarefit.encode")  # the package exports a function of the same name


def _job(ti: int, nbytes: int, log: list, fail_at: int | None = None, slow: float = 0.0,
         starts: list | None = None) -> E._Job:
    info = TensorInfo(f"t{ti}", "BF16", (nbytes // 2,), nbytes, "unused.safetensors", 0)
    n = (nbytes + SEGMENT_BYTES - 1) // SEGMENT_BYTES

    def work(k: int):
        def run():
            if k == fail_at:
                raise ValueError(f"work {ti}/{k} failed")
            if starts is not None:
                starts.append((ti, k))
            time.sleep(slow)
            log.append((ti, k))
            return (ti, k)
        return run

    return E._Job(ti, info.name, "patch", info, info, [work(k) for k in range(n)])


@pytest.mark.parametrize("window", [1, 2, 8])
def test_batched_results_come_back_in_order_with_empty_jobs_once(window):
    # Tiny tensors share a task, full segments get their own, empty tensors have no work at all.
    sizes = [4, 0, 2 * SEGMENT_BYTES + 6, 10, 0, 300, SEGMENT_BYTES, 2]
    log: list = []
    jobs = [_job(i, s, log) for i, s in enumerate(sizes)]
    with ThreadPoolExecutor(3) as pool:
        got = [(job.ti, k, res) for job, k, res in E._ordered(pool, iter(jobs), window)]
    want = []
    for i, s in enumerate(sizes):
        n = (s + SEGMENT_BYTES - 1) // SEGMENT_BYTES
        want += [(i, k, (i, k)) for k in range(n)] if n else [(i, -1, None)]
    assert got == want
    assert sorted(log) == sorted((i, k) for i, k, r in want if k >= 0)


def test_a_failing_work_raises_from_the_pipeline():
    jobs = [_job(0, 8, []), _job(1, 3 * SEGMENT_BYTES, [], fail_at=1), _job(2, 8, [])]
    with ThreadPoolExecutor(2) as pool, pytest.raises(ValueError, match="work 1/1 failed"):
        for _ in E._ordered(pool, iter(jobs), 2):
            pass


def test_a_failure_leaves_no_batch_running():
    # The pool outlives the encode (it is shared), the checkpoints the works read may not: when a work
    # fails, every work already started finishes before the error leaves the pipeline, and the ones not
    # started never start.
    log: list = []
    starts: list = []
    jobs = [_job(0, SEGMENT_BYTES, log, fail_at=0), _job(1, 4 * SEGMENT_BYTES, log, slow=0.05, starts=starts)]
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(ValueError, match="work 0/0 failed"):
            for _ in E._ordered(pool, iter(jobs), 3):
                pass
        done, started = list(log), list(starts)
        pool.shutdown(wait=True)  # whatever was still queued or running has ended now
        assert log == done and starts == started  # nothing started or ran after the error came out
    assert sorted(done) == sorted(started) and len(started) <= 2  # the window held at most two of job 1


def test_a_forked_child_encodes_with_its_own_pool(tmp_path):
    # The pool outlives encodes; a child forked after one has none of its threads. Without the at-fork
    # reset, the child's encode would queue work for threads that do not exist and hang.
    import os
    import signal

    from _pairs import write_pair

    bp, tp = write_pair(tmp_path, change=0.03)
    first = E.encode(bp, tp, str(tmp_path / "parent.delta"), threads=2)
    pid = os.fork()
    if pid == 0:  # the child: encode again, exit 0 on the same bytes
        code = 1
        try:
            rep = E.encode(bp, tp, str(tmp_path / "child.delta"), threads=2)
            same = (tmp_path / "child.delta").read_bytes() == (tmp_path / "parent.delta").read_bytes()
            code = 0 if same and rep.target_fingerprint == first.target_fingerprint else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's encode hung")
    assert os.waitstatus_to_exitcode(status) == 0
