"""One run at a time, and nothing left behind by a dead one: real processes, real locks, real SIGKILLs.

A holder is the real CLI in a child process, stopped at a seam while it holds its lock (the seam is
patched to say so on stdout and sleep); a second real CLI run must be refused with one line naming the
holder and exit code 11; after ``kill -9`` of the holder (the kernel drops its flock) a rerun finishes
bit for bit. Leftovers: a child kills itself (SIGKILL) at an exact point of a write, and the next real
run must remove what it left, and ``retain --dry-run`` must list exactly what ``retain`` then deletes.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

import deltarefit
from deltarefit.errors import LockedError
from deltarefit.io.locks import exclusive, lock_path_beside

TIMEOUT = 120  # seconds, for any one subprocess
ENV = dict(os.environ, DELTAREFIT_NO_PROGRESS="1")

# Run the real CLI with one seam replaced: MODE "hold" prints HOLDING and sleeps there (the lock is
# held); MODE "kill" SIGKILLs the process there, after calling the original with its first argument
# (so a temp file is half written).
_CHILD = r"""
import importlib, os, signal, sys, time
mode, target, args = sys.argv[1], sys.argv[2], sys.argv[3:]
mod_name, attr = target.split(":")
obj = importlib.import_module(mod_name)
*path, name = attr.split(".")
for p in path:
    obj = getattr(obj, p)
orig = getattr(obj, name)

def seam(*a, **k):
    if mode == "hold":
        print("HOLDING", flush=True)
        time.sleep(3600)
    if mode == "kill-after-half":  # LocalStore._copy(src, dest): half of src, then die
        src, dest = a[-2], a[-1]
        with open(src, "rb") as fi, open(dest, "wb") as fo:
            fo.write(fi.read(os.path.getsize(src) // 2))
            fo.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "kill-after-first":  # safetensors_write._stream(f, path, source): one tensor written, then die
        orig(*a, **k)
        a[0].flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return orig(*a, **k)

setattr(obj, name, seam if not isinstance(orig, staticmethod) else staticmethod(seam))
sys.argv = ["deltarefit", *args]
from deltarefit.cli import main
main()
"""


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "deltarefit", *args]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(*args), capture_output=True, text=True, timeout=TIMEOUT, env=ENV, check=False)


def sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class Holder:
    """The real CLI stopped at ``seam`` (module:attr) while it holds its lock."""

    def __init__(self, seam: str, *args: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", _CHILD, "hold", seam, *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, env=ENV)
        deadline = time.monotonic() + TIMEOUT
        line = b""
        while time.monotonic() < deadline and self.p.poll() is None:
            ready, _, _ = select.select([self.p.stdout], [], [], 1.0)
            if ready:
                line = self.p.stdout.readline()
                break
        if line.strip() != b"HOLDING":
            self.kill()
            raise AssertionError(f"holder never reached {seam}: exit {self.p.returncode}, "
                                 f"{self.p.stderr.read().decode(errors='replace')}")

    @property
    def pid(self) -> int:
        return self.p.pid

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
        self.p.wait(timeout=TIMEOUT)
        for s in (self.p.stdout, self.p.stderr):
            s.close()


def kill_at(mode: str, seam: str, *args: str) -> int:
    r = subprocess.run([sys.executable, "-c", _CHILD, mode, seam, *args], capture_output=True, text=True,
                       timeout=TIMEOUT, env=ENV, check=False)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr)
    return r.returncode


def assert_refused_by(r: subprocess.CompletedProcess, holder: Holder, what: str) -> None:
    assert r.returncode == LockedError.exit_code == 11, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # one line, no traceback
    assert lines[0].startswith("deltarefit: error: ") and what in lines[0], lines[0]
    assert f"pid {holder.pid} " in lines[0], lines[0]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """base -> target with an in-place patch, and base -> structural (a tensor removed, one added)."""
    d = tmp_path_factory.mktemp("locks")
    g = torch.Generator().manual_seed(3)
    base = {"a.weight": (torch.randn(1024, 1024, generator=g) * 0.02).to(torch.bfloat16),
            "b.weight": (torch.randn(1024, 1024, generator=g) * 0.02).to(torch.bfloat16)}
    target = {k: v.clone() for k, v in base.items()}
    target["a.weight"].view(torch.int16)[::5] += 1
    struct = {"a.weight": target["a.weight"].clone(), "c.weight": torch.ones(700, 1024, dtype=torch.bfloat16)}
    paths = {n: str(d / f"{n}.safetensors") for n in ("base", "target", "struct")}
    save_file(base, paths["base"])
    save_file(target, paths["target"])
    save_file(struct, paths["struct"])
    for n in ("target", "struct"):
        deltarefit.encode(paths["base"], paths[n], str(d / f"{n}.delta"))
        paths[f"{n}_delta"] = str(d / f"{n}.delta")
    return paths


# -------------------------------------------------------------------------------------------- item 7


def test_a_second_apply_on_a_checkpoint_is_refused_and_a_kill_releases_the_lock(pair, tmp_path):
    work = str(tmp_path / "work.safetensors")
    shutil.copyfile(pair["base"], work)
    h = Holder("deltarefit.apply:Applier.write", "apply", pair["target_delta"], work, "-q")
    try:
        before = sha(work)
        r = run("apply", pair["target_delta"], work, "-q")
        assert_refused_by(r, h, f"checkpoint {work}")
        assert sha(work) == before  # the refused run wrote nothing
        assert not os.path.exists(work + ".deltarefit-journal")  # nor journaled: the holder is still planning
    finally:
        h.kill()
    assert os.path.exists(lock_path_beside(work))  # left by the killed holder, unlocked
    r = run("apply", pair["target_delta"], work, "-q")  # kill -9 dropped the lock
    assert r.returncode == 0, r.stderr
    assert sha(work) == sha(pair["target"])
    assert not os.path.exists(lock_path_beside(work))  # taken over, and removed on release


def test_a_sync_is_refused_while_another_sync_holds_the_checkpoint(pair, tmp_path):
    store, pub = str(tmp_path / "store"), str(tmp_path / "pub")
    assert run("publish", store, pair["base"], "--state", pub).returncode == 0
    assert run("publish", store, pair["target"], "--state", pub).returncode == 0
    work = str(tmp_path / "rollout.safetensors")
    h = Holder("deltarefit.stream.subscriber:head", "sync", store, work)
    try:
        r = run("sync", store, work)
        assert_refused_by(r, h, f"checkpoint {work}")
        r = run("apply", pair["target_delta"], work, "-q")  # apply honours the same lock
        assert_refused_by(r, h, f"checkpoint {work}")
    finally:
        h.kill()
    r = run("sync", store, work, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["version"] == 2
    assert sha(work) == sha(pair["target"])


def test_a_second_publisher_on_one_state_directory_is_refused(pair, tmp_path):
    store = str(tmp_path / "store")  # default state: STORE/.publisher, shared by both
    assert run("publish", store, pair["base"]).returncode == 0
    h = Holder("deltarefit.stream.publisher:head", "publish", store, pair["target"])
    try:
        r = run("publish", store, pair["target"])
        assert_refused_by(r, h, f"publisher state {os.path.join(store, '.publisher')}")
    finally:
        h.kill()
    r = run("publish", store, pair["target"], "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["version"] == 2
    r = run("log", store, "--json")
    assert [v["version"] for v in json.loads(r.stdout)] == [1, 2]


def test_lock_files_are_not_checkpoint_files(pair, tmp_path):
    """A directory checkpoint's lock lies beside it (a keyframe renamed over the directory keeps it),
    and a file checkpoint's lock is no *.safetensors file of its directory."""
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copyfile(pair["base"], d / "model.safetensors")
    assert lock_path_beside(str(d)) == str(tmp_path / "ckpt.deltarefit-lock")
    with exclusive(lock_path_beside(str(d / "model.safetensors")), "x"), exclusive(lock_path_beside(str(d)), "y"):
        assert sorted(os.listdir(d)) == ["model.safetensors", "model.safetensors.deltarefit-lock"]
        assert deltarefit.fingerprint(str(d)) == deltarefit.fingerprint(pair["base"])
        rep = deltarefit.apply(pair["target_delta"], str(d))  # re-entrant for the thread holding it
        assert rep.target_fingerprint == deltarefit.fingerprint(pair["target"])
        assert os.path.exists(lock_path_beside(str(d)))  # the inner release did not let go
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # released: no lock file left


def test_the_lock_is_refused_to_another_thread_of_the_same_process(tmp_path):
    import threading

    path = str(tmp_path / "x.deltarefit-lock")
    got: list[BaseException] = []
    with exclusive(path, "thing"):
        t = threading.Thread(target=lambda: _try(path, got))
        t.start()
        t.join(TIMEOUT)
    assert len(got) == 1 and isinstance(got[0], LockedError) and "another thread" in str(got[0])
    with exclusive(path, "thing"):  # released
        pass


def _try(path: str, got: list[BaseException]) -> None:
    try:
        with exclusive(path, "thing"):
            pass
    except LockedError as e:
        got.append(e)


# -------------------------------------------------------------------------------------------- item 8


def test_a_killed_structural_apply_leaves_no_temp_after_the_next_run(pair, tmp_path):
    work = str(tmp_path / "work.safetensors")
    shutil.copyfile(pair["base"], work)
    kill_at("kill-after-first", "deltarefit.checkpoint.write:_stream", "apply", pair["struct_delta"], work, "-q")
    left = glob.glob(work + ".tmp-*")
    assert len(left) == 1 and os.path.getsize(left[0]) > 1 << 20, left  # a shard-sized temp of a dead pid
    live = f"{work}.tmp-{os.getpid()}"  # a temp of a live process (this one) must stay
    with open(live, "wb") as f:
        f.write(b"live")
    r = run("apply", pair["struct_delta"], work, "-q")
    assert r.returncode == 0, r.stderr
    assert sha(work) == sha(pair["struct"])
    assert glob.glob(work + ".tmp-*") == [live]


def test_a_killed_structural_apply_of_an_indexed_directory_leaves_no_temp(pair, tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copyfile(pair["base"], d / "model-00001.safetensors")
    with open(d / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": {"a.weight": "model-00001.safetensors",
                                                  "b.weight": "model-00001.safetensors"}}, f)
    kill_at("kill-after-first", "deltarefit.checkpoint.write:_stream", "apply", pair["struct_delta"], str(d), "-q")
    assert len(glob.glob(str(d / "*.tmp-*"))) == 1
    r = run("apply", pair["struct_delta"], str(d), "-q")
    assert r.returncode == 0, r.stderr
    assert deltarefit.fingerprint(str(d)) == deltarefit.fingerprint(pair["struct"])
    assert glob.glob(str(d / "*.tmp-*")) == []


def _store_temps(store: str) -> list[str]:
    return sorted(os.path.relpath(p, store) for p in glob.glob(os.path.join(store, "v", "**", "*.tmp-*"),
                                                                recursive=True))


def test_retain_dry_run_lists_the_upload_temp_a_killed_publish_left(pair, tmp_path):
    store = str(tmp_path / "store")
    # A publisher killed mid-upload of the stream's first keyframe.
    kill_at("kill-after-half", "deltarefit.storage.local:LocalStore._copy", "publish", store, pair["base"])
    temps = _store_temps(store)
    assert len(temps) == 1, temps
    r = run("retain", store, "--orphan-grace", "0", "--unsafe-short-grace", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    would = sorted(json.loads(r.stdout)["deleted"])
    assert temps[0] in would
    assert _store_temps(store) == temps  # a dry run deletes nothing
    r = run("retain", store, "--orphan-grace", "0", "--unsafe-short-grace", "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(json.loads(r.stdout)["deleted"]) == would  # exactly what the dry run said
    assert _store_temps(store) == []


@pytest.mark.parametrize("grace", ["0", "599", "-1", "nan"])
def test_a_grace_under_the_floor_is_refused_and_nothing_is_deleted(pair, tmp_path, grace):
    """``--orphan-grace`` under ``MIN_ORPHAN_GRACE`` would delete the upload of a publish still running
    (the temp a slow upload is filling): refused in one line before the store is touched, unless
    ``--unsafe-short-grace`` says no publish runs meanwhile. The library refuses the same way."""
    from deltarefit.errors import UsageError
    from deltarefit.shard.retention import retain_sharded
    from deltarefit.storage import LocalStore
    from deltarefit.stream.retention import retain

    store = str(tmp_path / "store")
    kill_at("kill-after-half", "deltarefit.storage.local:LocalStore._copy", "publish", store, pair["base"])
    temps = _store_temps(store)
    assert len(temps) == 1, temps
    r = run("retain", store, "--orphan-grace", grace)
    err = r.stderr.strip()
    assert r.returncode != 0 and "\n" not in err and "Traceback" not in err, r.stderr
    assert ("600 s floor" in err and "--unsafe-short-grace" in err) if grace in ("0", "599") else "seconds" in err
    assert _store_temps(store) == temps
    with pytest.raises(UsageError, match="floor"):
        retain(LocalStore(store), orphan_grace=float(grace) if grace in ("0", "599") else 0.0)
    with pytest.raises(UsageError, match="floor"):
        retain_sharded(LocalStore(store), orphan_grace=5)
    assert _store_temps(store) == temps
    assert retain(LocalStore(store), orphan_grace=600.0, dry_run=True).deleted == []  # the floor itself: fine


def test_the_next_publish_removes_what_its_killed_upload_left(pair, tmp_path):
    store = str(tmp_path / "store")
    assert run("publish", store, pair["base"]).returncode == 0
    kill_at("kill-after-half", "deltarefit.storage.local:LocalStore._copy", "publish", store, pair["target"],
            "--keyframe-every", "1")
    assert len(_store_temps(store)) == 1
    dead = {k for k in os.listdir(os.path.join(store, "v", f"{2:012d}"))}
    r = run("publish", store, pair["target"], "--keyframe-every", "1", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["version"] == 2
    assert _store_temps(store) == []
    live = {p["key"].split("/")[2] for _, p in rec["keyframe"]}
    assert not dead & live
    for attempt in dead:  # nothing of the killed attempt is left (its parts, its unfinished upload)
        assert [f for _, _, fs in os.walk(os.path.join(store, "v", f"{2:012d}", attempt)) for f in fs] == []
    w = str(tmp_path / "rollout.safetensors")
    assert run("sync", store, w).returncode == 0
    assert sha(w) == sha(pair["target"])


# An engine's worker (vLLM's worker extension, without vLLM: reloading into a model is stubbed), run
# in its own process as vLLM runs it, applying to the checkpoint directory while its driver holds the lock.
_WORKER = r"""
import json, sys
from deltarefit.engines.vllm import DeltaRefitWorkerExtension

class Worker(DeltaRefitWorkerExtension):
    rank = 0

    def _deltarefit_reload(self, ckpt, changed):
        return [], 0, []

print(json.dumps(Worker().apply_delta(*sys.argv[1:3])))
"""


class _EngineInOtherProcesses:
    """Just enough of ``vllm.LLM`` for ``refit_engine``: each collective_rpc runs one worker process."""

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert method == "apply_delta", method
        r = subprocess.run([sys.executable, "-c", _WORKER, *args], capture_output=True, text=True,
                           timeout=TIMEOUT, env=ENV, check=False)
        assert r.returncode == 0, r.stderr
        return [json.loads(r.stdout)]

    def reset_prefix_cache(self) -> bool:
        return True


def test_an_engine_sync_holds_the_lock_for_its_workers_in_other_processes(pair, tmp_path):
    from deltarefit.engines.vllm import sync_engine
    from deltarefit.stream import Subscriber

    store, pub = str(tmp_path / "store"), str(tmp_path / "pub")
    assert run("publish", store, pair["base"], "--state", pub).returncode == 0
    engine_dir = str(tmp_path / "engine")
    Subscriber(store, engine_dir).sync()  # the directory the engine loaded, at version 1
    assert run("publish", store, pair["target"], "--state", pub).returncode == 0
    rep = sync_engine(_EngineInOtherProcesses(), store, engine_dir)
    assert (rep.version, rep.route) == (2, "chain")
    assert deltarefit.fingerprint(engine_dir) == deltarefit.fingerprint(pair["target"])
    assert not os.path.exists(lock_path_beside(engine_dir))


# ------------------------------------------------------------------------- scratch of dead owners


_OWNER = """
import sys, time
from deltarefit.io.locks import owned_temp
path, fd = owned_temp(sys.argv[1], sys.argv[2], directory=sys.argv[3] == "dir")
if sys.argv[3] == "dir":
    open(path + "/staged.delta", "wb").write(b"x" * 4096)
print(path, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_scratch_of_an_owner_killed_by_sigkill_is_swept_and_a_live_owners_is_kept(tmp_path, kind):
    """An engine's scratch directory (or a group's shared-memory file) is locked by its owner for its
    life: a sweep leaves it while the owner runs (another process here), removes it once the owner is
    killed with SIGKILL, and leaves alone what carries no owner's lock."""
    from deltarefit.io.locks import owned_temp, sweep_abandoned

    parent = str(tmp_path)
    p = subprocess.Popen([sys.executable, "-c", _OWNER, "scratch-", parent, kind], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([p.stdout], [], [], 60)
        assert ready, "the owner did not start"
        theirs = p.stdout.readline().strip()
        assert os.path.basename(theirs).startswith("scratch-") and os.path.exists(theirs)
        mine, fd = owned_temp("scratch-", parent, directory=kind == "dir")
        # A directory without the owner's lock file is not one of ours; a file of the prefix that no one
        # locks is one a dead owner left (before it was locked, or by a release that did not lock).
        foreign = os.path.join(parent, "scratch-not-ours")
        os.makedirs(foreign) if kind == "dir" else open(foreign, "wb").close()
        assert sweep_abandoned(parent, "scratch-") == ([] if kind == "dir" else [foreign])
        assert os.path.exists(theirs) and os.path.exists(mine)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        assert sweep_abandoned(parent, "scratch-") == [theirs]
        assert not os.path.lexists(theirs) and os.path.exists(mine)
        os.close(fd)  # its owner lets go (an engine's shutdown removes it first)
        assert sweep_abandoned(parent, "scratch-") == [mine]
        assert sorted(os.listdir(parent)) == (["scratch-not-ours"] if kind == "dir" else [])
    finally:
        p.kill()
        p.wait()
