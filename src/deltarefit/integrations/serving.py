"""What the integrations that start ``vllm serve`` (``ray_http.ServerActor``, ``trl.check.Server``) share:
``wait_healthy``, the wait for a started server's ``/health``."""

from __future__ import annotations

import subprocess
import time
import urllib.request

from ..errors import DeltaRefitError


def wait_healthy(proc: subprocess.Popen, url: str, log_path: str, timeout: float, what: str) -> None:
    """Return once ``url``/health answers; ``DeltaRefitError`` (one line, ``what`` first) with the tail of
    ``log_path`` if the server process exits first, or naming the log after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                tail = f.read()[-3000:]
            raise DeltaRefitError(f"{what} exited {proc.returncode}: {tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise DeltaRefitError(f"{what} did not answer within {timeout:.0f} s (log: {log_path})") from None
            time.sleep(1)
