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
        "encode": ["as_json", "base", "output", "quiet", "target", "threads"],
        "apply": ["as_json", "checkpoint", "delta", "quiet", "threads"],
        "inspect": ["as_json", "delta", "show_all"],
        "fingerprint": ["as_json", "checkpoint", "threads"],
        "verify": ["checkpoint", "expected", "threads"],
        "publish": ["ack_timeout", "advance", "as_json", "catchup", "checkpoint", "keyframe_every", "keyframe_ratio",
                    "quarantine_head", "quorum", "reset_baseline", "signing_key", "state_dir", "step", "store",
                    "threads"],
        "sync": ["as_json", "checkpoint", "full_verify", "prepare", "public_key", "repair", "store", "stream_id",
                 "subscriber_id", "threads", "to_version"],
        "log": ["as_json", "public_key", "store"],
        "retain": ["as_json", "dry_run", "orphan_grace", "store", "ttl"],
        "keygen": ["private_key"],
        "compose": ["base", "deltas", "output"],
        "demo": ["lr", "out", "rollouts", "s3_url", "steps", "transport"],
        "simulate": ["apply_cores", "apply_gbps_core", "calibrate", "change_pct", "chunk_mb", "codec", "encode_cores",
                     "encode_gbps_core", "fabric_gbps", "fanout", "link_gbps", "nodes", "params", "plot_path", "ratio",
                     "references", "shards", "store_gbps"],
        "bench": [],
        "relay": [],
    }
    relay = {name: sorted(p.name for p in cmd.params) for name, cmd in main.commands["relay"].commands.items()}
    assert relay == {
        "root": ["fanout", "key_file", "listen", "mirror", "node_id", "poll", "rate", "store"],
        "node": ["checkpoint", "fanout", "join", "key_file", "listen", "mirror", "node_id", "rate", "until_version"],
        "keygen": ["key_file"],
    }
