"""``deltarefit demo --out DIR`` touches only what it made: a directory that is not empty and holds no marker
of the demo's is refused in one line (exit 2), nothing in it touched; in a directory of its own it cleans
only the entries its marker lists. Fast: the refusals come before any process starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deltarefit.errors import UsageError


def _demo(out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltarefit", "demo", "--out", str(out), "--steps", "1"],
                          capture_output=True, text=True, timeout=120)


def test_the_demo_refuses_a_non_empty_directory_it_did_not_make(tmp_path):
    out = tmp_path / "mine"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "model.safetensors").write_bytes(b"precious")
    (out / "store").mkdir()
    (out / "rollout-0").symlink_to(tmp_path)
    r = _demo(out)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "not a directory the demo made" in r.stderr, r.stderr
    assert r.stdout == ""
    assert (out / "checkpoints" / "model.safetensors").read_bytes() == b"precious"
    assert sorted(os.listdir(out)) == ["checkpoints", "rollout-0", "store"]


def test_the_demo_cleans_only_what_its_marker_lists(tmp_path):
    from deltarefit.apps.demo import MARKER, _clean

    out = str(tmp_path / "demo")
    _clean(out, rollouts=2)  # a new directory: made the demo's, the marker first
    assert set(os.listdir(out)) == {MARKER, "store", "trainer"}
    os.makedirs(os.path.join(out, "rollout-1", "deep"))
    os.makedirs(os.path.join(out, "notes"))  # the user's, beside the demo's
    open(os.path.join(out, "notes", "n.txt"), "w").write("keep")
    _clean(out, rollouts=1)
    assert set(os.listdir(out)) == {MARKER, "store", "trainer", "notes"}
    assert open(os.path.join(out, "notes", "n.txt")).read() == "keep"


@pytest.mark.parametrize("marker", [
    json.dumps({"by": "deltarefit demo", "made": ["store", "../victim"]}),
    json.dumps({"by": "deltarefit demo", "made": ["notes"]}),
    json.dumps({"by": "someone", "made": ["store"]}),
    "[" * 5000,
])
def test_a_marker_the_demo_did_not_write_is_refused(tmp_path, marker):
    from deltarefit.apps.demo import MARKER, _clean

    out = tmp_path / "demo"
    (out / "notes").mkdir(parents=True)
    (tmp_path / "victim").mkdir()
    (out / MARKER).write_text(marker)
    with pytest.raises(UsageError, match="not a marker the demo wrote"):
        _clean(str(out), rollouts=1)
    assert (out / "notes").is_dir() and (tmp_path / "victim").is_dir()
