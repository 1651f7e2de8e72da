"""Names a sync keeps beside a checkpoint, planted by another local user: never followed.

``CKPT.deltarefit-staging`` (the staged parts), ``CKPT.deltarefit-keyframe.tmp`` and
``CKPT.deltarefit-old`` (a keyframe install's new and replaced copies) are refused in one line naming
the path when a symbolic link (or something that is not what the name must hold) lies there, as the
lock file is refused: nonzero exit, nothing written through the link, the link left where it is.
``CKPT.deltarefit-history`` (the history book) is local state the stream rebuilds: what is planted
there is removed, never followed. Real ``python -m deltarefit`` children, real stores, real links.
"""

from __future__ import annotations

import os
import shutil

import pytest
from test_fs_identity import cli, history_stream, one_line, versions

import deltarefit
from deltarefit.stream import Publisher, Subscriber


def _victim(tmp_path) -> tuple[str, list[str]]:
    """A directory another user's link points at, holding one file; (its path, its listing)."""
    victim = str(tmp_path / "victim")
    os.makedirs(victim)
    with open(os.path.join(victim, "precious"), "wb") as f:
        f.write(b"precious")
    return victim, ["precious"]


@pytest.fixture
def stream(tmp_path):
    """(store, [v0..v3]): versions 1..3 from v0..v2, version 1 the only keyframe."""
    os.makedirs(tmp_path / "src")
    vs = versions(str(tmp_path / "src"), 4)
    store = str(tmp_path / "store")
    pub = Publisher(store, str(tmp_path / "pub"), keyframe_every=50, keyframe_ratio=1000.0)
    for v in vs[:3]:
        pub.publish(v)
    return store, vs


@pytest.mark.parametrize("route", ["chain", "keyframe"])
def test_a_symlink_planted_at_the_staging_directory_is_refused_not_written_through(tmp_path, stream, route):
    """Regression (issue 46 item 4): ``sync`` staged its deltas into the directory a link planted at
    ``CKPT.deltarefit-staging`` points to, left them there, and said "verified"."""
    store, vs = stream
    ck = str(tmp_path / "ck.safetensors")
    if route == "chain":
        Subscriber(store, ck).sync(to_version=2)
    victim, listing = _victim(tmp_path)
    at = ck + ".deltarefit-staging"
    os.symlink(victim, at)
    before = open(ck, "rb").read() if os.path.exists(ck) else None
    r = cli("sync", store, ck)
    one_line(r, at, "symbolic link")
    assert r.returncode == 4, r.stderr
    assert sorted(os.listdir(victim)) == listing and os.path.islink(at)
    assert (open(ck, "rb").read() if os.path.exists(ck) else None) == before  # nothing written
    os.unlink(at)
    r = cli("sync", store, ck)
    assert r.returncode == 0 and "verified" in r.stdout, r.stderr
    assert deltarefit.fingerprint(ck) == deltarefit.fingerprint(vs[2])


def test_a_file_or_a_fifo_planted_at_the_staging_directory_is_refused(tmp_path, stream):
    """Regression (issue 46 item 4): what is not a directory at the staging name is refused in one line."""
    store, _ = stream
    ck = str(tmp_path / "ck.safetensors")
    at = ck + ".deltarefit-staging"
    os.mkfifo(at)
    one_line(cli("sync", store, ck), at, "not a directory")
    assert not os.path.exists(ck)


@pytest.mark.parametrize("name", [".deltarefit-keyframe.tmp", ".deltarefit-old"])
@pytest.mark.parametrize("layout", ["file", "directory"])
def test_a_symlink_planted_at_a_keyframe_temporary_is_refused_not_written_through(tmp_path, stream, name, layout):
    """Regression (issue 46 item 4): the keyframe install's temporaries beside the checkpoint, planted
    as links (to a directory another user chose), are refused before anything is staged."""
    store, vs = stream
    ck = str(tmp_path / ("ck.safetensors" if layout == "file" else "ckdir"))
    victim, listing = _victim(tmp_path)
    at = ck + name
    os.symlink(victim, at)
    r = cli("sync", store, ck)
    one_line(r, at, "symbolic link")
    assert r.returncode == 4, r.stderr
    assert sorted(os.listdir(victim)) == listing and os.path.islink(at)
    assert not os.path.exists(ck) and not os.path.exists(ck + ".deltarefit-staging")
    os.unlink(at)
    r = cli("sync", store, ck)
    assert r.returncode == 0 and "verified" in r.stdout, r.stderr
    assert deltarefit.fingerprint(ck) == deltarefit.fingerprint(vs[2])


def test_a_symlink_planted_at_the_history_book_is_removed_not_followed(tmp_path):
    """The history book is local state: a link planted at ``CKPT.deltarefit-history`` is unlinked (the
    name, never what it points to) and the sync of deltas coded with history ends verified."""
    vs, store, _ = history_stream(tmp_path)
    ck = str(tmp_path / "ck.safetensors")
    Subscriber(store, ck).sync(to_version=2)
    at = ck + ".deltarefit-history"
    shutil.rmtree(at)
    victim, listing = _victim(tmp_path)
    os.symlink(victim, at)
    r = cli("sync", store, ck)
    assert r.returncode == 0 and "verified" in r.stdout, r.stderr
    assert sorted(os.listdir(victim)) == listing
    assert not os.path.islink(at)
    assert deltarefit.fingerprint(ck) == deltarefit.fingerprint(vs[2])
