"""What a new user meets in the first hour, through the real CLI: bare commands print their help, a
checkpoint the tool wrote reads as unchanged, Ctrl-C says what was written, --repair says what it changed,
and a checkpoint of another model is not published silently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

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


@pytest.fixture
def two_versions(tmp_path):
    """A store ``s`` with versions 1 and 2 of one small model, and ``other.safetensors``: another model."""
    rng = np.random.default_rng(0)
    a = {"w": rng.standard_normal((64, 64)).astype(np.float32), "b": rng.standard_normal(64).astype(np.float32)}
    b = {k: v.copy() for k, v in a.items()}
    b["w"][::7, ::5] += 1e-3
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    save_file({"emb": rng.standard_normal((32, 16)).astype(np.float32)}, str(tmp_path / "other.safetensors"))
    for ck in ("a.safetensors", "b.safetensors"):
        assert run("publish", "s", ck, cwd=tmp_path).returncode == 0
    return tmp_path


def test_status_of_a_checkpoint_the_tool_synced_reads_unchanged_once_a_timestamp_tick_has_passed(two_versions):
    d = two_versions
    assert run("sync", "s", "r.safetensors", cwd=d).returncode == 0
    time.sleep(0.3)  # a tick of a file system keeping nanoseconds (ext4, xfs, tmpfs) is at most 10 ms
    r = run("status", "r.safetensors", cwd=d)
    assert r.returncode == 0 and "files unchanged since verified" in r.stdout, r.stdout
    assert json.loads(run("status", "r.safetensors", "--json", cwd=d).stdout)["files_unchanged"] is True
    # A write (same size) is seen without a hash.
    with open(d / "r.safetensors", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    r = run("status", "r.safetensors", cwd=d)
    assert "files changed since verified: --verify hashes them" in r.stdout, r.stdout
    assert "unchanged" not in r.stdout
