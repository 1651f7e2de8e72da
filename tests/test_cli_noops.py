"""No-ops say they are no-ops, and an empty stream says so: real CLI processes on real checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

CLI = [sys.executable, "-m", "deltarefit"]


def run(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def ckpts(tmp_path):
    rng = np.random.default_rng(0)
    a = {"w": rng.standard_normal((64, 64)).astype(np.float32), "b": rng.standard_normal(64).astype(np.float32)}
    b = {k: v.copy() for k, v in a.items()}
    b["w"][::7, ::5] += 1e-3
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    return tmp_path


def test_empty_stream_log_and_sync_say_so(ckpts):
    os.makedirs(ckpts / "s")
    r = run("log", "s", cwd=ckpts)
    assert r.returncode == 0 and "s: no versions yet" in r.stdout and "deltarefit publish s CHECKPOINT" in r.stdout
    r = run("sync", "s", "r.safetensors", cwd=ckpts)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no versions yet (nothing published, nothing written here)" in r.stderr
    assert not (ckpts / "r.safetensors").exists()


def test_republish_and_sync_at_head_are_no_ops_that_say_so(ckpts):
    assert run("publish", "s", "a.safetensors", cwd=ckpts).returncode == 0
    r = run("publish", "s", "b.safetensors", cwd=ckpts)
    assert r.returncode == 0 and "s: version 2 (delta" in r.stdout, r.stdout + r.stderr
    r = run("publish", "s", "b.safetensors", cwd=ckpts)
    assert r.returncode == 0 and "already version 2" in r.stdout and "nothing published" in r.stdout, r.stdout
    assert "version 3" not in r.stdout and not os.path.exists(ckpts / "s" / "v" / "000000000003")
    r = run("sync", "s", "r.safetensors", cwd=ckpts)
    assert r.returncode == 0 and "version 0 -> 2" in r.stdout
    r = run("sync", "s", "r.safetensors", "--verify", cwd=ckpts)
    assert r.returncode == 0 and "at version 2, nothing to do" in r.stdout and "verified" in r.stdout, r.stdout
    assert "->" not in r.stdout


@pytest.mark.parametrize(("args", "said"), [
    (("publish", "a.safetensors", "s"), "a.safetensors is a checkpoint, s is a store"),
    (("sync", "a.safetensors", "s"), "a.safetensors is a checkpoint, s is a store"),
    (("apply", "a.safetensors", "d.delta"), "a.safetensors is a checkpoint, d.delta is a delta"),
])
def test_swapped_arguments_are_named_and_nothing_is_done(ckpts, args, said):
    assert run("publish", "s", "a.safetensors", cwd=ckpts).returncode == 0
    assert run("encode", "a.safetensors", "b.safetensors", "-o", "d.delta", cwd=ckpts).returncode == 0
    before = {p: os.stat(ckpts / p).st_mtime_ns for p in ("a.safetensors", "d.delta")}
    r = run(*args, cwd=ckpts)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "the arguments look swapped" in r.stderr and said in r.stderr and "nothing was done" in r.stderr
    assert {p: os.stat(ckpts / p).st_mtime_ns for p in before} == before
    assert sorted(os.listdir(ckpts / "s" / "v")) == ["000000000001"]


def test_a_store_directory_holding_checkpoints_is_not_taken_for_swapped_arguments(ckpts):
    os.makedirs(ckpts / "mixed")
    save_file({"x": np.zeros(3, np.float32)}, str(ckpts / "mixed" / "other.safetensors"))
    r = run("publish", "mixed", "a.safetensors", cwd=ckpts)
    assert r.returncode == 0 and "mixed: version 1" in r.stdout, r.stderr


def test_a_wrong_base_names_both_files_the_fingerprint_what_was_written_and_the_cause(ckpts):
    """One version behind (same tensors, other values) and another model get different words."""
    from safetensors.numpy import load_file

    rng = np.random.default_rng(1)
    b = load_file(str(ckpts / "b.safetensors"))
    c = {k: v.copy() for k, v in b.items()}
    c["w"][::3, ::3] += 1e-3
    save_file(c, str(ckpts / "c.safetensors"))
    assert run("encode", "b.safetensors", "c.safetensors", "-o", "bc.delta", cwd=ckpts).returncode == 0
    before = (ckpts / "a.safetensors").read_bytes()
    r = run("apply", "bc.delta", "a.safetensors", cwd=ckpts)  # a: the version before b
    assert r.returncode == 5 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for words in ("a.safetensors: not the base of bc.delta", "base fingerprint", "nothing was written",
                  "another version of this model", "deltarefit sync STORE a.safetensors"):
        assert words in r.stderr, (words, r.stderr)
    save_file({"w": rng.standard_normal((32, 64)).astype(np.float32), "b": b["b"]}, str(ckpts / "other.safetensors"))
    r = run("apply", "bc.delta", "other.safetensors", cwd=ckpts)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "another model" in r.stderr
    assert "other.safetensors" in r.stderr and "nothing was written" in r.stderr
    assert (ckpts / "a.safetensors").read_bytes() == before


def test_warnings_are_one_line_in_the_errors_style(ckpts):
    """Without -v a warning is 'deltarefit: warning: ...' (no timestamp, no module); with -v it has both."""
    assert run("publish", "s", "a.safetensors", cwd=ckpts).returncode == 0
    assert run("sync", "s", "r.safetensors", cwd=ckpts).returncode == 0
    with open(ckpts / "r.safetensors", "r+b") as f:  # edited by hand: --repair restores it, with a warning
        f.seek(-3, os.SEEK_END)
        f.write(b"\x01\x02\x03")
    r = run("sync", "s", "r.safetensors", "--repair", cwd=ckpts)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines and all(ln.startswith("deltarefit: warning: ") for ln in lines), r.stderr
