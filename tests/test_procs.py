"""``io.procs.stop``: real child processes, real signals. SIGTERM first, SIGKILL after the grace period,
a whole session with ``group``, every process reaped, and an exited one left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from deltarefit.io.procs import stop

PY = sys.executable


def _started(code: str, **kw) -> tuple[subprocess.Popen, list[str]]:
    """A Python child running ``code``, then printing "ready" (its handlers set before we signal), and
    what it printed before that."""
    p = subprocess.Popen([PY, "-c", code + "\nprint('ready', flush=True)\nimport time\ntime.sleep(60)"],
                         stdout=subprocess.PIPE, text=True, **kw)
    said = []
    while (line := p.stdout.readline().strip()) != "ready":
        assert line, "the child exited before it was ready"
        said.append(line)
    return p, said


def test_sigterm_ends_a_process_that_heeds_it_and_sigkill_one_that_does_not():
    heeds, _ = _started("")
    deaf, _ = _started("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    t0 = time.monotonic()
    stop([heeds, deaf], grace=1.0)
    assert heeds.returncode == -signal.SIGTERM and deaf.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 10
    stop(heeds)  # exited and reaped: nothing to do, no error


def test_group_ends_the_children_a_process_started_in_its_session():
    leader, said = _started("import subprocess, sys\n"
                            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                            "print(c.pid, flush=True)", start_new_session=True)
    child = int(said[0])
    os.kill(child, 0)  # running, in the leader's session
    assert os.getpgid(child) == leader.pid
    stop(leader, grace=5.0, group=True)
    assert leader.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the child is the leader's, not ours: gone, or a zombie left to init
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise AssertionError(f"child {child} of the session outlived stop(group=True)")
