"""``deltarefit status CKPT``: which stream and version a checkpoint holds and whether it is behind, from
real CLI processes on a real store; and that it writes no byte anywhere."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

CLI = [sys.executable, "-m", "deltarefit"]
FIELDS = {"checkpoint", "record", "state", "version", "fingerprint", "stream_id", "store", "store_from", "head",
          "behind", "files_unchanged", "too_soon", "hashed", "found_version", "fix"}


def run(*args: str, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False,
                          env=env)


def status_json(*args: str, cwd) -> dict:
    r = run("status", *args, "--json", cwd=cwd)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert set(d) == FIELDS, set(d) ^ FIELDS
    return d


@pytest.fixture
def stream(tmp_path):
    """Versions 1..3 of one stream in ``s`` (from v0..v2), and v3, unpublished."""
    rng = np.random.default_rng(0)
    w = {"w": rng.standard_normal((64, 64)).astype(np.float32), "b": rng.standard_normal(64).astype(np.float32)}
    for i in range(4):
        save_file(w, str(tmp_path / f"v{i}.safetensors"))
        w = {k: v.copy() for k, v in w.items()}
        w["w"][i::7, ::5] += 1e-3
    for i in range(3):
        assert run("publish", "s", f"v{i}.safetensors", "-q", cwd=tmp_path).returncode == 0
    return tmp_path


def test_behind_by_n_names_the_version_the_stream_the_head_and_the_command(stream):
    assert run("sync", "s", "r.safetensors", "--to", "1", "-q", cwd=stream).returncode == 0
    r = run("status", "r.safetensors", cwd=stream)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert 2 <= len(lines) <= 4, r.stdout
    assert lines[0].startswith("r.safetensors: version 1 of stream ")
    assert f"store {stream / 's'} (recorded): head version 3; 2 versions behind" in r.stdout
    assert f"'deltarefit sync {stream / 's'} r.safetensors' brings it there" in r.stdout
    d = status_json("r.safetensors", cwd=stream)
    assert (d["state"], d["version"], d["head"], d["behind"], d["store_from"]) == ("behind", 1, 3, 2, "recorded")
    assert d["hashed"] is None  # no hash unless asked
    log = json.loads(run("log", "s", "--json", cwd=stream).stdout)
    assert d["fingerprint"] == log[0]["fingerprint"] and d["stream_id"] == log[0]["stream"]
    assert run("sync", "s", "r.safetensors", "-q", cwd=stream).returncode == 0
    r = run("status", "r.safetensors", "--store", "s", cwd=stream)
    assert r.returncode == 0 and "store s (given): head version 3; at the head, nothing to sync" in r.stdout, r.stdout
    d = status_json("r.safetensors", "--verify", cwd=stream)
    assert (d["state"], d["behind"], d["fix"]) == ("at-head", 0, None)
    assert d["hashed"] == d["fingerprint"] == log[2]["fingerprint"]


def test_without_a_record_it_says_so_and_verify_finds_the_version_or_another_model(stream):
    r = run("status", "v1.safetensors", cwd=stream)
    assert r.returncode == 0 and "v1.safetensors: no version record" in r.stdout, r.stdout + r.stderr
    assert "'deltarefit sync STORE v1.safetensors'" in r.stdout
    d = status_json("v1.safetensors", "--store", "s", "--verify", cwd=stream)
    assert (d["state"], d["found_version"], d["version"], d["fix"]) == (
        "no-record", 2, None, "deltarefit sync s v1.safetensors")
    r = run("status", "v3.safetensors", "--store", "s", "--verify", cwd=stream)  # never published
    assert r.returncode == 0 and "is no version of store s (given)" in r.stdout, r.stdout
    assert "'deltarefit sync s v3.safetensors --repair'" in r.stdout


def test_a_modified_checkpoint_is_told_by_verify(stream):
    assert run("sync", "s", "r.safetensors", "-q", cwd=stream).returncode == 0
    with open(stream / "r.safetensors", "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x01\x02\x03")
    d = status_json("r.safetensors", "--verify", cwd=stream)
    assert d["state"] == "modified" and d["hashed"] != d["fingerprint"] and d["fix"].endswith(" --repair")


@pytest.mark.parametrize(("setup", "args", "code", "said"), [
    ("", ("status", "r.safetensors", "--store", "nowhere"), 7, "nowhere: no store here"),
    ("sync", ("status", "r.safetensors", "--store", "v0.safetensors"), 7, "no store here (not a directory)"),
    ("corrupt", ("status", "r.safetensors"), 9, "'deltarefit sync --repair' rebuilds it"),
    ("", ("status", "none.safetensors"), 4, "creates it from the stream's newest keyframe"),
    ("gone", ("status", "r.safetensors"), 4, "version record"),
])
def test_refusals_are_one_line_with_the_table_s_exit_code(stream, setup, args, code, said):
    if setup in ("sync", "corrupt", "gone"):
        assert run("sync", "s", "r.safetensors", "-q", cwd=stream).returncode == 0
    elif setup == "":
        save_file({"x": np.zeros(3, np.float32)}, str(stream / "r.safetensors"))
    if setup == "corrupt":
        (stream / "r.safetensors.deltarefit-version.json").write_text("{not json")
    if setup == "gone":
        os.unlink(stream / "r.safetensors")
    r = run(*args, cwd=stream)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1 and lines[0].startswith("deltarefit: error: "), r.stderr
    assert said in lines[0] and r.stdout == "", (said, r.stderr)


def _tree(root) -> dict[str, tuple]:
    """Every name under ``root`` (directories included) with its size, mtime and content hash."""
    out = {}
    for dp, dns, fns in os.walk(root):
        for n in dns + fns:
            p = os.path.join(dp, n)
            st = os.lstat(p)
            digest = hashlib.sha256(open(p, "rb").read()).hexdigest() if os.path.isfile(p) else ""
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns, digest)
    return out


def test_status_writes_no_byte_anywhere(stream, tmp_path_factory):
    """Every state and flag, with HOME, the caches and the working directory watched: no name appears,
    none changes (the store's, the checkpoint's, its record's, a lock's, a cache's)."""
    assert run("sync", "s", "r.safetensors", "--to", "2", "-q", cwd=stream).returncode == 0
    home = tmp_path_factory.mktemp("home")
    env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / "cache"), DELTAREFIT_NO_PROGRESS="1")
    before, home_before = _tree(stream), _tree(home)
    for args in (("r.safetensors",), ("r.safetensors", "--verify"), ("r.safetensors", "--store", "s", "--json"),
                 ("v3.safetensors", "--store", "s", "--verify"), ("v1.safetensors", "--verify", "--json"),
                 ("r.safetensors", "--store", "nowhere")):
        r = run("status", *args, cwd=stream, env=env)
        assert r.returncode in (0, 7), r.stderr
    assert _tree(stream) == before
    assert _tree(home) == home_before == {}


def test_a_store_wiped_and_republished_is_another_stream_with_the_repair_command(stream):
    assert run("sync", "s", "r.safetensors", "-q", cwd=stream).returncode == 0
    shutil.rmtree(stream / "s")
    assert run("publish", "s", "v3.safetensors", "-q", cwd=stream).returncode == 0
    d = status_json("r.safetensors", cwd=stream)
    assert (d["state"], d["version"], d["head"]) == ("other-stream", 3, 1), d
    assert d["fix"] == f"deltarefit sync {stream / 's'} r.safetensors --repair"
    r = run("status", "r.safetensors", cwd=stream)
    assert r.returncode == 0 and "the store holds another stream" in r.stdout, r.stdout
