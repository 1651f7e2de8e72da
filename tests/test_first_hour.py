"""What a new user meets in the first hour, through the real CLI: bare commands print their help, a
checkpoint the tool wrote reads as unchanged, Ctrl-C says what was written, --repair says what it changed,
and a checkpoint of another model is not published silently."""

from __future__ import annotations

import json
import os
import shutil
import signal
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


def _interrupt_when(args: list[str], cwd, appears: str) -> subprocess.CompletedProcess | None:
    """Run the CLI, send SIGINT (Ctrl-C) as soon as ``appears`` (a glob under ``cwd``) exists, and return
    the finished process; None where it finished before the signal landed."""
    proc = subprocess.Popen([*CLI, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(cwd.glob(appears)) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.0005)
    if proc.poll() is not None:
        proc.communicate()
        return None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def big_pair(tmp_path_factory):
    """A 4 MiB checkpoint and a delta that rewrites all of it: an apply long enough to interrupt."""
    d = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(1)
    a = {f"w{i}": rng.standard_normal((512, 1024)).astype(np.float32) for i in range(2)}
    save_file(a, str(d / "a.safetensors"))
    b = {k: v + np.float32(1e-3) * rng.standard_normal(v.shape).astype(np.float32) for k, v in a.items()}
    save_file(b, str(d / "b.safetensors"))
    assert run("encode", "a.safetensors", "b.safetensors", "-o", "d.delta", "-q", cwd=d).returncode == 0
    return d


def test_ctrl_c_during_an_apply_says_what_was_written_and_that_rerunning_is_safe_and_a_rerun_verifies(big_pair):
    d = big_pair
    for _attempt in range(3):
        shutil.copyfile(d / "a.safetensors", d / "r.safetensors")
        r = _interrupt_when(["apply", "d.delta", "r.safetensors", "-q"], d, "r.safetensors.deltarefit-lock")
        if r is not None:
            break
    assert r is not None, "the apply finished before each Ctrl-C"
    assert r.returncode == 130, r.stderr
    err = r.stderr.strip()
    assert err.count("\n") == 0 and "Traceback" not in r.stderr, r.stderr
    assert err.startswith("deltarefit: interrupted: r.safetensors: part of the delta may be written in place")
    assert "not verified" in err and "rerunning the same command is safe" in err and "resumes" in err
    r = run("apply", "d.delta", "r.safetensors", cwd=d)
    assert r.returncode == 0 and "verified" in r.stdout, r.stderr
    assert (d / "r.safetensors").read_bytes() == (d / "b.safetensors").read_bytes()


def _synced_files(commands: list[str]) -> set[str]:
    return {os.path.basename(c.split()[3]) for c in commands if c.startswith("deltarefit sync ")}


def test_the_readme_and_the_demo_next_steps_sync_into_different_files():
    from deltarefit.apps.demo_trainer import _next_steps

    class Said:  # the demo's printer, as far as _next_steps uses it
        def __init__(self):
            self.commands: list[str] = []

        def line(self, text: str) -> None:
            pass

        def command(self, cmd: str) -> None:
            self.commands.append(cmd)

    said = Said()
    _next_steps(said, "out/demo", 9)
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    readme_cmds = [line.strip() for line in readme.splitlines()]
    demo, ours = _synced_files(said.commands), _synced_files(readme_cmds)
    assert demo and ours and not demo & ours, (demo, ours)


def test_sync_repair_onto_another_stream_says_what_it_changed(two_versions):
    d = two_versions
    for ck in ("a.safetensors", "b.safetensors"):
        assert run("publish", "t", ck, cwd=d).returncode == 0  # the same checkpoints, another stream
    assert run("sync", "s", "r.safetensors", cwd=d).returncode == 0
    r = run("sync", "t", "r.safetensors", cwd=d)
    assert r.returncode == 9 and "--repair" in r.stderr, r.stderr
    s_id, t_id = (json.loads(run("log", st, "--json", cwd=d).stdout)[0]["stream"] for st in ("s", "t"))
    r = run("sync", "t", "r.safetensors", "--repair", cwd=d)
    assert r.returncode == 0, r.stderr
    assert "nothing to do" not in r.stdout
    assert (f"r.safetensors: repaired: the record said version 2 of stream {s_id} ({d / 's'}), now version 2 of "
            f"stream {t_id} ({d / 't'}); adopted by its fingerprint, unchanged; fingerprint ") in r.stdout, r.stdout
    assert r.stdout.rstrip().endswith("verified")
    r = run("sync", "t", "r.safetensors", "--repair", cwd=d)  # a repair that changes nothing says so
    assert "at version 2, nothing to do" in r.stdout and "repaired" not in r.stdout, r.stdout


def test_publishing_another_model_into_a_stream_is_refused_unless_asked_for(two_versions):
    d = two_versions
    r = run("publish", "s", "other.safetensors", cwd=d)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "version 2 -> other.safetensors: 100.0% of elements changed: they look unrelated" in r.stderr
    assert "nothing published" in r.stderr and "--another-model" in r.stderr, r.stderr
    assert sorted(os.listdir(d / "s" / "v")) == ["000000000001", "000000000002"]
    r = run("publish", "s", "other.safetensors", "--another-model", cwd=d)
    assert r.returncode == 0 and "s: version 3" in r.stdout, r.stderr


def test_the_library_publish_refuses_another_model_unless_its_keyword_is_given(tmp_path):
    from deltarefit.errors import UsageError
    from deltarefit.stream import Publisher

    rng = np.random.default_rng(2)
    for name, shape in (("a", (32, 32)), ("other", (32, 32))):  # same names and shapes, unrelated values
        save_file({"w": rng.standard_normal(shape).astype(np.float32)}, str(tmp_path / f"{name}.safetensors"))
    pub = Publisher(str(tmp_path / "s"), str(tmp_path / "state"))
    pub.publish(str(tmp_path / "a.safetensors"))
    with pytest.raises(UsageError, match="another_model=True"):
        pub.publish(str(tmp_path / "other.safetensors"))
    pub = Publisher(str(tmp_path / "s"), str(tmp_path / "state"), another_model=True)
    assert pub.publish(str(tmp_path / "other.safetensors")).version == 2


def test_a_partial_reload_drops_vllms_expected_not_loaded_warnings_and_says_what_they_meant_once(caplog):
    """vLLM's own loggers (by name: vLLM is not needed), as its reload logs through them."""
    import logging

    from deltarefit.engines.kernels import Reloading

    class Model:
        def modules(self):
            return []

    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    inplace = logging.getLogger("vllm.model_executor.model_loader.reload.inplace")
    caplog.set_level(logging.INFO)
    with Reloading(Model(), []):
        for layer in ("Attention", "RMSNorm", "Attention"):
            layerwise.warning("%s: Failed to load weights", layer)
        inplace.warning("Following weights were not loaded from checkpoint: %s", {"lm_head.weight"})
        layerwise.warning("%s: something else", "Linear")
    said = [r for r in caplog.records if r.name.startswith("vllm.")]
    assert [r.getMessage() for r in said] == ["Linear: something else"]  # only the expected ones dropped
    ours = [r for r in caplog.records if r.name == "deltarefit.engines.reload_logs"]
    assert len(ours) == 1 and "4 warnings of vLLM's reload" in ours[0].getMessage() and "expected" in ours[0].getMessage()
    layerwise.warning("%s: Failed to load weights", "Attention")  # outside a deltarefit reload: vLLM's own
    assert caplog.records[-1].name == layerwise.name


def test_every_worker_extension_cls_in_the_docs_names_a_class():
    """vLLM imports ``--worker-extension-cls`` as a class path: a string constant there fails at start."""
    import importlib
    import inspect
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    named = {(f.name, m) for f in [root / "README.md", *(root / "docs").glob("*.md")]
             for m in re.findall(r"--worker-extension-cls[ =]([\w.]+)", f.read_text())}
    assert named
    for where, path in sorted(named):
        module, _, attr = path.rpartition(".")
        assert inspect.isclass(getattr(importlib.import_module(module), attr)), (where, path)
