"""One version record per checkpoint, whichever form names it: a directory holding one weight file and no
index is the same checkpoint as that file (``checkpoint.read.sole_weight_file``). Real checkpoints, a real
store on disk, the real subscriber; the CLI for what a user reads."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from deltarefit.checkpoint.read import open_checkpoint
from deltarefit.errors import LockedError, StreamError
from deltarefit.io.locks import checkpoint_lock
from deltarefit.stream import Publisher, Subscriber
from deltarefit.stream.holder import state_path
from deltarefit.stream.records import held_state, record_version

RECORD = ".deltarefit-version.json"


@pytest.fixture
def world(tmp_path):
    """Checkpoints v1..v3 of one model, a store holding versions 1 and 2, and a rollout directory ``r``."""
    rng = np.random.default_rng(0)
    w = {"w": rng.standard_normal((64, 64)).astype(np.float32), "b": rng.standard_normal(64).astype(np.float32)}
    cks = []
    for i in range(3):
        w = {k: v.copy() for k, v in w.items()}
        w["w"][i::7, ::5] += 1e-3
        p = str(tmp_path / f"v{i + 1}.safetensors")
        save_file(w, p)
        cks.append(p)
    store = str(tmp_path / "store")
    pub = Publisher(store, str(tmp_path / "pub"))
    pub.publish(cks[0])
    pub.publish(cks[1])
    os.makedirs(tmp_path / "r")
    return {"root": tmp_path, "cks": cks, "store": store, "pub": pub, "dir": str(tmp_path / "r"),
            "file": str(tmp_path / "r" / "model.safetensors")}


def records(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(RECORD))


@pytest.mark.parametrize("first", ["file", "dir"])
def test_the_other_form_at_the_head_has_nothing_to_do_and_fetches_nothing(world, first):
    """Regression (issue 47): a sync naming the directory after one naming its file adopted the checkpoint
    into a second record; once the file form moved on, the directory's stale record took it "2 -> 3"
    again, fetching the delta a second time."""
    other = "dir" if first == "file" else "file"
    Subscriber(world["store"], world["file"]).sync()  # creates the file: the directory's one weight file
    if first == "dir":
        assert Subscriber(world["store"], world["dir"]).sync().from_version == 2
    rep = Subscriber(world["store"], world[other]).sync()
    assert (rep.from_version, rep.version, rep.route, rep.bytes_fetched) == (2, 2, "none", 0)
    world["pub"].publish(world["cks"][2])
    rep = Subscriber(world["store"], world[first]).sync()
    assert (rep.from_version, rep.version) == (2, 3)
    rep = Subscriber(world["store"], world[other]).sync()
    assert (rep.from_version, rep.version, rep.route, rep.bytes_fetched) == (3, 3, "none", 0)
    assert records(world["dir"]) == ["model.safetensors" + RECORD]
    assert state_path(world["dir"]) == state_path(world["file"]) == world["file"] + RECORD


def test_the_cli_says_nothing_to_do_for_the_directory_form(world):
    Subscriber(world["store"], world["file"]).sync()
    r = subprocess.run([sys.executable, "-m", "deltarefit", "sync", world["store"], world["dir"]],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and "at version 2, nothing to do" in r.stdout and "->" not in r.stdout, r.stdout + r.stderr


def test_a_directory_of_several_files_keeps_its_own_record(world, tmp_path):
    d = tmp_path / "two"
    os.makedirs(d)
    save_file({"x": np.zeros(3, np.float32)}, str(d / "a.safetensors"))
    save_file({"y": np.zeros(3, np.float32)}, str(d / "b.safetensors"))
    from deltarefit.stream.holder import other_state_paths

    assert state_path(str(d)) == str(d / RECORD) and other_state_paths(str(d)) == []
    assert state_path(str(d / "a.safetensors")) == str(d / "a.safetensors") + RECORD
    assert other_state_paths(str(d / "a.safetensors")) == []


@pytest.mark.parametrize("form", ["file", "dir"])
def test_duplicate_records_left_by_older_syncs_keep_the_one_that_verifies(world, form):
    """The directory's record says 2, the file's 3 (the checkpoint holds 3): the one whose files are
    unchanged since it was recorded is kept, at the one place, and nothing is fetched."""
    Subscriber(world["store"], world["file"]).sync(to_version=1)
    legacy = os.path.join(world["dir"], RECORD)
    os.replace(world["file"] + RECORD, legacy)
    world["pub"].publish(world["cks"][2])
    # a sync naming the file now adopts it by fingerprint, as it did before records were one: both exist
    with open(legacy, "rb") as f:
        kept = f.read()
    Subscriber(world["store"], world["file"]).sync()
    with open(legacy, "wb") as f:
        f.write(kept)
    assert records(world["dir"]) == [RECORD, "model.safetensors" + RECORD]
    rep = Subscriber(world["store"], world[form]).sync()
    assert (rep.from_version, rep.version, rep.bytes_fetched) == (3, 3, 0)
    assert records(world["dir"]) == ["model.safetensors" + RECORD]
    assert held_state(world["file"] + RECORD)["version"] == 3


def test_a_legacy_directory_record_alone_is_moved_beside_the_file(world):
    Subscriber(world["store"], world["file"]).sync()
    os.replace(world["file"] + RECORD, os.path.join(world["dir"], RECORD))
    rep = Subscriber(world["store"], world["file"]).sync()
    assert (rep.from_version, rep.version, rep.bytes_fetched) == (2, 2, 0)
    assert records(world["dir"]) == ["model.safetensors" + RECORD]


def test_duplicate_records_neither_of_which_verifies_are_refused_with_the_way_out(world):
    Subscriber(world["store"], world["file"]).sync(to_version=1)
    legacy = os.path.join(world["dir"], RECORD)
    os.replace(world["file"] + RECORD, legacy)
    with open(legacy, "rb") as f:
        kept = f.read()
    Subscriber(world["store"], world["file"]).sync()
    with open(legacy, "wb") as f:
        f.write(kept)
    save_file({"w": np.ones((64, 64), np.float32), "b": np.ones(64, np.float32)}, world["file"])  # edited
    before = {n: open(os.path.join(world["dir"], n), "rb").read() for n in os.listdir(world["dir"])}
    with pytest.raises(StreamError) as e:
        Subscriber(world["store"], world["dir"]).sync()
    msg = str(e.value)
    assert "two version records of one checkpoint disagree" in msg and legacy in msg and "nothing was written" in msg
    assert "--repair" in msg
    assert {n: open(os.path.join(world["dir"], n), "rb").read() for n in os.listdir(world["dir"])} == before
    rep = Subscriber(world["store"], world["dir"]).sync(repair=True)
    assert rep.version == 2 and records(world["dir"]) == ["model.safetensors" + RECORD]


_HOLD = r"""
import sys, time
from deltarefit.io.locks import checkpoint_lock
with checkpoint_lock(sys.argv[1]):
    print("HOLDING", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize(("held", "taken"), [("dir", "file"), ("file", "dir")])
def test_a_run_naming_one_form_excludes_a_run_naming_the_other(world, held, taken):
    Subscriber(world["store"], world["file"]).sync()
    p = subprocess.Popen([sys.executable, "-c", _HOLD, world[held]], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "HOLDING"
        with pytest.raises(LockedError, match=str(p.pid)), checkpoint_lock(world[taken]):
            pass
    finally:
        p.kill()
        p.wait()


def test_a_record_of_the_directory_when_it_held_more_files_is_not_taken_for_the_file(world):
    """The directory was a two-file checkpoint when its record was written; one file is left: that record
    is of another checkpoint, and the file is adopted by its fingerprint instead of being taken back to
    the record's version."""
    Subscriber(world["store"], world["file"]).sync()
    os.unlink(world["file"] + RECORD)
    extra = os.path.join(world["dir"], "extra.safetensors")
    save_file({"x": np.zeros(3, np.float32)}, extra)
    with open_checkpoint(world["dir"]) as ck:
        two = ck.identity()
    record_version(os.path.join(world["dir"], RECORD), 1, "ab" * 32, world["store"], identity=two)
    os.unlink(extra)
    rep = Subscriber(world["store"], world["file"]).sync()
    assert (rep.from_version, rep.version, rep.bytes_fetched) == (2, 2, 0)
    assert records(world["dir"]) == ["model.safetensors" + RECORD]
