"""The store contract (``deltarefit.storage.base``): the same assertions against every store, a memory
store, a local directory and S3 on a real S3 server (SeaweedFS on loopback, ``conftest_s3``).

Each optional operation is either declared in the store's ``capabilities`` and works as the contract
says, or is undeclared and refuses with a one-line ``StoreError``. The S3 cases are skipped (with the
reason) only where ``tests/test_s3.py`` is: ``boto3`` or the ``weed`` binary is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import pytest

pytest.register_assert_rewrite("conftest_s3")
from conftest_s3 import subprocess_env  # noqa: E402

from deltarefit.errors import FileSystemError, UsageError  # noqa: E402
from deltarefit.storage import StoreError, open_store  # noqa: E402
from deltarefit.storage.base import (  # noqa: E402
    GET_RANGE,
    MTIME,
    OPTIONAL,
    PATH_OF,
    SET_PROGRESS,
    SWEEP_TEMPS,
    Store,
)

pytest_plugins = ["conftest_s3"]  # the fixtures s3_server (session) and s3_env

MiB = 1 << 20
TIMEOUT = 120  # seconds, for any one thread or subprocess
BAD_KEYS = ("", "/a", "a//b", "a/../b", "./a", "a/")

# What each store declares: the callers' behaviour depends on it (retention ages orphans by mtime,
# a publisher sweeps a killed attempt's uploads, a local store's files are read in place).
DECLARED = {
    "memory": frozenset({GET_RANGE}),
    "local": OPTIONAL,
    "s3": OPTIONAL - {PATH_OF},
}


@dataclass
class Made:
    kind: str
    url: str
    store: Store
    env: dict[str, str] | None  # the environment for a child process that opens the store (None: none can)

    def again(self) -> Store:
        """Another store object on the same objects (as another thread or process would hold)."""
        return open_store(self.url)


@pytest.fixture(params=sorted(DECLARED))
def made(request, tmp_path_factory) -> Made:
    kind = request.param
    if kind == "memory":
        url = f"memory://contract-{uuid.uuid4().hex[:10]}"
        env = None  # a memory store lives and dies with its process
    elif kind == "local":
        url = str(tmp_path_factory.mktemp("store"))  # apart from the test's own tmp_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    else:
        srv = request.getfixturevalue("s3_env")  # skips (with the reason) where test_s3.py skips
        url = srv.url("contract")
        env = subprocess_env(srv)
    return Made(kind, url, open_store(url), env)


def having(capability: str):
    """Run a test on the stores that declare ``capability`` only: a store without it can never run it
    (``test_capabilities_are_declared_and_absent_ones_refuse`` checks its refusal)."""
    return pytest.mark.parametrize("made", sorted(k for k, caps in DECLARED.items() if capability in caps),
                                   indirect=True)


def _ops(st: Store, key: str, tmp: str):
    """Every operation on ``key`` (the optional ones too), as zero-argument calls."""
    return {
        "put": lambda: st.put(key, b"x"),
        "put_file": lambda: st.put_file(key, tmp),
        "create": lambda: st.create(key, b"x"),
        "get": lambda: st.get(key),
        "get_to": lambda: st.get_to(key, tmp + ".out"),
        "exists": lambda: st.exists(key),
        "size": lambda: st.size(key),
        "delete": lambda: st.delete(key),
        GET_RANGE: lambda: st.get_range(key, 0, 1),
        MTIME: lambda: st.mtime(key),
        PATH_OF: lambda: st.path_of(key),
    }


def _one_line_store_error(e: BaseException, *names: str) -> None:
    msg = str(e)
    assert type(e) is StoreError and "\n" not in msg and all(n in msg for n in names), msg


# ------------------------------------------------------------------------------------------ declared


def test_capabilities_are_declared_and_absent_ones_refuse(made):
    st = made.store
    assert isinstance(st, Store)
    assert isinstance(st.capabilities, frozenset) and st.capabilities <= OPTIONAL
    assert st.capabilities == DECLARED[made.kind]
    absent = {
        GET_RANGE: lambda: st.get_range("k", 0, 1),
        MTIME: lambda: st.mtime("k"),
        SWEEP_TEMPS: lambda: st.sweep_temps(0.0),
        PATH_OF: lambda: st.path_of("k"),
        SET_PROGRESS: lambda: st.set_progress(None),
    }
    assert set(absent) == OPTIONAL
    st.put("k", b"data")
    for name in sorted(OPTIONAL - st.capabilities):
        with pytest.raises(StoreError) as ei:
            absent[name]()
        _one_line_store_error(ei.value, st.url, name)
    assert st.list() == ["k"] and st.get("k") == b"data"  # a refusal touches nothing


# ------------------------------------------------------------------------------------------ keys


def test_bad_keys_are_usage_errors_before_any_io(made, tmp_path):
    st = made.store
    src = tmp_path / "src"
    src.write_bytes(b"x")
    for key in BAD_KEYS:
        for name, op in _ops(st, key, str(src)).items():
            if name in OPTIONAL and name not in st.capabilities:
                continue  # refused as absent (see above)
            with pytest.raises(UsageError):
                op()
    assert st.list() == [] and sorted(os.listdir(tmp_path)) == ["src"]
    if made.kind == "local":
        assert os.listdir(made.url) == []


# ------------------------------------------------------------------------------------------ put/get


def test_put_get_exists_size_and_overwrite(made, tmp_path):
    st = made.store
    every_byte = bytes(range(256)) * 5
    st.put("a/x", b"one")
    st.put("a/x", b"two")  # overwrite
    st.put("empty", b"")
    st.put("a/b/c", every_byte)
    st.put("ba", bytearray(b"from a bytearray"))
    src = tmp_path / "src"
    src.write_bytes(every_byte[::-1])
    st.put_file("file", str(src))
    assert st.get("a/x") == b"two" and st.get("empty") == b"" and st.get("a/b/c") == every_byte
    assert st.get("ba") == b"from a bytearray" and st.get("file") == every_byte[::-1]
    assert all(st.exists(k) for k in ("a/x", "empty", "a/b/c", "ba", "file"))
    for prefix in ("a", "a/b"):  # a key's prefix is not an object
        assert not st.exists(prefix)
        for call in (st.get, st.size):
            with pytest.raises(KeyError):
                call(prefix)
    assert (st.size("a/x"), st.size("empty"), st.size("a/b/c"), st.size("file")) == (3, 0, 1280, 1280)
    st.get_to("a/b/c", str(tmp_path / "out"))
    assert (tmp_path / "out").read_bytes() == every_byte
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]  # no temp file left behind
    other = made.again()
    assert other.get("a/x") == b"two" and other.list() == st.list()


def test_missing_keys_raise_key_error_naming_the_key(made, tmp_path):
    st = made.store
    st.put("there", b"x")
    out = tmp_path / "out"
    calls = {
        "get": lambda: st.get("v/nope"),
        "get_to": lambda: st.get_to("v/nope", str(out)),
        "size": lambda: st.size("v/nope"),
    }
    if GET_RANGE in st.capabilities:
        calls[GET_RANGE] = lambda: st.get_range("v/nope", 0, 1)
        calls[GET_RANGE + " (empty range)"] = lambda: st.get_range("v/nope", 0, 0)
    if MTIME in st.capabilities:
        calls[MTIME] = lambda: st.mtime("v/nope")
    for name, call in calls.items():
        with pytest.raises(KeyError) as ei:
            call()
        assert type(ei.value) is KeyError and ei.value.args == ("v/nope",), (name, ei.value)
    for call in (st.get, st.size):  # under an object's key, as under a directory's
        with pytest.raises(KeyError):
            call("there/nope")
    assert not st.exists("there/nope")
    assert os.listdir(tmp_path) == []  # get_to of a missing key writes nothing
    assert not st.exists("v/nope")
    st.delete("v/nope")  # deleting a missing key is no error
    assert st.list() == ["there"]


def test_list_is_sorted_by_string_prefix_and_delete_removes(made):
    st = made.store
    assert st.list() == []
    for k in ("b", "a/x", "ab", "a/b/c", "a/b/d"):
        st.put(k, k.encode())
    assert st.list() == ["a/b/c", "a/b/d", "a/x", "ab", "b"]
    assert st.list("a") == ["a/b/c", "a/b/d", "a/x", "ab"]
    assert st.list("a/") == ["a/b/c", "a/b/d", "a/x"]
    assert st.list("a/b") == ["a/b/c", "a/b/d"]
    assert st.list("a/b/c") == ["a/b/c"]
    assert st.list("c") == [] and st.list("a/y") == []
    st.delete("a/b/c")
    assert not st.exists("a/b/c") and st.list("a/b") == ["a/b/d"]
    with pytest.raises(KeyError):
        st.get("a/b/c")
    st.delete("a/b/c")  # twice: still no error
    assert st.create("a/b/c", b"again") is True and st.get("a/b/c") == b"again"


def test_create_is_conditional_and_one_racer_wins(made):
    st = made.store
    assert st.create("c", b"first") is True
    assert st.create("c", b"second") is False and st.get("c") == b"first"
    st.put("p", b"put")
    assert st.create("p", b"z") is False and st.get("p") == b"put"

    # 6 threads, each with its own store object, create the same keys at once.
    n_threads, keys = 6, [f"race/{k}" for k in range(3)]
    stores = [made.again() for _ in range(n_threads)]
    barrier = threading.Barrier(n_threads, timeout=TIMEOUT)
    wins: dict[str, list[int]] = {k: [] for k in keys}
    errors: list[BaseException] = []

    def racer(i: int) -> None:
        try:
            for key in keys:
                barrier.wait()
                if stores[i].create(key, f"{key} by {i}".encode()):
                    wins[key].append(i)
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    ts = [threading.Thread(target=racer, args=(i,)) for i in range(n_threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=TIMEOUT)
    assert not errors and not any(t.is_alive() for t in ts), errors
    for key, w in wins.items():
        assert len(w) == 1, (key, w)
        assert st.get(key) == f"{key} by {w[0]}".encode()


# ------------------------------------------------------------------------------------------ whole or nothing


def test_a_concurrent_reader_sees_whole_objects_only(made):
    """Overwrites of a 9 MiB object (multipart on S3) under a reader that reads it in a loop: every
    read is one of the objects put, whole."""
    st = made.store
    a, b = b"A" * (9 * MiB), b"B" * (9 * MiB + 1)
    st.put("v/obj", a)
    done = threading.Event()
    seen: list[tuple[int, bool]] = []
    errors: list[BaseException] = []

    def reader() -> None:
        other = made.again()
        try:
            while True:
                last = done.is_set()
                data = other.get("v/obj")
                seen.append((len(data), data in (a, b)))
                if last:
                    return
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(4):
            st.put("v/obj", b if i % 2 == 0 else a)
    finally:
        done.set()
        t.join(timeout=TIMEOUT)
    assert not errors and not t.is_alive(), errors
    assert seen and all(whole for _, whole in seen), [s for s in seen if not s[1]][:5]
    assert seen[-1] == (len(a), True)  # the last read came after the last put
    assert st.list() == ["v/obj"]


def test_a_failed_put_leaves_the_old_object(made, tmp_path):
    st = made.store
    st.put("k", b"old")
    with pytest.raises(StoreError) as ei:
        st.put_file("k", str(tmp_path / "no-such-file"))
    assert "\n" not in str(ei.value)
    with pytest.raises(StoreError):
        st.put_file("new", str(tmp_path))  # a directory, not a file
    assert st.get("k") == b"old" and not st.exists("new") and st.list() == ["k"]
    if SWEEP_TEMPS in st.capabilities:
        assert st.sweep_temps(0.0) == []  # and left no unfinished write behind


WRITER = """
import sys
from deltarefit.storage import open_store
url, key, src = sys.argv[1:4]
st = open_store(url, rate=2e6)  # 12 MiB at 2 MB/s: ~6 s, killed long before its end
moved = []
def note(n):
    moved.append(n)
    if len(moved) == 1:
        print("moving", flush=True)
st.set_progress(note)
st.put_file(key, src)
print("finished", flush=True)
"""


@having(SWEEP_TEMPS)  # not a memory store: it lives in one process, no writer can be killed under it
def test_a_killed_writer_leaves_no_object_and_sweep_temps_removes_its_leftovers(made, tmp_path):
    """A writer killed (SIGKILL) mid-upload: its key never appears, ``list`` shows nothing, and
    ``sweep_temps`` finds what it left (a temp file, an incomplete multipart upload) only once older
    than the grace, lists it on a dry run, removes it, and then finds nothing."""
    st = made.store
    assert made.env is not None
    src = tmp_path / "src"
    src.write_bytes(os.urandom(12 * MiB))
    st.put("v/live", b"ok")
    p = subprocess.Popen([sys.executable, "-c", WRITER, made.url, "v/big", str(src)], env=made.env, text=True,
                         stdout=subprocess.PIPE, stderr=open(tmp_path / "err", "w"))
    lines: list[str] = []
    t = threading.Thread(target=lambda: lines.append(p.stdout.readline()))
    try:
        t.start()
        t.join(timeout=TIMEOUT)
        assert lines == ["moving\n"], (lines, (tmp_path / "err").read_text())
    finally:
        p.kill()
        p.wait(timeout=30)
        p.stdout.close()
    assert p.returncode == -9
    assert not st.exists("v/big") and st.list() == ["v/live"]
    assert st.sweep_temps(3600.0) == []  # younger than the grace: left alone
    time.sleep(1.1)  # S3 dates an upload to the second: the leftover is now older than a grace of 0
    left = st.sweep_temps(0.0, dry_run=True)
    assert left and all(k.startswith("v/big") for k in left), left
    assert st.sweep_temps(0.0, dry_run=True) == left  # a dry run removed nothing
    assert st.sweep_temps(0.0, prefix="w/") == []  # outside the prefix: left alone
    assert st.sweep_temps(0.0, prefix="v/") == left
    assert st.sweep_temps(0.0) == []
    assert st.list() == ["v/live"] and st.get("v/live") == b"ok"
    if made.kind == "local":
        assert sorted(os.listdir(os.path.join(made.url, "v"))) == ["live"]


# ------------------------------------------------------------------------------------------ get_to


def test_get_to_replaces_its_destination_by_rename(made, tmp_path):
    st = made.store
    st.put("k", b"new bytes")
    dest = tmp_path / "dest"
    dest.write_bytes(b"old bytes, held open by a reader")
    with open(dest, "rb") as held:
        st.get_to("k", str(dest))
        assert held.read() == b"old bytes, held open by a reader"  # never truncated under its reader
    assert dest.read_bytes() == b"new bytes" and sorted(os.listdir(tmp_path)) == ["dest"]
    # The destination's own fault is the local filesystem's, named (the CLI's exit 12), not the store's.
    with pytest.raises(FileSystemError) as ei:
        st.get_to("k", str(tmp_path / "no-such-dir" / "dest"))
    assert "\n" not in str(ei.value) and "no-such-dir" in str(ei.value)
    assert sorted(os.listdir(tmp_path)) == ["dest"]


# ------------------------------------------------------------------------------------------ optional operations


@having(GET_RANGE)
def test_get_range_bounds(made):
    st = made.store
    data = os.urandom(1000)
    st.put("k", data)
    st.put("empty", b"")
    cases = [(0, 10), (0, 1000), (0, 10**9), (990, 100), (999, 1), (1000, 1), (5000, 3), (0, 0), (500, 0)]
    for start, length in cases:
        assert st.get_range("k", start, length) == data[start:start + length], (start, length)
    assert st.get_range("empty", 0, 1) == b"" and st.get_range("empty", 0, 0) == b""
    for start, length in ((-1, 5), (-10, 10), (0, -1)):
        with pytest.raises(UsageError):
            st.get_range("k", start, length)
    big = os.urandom(3 * MiB + 17)  # slices across what a store reads in one go
    st.put("big", big)
    assert st.get_range("big", MiB - 3, 2 * MiB) == big[MiB - 3:3 * MiB - 3]
    assert st.get_range("big", 3 * MiB, MiB) == big[3 * MiB:]


@having(MTIME)
def test_mtime_dates_the_last_write(made):
    st = made.store
    t0 = time.time()
    st.put("k", b"one")
    m1 = st.mtime("k")
    assert isinstance(m1, float) and abs(m1 - t0) < 60  # the store's clock, to the second or better
    st.put("k", b"two")
    m2 = st.mtime("k")
    assert m2 >= m1 and abs(m2 - time.time()) < 60
    assert st.create("c", b"x") and abs(st.mtime("c") - time.time()) < 60


@having(PATH_OF)
def test_path_of_names_the_file_that_holds_a_key(made):
    st = made.store
    st.put("a/b", b"in a file")
    with open(st.path_of("a/b"), "rb") as f:
        assert f.read() == b"in a file"
    assert not os.path.exists(st.path_of("a/missing"))  # where it would be


@having(SET_PROGRESS)
def test_set_progress_reports_the_bytes_of_each_transfer(made, tmp_path):
    st = made.store
    src = tmp_path / "src"
    src.write_bytes(os.urandom(3 * MiB + 5))
    moved: list[int] = []
    st.set_progress(moved.append)
    st.put_file("k", str(src))
    assert sum(moved) == src.stat().st_size and all(n > 0 for n in moved)
    moved.clear()
    st.get_to("k", str(tmp_path / "back"))
    assert sum(moved) == src.stat().st_size
    assert (tmp_path / "back").read_bytes() == src.read_bytes()
    st.set_progress(None)
    moved.clear()
    st.put_file("k2", str(src))
    st.get_to("k2", str(tmp_path / "back2"))
    assert moved == []
