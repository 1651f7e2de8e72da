"""What deltarefit keeps in a directory every local user can write (the temp directory, ``/dev/shm``) is
private by construction (``deltarefit.io.private``): a real second user (``nobody``, switched to with
``setuid`` in a child process) makes the name first, open to all or as a symbolic link, and the TRL
launcher and the verl rollout refuse it in one line instead of writing through it; a dry run writes nothing.
"""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
import tempfile

import pytest

from deltarefit.errors import FileSystemError
from deltarefit.io import private

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _other_user() -> int:
    try:
        uid = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user 'nobody' to act as another local user")
    if os.geteuid() != 0:
        pytest.skip("acting as another local user needs root (setuid in a child process); run as root (CI does)")
    return uid


def as_other(uid: int, script: str) -> None:
    """Run ``script`` (sh) as the other user, in a real child process that switched uid and gid."""
    subprocess.run(["/bin/sh", "-ec", script], user=uid, group=uid, check=True, capture_output=True, timeout=30)


@pytest.fixture
def shared():
    """A directory like /tmp: sticky, writable by everyone (a tmp_path is root's 0700: nobody could enter)."""
    d = tempfile.mkdtemp(prefix="deltarefit-test-shared-")
    os.chmod(d, 0o1777)
    yield d
    subprocess.run(["rm", "-rf", d], check=False)


def _launch(shared_dir: str, model: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": shared_dir, "PYTHONPATH": SRC}
    return subprocess.run([sys.executable, "-m", "deltarefit.integrations.trl.serve", model, "--cpu-workarounds", "on",
                           *args], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("planted", ["open directory", "symbolic link"])
def test_the_trl_launcher_refuses_a_site_directory_another_user_made_first(tmp_path, shared, planted):
    uid = _other_user()
    model = tmp_path / "model"
    model.mkdir()
    name = os.path.join(shared, f"deltarefit-serve-cpu-{os.geteuid()}")
    theirs = os.path.join(shared, "theirs")
    if planted == "open directory":
        as_other(uid, f"mkdir -m 0777 {name}")
    else:
        as_other(uid, f"mkdir -m 0777 {theirs}; ln -s {theirs} {name}")
    r = _launch(shared, str(model))
    assert r.returncode == 12, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and name in r.stderr and "remove it" in r.stderr, r.stderr
    for d in (name, theirs):
        if os.path.isdir(d):
            assert os.listdir(d) == [], os.listdir(d)  # nothing written where the other user can swap it


def test_the_trl_launchers_dry_run_writes_nothing(tmp_path, shared):
    model = tmp_path / "model"
    model.mkdir()
    r = _launch(shared, str(model), "--print")
    assert r.returncode == 0, r.stderr
    assert f"deltarefit-serve-cpu-{os.geteuid()}" in r.stdout
    assert os.listdir(shared) == []


def test_the_trl_launcher_keeps_its_site_in_a_0700_directory_of_its_own(tmp_path, shared, monkeypatch):
    from deltarefit.integrations.trl import serve

    monkeypatch.setattr(tempfile, "tempdir", shared)
    for _ in range(2):  # made, then reused (checked again)
        d = serve.site_dir(no_prepack=True)
        st = os.lstat(d)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        assert os.path.dirname(d) == shared and os.listdir(d) == ["sitecustomize.py"]
        assert "_supports_onednn = False" in open(os.path.join(d, "sitecustomize.py")).read()
    os.chmod(d, 0o755)  # left open (by hand, or an old version): refused, not trusted
    with pytest.raises(FileSystemError, match="open to other users"):
        serve.site_dir(no_prepack=True)


def test_the_verl_rollouts_default_copy_directory_is_private(tmp_path, shared, monkeypatch):
    uid = _other_user()
    from deltarefit.integrations import verl as dv

    monkeypatch.setattr(private, "shared_root", lambda prefer_memory=False: shared)
    os.makedirs(tmp_path / "stream")
    name = os.path.join(shared, f"deltarefit-verl-{os.geteuid()}")
    eng = dv.DeltaRefitEngine(stream=str(tmp_path / "stream"), subscriber_id="r0")
    assert os.path.dirname(eng.checkpoint) == name and not os.path.exists(name)  # named, not made
    as_other(uid, f"mkdir -m 0777 {name}")
    with pytest.raises(FileSystemError, match="owned by another user"):
        eng.subscriber  # noqa: B018 (the property makes the directory)
    assert os.listdir(name) == []
    subprocess.run(["rm", "-rf", name], check=True)
    sub = dv.DeltaRefitEngine(stream=str(tmp_path / "stream"), subscriber_id="r0").subscriber
    assert sub is not None and stat.S_IMODE(os.lstat(name).st_mode) == 0o700


def test_private_files_never_follow_a_link_planted_at_their_names(tmp_path):
    d = private.user_dir(str(tmp_path), "p")
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, os.path.join(d, "f"))
    os.symlink(victim, os.path.join(d, f"f.tmp-{os.getpid()}"))
    private.write_private(os.path.join(d, "f"), b"new")
    assert victim.read_text() == "keep" and open(os.path.join(d, "f")).read() == "new"
    assert not os.path.islink(os.path.join(d, "f"))


@pytest.mark.parametrize("planted", ["symbolic link", "their directory"])
def test_a_publisher_state_directory_planted_in_a_shared_store_is_refused(tmp_path, shared, planted):
    """A store other users can write (a shared stream directory): another user makes ``STORE/.publisher``
    first, as a link to a directory of theirs or as their own directory; ``deltarefit publish`` refuses it
    in one line (exit 4) and writes nothing there (its baseline would be theirs to swap)."""
    uid = _other_user()
    import numpy as np

    from deltarefit.checkpoint import TensorSource, write_safetensors

    store = os.path.join(shared, "store")
    os.mkdir(store)
    os.chmod(store, 0o1777)
    theirs = os.path.join(shared, "theirs")
    state = os.path.join(store, ".publisher")
    if planted == "symbolic link":
        as_other(uid, f"mkdir -m 0777 {theirs}; ln -s {theirs} {state}")
    else:
        as_other(uid, f"mkdir -m 0777 {state}")
    a = np.arange(4096, dtype=np.float32)
    ck = str(tmp_path / "ck.safetensors")
    write_safetensors(ck, [TensorSource("w", "F32", a.shape, a.nbytes, lambda: [a.tobytes()])])
    r = subprocess.run([sys.executable, "-m", "deltarefit", "publish", store, ck], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": SRC, "DELTAREFIT_NO_PROGRESS": "1"})
    assert r.returncode == 4, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "publisher state directory" in r.stderr, r.stderr
    for d in (theirs, state):
        if os.path.isdir(d):
            assert os.listdir(d) == [], os.listdir(d)
