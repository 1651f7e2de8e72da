"""A checkpoint overwritten in place around a sync's plan (another process ``cp``s an edited copy over it; the
edited byte lies in a tensor the version does not change): before the apply opens it, the plan's hash of every
tensor it reads refuses it (exit 5); after the plan and before the first write, the identity taken at the open
does (exit 6); nothing written either way, the way out named; files merely touched (a chmod) still sync."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import deltarefit
from deltarefit.checkpoint import TensorSource, write_safetensors
from deltarefit.errors import BaseMismatchError, VerificationError
from deltarefit.stream import Publisher, Subscriber
from deltarefit.stream import subscriber as subscriber_mod


def _write(path: str, arrays: dict[str, np.ndarray]) -> str:
    write_safetensors(path, [TensorSource(n, "F32", a.shape, a.nbytes, lambda a=a: [a.tobytes()])
                             for n, a in arrays.items()])
    return path


@pytest.fixture
def stream(tmp_path):
    """A store with versions 1 (keyframe) and 2 (a delta changing only ``w``), and version 1's file."""
    rng = np.random.default_rng(0)
    a = {"w": rng.standard_normal(4096).astype(np.float32), "c": rng.standard_normal(1024).astype(np.float32)}
    v1 = _write(str(tmp_path / "v1.safetensors"), a)
    a["w"] = a["w"].copy()
    a["w"][::97] += np.float32(0.5)
    v2 = _write(str(tmp_path / "v2.safetensors"), a)
    store = str(tmp_path / "store")
    pub = Publisher(store, str(tmp_path / "pub"), keyframe_every=50, keyframe_ratio=1000.0)
    pub.publish(v1)
    pub.publish(v2)
    return store, v1, v2


def _edited_copy(src: str, dest: str) -> str:
    """``src`` with one byte of tensor ``c`` (which version 2 does not change) flipped."""
    data = bytearray(open(src, "rb").read())
    data[8 + int.from_bytes(data[:8], "little") + 5] ^= 0x10  # ``c`` is the file's first tensor (names sorted)
    open(dest, "wb").write(bytes(data))
    return dest


@pytest.mark.parametrize("when", ["before the apply opens it", "after the plan, before the first write"])
def test_a_checkpoint_copied_over_around_the_plan_is_refused_with_nothing_written(tmp_path, stream, monkeypatch,
                                                                                  when):
    store, _, v2 = stream
    ck = str(tmp_path / "r.safetensors")
    assert Subscriber(store, ck).sync(to_version=1).version == 1
    edited = _edited_copy(ck, str(tmp_path / "edited.safetensors"))
    real = subscriber_mod.apply_delta

    def cp_around_the_plan(*a, before_write=None, **kw):
        def hook():
            if before_write is not None:
                before_write()
            subprocess.run(["cp", edited, ck], check=True)  # a real cp onto the same inode

        if when.startswith("before"):
            hook()
            return real(*a, before_write=before_write, **kw)
        return real(*a, before_write=hook, **kw)

    monkeypatch.setattr(subscriber_mod, "apply_delta", cp_around_the_plan)
    with pytest.raises((BaseMismatchError, VerificationError), match=r"--repair|run again"):
        Subscriber(store, ck).sync(to_version=2)
    monkeypatch.setattr(subscriber_mod, "apply_delta", real)
    assert open(ck, "rb").read() == open(edited, "rb").read()  # nothing written
    rep = Subscriber(store, ck).sync(to_version=2, repair=True)  # the way out named
    assert rep.verified and deltarefit.fingerprint(ck) == deltarefit.fingerprint(v2)


def test_the_cli_refuses_it_with_the_wrong_base_exit_code(tmp_path, stream):
    """The same through ``deltarefit sync``, the cp made by another process before the sync opens the file
    (the version record still names version 1's identity)."""
    store, _, _ = stream
    ck = str(tmp_path / "r.safetensors")
    env = dict(os.environ, DELTAREFIT_NO_PROGRESS="1")
    cli = [sys.executable, "-m", "deltarefit", "sync", store, ck]
    assert subprocess.run([*cli, "--to", "1"], env=env, capture_output=True, timeout=60).returncode == 0
    subprocess.run(["cp", _edited_copy(ck, str(tmp_path / "e.safetensors")), ck], check=True)
    r = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode in (5, 6), (r.returncode, r.stderr)  # never "verified" with the wrong bytes
    assert r.stderr.count("\n") == 1 and "--repair" in r.stderr, r.stderr


def test_a_checkpoint_only_touched_since_its_verification_still_syncs(tmp_path, stream):
    store, _, v2 = stream
    ck = str(tmp_path / "r.safetensors")
    assert Subscriber(store, ck).sync(to_version=1).version == 1
    os.chmod(ck, 0o640)  # its change time moves; its bytes are version 1's
    rep = Subscriber(store, ck).sync(to_version=2)
    assert rep.verified and rep.version == 2 and deltarefit.fingerprint(ck) == deltarefit.fingerprint(v2)
