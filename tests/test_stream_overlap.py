"""A subscriber's sync plans a delta while its part downloads (``stream.arriving``): ranged reads into
staging, the index first, and the plan decoding chunks as their bytes arrive; nothing written before
the whole part matches its record and the whole plan passed.

Real stores (local directories, the in-memory store, and a real S3 server on loopback in
``test_s3.py``), real files, real processes killed with SIGKILL. The model: a synthetic bf16 pair of
32 MiB (40% of its elements moved by one ulp per version), so that a delta's payload spans several
ranged reads.
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from _stream_util import read_bytes, sha

import deltarefit
from deltarefit.apps.bench.stream import _chain
from deltarefit.format import DeltaReader
from deltarefit.storage import LocalStore, MemoryStore, StoreError
from deltarefit.stream import Publisher, StreamError, Subscriber
from deltarefit.stream.arriving import read_bytes as range_read_bytes
from deltarefit.stream.records import load_commit
from deltarefit.stream.subscriber import state_path

TIMEOUT = 120
SEED = int(os.environ.get("DELTAREFIT_STREAM_CRASH_SEED", "20240613"))
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> list[str]:
    return _chain(str(tmp_path_factory.mktemp("overlap-chain")), 32, 4, 0.4, 7)


@pytest.fixture(scope="module")
def fps(steps) -> list[str]:
    return [deltarefit.fingerprint(p) for p in steps]


def _publish(store, state_dir: str, steps: list[str]) -> None:
    pub = Publisher(store, state_dir, keyframe_every=10**6, keyframe_ratio=1e9)
    for i, p in enumerate(steps):
        pub.publish(p, step=i)  # version i + 1: a keyframe, then deltas


@pytest.fixture(scope="module")
def local_stream(tmp_path_factory, steps):
    d = tmp_path_factory.mktemp("overlap-stream")
    _publish(LocalStore(str(d / "store")), str(d / "pub"), steps)
    rec = load_commit(LocalStore(str(d / "store")), 2)
    with DeltaReader(os.path.join(str(d / "store"), *rec.delta.key.split("/"))) as r:
        assert r.payload_len > 4 * range_read_bytes(os.path.getsize(r.path)), "deltas too small: raise the rate"
    # A subscriber at version 1 (the keyframe), the template every test copies.
    tmpl = str(d / "tmpl.safetensors")
    Subscriber(LocalStore(str(d / "store")), tmpl, subscriber_id="tmpl").sync(to_version=1)
    return {"store": str(d / "store"), "tmpl": tmpl}


def _at_v1(local_stream, dest: str) -> str:
    with open(local_stream["tmpl"], "rb") as f, open(dest, "wb") as g:
        g.write(f.read())
    with open(state_path(local_stream["tmpl"]), "rb") as f, open(state_path(dest), "wb") as g:
        g.write(f.read())
    return dest


class Counting:
    """Notes which reads a store served for part keys (a mixin over a real store)."""

    def _note(self, what: str, key: str) -> None:
        if "/" in key and not key.endswith(".json"):
            self.calls.setdefault(what, set()).add(key)

    def get_range(self, key, start, length):
        self._note("get_range", key)
        return super().get_range(key, start, length)

    def get_to(self, key, path):
        self._note("get_to", key)
        return super().get_to(key, path)


class CountingLocal(Counting, LocalStore):
    def __init__(self, root: str, **kw) -> None:
        super().__init__(root, **kw)
        self.calls: dict[str, set[str]] = {}


class CountingMemory(Counting, MemoryStore):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.calls: dict[str, set[str]] = {}


def _no_leftovers(ck: str) -> None:
    assert not os.path.exists(ck + ".deltarefit-staging")
    assert not os.path.exists(ck + ".deltarefit-journal")


# ------------------------------------------------------------------------------------------ bit-exact


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_sync_through_ranged_reads_is_bit_exact(kind, local_stream, steps, fps, tmp_path):
    if kind == "local":
        store = CountingLocal(local_stream["store"])
    else:  # the same stream, object for object, in a memory store
        src = LocalStore(local_stream["store"])
        store = CountingMemory(f"overlap-{os.getpid()}-{time.monotonic_ns()}")
        for k in src.list(""):
            store.put(k, src.get(k))
    ck = _at_v1(local_stream, str(tmp_path / "sub.safetensors"))
    rep = Subscriber(store, ck, subscriber_id="exact").sync(to_version=2)  # one delta
    assert (rep.route, rep.versions_applied) == ("chain", [2])
    assert sha(ck) == sha(steps[1]) and rep.fingerprint == fps[1]
    part2 = load_commit(store, 2).delta
    assert rep.bytes_fetched == part2.bytes
    assert store.calls.get("get_range") == {part2.key} and "get_to" not in store.calls  # the ranged path
    _no_leftovers(ck)
    rep = Subscriber(store, ck, subscriber_id="exact").sync()  # a chain of two deltas
    assert (rep.route, rep.versions_applied) == ("chain", [3, 4])
    assert sha(ck) == sha(steps[3]) and Subscriber(store, ck, subscriber_id="exact").current() == (4, fps[3])
    assert "get_to" not in store.calls
    _no_leftovers(ck)


def test_keyframe_route_keeps_the_staged_path(local_stream, steps, tmp_path):
    store = CountingLocal(local_stream["store"])
    ck = str(tmp_path / "new.safetensors")
    rep = Subscriber(store, ck, subscriber_id="new").sync(to_version=2)
    assert rep.route == "keyframe" and sha(ck) == sha(steps[1]) and rep.early_reads == 0
    assert store.calls.get("get_to") and "get_range" not in store.calls
    _no_leftovers(ck)


# ------------------------------------------------------------------------------------------ overlap


class HoldsTheLastRead(LocalStore):
    """A real local store whose read of a delta's last payload bytes waits (a minute at most) until the
    subscriber's plan has been served a payload of that part while it was still arriving: the order
    is forced by the store, not measured in time."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.sub: Subscriber | None = None
        self.held: list[bool] = []

    def get_range(self, key, start, length):
        dl = getattr(self.sub, "arriving", None)
        if dl is not None and key.endswith("/delta"):
            with DeltaReader(self.path_of(key)) as r:
                end = r.payload_off + r.payload_len
            if start < end <= start + length:  # the last payload read (not the header, not the index)
                t0 = time.monotonic()
                while dl.early_reads == 0 and time.monotonic() - t0 < 60:
                    time.sleep(0.005)
                self.held.append(dl.early_reads > 0)
        return super().get_range(key, start, length)


def test_plan_decodes_chunks_before_the_download_ends(local_stream, steps, fps, tmp_path):
    store = HoldsTheLastRead(local_stream["store"])
    ck = _at_v1(local_stream, str(tmp_path / "sub.safetensors"))
    sub = Subscriber(store, ck, subscriber_id="early")
    store.sub = sub
    rep = sub.sync(to_version=2)
    # The plan was served payloads of version 2's part while its last bytes were still held back.
    assert store.held == [True] and rep.early_reads > 0
    assert sha(ck) == sha(steps[1]) and rep.versions_applied == [2]
    assert sub.arriving is None
    _no_leftovers(ck)


# ------------------------------------------------------------------------------------------ refusals


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("where", ["header", "payload", "manifest", "table"])
def test_part_corrupted_in_the_store_is_refused_nothing_written(where, local_stream, tmp_path):
    root = str(tmp_path / "store")
    import shutil

    shutil.copytree(local_stream["store"], root)
    store = LocalStore(root)
    part = os.path.join(root, *load_commit(store, 2).delta.key.split("/"))
    with DeltaReader(part) as r:
        man_off = r.payload_off + r.payload_len
        at = {"header": 40, "payload": r.payload_off + r.payload_len // 3, "manifest": man_off + 20,
              "table": os.path.getsize(part) - 50}[where]
    _flip(part, at)
    ck = _at_v1(local_stream, str(tmp_path / "sub.safetensors"))
    before, st = sha(ck), read_bytes(state_path(ck))
    with pytest.raises(StreamError, match="part does not match its commit record"):
        Subscriber(store, ck, subscriber_id="bad").sync(to_version=2)
    assert sha(ck) == before and read_bytes(state_path(ck)) == st
    assert not os.path.exists(ck + ".deltarefit-journal")
    assert glob.glob(os.path.join(ck + ".deltarefit-staging", "*")) == []  # the bad bytes are not kept


@pytest.mark.parametrize("change", ["longer", "shorter"])
def test_part_of_another_size_than_its_record_is_refused(change, local_stream, tmp_path):
    import shutil

    root = str(tmp_path / "store")
    shutil.copytree(local_stream["store"], root)
    store = LocalStore(root)
    part = os.path.join(root, *load_commit(store, 2).delta.key.split("/"))
    if change == "longer":  # the record's bytes, and one more: its hash alone would not tell
        with open(part, "ab") as f:
            f.write(b"\0")
    else:
        os.truncate(part, os.path.getsize(part) - 1)
    ck = _at_v1(local_stream, str(tmp_path / "sub.safetensors"))
    before, st = sha(ck), read_bytes(state_path(ck))
    with pytest.raises(StreamError, match=f"part does not match its commit record \\(the object is {change}"):
        Subscriber(store, ck, subscriber_id="size").sync(to_version=2)
    assert sha(ck) == before and read_bytes(state_path(ck)) == st
    assert glob.glob(os.path.join(ck + ".deltarefit-staging", "*")) == []


def test_later_part_corrupted_refuses_the_whole_chain(local_stream, tmp_path):
    import shutil

    root = str(tmp_path / "store")
    shutil.copytree(local_stream["store"], root)
    store = LocalStore(root)
    part = os.path.join(root, *load_commit(store, 4).delta.key.split("/"))
    _flip(part, os.path.getsize(part) // 2)
    ck = _at_v1(local_stream, str(tmp_path / "sub.safetensors"))
    before, st = sha(ck), read_bytes(state_path(ck))
    with pytest.raises(StreamError, match="part does not match its commit record"):
        Subscriber(store, ck, subscriber_id="bad").sync()
    # Not even version 2, planned while the parts downloaded: every part is checked before the first write.
    assert sha(ck) == before and read_bytes(state_path(ck)) == st
    assert not os.path.exists(ck + ".deltarefit-journal")


class FailsMidway(LocalStore):
    """A real local store whose ranged reads of a delta fail once ``budget`` bytes of it were served."""

    def __init__(self, root: str, budget: int) -> None:
        super().__init__(root)
        self.budget = budget
        self.lock = threading.Lock()

    def get_range(self, key, start, length):
        if key.endswith("/delta"):
            with self.lock:
                self.budget -= length
                if self.budget < 0:
                    raise StoreError(f"{self.url}/{key}: read failed (connection reset)")
        return super().get_range(key, start, length)


def test_download_failing_midway_leaves_the_checkpoint_untouched(local_stream, steps, fps, tmp_path):
    ck = _at_v1(local_stream, str(tmp_path / "sub.safetensors"))
    before, st = sha(ck), read_bytes(state_path(ck))
    store = FailsMidway(local_stream["store"], budget=1 << 20)
    with pytest.raises(StoreError, match="connection reset"):
        Subscriber(store, ck, subscriber_id="mid").sync(to_version=2)
    assert sha(ck) == before and read_bytes(state_path(ck)) == st
    assert not os.path.exists(ck + ".deltarefit-journal")
    rep = Subscriber(LocalStore(local_stream["store"]), ck, subscriber_id="mid").sync(to_version=2)
    assert rep.versions_applied == [2] and sha(ck) == sha(steps[1]) and rep.fingerprint == fps[1]
    _no_leftovers(ck)


# ------------------------------------------------------------------------------------------ SIGKILL

SYNC_SCRIPT = """
import sys
from deltarefit.storage.base import open_store
from deltarefit.stream import Subscriber
Subscriber(open_store(sys.argv[1], rate=float(sys.argv[3])), sys.argv[2], subscriber_id="kill").sync()
"""


def _kill_when(args: list[str], when, after: float) -> tuple[int, bool]:
    """Run the sync script; SIGKILL it ``after`` s once ``when()`` holds. (exit status, when() held)."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), DELTAREFIT_NO_PROGRESS="1")
    p = subprocess.Popen([sys.executable, "-c", SYNC_SCRIPT, *args], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    t0, seen = time.monotonic(), False
    try:
        while p.poll() is None and time.monotonic() - t0 < TIMEOUT:
            if when():
                seen = True
                break
            time.sleep(0.0005)
        if seen and after > 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=after)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        _, err = p.communicate(timeout=TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=TIMEOUT)
    assert p.returncode in (0, -9), err.decode(errors="replace")
    return p.returncode, seen


def test_killed_during_overlapped_sync_then_rerun_is_bit_exact(local_stream, steps, fps, tmp_path):
    rng = random.Random(SEED + 7)
    print(f"seed {SEED + 7}")
    store = LocalStore(local_stream["store"])
    rate = 4e6  # bytes/s: each delta takes about a second to arrive, so kills land inside the download
    kills = 0
    for i, phase in enumerate(["arriving", "arriving", "arriving", "journal", "journal"]):
        ck = _at_v1(local_stream, str(tmp_path / f"sub{i}.safetensors"))
        stage, journal = ck + ".deltarefit-staging", ck + ".deltarefit-journal"
        if phase == "arriving":  # from the moment a part starts arriving in staging
            when, after = (lambda s=stage: bool(glob.glob(os.path.join(s, "*.arriving")))), rng.uniform(0, 1.0)
        else:  # inside the write phase of one delta
            when, after = (lambda j=journal: os.path.exists(j)), rng.uniform(0, 0.05)
        rc, seen = _kill_when([store.url, ck, str(rate)], when, after)
        kills += rc == -9
        st = read_bytes(state_path(ck))
        print(f"kill {i}: {phase} +{after:.3f} s, seen {seen}, exit {rc}, state {st and st[:40]}")
        rep = Subscriber(store, ck, subscriber_id="kill").sync()
        assert rep.version == 4 and sha(ck) == sha(steps[3])
        assert Subscriber(store, ck, subscriber_id="kill").current() == (4, fps[3])
        _no_leftovers(ck)
    assert kills >= 3, "too few kills landed: the syncs ended before them"
