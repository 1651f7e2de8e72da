"""What a new user meets in the first hour, through the real CLI: bare commands print their help, a
checkpoint the tool wrote reads as unchanged, Ctrl-C says what was written, --repair says what it changed,
and a checkpoint of another model is not published silently."""

from __future__ import annotations

import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "deltarefit"]


def run(*args: str, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.parametrize(("args", "commands"), [
    ((), ("apply", "encode", "publish", "sync", "status")),
    (("relay",), ("keygen", "node", "root")),
])
def test_a_bare_group_prints_its_usage_and_commands_as_help_does_and_exits_2(args, commands):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    help_ = run(*args, "--help")
    assert help_.returncode == 0
    assert r.stderr.strip() == help_.stdout.strip()
    lines = r.stderr.splitlines()
    assert lines[0].startswith("Usage: deltarefit") and "Commands:" in lines
    assert all(len(line) <= 100 for line in lines)
    listed = {line.split()[0] for line in lines[lines.index("Commands:") + 1:] if line.strip()}
    assert set(commands) <= listed
