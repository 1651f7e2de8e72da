"""A keyframe installed into a Hugging Face directory checkpoint replaces its weight files (and their index)
and nothing else: a repository's ``original/`` subdirectory, links, config files and the directory's mode
stay as they were, whether the sync takes the keyframe route or ``sync --repair`` restores the directory."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

import deltarefit
from deltarefit.checkpoint import TensorSource, write_safetensors
from deltarefit.stream import Publisher, Subscriber

INDEX = "model.safetensors.index.json"


def _write(path: str, arrays: dict[str, np.ndarray]) -> None:
    write_safetensors(path, [TensorSource(n, "F32", a.shape, a.nbytes, lambda a=a: [a.tobytes()])
                             for n, a in arrays.items()])


def _weights(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"a.weight": rng.standard_normal(2048).astype(np.float32),
            "b.weight": rng.standard_normal(1024).astype(np.float32)}


def _sharded(d: str, arrays: dict[str, np.ndarray]) -> str:
    """A directory of two shards and their index (the form the stream publishes)."""
    os.makedirs(d, exist_ok=True)
    names = sorted(arrays)
    shards = {n: f"model-0000{i + 1}-of-00002.safetensors" for i, n in enumerate(names)}
    for n, f in shards.items():
        _write(os.path.join(d, f), {n: arrays[n]})
    with open(os.path.join(d, INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": shards}, f)
    return d


def _user_entries(ck: str, tmp_path) -> None:
    """What a downloaded repository holds beside its weights, and a mode of 0755."""
    os.makedirs(os.path.join(ck, "original", "deep"))
    open(os.path.join(ck, "original", "consolidated.00.pth"), "wb").write(b"meta weights")
    open(os.path.join(ck, "original", "deep", "params.json"), "w").write("{}")
    open(os.path.join(ck, "config.json"), "w").write('{"model_type": "llama"}')
    (tmp_path / "shared-tokenizer.json").write_text("tok")
    os.symlink(str(tmp_path / "shared-tokenizer.json"), os.path.join(ck, "tokenizer.json"))
    os.chmod(ck, 0o755)


def _check_kept(ck: str, tmp_path) -> None:
    assert open(os.path.join(ck, "original", "consolidated.00.pth"), "rb").read() == b"meta weights"
    assert os.path.isfile(os.path.join(ck, "original", "deep", "params.json"))
    assert open(os.path.join(ck, "config.json")).read() == '{"model_type": "llama"}'
    assert os.readlink(os.path.join(ck, "tokenizer.json")) == str(tmp_path / "shared-tokenizer.json")
    assert stat.S_IMODE(os.stat(ck).st_mode) == 0o755


@pytest.fixture
def stream(tmp_path):
    """A stream of keyframes only (every version one), published from sharded directories: (store, [dirs])."""
    store = str(tmp_path / "store")
    pub = Publisher(store, str(tmp_path / "pub"), keyframe_every=1, another_model=True)  # (random weights)
    dirs = []
    for step in (1, 2):
        d = _sharded(str(tmp_path / f"src{step}"), _weights(step))
        pub.publish(d)
        dirs.append(d)
    return store, dirs


def test_a_keyframe_route_into_a_directory_keeps_everything_but_the_weights(tmp_path, stream):
    store, dirs = stream
    ck = str(tmp_path / "model")
    assert Subscriber(store, ck).sync(to_version=1).version == 1
    _user_entries(ck, tmp_path)
    for root, _, files in os.walk(os.path.join(store, "v", "000000000002")):  # as retention prunes a delta:
        for f in [f for f in files if f == "delta"]:  # the keyframe is the one route left
            os.unlink(os.path.join(root, f))
    rep = Subscriber(store, ck).sync(to_version=2)
    assert rep.route == "keyframe" and rep.verified, rep
    assert deltarefit.fingerprint(ck) == deltarefit.fingerprint(dirs[1])
    _check_kept(ck, tmp_path)


def test_sync_repair_into_a_single_file_directory_replaces_only_its_weights(tmp_path, stream):
    """A directory holding one ``model.safetensors`` (no index) that is no version: ``sync --repair``
    installs the sharded keyframe and its index, removes the old weight file, and keeps the rest."""
    store, dirs = stream
    ck = tmp_path / "repo"
    ck.mkdir()
    _write(str(ck / "model.safetensors"), _weights(99))
    _user_entries(str(ck), tmp_path)
    r = subprocess.run([sys.executable, "-m", "deltarefit", "sync", store, str(ck), "--repair"], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, DELTAREFIT_NO_PROGRESS="1"))
    assert r.returncode == 0, r.stderr
    assert deltarefit.fingerprint(str(ck)) == deltarefit.fingerprint(dirs[1])
    assert not (ck / "model.safetensors").exists() and (ck / INDEX).is_file()
    _check_kept(str(ck), tmp_path)
