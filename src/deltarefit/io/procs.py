"""Stopping child processes: SIGTERM, a grace period, then SIGKILL, and every one reaped.

The one way the demo, the benchmarks and the test helpers end the processes they start (servers, relay
nodes, rollouts), so that none is left running or a zombie when its owner returns or raises."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable


def _signal(p: subprocess.Popen, sig: int, group: bool) -> None:
    # An exited (or already reaped) process: nothing to signal. Its group may outlive it, hence killpg
    # even then when ``group``.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(p.pid, sig)
        elif p.poll() is None:
            p.send_signal(sig)


def stop(procs: subprocess.Popen | Iterable[subprocess.Popen], *, grace: float = 10.0, group: bool = False) -> None:
    """SIGTERM each process still running, in the order given (their process groups with ``group``,
    for children started with ``start_new_session=True``), then wait for each up to ``grace`` seconds;
    SIGKILL any that has not exited and reap it."""
    procs = [procs] if isinstance(procs, subprocess.Popen) else list(procs)
    for p in procs:
        if p.poll() is None:
            _signal(p, signal.SIGTERM, group)
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL, group)
            p.wait()
