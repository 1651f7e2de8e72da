"""The command line as a user runs it: real processes, real files, exit codes and one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from deltarefit.cli import main


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, DELTAREFIT_NO_PROGRESS="1")
    return subprocess.run([sys.executable, "-m", "deltarefit", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    g = torch.Generator().manual_seed(0)
    base = {"a.weight": (torch.randn(300, 200, generator=g) * 0.02).to(torch.bfloat16),
            "b.bias": torch.zeros(200, dtype=torch.bfloat16)}
    target = {k: v.clone() for k, v in base.items()}
    target["a.weight"].view(torch.int16)[::7] += 1
    save_file(base, str(d / "base.safetensors"))
    save_file(target, str(d / "target.safetensors"))
    return d


def test_encode_apply_inspect_fingerprint_verify_round_trip(files, tmp_path):
    delta = str(tmp_path / "d.delta")
    r = run("encode", str(files / "base.safetensors"), str(files / "target.safetensors"), "-o", delta, "--json")
    assert r.returncode == 0, r.stderr
    enc = json.loads(r.stdout)
    assert enc["ratio"] > 1 and enc["changed_fraction"] == 43 * 200 / (300 * 200 + 200)  # rows 0, 7, ..., 294
    work = str(tmp_path / "w.safetensors")
    shutil.copy(files / "base.safetensors", work)
    r = run("apply", delta, work)
    assert r.returncode == 0, r.stderr
    assert enc["target_fingerprint"] in r.stdout and "verified" in r.stdout
    r = run("inspect", delta, "--json")
    info = json.loads(r.stdout)
    ops = {t["name"]: t for t in info["tensors"]}
    assert ops["a.weight"]["op"] == "patch" and ops["b.bias"]["op"] == "same"
    assert ops["a.weight"]["changed"] == info["changed_elements"] == enc["changed_fraction"] * info["total_elements"]
    assert info["delta_bytes"] == os.path.getsize(delta)
    r = run("inspect", delta)
    assert r.returncode == 0 and "a.weight" in r.stdout and "b.bias" not in r.stdout
    r = run("fingerprint", work)
    assert r.stdout.strip() == enc["target_fingerprint"]
    assert run("verify", work, enc["target_fingerprint"]).returncode == 0


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (("verify", "{work}", "0" * 64), 6, "does not match"),
        (("verify", "{work}", "xyz"), 2, "64 hex digits"),
        (("apply", "{missing}", "{work}"), 3, "cannot open delta"),
        (("apply", "{garbage}", "{work}"), 3, "bad magic"),
        (("fingerprint", "{missing}"), 4, "missing"),
    ],
)
def test_errors_are_one_line_with_a_distinct_exit_code(files, tmp_path, args, code, needle):
    work = str(tmp_path / "w.safetensors")
    shutil.copy(files / "base.safetensors", work)
    garbage = tmp_path / "garbage.delta"
    garbage.write_bytes(b"not a delta at all" * 10)
    subst = {"work": work, "missing": str(tmp_path / "missing"), "garbage": str(garbage)}
    r = run(*(a.format(**subst) for a in args))
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deltarefit: error: ") and needle in lines[0], r.stderr


def test_apply_of_a_wrong_base_exits_5_and_writes_nothing(files, tmp_path):
    delta = str(tmp_path / "d.delta")
    assert run("encode", str(files / "base.safetensors"), str(files / "target.safetensors"), "-o", delta).returncode == 0
    other = str(tmp_path / "other.safetensors")
    save_file({"a.weight": torch.ones(300, 200, dtype=torch.bfloat16),
               "b.bias": torch.zeros(200, dtype=torch.bfloat16)}, other)
    before = open(other, "rb").read()
    r = run("apply", delta, other)
    assert r.returncode == 5 and "a.weight" in r.stderr
    assert open(other, "rb").read() == before


def test_the_set_of_commands_and_flags_is_deliberate():
    # Adding a flag is fine; doing it by accident is not. Update this table with the change.
    got = {name: sorted(p.name for p in cmd.params) for name, cmd in main.commands.items()}
    assert got == {
        "encode": ["as_json", "base", "format_version", "history_dir", "output", "quiet", "target", "threads"],
        "apply": ["as_json", "checkpoint", "delta", "history_dir", "quiet", "threads"],
        "inspect": ["as_json", "delta", "show_all"],
        "fingerprint": ["as_json", "checkpoint", "quiet", "threads"],
        "verify": ["checkpoint", "expected", "threads"],
        "publish": ["ack_timeout", "advance", "another_model", "as_json", "catchup", "checkpoint", "format_version",
                    "history",
                    "keyframe_every",
                    "keyframe_ratio", "quarantine_head", "quiet", "quorum", "reset_baseline", "signing_key", "state_dir", "step",
                    "store", "threads"],
        "sync": ["as_json", "checkpoint", "full_verify", "prepare", "public_key", "quiet", "repair", "store",
                 "stream_id", "subscriber_id", "threads", "to_version"],
        "log": ["as_json", "public_key", "store"],
        "retain": ["as_json", "dry_run", "orphan_grace", "store", "ttl", "unsafe_short_grace"],
        "keygen": ["private_key"],
        "status": ["as_json", "checkpoint", "public_key", "store", "threads", "verify"],
        "compose": ["base", "deltas", "format_version", "output", "quiet"],
        "demo": ["as_json", "lr", "out", "rollouts", "s3_url", "steps", "transport"],
        "simulate": ["apply_cores", "apply_gbps_core", "calibrate", "change_pct", "chunk_mb", "codec", "encode_cores",
                     "encode_gbps_core", "fabric_gbps", "fanout", "link_gbps", "nodes", "out_dir", "params", "plot_path",
                     "ratio", "references", "rollout", "shards", "store_gbps"],
        "bench": [],
        "relay": [],
    }
    relay = {name: sorted(p.name for p in cmd.params) for name, cmd in main.commands["relay"].commands.items()}
    assert relay == {
        "root": ["fanout", "key_file", "listen", "mirror", "node_id", "poll", "rate", "store"],
        "node": ["checkpoint", "fanout", "join", "key_file", "listen", "mirror", "node_id", "rate", "until_version"],
        "keygen": ["key_file"],
    }


# ------------------------------------------------------------------------- the command line, as a person uses it


def _tty_run(*args: str, timeout: float = 120) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal (progress bars on); (exit, stdout, terminal output)."""
    import pty
    import select
    import time

    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "DELTAREFIT_NO_PROGRESS"}
    p = subprocess.Popen([sys.executable, "-m", "deltarefit", *args], stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if p.poll() is not None:
                    break
                continue
            try:
                b = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not b:
                break
            out += b
        stdout, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)
    return p.returncode, stdout.decode(), out.decode(errors="replace")


def test_publish_sync_and_compose_take_quiet_and_show_transfer_progress_on_a_terminal(files, tmp_path):
    store = str(tmp_path / "store")
    rc, out, term = _tty_run("publish", store, str(files / "base.safetensors"))
    assert rc == 0 and "version 1" in out and "publish: upload" in term, (rc, out, term)
    rc, out, term = _tty_run("publish", store, str(files / "target.safetensors"), "--quiet")
    assert rc == 0 and "version 2" in out and term.strip() == "", (rc, out, term)
    rc, out, term = _tty_run("sync", store, str(tmp_path / "r1.safetensors"))
    assert rc == 0 and "sync: fetch" in term, (rc, out, term)
    rc, out, term = _tty_run("sync", store, str(tmp_path / "r2.safetensors"), "-q")
    assert rc == 0 and "-> 2" in out and term.strip() == "", (rc, out, term)
    d1, d2 = str(tmp_path / "d1.delta"), str(tmp_path / "d2.delta")
    assert run("encode", str(files / "base.safetensors"), str(files / "target.safetensors"), "-o", d1).returncode == 0
    assert run("encode", str(files / "target.safetensors"), str(files / "base.safetensors"), "-o", d2).returncode == 0
    rc, out, term = _tty_run("compose", d1, d2, "-o", str(tmp_path / "c.delta"), "--base",
                             str(files / "base.safetensors"), "-q")
    assert rc == 0 and "2 deltas composed" in out and term.strip() == "", (rc, out, term)


@pytest.mark.parametrize("args", [("encode", "{base}", "{target}", "-o", "{missing}/d.delta"),
                                  ("compose", "{delta}", "-o", "{missing}/c.delta", "--base", "{base}")])
def test_output_into_a_missing_directory_is_one_line(files, tmp_path, args):
    delta = str(tmp_path / "d.delta")
    assert run("encode", str(files / "base.safetensors"), str(files / "target.safetensors"), "-o", delta).returncode == 0
    subst = {"base": str(files / "base.safetensors"), "target": str(files / "target.safetensors"), "delta": delta,
             "missing": str(tmp_path / "no" / "such")}
    r = run(*(a.format(**subst) for a in args))
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deltarefit: error: ") and "does not exist" in lines[0], r.stderr
    assert not os.path.exists(tmp_path / "no")


@pytest.mark.parametrize(("args", "needle"), [(("encode", "{base}", "{target}"), "Missing option '-o'"),
                                             (("frobnicate",), "No such command 'frobnicate'"),
                                             (("apply", "--bogus"), "--bogus"),
                                             (("sync", "s", "c", "--to", "0"), "--to"),
                                             (("publish",), "Missing argument 'STORE'")])
def test_usage_errors_are_one_line_and_exit_2(files, args, needle):
    subst = {"base": str(files / "base.safetensors"), "target": str(files / "target.safetensors")}
    r = run(*(a.format(**subst) for a in args))
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deltarefit: error: ") and needle in lines[0], r.stderr
    assert r.stdout == ""


def test_help_and_version_still_exit_0():
    r = run("publish", "--help")
    assert r.returncode == 0 and "s3://" in r.stdout and "directory" in r.stdout, r.stdout
    assert run("--version").returncode == 0


def _structural_pair(tmp_path):
    g = torch.Generator().manual_seed(5)
    base = {"keep": (torch.randn(600, 1024, generator=g) * 0.02).to(torch.bfloat16),
            "gone": torch.zeros(300, 1000, dtype=torch.bfloat16)}
    target = {"keep": base["keep"].clone(), "new.weight": torch.ones(10, 20, dtype=torch.float32)}
    target["keep"].view(torch.int16)[::3] += 1
    paths = str(tmp_path / "base.safetensors"), str(tmp_path / "target.safetensors")
    save_file(base, paths[0])
    save_file(target, paths[1])
    delta = str(tmp_path / "s.delta")
    assert run("encode", *paths, "-o", delta).returncode == 0
    return paths[0], paths[1], delta


def test_a_structural_apply_names_what_it_added_and_removed_and_keeps_the_file_mode(tmp_path):
    base, _target, delta = _structural_pair(tmp_path)
    work = str(tmp_path / "w.safetensors")
    shutil.copyfile(base, work)
    os.chmod(work, 0o600)
    r = run("apply", delta, work)
    assert r.returncode == 0, r.stderr
    assert "added 1 tensor (new.weight)" in r.stdout and "removed 1 tensor (gone)" in r.stdout, r.stdout
    assert os.stat(work).st_mode & 0o777 == 0o600
    r = run("apply", delta, work, "--json")
    assert json.loads(r.stdout)["structural"] == []  # a rerun has nothing left to do


def test_a_structural_apply_of_an_indexed_directory_keeps_the_modes(tmp_path):
    base, _target, delta = _structural_pair(tmp_path)
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copyfile(base, d / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"keep": "model-00001-of-00001.safetensors",
                                        "gone": "model-00001-of-00001.safetensors"}}))
    for f in d.iterdir():
        os.chmod(f, 0o600)
    r = run("apply", delta, str(d), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["structural_ops"] == {"gone": "remove", "new.weight": "add"}
    assert sorted(oct(os.stat(f).st_mode & 0o777) for f in d.iterdir()) == [oct(0o600)] * len(list(d.iterdir()))


def test_encode_progress_adds_up_to_the_target_size(tmp_path):
    """The encode bar's total is the target's bytes; what it is advanced by must add up to exactly that
    (small tensors, a partial last segment, a removed and a re-typed tensor)."""
    import deltarefit

    g = torch.Generator().manual_seed(7)
    base = {"big": (torch.randn(1100, 1000, generator=g)).to(torch.bfloat16),  # 2.1 MiB: a partial segment
            "tiny": torch.zeros(3, dtype=torch.bfloat16), "gone": torch.zeros(700, 1000, dtype=torch.float32),
            "retyped": torch.zeros(100, 100, dtype=torch.float32)}
    target = {"big": base["big"].clone(), "tiny": torch.ones(3, dtype=torch.bfloat16),
              "retyped": torch.zeros(100, 100, dtype=torch.bfloat16), "added": torch.ones(5, 7)}
    target["big"].view(torch.int16)[::11] += 1
    b, t = str(tmp_path / "b.safetensors"), str(tmp_path / "t.safetensors")
    save_file(base, b)
    save_file(target, t)
    seen: list[int] = []
    deltarefit.encode(b, t, str(tmp_path / "d.delta"), progress=seen.append)
    assert sum(seen) == sum(v.numel() * v.element_size() for v in target.values())


@pytest.mark.parametrize("cmd", ["sync", "log", "retain"])
def test_a_store_that_does_not_exist_is_an_error_not_a_new_directory(files, tmp_path, cmd):
    missing = str(tmp_path / "stroe")  # a typo
    args = [cmd, missing] + ([str(tmp_path / "r.safetensors")] if cmd == "sync" else [])
    r = run(*args)
    assert r.returncode == 7, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no store here" in lines[0] and missing in lines[0], r.stderr
    assert not os.path.exists(missing)


# Modules the hot commands must not import: numba (about 0.2 s, and its kernels' first calls), the
# sharded layer, torch, rich and transformers (seconds), and importlib.abc / importlib.resources (which
# bring pathlib, tempfile, shutil, bz2, lzma and random: about 30 ms).
NOT_ON_HOT_PATHS = ("numba", "deltarefit.shard", "torch", "rich", "transformers", "importlib.abc",
                    "importlib.resources")


@pytest.mark.parametrize("cmd", ["--help", "apply", "encode"])
def test_hot_commands_start_without_heavy_imports(files, tmp_path, cmd):
    """Start-up: ``deltarefit --help``, and ``apply`` and ``encode`` of bf16 weights, run on the native
    kernels alone and import none of ``NOT_ON_HOT_PATHS`` (checked in the finished process's
    ``sys.modules``)."""
    from deltarefit.codec.native import SCAN_AVX512, USE_NATIVE

    if not USE_NATIVE:
        pytest.skip("the native kernels are not built here (numba is their fallback; pip install -e . builds them where a C compiler is)")
    if cmd == "encode" and not SCAN_AVX512:
        pytest.skip("this CPU has no AVX-512: the encoder's scan runs in numba here, by design (codec.native)")
    delta = str(tmp_path / "d.delta")
    assert run("encode", str(files / "base.safetensors"), str(files / "target.safetensors"), "-o", delta).returncode == 0
    work = str(tmp_path / "w.safetensors")
    shutil.copyfile(files / "base.safetensors", work)
    argv = {"--help": ["--help"], "apply": ["apply", delta, work, "-q"],
            "encode": ["encode", str(files / "base.safetensors"), str(files / "target.safetensors"), "-o",
                       str(tmp_path / "e.delta"), "-q"]}[cmd]
    code = ("import sys; from deltarefit.cli import main\n"
            f"sys.argv = ['deltarefit', *{argv!r}]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            f"print(sorted(m for m in {NOT_ON_HOT_PATHS!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout
    if cmd == "--help":  # numpy too: nothing of the library is loaded to print the help
        r = subprocess.run([sys.executable, "-c", code.replace(repr(NOT_ON_HOT_PATHS), "('numpy',)")],
                           capture_output=True, text=True, timeout=120)
        assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout + r.stderr
    if cmd == "apply":
        want = run("fingerprint", str(files / "target.safetensors")).stdout.split()[0]
        assert run("fingerprint", work).stdout.split()[0] == want


@pytest.mark.parametrize("user", [None, "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"])
def test_a_command_loads_numpy_with_one_blas_thread(files, user):
    """A command of ``cli.common.NUMPY_WITHOUT_BLAS`` (here ``fingerprint``) run as its own process loads
    numpy with OpenBLAS's pool at one thread, and leaves no variable set behind it (a child process or
    torch would read it); where the user set one of the variables, numpy follows the user's."""
    threadpoolctl = pytest.importorskip("threadpoolctl", reason="reads OpenBLAS's pool: pip install threadpoolctl")
    del threadpoolctl
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                                                              "OMP_NUM_THREADS")}
    if user is not None:
        env[user] = "2"  # OpenBLAS takes at most the cores
    code = ("import os, sys; from deltarefit.cli import main\n"
            f"sys.argv = ['deltarefit', 'fingerprint', {str(files / 'base.safetensors')!r}]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "from threadpoolctl import threadpool_info\n"
            "print(sorted({i['num_threads'] for i in threadpool_info() if i['internal_api'] == 'openblas'}),"
            " sorted(k for k in ('OPENBLAS_NUM_THREADS', 'GOTO_NUM_THREADS', 'OMP_NUM_THREADS') if k in os.environ))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    want = "[1] []" if user is None else f"[{min(2, os.cpu_count() or 1)}] ['{user}']"
    assert r.stdout.strip().splitlines()[-1] == want, r.stdout
