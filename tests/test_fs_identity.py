"""File identity on the checkpoint/apply/sync side (issue 34): "verified" means the bytes the path names
now; locks by device and inode; no output that is an input; files opened by another local user's
planted symlink or FIFO refused; filesystem faults as one line.

Small synthetic checkpoints (a few float32 tensors, a few elements changed per version), real stores
on disk, real renames, symlinks, hard links, FIFOs and second processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import deltarefit
from deltarefit.checkpoint import TensorSource, write_safetensors
from deltarefit.errors import LockedError, VerificationError
from deltarefit.stream import Publisher, Subscriber
from deltarefit.stream import subscriber as subscriber_mod
from deltarefit.stream.subscriber import state_path

ENV = dict(os.environ, DELTAREFIT_NO_PROGRESS="1")
TIMEOUT = 60


def cli(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltarefit", *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


def one_line(r: subprocess.CompletedProcess, *words: str) -> str:
    """``r`` failed with one line on stderr, no traceback, naming each of ``words``."""
    err = r.stderr.strip()
    assert r.returncode != 0, (r.stdout, r.stderr)
    assert err.count("\n") == 0 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in err, (w, err)
    return err


def write_ck(path: str, arrays: dict[str, np.ndarray]) -> str:
    write_safetensors(path, [TensorSource(n, "F32", a.shape, a.nbytes, lambda a=a: [a.tobytes()])
                             for n, a in arrays.items()])
    return path


def versions(d: str, n: int, *, size: int = 1 << 16) -> list[str]:
    """``n`` checkpoint files ``v0..v{n-1}`` in ``d``: two float32 tensors, a few elements changed each step."""
    rng = np.random.default_rng(0)
    a = {"w": rng.standard_normal(size).astype(np.float32), "b": rng.standard_normal(size // 4).astype(np.float32)}
    out = []
    for i in range(n):
        out.append(write_ck(os.path.join(d, f"v{i}.safetensors"), a))
        a = {k: v.copy() for k, v in a.items()}
        for v in a.values():
            idx = rng.integers(0, v.size, 16)
            v[idx] += np.float32(0.5)
    return out


def history_stream(tmp_path) -> tuple[list[str], str, Publisher]:
    """Four checkpoint versions in ``tmp_path/src`` and a stream coded with history (``tmp_path/store``)
    holding the first three: (the versions, the store, its publisher)."""
    os.makedirs(tmp_path / "src", exist_ok=True)
    vs = versions(str(tmp_path / "src"), 4)
    store = str(tmp_path / "store")
    pub = Publisher(store, str(tmp_path / "pub"), keyframe_every=50, keyframe_ratio=1000.0, history=True)
    for v in vs[:3]:
        pub.publish(v)
    return vs, store, pub


@pytest.fixture
def stream(tmp_path):
    """(store dir, [checkpoint files]): versions 1..3 published from v0..v2 (v1 a keyframe)."""
    os.makedirs(tmp_path / "src", exist_ok=True)
    vs = versions(str(tmp_path / "src"), 4)
    store = str(tmp_path / "store")
    pub = Publisher(store, str(tmp_path / "pub"), keyframe_every=50, keyframe_ratio=1000.0)
    for v in vs[:3]:
        pub.publish(v)
    return store, vs, pub


# --------------------------------------------------------------- item 1: verified is the path's inode


def test_checkpoint_renamed_over_during_sync_is_refused_not_verified(tmp_path, stream, monkeypatch):
    """A file renamed over the checkpoint after the apply opened it: the apply verifies the inode it
    opened, which the path no longer names; the sync refuses (nothing recorded) and the next sync
    hashes instead of calling the old identity "unchanged"."""
    store, vs, _ = stream
    ck = str(tmp_path / "r.safetensors")
    sub = Subscriber(store, ck)
    assert sub.sync(to_version=2).version == 2
    real = subscriber_mod.apply_delta
    impostor = str(tmp_path / "impostor.safetensors")

    def apply_then_replace(*a, before_write=None, **kw):
        def hook():
            if before_write is not None:
                before_write()
            with open(vs[0], "rb") as f, open(impostor, "wb") as g:
                g.write(f.read())
            os.rename(impostor, ck)  # real rename, after the plan, before the first write

        return real(*a, before_write=hook, **kw)

    monkeypatch.setattr(subscriber_mod, "apply_delta", apply_then_replace)
    with pytest.raises(VerificationError, match="no longer"):
        Subscriber(store, ck).sync(to_version=3)
    monkeypatch.setattr(subscriber_mod, "apply_delta", real)
    assert json.loads(open(state_path(ck)).read())["version"] == 2  # nothing recorded
    assert deltarefit.fingerprint(ck) == deltarefit.fingerprint(vs[0])
    # The next sync hashes: it never says "unchanged since verified" for a file it did not verify.
    rep = Subscriber(store, ck).sync(repair=True)
    assert rep.verified and rep.version == 3 and deltarefit.fingerprint(ck) == deltarefit.fingerprint(vs[2])


def test_checkpoint_copied_over_in_place_during_sync_is_refused_not_verified(tmp_path, stream, monkeypatch):
    """``cp`` over the checkpoint (same inode, truncated and rewritten) after the plan read it: the apply
    refuses before its first write (the file's size or times changed since it was opened), records
    nothing, and the next sync hashes."""
    store, vs, _ = stream
    ck = str(tmp_path / "r.safetensors")
    assert Subscriber(store, ck).sync(to_version=2).version == 2
    ino = os.stat(ck).st_ino
    real = subscriber_mod.apply_delta

    def apply_then_copy_over(*a, before_write=None, **kw):
        def hook():
            if before_write is not None:
                before_write()
            subprocess.run(["cp", vs[0], ck], check=True)  # a real cp, into the same inode

        return real(*a, before_write=hook, **kw)

    monkeypatch.setattr(subscriber_mod, "apply_delta", apply_then_copy_over)
    with pytest.raises(VerificationError, match="modified by another process"):
        Subscriber(store, ck).sync(to_version=3)
    monkeypatch.setattr(subscriber_mod, "apply_delta", real)
    assert os.stat(ck).st_ino == ino and open(ck, "rb").read() == open(vs[0], "rb").read()  # nothing written
    assert json.loads(open(state_path(ck)).read())["version"] == 2
    with pytest.raises(VerificationError, match="changed since it was synced"):  # hashed, never "unchanged"
        Subscriber(store, ck).sync(to_version=2)
    rep = Subscriber(store, ck).sync(repair=True)
    assert rep.verified and rep.version == 3 and deltarefit.fingerprint(ck) == deltarefit.fingerprint(vs[2])


def _copy_over(src: str, dest: str) -> int:
    """``cp SRC DEST``: a real cp, truncating and rewriting DEST's inode; returns that inode."""
    ino = os.stat(dest).st_ino
    subprocess.run(["cp", src, dest], check=True)
    assert os.stat(dest).st_ino == ino
    return ino


def _copy_over_before_the_flush(monkeypatch, src: str, dest: str) -> None:
    """Once: ``cp SRC DEST`` when the apply flushes its writes (its last write done, its verification
    and its final identity still to come): the fsync's window, where another writer can land."""
    from deltarefit.checkpoint.read import Checkpoint

    real_flush, done = Checkpoint.flush, []

    def copy_over_then_flush(self):
        if self.writable and not done:
            done.append(_copy_over(src, dest))
        return real_flush(self)

    monkeypatch.setattr(Checkpoint, "flush", copy_over_then_flush)


@pytest.mark.parametrize("point", ["after the write", "after the apply"])
def test_checkpoint_copied_over_in_place_after_the_write_is_refused_not_verified(tmp_path, stream, monkeypatch,
                                                                                   point):
    """Regression (issue 46 item 9): ``cp`` onto the checkpoint's inode once the apply's writes were done
    (at its flush, before its final identity), or once the apply returned (before the sync recorded the
    version), was reported "verified" with other bytes in the file. The identity and change time are
    checked again at the end: refused, nothing recorded; the next sync hashes and refuses, and a repair
    ends bit-exact."""
    store, vs, _ = stream
    ck = str(tmp_path / "r.safetensors")
    assert Subscriber(store, ck).sync(to_version=2).version == 2
    if point == "after the write":
        _copy_over_before_the_flush(monkeypatch, vs[0], ck)
    else:
        real_apply = subscriber_mod.apply_delta

        def apply_then_copy_over(*a, **kw):
            rep = real_apply(*a, **kw)
            _copy_over(vs[0], ck)
            return rep

        monkeypatch.setattr(subscriber_mod, "apply_delta", apply_then_copy_over)
    with pytest.raises(VerificationError, match="modified by another process"):
        Subscriber(store, ck).sync(to_version=3)
    monkeypatch.undo()
    assert open(ck, "rb").read() == open(vs[0], "rb").read()
    assert json.loads(open(state_path(ck)).read())["version"] == 2  # nothing recorded
    with pytest.raises(VerificationError, match="changed since it was synced"):  # hashed, never "unchanged"
        Subscriber(store, ck).sync(to_version=2)
    rep = Subscriber(store, ck).sync(repair=True)
    assert rep.verified and rep.version == 3 and deltarefit.fingerprint(ck) == deltarefit.fingerprint(vs[2])


def test_apply_refuses_a_checkpoint_copied_over_in_place_after_its_write(tmp_path, pair, monkeypatch):
    """Regression (issue 46 item 9): ``apply`` alone, ``cp`` onto the checkpoint's inode after its writes:
    refused as modified by another process (never "verified"); a rerun on the bytes left then refuses
    them as another base, writing nothing, and a rerun on the base ends bit-exact."""
    from deltarefit.apply import apply
    from deltarefit.errors import BaseMismatchError

    base, delta, vs = pair
    keep = open(base, "rb").read()
    other = str(tmp_path / "other.safetensors")  # the base with its last bytes (tensor data) changed
    with open(other, "wb") as f:
        f.write(keep[:-64] + bytes(64))
    _copy_over_before_the_flush(monkeypatch, other, base)
    with pytest.raises(VerificationError, match="modified by another process"):
        apply(delta, base)
    monkeypatch.undo()
    with pytest.raises(BaseMismatchError):
        apply(delta, base)
    assert open(base, "rb").read() == open(other, "rb").read()
    with open(base, "wb") as f:
        f.write(keep)
    apply(delta, base)
    assert open(base, "rb").read() == open(vs[1], "rb").read()


# ------------------------------------------------------------------- item 2: locks by device and inode

_HOLD = r"""
import sys, time
from deltarefit.apply import checkpoint_lock
with checkpoint_lock(sys.argv[1]):
    print("HOLDING", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def holder():
    """``hold(path)``: a second process holding ``path``'s checkpoint lock; returns its Popen."""
    procs: list[subprocess.Popen] = []

    def hold(path: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", _HOLD, path], stdout=subprocess.PIPE, text=True, env=ENV)
        procs.append(p)
        assert p.stdout.readline().strip() == "HOLDING"
        return p

    yield hold
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture
def pair(tmp_path):
    """(base checkpoint, delta to its next version) in ``tmp_path``."""
    os.makedirs(tmp_path / "src2")
    vs = versions(str(tmp_path / "src2"), 2)
    base = str(tmp_path / "ck.safetensors")
    with open(vs[0], "rb") as f, open(base, "wb") as g:
        g.write(f.read())
    delta = str(tmp_path / "d.delta")
    deltarefit.encode(base, vs[1], delta)
    return base, delta, vs


@pytest.mark.parametrize("alias", ["symlink", "hardlink", "symlinked-dir"])
def test_apply_through_another_name_of_a_locked_checkpoint_is_refused_naming_the_pid(tmp_path, pair, holder,
                                                                                     alias):
    base, delta, vs = pair
    if alias == "symlink":
        other = str(tmp_path / "alias.safetensors")
        os.symlink(base, other)
    elif alias == "hardlink":
        os.makedirs(tmp_path / "elsewhere")
        other = str(tmp_path / "elsewhere" / "ck.safetensors")
        os.link(base, other)
    else:
        os.symlink(str(tmp_path), str(tmp_path.parent / f"{tmp_path.name}-link"))
        other = str(tmp_path.parent / f"{tmp_path.name}-link" / "ck.safetensors")
    before = open(base, "rb").read()
    p = holder(base)
    r = cli("apply", delta, other)
    assert r.returncode == 11
    one_line(r, f"pid {p.pid}")
    assert open(base, "rb").read() == before  # nothing written
    # and the other way round: holding the alias refuses the real name
    p.kill()
    p.wait()
    q = holder(other)
    r = cli("apply", delta, base)
    assert r.returncode == 11
    one_line(r, f"pid {q.pid}")
    q.kill()
    q.wait()
    cli_ok = cli("apply", delta, other)
    assert cli_ok.returncode == 0, cli_ok.stderr
    assert deltarefit.fingerprint(base) == deltarefit.fingerprint(vs[1])


def test_the_same_thread_reenters_and_another_thread_is_refused(pair):
    import threading

    from deltarefit.apply import checkpoint_lock

    base, _, _ = pair
    alias = base + ".alias"
    os.link(base, alias)
    errs: list[BaseException] = []
    with checkpoint_lock(base), checkpoint_lock(alias):  # one thread, two names: re-entered
        t = threading.Thread(target=lambda: _try(lambda: checkpoint_lock(base).__enter__(), errs))
        t.start()
        t.join()
    assert len(errs) == 1 and isinstance(errs[0], LockedError)
    with checkpoint_lock(alias):  # released
        pass


def _try(fn, errs):
    try:
        fn()
    except BaseException as e:
        errs.append(e)


# --------------------------------------------------------------------- item 5: no output is an input


@pytest.mark.parametrize("how", ["same", "symlink", "hardlink", "dot-path"])
def test_encode_refuses_an_output_that_is_its_base(tmp_path, pair, how):
    base, _, vs = pair
    if how == "same":
        out = base
    elif how == "symlink":
        out = str(tmp_path / "out.delta")
        os.symlink(base, out)
    elif how == "hardlink":
        out = str(tmp_path / "out.delta")
        os.link(base, out)
    else:
        out = os.path.join(str(tmp_path), ".", "ck.safetensors")
    before = open(base, "rb").read()
    names = sorted(os.listdir(tmp_path))
    r = cli("encode", base, vs[1], "-o", out)
    assert r.returncode == 2
    one_line(r, out, "input")
    assert open(base, "rb").read() == before and sorted(os.listdir(tmp_path)) == names  # nothing written
    r = cli("encode", vs[1], base, "-o", out)  # the target too
    assert r.returncode == 2 and open(base, "rb").read() == before


def test_commands_that_write_refuse_their_inputs_as_outputs(tmp_path, pair, stream):
    base, delta, _ = pair
    d_before = open(delta, "rb").read()
    r = cli("compose", delta, "-o", delta, "--base", base)
    assert r.returncode == 2 and open(delta, "rb").read() == d_before
    one_line(r, "input")
    os.link(delta, str(tmp_path / "d2.delta"))
    r = cli("apply", str(tmp_path / "d2.delta"), delta)
    assert r.returncode == 2 and open(delta, "rb").read() == d_before
    one_line(r, "input")
    store, _, _ = stream
    listing = sorted(os.listdir(store))
    r = cli("sync", store, store)  # a checkpoint that is the store itself
    one_line(r, "input", store)
    assert sorted(os.listdir(store)) == listing
    r = cli("sync", store, os.path.join(store, "inside.safetensors"))
    one_line(r, "input")
    assert sorted(os.listdir(store)) == listing
    r = cli("publish", store, base, "--state", os.path.dirname(base) + "/./" + os.path.basename(base))
    one_line(r, "input")


# ------------------------------------------------------- item 8: what another local user plants there


@pytest.mark.parametrize("planted", ["lock", "journal"])
@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_planted_lock_or_journal_is_refused_and_never_written_through(tmp_path, pair, planted, kind):
    base, delta, _ = pair
    victim = str(tmp_path / "victim")
    with open(victim, "wb") as f:
        f.write(b"precious")
    at = base + (".deltarefit-lock" if planted == "lock" else ".deltarefit-journal")
    if kind == "symlink":
        os.symlink(victim, at)
    else:
        os.mkfifo(at)
    before = open(base, "rb").read()
    r = cli("apply", delta, base, timeout=30)  # a FIFO opened blocking would hang here
    one_line(r, at)
    assert open(victim, "rb").read() == b"precious" and open(base, "rb").read() == before
    assert os.path.islink(at) if kind == "symlink" else os.path.exists(at)


@pytest.mark.parametrize("given", ["fifo", "device"])
def test_a_delta_argument_that_is_no_regular_file_is_refused_not_hung_on(tmp_path, pair, given):
    """``apply``, ``inspect`` and ``verify`` open the delta as every input is (``io.fsutil.open_input``):
    a FIFO (opened blocking, it would hang) or a device is refused in one line, exit 3, nothing written."""
    base, _, _ = pair
    bad = "/dev/zero" if given == "device" else str(tmp_path / "d.fifo")
    if given == "fifo":
        os.mkfifo(bad)
    before = open(base, "rb").read()
    for r in (cli("apply", bad, base, timeout=30), cli("inspect", bad, timeout=30)):
        assert r.returncode == 3, r.stderr
        one_line(r, bad, "cannot open delta: not a regular file")
    assert open(base, "rb").read() == before


@pytest.mark.parametrize("given", ["fifo", "device", "oversized"])
def test_a_relay_key_that_is_no_small_regular_file_is_refused_not_hung_on(tmp_path, given):
    """``relay.protocol.load_key`` reads a regular file of at most 64 KiB (``io.fsutil.read_small``): a FIFO
    (which would hang the open), a device or a bigger file is refused in one line."""
    from deltarefit.errors import UsageError
    from deltarefit.relay.protocol import load_key

    bad = "/dev/zero" if given == "device" else str(tmp_path / "key")
    if given == "fifo":
        os.mkfifo(bad)
    elif given == "oversized":
        with open(bad, "wb") as f:
            f.write(b"k" * ((64 << 10) + 1))
    with pytest.raises(UsageError, match="not a regular file" if given != "oversized" else "more than") as e:
        load_key(bad)
    assert str(e.value).startswith(bad) and "\n" not in str(e.value)


def test_a_symlink_planted_at_a_temp_name_is_replaced_not_written_through(tmp_path):
    from deltarefit.io.fsutil import write_atomic

    victim = str(tmp_path / "victim")
    with open(victim, "wb") as f:
        f.write(b"precious")
    target = str(tmp_path / "ck.safetensors.deltarefit-version.json")
    os.symlink(victim, f"{target}.tmp-{os.getpid()}")  # the pid of a root sync is easy to guess
    write_atomic(target, b"{}")
    assert open(victim, "rb").read() == b"precious" and open(target, "rb").read() == b"{}"
    assert not os.path.islink(target)
    os.symlink(victim, f"{target[:-len('.deltarefit-version.json')]}.tmp-{os.getpid()}")
    write_ck(target[:-len(".deltarefit-version.json")], {"w": np.zeros(4, np.float32)})
    assert open(victim, "rb").read() == b"precious"


_SWEEP = r"""
import sys
from deltarefit.io.locks import owned_temp
path, fd = owned_temp(sys.argv[2], sys.argv[1], directory=sys.argv[3] == "dir")
print(path)
"""

# engines.vllm.holder.SCRATCH_PREFIX and engines.vllm.group.SHM_PREFIX (those modules import vllm,
# which the default suite need not have): the engine's scratch directory, a tensor-parallel group's shared-memory file.
ENGINE_PREFIXES = [("deltarefit-engine-", "dir"), ("deltarefit-tp-", "file")]


@pytest.mark.parametrize(("prefix", "kind"), ENGINE_PREFIXES)
def test_a_fifo_with_the_engine_scratch_prefix_does_not_hang_an_engine_start(tmp_path, prefix, kind):
    """An engine's scratch (``owned_temp``, in /tmp and /dev/shm) sweeps what dead engines left by
    opening each entry of its prefix: a FIFO there (as a file, or as a directory's owner file) must
    neither hang it nor be taken for one of ours."""
    parent = str(tmp_path)
    os.mkfifo(os.path.join(parent, prefix + "fifo"))
    os.makedirs(os.path.join(parent, prefix + "dir"))
    os.mkfifo(os.path.join(parent, prefix + "dir", ".owner"))
    r = subprocess.run([sys.executable, "-c", _SWEEP, parent, prefix, kind], capture_output=True, text=True,
                       env=ENV, timeout=30)
    assert r.returncode == 0, r.stderr
    made = r.stdout.strip().splitlines()[-1]
    assert os.path.dirname(made) == parent and os.path.basename(made).startswith(prefix)
    assert os.path.exists(os.path.join(parent, prefix + "fifo"))  # not ours: left alone
    assert os.path.exists(os.path.join(parent, prefix + "dir", ".owner"))


def test_the_engine_prefixes_are_the_engines():
    src = os.path.join(os.path.dirname(deltarefit.__file__), "engines")
    assert 'SCRATCH_PREFIX = "deltarefit-engine-"' in open(os.path.join(src, "vllm", "holder.py")).read()
    assert 'SHM_PREFIX = "deltarefit-tp-"' in open(os.path.join(src, "vllm", "group.py")).read()


# ----------------------------------------------------------------- item 7: a full disk during apply


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(size)``: a real tmpfs of ``size`` mounted in ``tmp_path`` (skipped where mounting is not
    permitted: not root, or no CAP_SYS_ADMIN in a container)."""
    mounted: list[str] = []

    def mount(size: str) -> str:
        d = str(tmp_path / f"tmpfs{len(mounted)}")
        os.makedirs(d)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'mount failed'}); needs root")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", d], check=False)


def fill(directory: str, leave: int) -> str:
    """Fill the filesystem of ``directory`` up to ``leave`` free bytes (a page or so more); the filler's path."""
    filler = os.path.join(directory, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        while os.write(fd, b"\xff" * 4096) > 0:
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    size = os.path.getsize(filler)
    os.truncate(filler, max(0, size - leave))
    return filler


def test_a_full_disk_during_apply_is_refused_before_any_byte_changes_and_a_rerun_finishes(tmp_path, tmpfs):
    """The journal is allocated before the first write: a disk with room for a few records but not for
    a dense chunk's is refused up front (one line naming the journal), the checkpoint as it was; once
    there is room a rerun applies it."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal(1 << 19).astype(np.float32)  # two 1 MiB segments
    base = {"w": w, "b": rng.standard_normal(64).astype(np.float32)}
    nxt = {"w": w.copy(), "b": base["b"] + np.float32(1)}
    nxt["w"][:16] += np.float32(0.5)  # segment 0: a few elements (a small journal record)
    nxt["w"][1 << 18:] += np.float32(0.25)  # segment 1: every element (a whole-segment record)
    os.makedirs(tmp_path / "src")
    write_ck(str(tmp_path / "src" / "t.safetensors"), nxt)
    d = tmpfs("5m")
    ck = write_ck(os.path.join(d, "ck.safetensors"), base)
    delta = str(tmp_path / "d.delta")
    deltarefit.encode(ck, str(tmp_path / "src" / "t.safetensors"), delta)
    before = open(ck, "rb").read()
    filler = fill(d, 256 << 10)
    r = cli("apply", delta, ck, "--threads", "1")
    one_line(r, ck + ".deltarefit-journal", "No space left")
    assert open(ck, "rb").read() == before
    assert not os.path.exists(ck + ".deltarefit-journal")
    os.unlink(filler)
    r = cli("apply", delta, ck, "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert deltarefit.fingerprint(ck) == deltarefit.fingerprint(str(tmp_path / "src" / "t.safetensors"))


@pytest.mark.parametrize("leave", [0, 64 << 10])
def test_a_full_disk_during_sync_is_one_line_naming_the_file_and_a_rerun_finishes(tmp_path, stream, tmpfs, leave):
    store, vs, _ = stream
    d = tmpfs("2m")
    ck = os.path.join(d, "ck.safetensors")
    r = cli("sync", store, ck, "--to", "2")
    assert r.returncode == 0, r.stderr
    before = open(ck, "rb").read()
    filler = fill(d, leave)
    r = cli("sync", store, ck)
    one_line(r, d, "No space left on device")
    assert open(ck, "rb").read() == before
    assert json.loads(open(state_path(ck)).read())["version"] == 2
    os.unlink(filler)
    r = cli("sync", store, ck)
    assert r.returncode == 0 and "verified" in r.stdout, r.stderr
    assert deltarefit.fingerprint(ck) == deltarefit.fingerprint(vs[2])


def test_apply_on_a_read_only_filesystem_is_one_line(tmp_path, pair, tmpfs):
    base, delta, _ = pair
    d = tmpfs("2m")
    ck = os.path.join(d, "ck.safetensors")
    with open(base, "rb") as f, open(ck, "wb") as g:
        g.write(f.read())
    subprocess.run(["mount", "-o", "remount,ro", d], check=True)
    r = cli("apply", delta, ck)
    one_line(r, d, "Read-only file system")
    assert open(ck, "rb").read() == open(base, "rb").read()


# ------------------------------------------------------------------------------ item 10: small ones


def test_a_file_that_is_not_a_checkpoint_is_named_so(tmp_path, pair):
    _, delta, _ = pair
    notes = str(tmp_path / "notes.safetensors")
    with open(notes, "wb") as f:
        f.write(b"PK\x03\x04 this is a zip, not a checkpoint" * 4)
    for r in (cli("fingerprint", notes), cli("apply", delta, notes)):
        err = one_line(r, f"not a safetensors file: {notes}")
        assert "header length 18" not in err.split("(")[0]
    with open(notes, "wb") as f:
        f.write((16).to_bytes(8, "little") + b"[1, 2, 3, 4, 5, 6]")
    one_line(cli("fingerprint", notes), f"not a safetensors file: {notes}")


def test_sync_into_a_missing_directory_names_the_directory(tmp_path, stream):
    store, _, _ = stream
    missing = str(tmp_path / "no" / "such")
    r = cli("sync", store, os.path.join(missing, "ck.safetensors"))
    err = one_line(r, missing, "does not exist")
    assert "lock" not in err
    assert not os.path.exists(missing)


def test_a_keyframe_install_needs_the_checkpoints_size_free_once(tmp_path, stream, tmpfs):
    """The keyframe is staged beside the checkpoint and renamed in: a filesystem with room for one copy
    (and a half) installs it, where a copy needed two."""
    store, vs, _ = stream
    size = os.path.getsize(vs[0])
    d = tmpfs(str(size * 3 // 2 // 4096 * 4096))
    ck = os.path.join(d, "ck.safetensors")
    r = cli("sync", store, ck, "--to", "1")
    assert r.returncode == 0, r.stderr
    assert deltarefit.fingerprint(ck) == deltarefit.fingerprint(vs[0])
    assert oct(os.stat(ck).st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


_PAUSE_PLAN = r"""
import sys
import deltarefit.apply.protocol as applier
from deltarefit.cli import main
orig = applier.Applier.plan
def plan(self, *a, **k):
    print("MAPPED", flush=True)
    sys.stdin.readline()  # the parent truncates the checkpoint meanwhile
    return orig(self, *a, **k)
applier.Applier.plan = plan
main(sys.argv[1:])
"""


def test_a_checkpoint_truncated_by_another_process_mid_apply_is_one_line_not_a_crash(tmp_path, pair):
    pytest.importorskip("deltarefit._sigbus", reason="the optional SIGBUS extension is not built "
                        "(pip install -e . builds it where a C compiler is)")
    base, delta, vs = pair
    before = open(base, "rb").read()
    p = subprocess.Popen([sys.executable, "-c", _PAUSE_PLAN, "apply", delta, base, "--threads", "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert p.stdout.readline().strip() == "MAPPED"
        os.truncate(base, 4096)  # a real second process's truncate (this one): the pages past it are gone
        out, err = p.communicate("go\n", timeout=TIMEOUT)
    finally:
        p.kill()
    r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    assert r.returncode == 4, (r.returncode, err)
    one_line(r, base, "truncated by another process")
    with open(base, "wb") as f:
        f.write(before)
    r = cli("apply", delta, base)
    assert r.returncode == 0, r.stderr
    assert deltarefit.fingerprint(base) == deltarefit.fingerprint(vs[1])


# --------------------------------------------------------------- item 8: FIFOs where a store or a book keeps files


def _fifo_at(path: str) -> None:
    if os.path.lexists(path):
        os.unlink(path)
    os.mkfifo(path)


def _subscribed(tmp_path, stream) -> str:
    store, _vs, _ = stream
    ck = str(tmp_path / "ck.safetensors")
    Subscriber(store, ck, subscriber_id="one").sync()
    return ck


@pytest.mark.parametrize("planted", ["HEAD", "v/000000000002/commit.json"])
@pytest.mark.parametrize("command", ["sync", "log", "retain", "publish"])
def test_a_fifo_planted_at_a_store_object_is_one_line_not_a_hang(tmp_path, stream, planted, command):
    """A FIFO at the stream's HEAD or at a commit record (written by another local user): every command
    that reads it ends in one line naming it, within the timeout (a blocking open would hang forever)."""
    store, vs, _ = stream
    ck = str(tmp_path / "new.safetensors")
    at = os.path.join(store, *planted.split("/"))
    _fifo_at(at)
    args = {"sync": ["sync", store, ck], "log": ["log", store], "retain": ["retain", store, "--orphan-grace", "0", "--unsafe-short-grace"],
            "publish": ["publish", store, vs[3], "--state", str(tmp_path / "pub")]}[command]
    r = cli(*args)
    if command == "log" and planted == "HEAD":
        assert r.returncode == 0 and "v3" in r.stdout, r.stderr  # the listing does not read HEAD
    else:
        one_line(r, at, "not a regular file")
    assert not os.path.exists(ck)
    assert os.path.exists(at) and not os.path.isfile(at)  # not ours to remove


@pytest.mark.parametrize("planted", ["subs", "acks"])
def test_a_fifo_planted_as_a_subscriber_object_is_ignored(tmp_path, stream, planted):
    """``subs/`` and ``acks/`` take any subscriber credential's writes: a FIFO there is skipped like a
    malformed object (logged), and neither retention nor a joint commit stops or hangs on it."""
    store, vs, _ = stream
    _subscribed(tmp_path, stream)
    d = os.path.join(store, "subs") if planted == "subs" else os.path.join(store, "acks", "000000000004")
    os.makedirs(d, exist_ok=True)
    _fifo_at(os.path.join(d, "evil.json"))
    if planted == "subs":
        r = cli("retain", store, "--orphan-grace", "0", "--unsafe-short-grace", "--json")
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        assert "evil.json" in r.stderr and "unreadable subscriber object" in r.stderr
    else:
        r = cli("publish", store, vs[3], "--state", str(tmp_path / "pub"), "--quorum", "1", "--ack-timeout", "2")
        assert r.returncode != 0 and "Traceback" not in r.stderr and "acknowledged" in r.stderr, r.stderr


@pytest.mark.parametrize("planted", ["HEAD.json", "moves"])
def test_a_fifo_planted_in_a_history_book_is_started_over_not_a_hang(tmp_path, planted):
    """A FIFO at a history book's HEAD or at one of its moves files: the sync starts the book over (a
    book is local state the stream rebuilds) and ends verified, within the timeout."""
    from deltarefit.history_book import HistoryBook
    from deltarefit.stream.subscriber import history_path

    vs, store, pub = history_stream(tmp_path)
    ck = str(tmp_path / "ck.safetensors")
    Subscriber(store, ck, subscriber_id="b").sync()
    book = history_path(ck)
    assert HistoryBook(book).tip is not None
    at = os.path.join(book, "HEAD.json") if planted == "HEAD.json" else \
        os.path.join(book, HistoryBook(book).versions()[0] + ".moves")
    _fifo_at(at)
    pub.publish(vs[3])
    r = cli("sync", store, ck)
    assert r.returncode == 0 and "verified" in r.stdout and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    assert open(ck, "rb").read() == open(vs[3], "rb").read()
    assert not os.path.exists(at) or os.path.isfile(at)
