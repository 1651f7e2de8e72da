"""The sharded refit example as a real multi-process run: 2 trainer ranks and 2 tensor-parallel
rollout ranks over torch.distributed gloo on loopback (kept to 2 steps)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str, timeout: int = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", "sharded_refit.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_sharded_refit_example_gloo(tmp_path):
    pytest.importorskip("transformers", reason="transformers is in the test extra: pip install -e '.[test]' (make test installs it)")
    r = run("--steps", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith("step")]
    assert len(lines) == 3 and all("verified yes" in x for x in lines), r.stdout
    assert "keyframe" in lines[0] and "delta" in lines[1]
    assert "publish memory beyond the model" in r.stdout


def test_sharded_refit_example_wrong_map_fails(tmp_path):
    pytest.importorskip("transformers", reason="transformers is in the test extra: pip install -e '.[test]' (make test installs it)")
    r = run("--steps", "1", "--out", str(tmp_path), "--wrong-map")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "verified NO" in r.stdout and "refusing the version, nothing written" in r.stdout
