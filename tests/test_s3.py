"""The S3 store against a real S3 server (SeaweedFS ``weed mini`` on loopback, see ``conftest_s3``):
the store contract, conditional create under racing threads and processes, multipart uploads and their
clean-up, error lines, and whole version streams published and followed with the real CLI.

Skipped (with the reason) only when ``boto3`` or the ``weed`` binary is not installed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

pytest.register_assert_rewrite("conftest_s3")
from conftest_s3 import missing_reason, subprocess_env  # noqa: E402

if missing_reason():
    if os.environ.get("CI"):  # CI installs the test extra: a missing server there is a broken set-up
        raise RuntimeError(f"S3 tests cannot run in CI: {missing_reason()}")
    pytest.skip(missing_reason(), allow_module_level=True)

import deltarefit  # noqa: E402
from deltarefit.errors import UsageError  # noqa: E402
from deltarefit.storage import StoreError, open_store  # noqa: E402
from deltarefit.storage.local import LocalStore  # noqa: E402
from deltarefit.storage.s3 import S3Store  # noqa: E402
from deltarefit.stream.records import commit_key, head, vkey  # noqa: E402

pytest_plugins = ["conftest_s3"]  # the fixtures s3_server (session) and s3_env

TIMEOUT = 120  # seconds, for any one subprocess
MiB = 1 << 20


def _sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 22):
            h.update(b)
    return h.hexdigest()


def _uploads(srv, store: S3Store) -> list[dict]:
    r = srv.client().list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix + "/")
    return r.get("Uploads", [])


# ------------------------------------------------------------------------------------------ contract


def test_open_store_routes_s3_urls(s3_env):
    st = open_store(f"s3://{s3_env.bucket}/a/b/")
    assert isinstance(st, S3Store) and st.url == f"s3://{s3_env.bucket}/a/b"
    assert (st.bucket, st.prefix) == (s3_env.bucket, "a/b")
    with pytest.raises(UsageError):
        S3Store("s3:///prefix")


def test_store_contract(s3_env, tmp_path):
    url = s3_env.url("contract")
    st = open_store(url)
    assert st.list() == []
    with pytest.raises(KeyError):
        st.get("nope")
    with pytest.raises(KeyError):
        st.get_to("nope", str(tmp_path / "x"))
    assert not (tmp_path / "x").exists() and os.listdir(tmp_path) == []
    with pytest.raises(KeyError):
        st.size("nope")
    with pytest.raises(KeyError):
        st.mtime("nope")
    assert not st.exists("nope")
    st.delete("nope")  # deleting a missing key is not an error
    for bad in ("", "/a", "a//b", "a/../b", "./a"):
        with pytest.raises(UsageError):
            st.put(bad, b"x")

    t0 = time.time()
    st.put("a/x", b"one")
    st.put("a/x", b"two")  # overwrite
    st.put("ab", b"")  # empty object
    st.put("a/b/c", b"\x00" * 1000)
    src = tmp_path / "src"
    src.write_bytes(b"file" * 100)
    st.put_file("b", str(src))
    assert st.get("a/x") == b"two" and st.get("ab") == b"" and st.get("b") == b"file" * 100
    assert st.exists("a/x") and st.exists("ab")
    assert st.size("a/b/c") == 1000 and st.size("ab") == 0
    assert abs(st.mtime("a/x") - t0) < 60
    st.get_to("a/b/c", str(tmp_path / "out"))
    assert (tmp_path / "out").read_bytes() == b"\x00" * 1000
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]  # no temp file left behind

    # String-prefix semantics, sorted, relative to the store's prefix.
    assert st.list() == ["a/b/c", "a/x", "ab", "b"]
    assert st.list("a") == ["a/b/c", "a/x", "ab"]
    assert st.list("a/") == ["a/b/c", "a/x"]
    assert st.list("a/b") == ["a/b/c"]
    assert st.list("c") == []
    # A store's prefix is a directory: s3://bucket/p does not see s3://bucket/px.
    other = open_store(url + "x")
    other.put("a/x", b"other")
    assert st.list() == ["a/b/c", "a/x", "ab", "b"] and other.list() == ["a/x"]
    assert st.get("a/x") == b"two"

    assert st.create("c", b"first") is True
    assert st.create("c", b"second") is False
    assert st.get("c") == b"first"
    assert st.create("a/x", b"z") is False and st.get("a/x") == b"two"

    st.delete("a/x")
    assert not st.exists("a/x") and st.list("a/") == ["a/b/c"]
    with pytest.raises(KeyError):
        st.get("a/x")
    assert st.create("a/x", b"again") is True


# Racing creators in threads, one store object each: tests/test_store_contract.py runs that on every store, S3
# included. Here, racing processes:


RACER = """
import json, os, sys, time
from deltarefit.storage.s3 import S3Store
url, gate, me = sys.argv[1], sys.argv[2], sys.argv[3]
st = S3Store(url)
st.exists("warm-up")  # the client is made and connected before the gate opens
open(f"{gate}.{os.getpid()}.ready", "w").close()
t0 = time.monotonic()
while not os.path.exists(gate) and time.monotonic() - t0 < 60:
    time.sleep(0.001)
print(json.dumps([k for k in range(int(sys.argv[4])) if st.create(f"p/{k:03d}", f"{k} by {me}".encode())]))
"""


def wait_ready(gate: str, procs) -> None:
    """Until every process has written ``GATE.PID.ready`` (or one exited, or 60 s passed)."""
    t0 = time.monotonic()
    while not all(os.path.exists(f"{gate}.{p.pid}.ready") for p in procs):
        assert time.monotonic() - t0 < 60 and all(p.poll() is None for p in procs), "a racer never got ready"
        time.sleep(0.005)


def test_create_race_processes(s3_env, tmp_path):
    """Two processes create the same keys at once: exactly one wins each key."""
    url, gate, n = s3_env.url("race-procs"), str(tmp_path / "gate"), 30
    env = subprocess_env(s3_env)
    procs = {me: subprocess.Popen([sys.executable, "-c", RACER, url, gate, me, str(n)], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for me in "AB"}
    res = {}
    try:
        wait_ready(gate, procs.values())  # both have imported and connected
        open(gate, "w").close()
        for me, p in procs.items():
            out, err = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, err
            res[me] = set(json.loads(out))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert res["A"] | res["B"] == set(range(n)) and not res["A"] & res["B"], res
    st = S3Store(url)
    for k in range(n):
        assert st.get(f"p/{k:03d}") == f"{k} by {'A' if k in res['A'] else 'B'}".encode()


# ------------------------------------------------------------------------------------------ big objects


def test_put_file_40mib_multipart_round_trip(s3_env, tmp_path):
    st = S3Store(s3_env.url("big"), multipart_threshold=8 * MiB, multipart_chunksize=8 * MiB, max_concurrency=4)
    src = tmp_path / "big"
    src.write_bytes(os.urandom(40 * MiB + 12345))
    t0 = time.perf_counter()
    st.put_file("v/big", str(src))
    t_put = time.perf_counter() - t0
    head_ = s3_env.client().head_object(Bucket=st.bucket, Key=st.prefix + "/v/big")
    assert head_["ETag"].strip('"').endswith("-6"), head_["ETag"]  # a multipart object of 6 parts
    assert st.size("v/big") == src.stat().st_size and st.list() == ["v/big"]
    assert _uploads(s3_env, st) == []
    t0 = time.perf_counter()
    st.get_to("v/big", str(tmp_path / "back"))
    t_get = time.perf_counter() - t0
    assert _sha(str(tmp_path / "back")) == _sha(str(src))
    assert sorted(os.listdir(tmp_path)) == ["back", "big"]
    # put of bytes over the threshold goes multipart too
    data = os.urandom(9 * MiB)
    st.put("v/bytes", data)
    assert st.get("v/bytes") == data
    print(f"40 MiB put_file {t_put:.2f} s, get_to {t_get:.2f} s")


def test_rate_paces_multipart_transfers_bytes_exact(s3_env, tmp_path):
    """Link emulation: every connection of a parallel multipart transfer shares the store's bucket."""
    rate = 20e6  # 20 MB/s: 12 MiB up and down take at least ~1.2 s
    st = S3Store(s3_env.url("rate"), multipart_threshold=4 * MiB, multipart_chunksize=4 * MiB, max_concurrency=4,
                 rate=rate)
    src = tmp_path / "src"
    src.write_bytes(os.urandom(6 * MiB))
    t0 = time.monotonic()
    st.put_file("v/a", str(src))
    st.get_to("v/a", str(tmp_path / "back"))
    took = time.monotonic() - t0
    assert _sha(str(tmp_path / "back")) == _sha(str(src))
    assert took >= (12 * MiB - 2 * max(rate * 0.05, 64 << 10)) / rate * 0.95


def test_get_range_slices_an_object_on_every_store(s3_env, tmp_path):
    """The relay root streams parts with ranged reads: same slices from S3, a directory and memory."""
    from deltarefit.storage.memory import MemoryStore

    data = os.urandom(3 * MiB + 17)
    stores = [S3Store(s3_env.url("range")), LocalStore(str(tmp_path / "d")), MemoryStore("range")]
    for st in stores:
        st.put("v/obj", data)
        assert st.get_range("v/obj", 0, 10) == data[:10]
        assert st.get_range("v/obj", MiB, 2 * MiB) == data[MiB:3 * MiB]
        assert st.get_range("v/obj", 3 * MiB, MiB) == data[3 * MiB:]  # clipped at the end
    with pytest.raises(KeyError):
        stores[1].get_range("v/missing", 0, 1)


def test_failed_multipart_upload_is_aborted_not_visible(s3_env, tmp_path):
    """A part upload fails mid-transfer: put_file raises StoreError, no object appears and no
    incomplete upload is left, even when the transfer manager's own abort fails too."""
    st = S3Store(s3_env.url("fail"), multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=2)
    src = tmp_path / "f"
    src.write_bytes(os.urandom(20 * MiB))
    cli = st._client()
    calls = {"part": 0, "abort": 0}

    def fail_part(**kw):
        calls["part"] += 1
        if calls["part"] == 3:
            raise RuntimeError("injected: connection lost during part 3")

    def fail_first_abort(**kw):
        calls["abort"] += 1
        if calls["abort"] == 1:
            raise RuntimeError("injected: abort lost")

    cli.meta.events.register("before-send.s3.UploadPart", fail_part)
    cli.meta.events.register("before-send.s3.AbortMultipartUpload", fail_first_abort)
    try:
        with pytest.raises(StoreError) as ei:
            st.put_file("v/f", str(src))
    finally:
        cli.meta.events.unregister("before-send.s3.UploadPart", fail_part)
        cli.meta.events.unregister("before-send.s3.AbortMultipartUpload", fail_first_abort)
    msg = str(ei.value)
    assert "\n" not in msg and st.url + "/v/f" in msg and "injected" in msg, msg
    assert calls["abort"] >= 2  # the transfer manager's abort failed; the store's went through
    assert not st.exists("v/f") and st.list() == []
    assert _uploads(s3_env, st) == []
    st.put_file("v/f", str(src))  # and the store still works
    assert st.size("v/f") == 20 * MiB


def test_sweep_temps_aborts_stale_multipart_uploads(s3_env):
    """A writer killed mid-upload leaves an incomplete multipart upload: never listed as an object,
    removed by sweep_temps once older than the grace period."""
    st = S3Store(s3_env.url("sweep"))
    c = s3_env.client()
    up = c.create_multipart_upload(Bucket=st.bucket, Key=st.prefix + "/v/dead")
    c.upload_part(Bucket=st.bucket, Key=st.prefix + "/v/dead", UploadId=up["UploadId"], PartNumber=1,
                  Body=b"x" * (5 * MiB))
    st.put("v/live", b"ok")
    assert st.list() == ["v/live"]
    assert st.sweep_temps(older_than=3600) == []
    assert len(_uploads(s3_env, st)) == 1
    time.sleep(1.1)
    assert st.sweep_temps(older_than=0, dry_run=True) == ["v/dead"]  # lists, aborts nothing
    assert st.sweep_temps(older_than=0, prefix="v/other/") == []  # outside the prefix: left
    assert len(_uploads(s3_env, st)) == 1
    assert st.sweep_temps(older_than=0) == ["v/dead"]
    assert _uploads(s3_env, st) == [] and st.list() == ["v/live"]


# ------------------------------------------------------------------------------------------ errors


def test_errors_are_one_line_store_errors(s3_env, monkeypatch):
    url = f"s3://{s3_env.bucket}/errs"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(StoreError, match=r"refused by S3 .*credentials") as ei:
        S3Store(url).get("HEAD")
    assert "\n" not in str(ei.value) and url + "/HEAD" in str(ei.value)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    with pytest.raises(StoreError, match="no usable AWS credentials") as ei:
        S3Store(url).put("k", b"x")
    assert "\n" not in str(ei.value) and url in str(ei.value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_env.env["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.env["AWS_SECRET_ACCESS_KEY"])
    with pytest.raises(StoreError, match="bucket 'no-such-bucket' does not exist"):
        S3Store("s3://no-such-bucket/x").list()
    # Nothing listens on a port just freed: connection refused, at once.
    from conftest_s3 import _free_ports

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_ports(1)[0]}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="cannot reach the S3 endpoint") as ei:
        S3Store(url).exists("k")
    assert "\n" not in str(ei.value) and time.monotonic() - t0 < 20


# ------------------------------------------------------------------------------------------ streams


def _checkpoints(d: str, n: int) -> list[str]:
    """n small bf16 safetensors checkpoints, each a small random step from the one before."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    w = {"embed.weight": torch.randn(512, 64, generator=g), "layer.0.weight": torch.randn(64, 64, generator=g),
         "layer.0.bias": torch.randn(64, generator=g), "head.weight": torch.randn(128, 64, generator=g)}
    paths = []
    for i in range(n):
        if i:
            w = {k: v + 0.02 * torch.randn(v.shape, generator=g) * v.abs() for k, v in w.items()}
        p = os.path.join(d, f"step_{i:03d}.safetensors")
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in w.items()}, p)
        paths.append(p)
    return paths


def _cli(srv, *args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltarefit", *args], capture_output=True, text=True,
                          timeout=timeout, env=subprocess_env(srv), check=False)


def _cli_ok(srv, *args: str) -> subprocess.CompletedProcess:
    r = _cli(srv, *args)
    assert r.returncode == 0, f"deltarefit {' '.join(args)} exited {r.returncode}: {r.stderr}"
    return r


@pytest.fixture(scope="module")
def s3_stream(s3_server, tmp_path_factory):
    """A stream on S3 with versions 1..4 = step_000..step_003, published by `deltarefit publish`
    processes. Also step_004 and an alternative step (for racing publishers) not yet published."""
    d = str(tmp_path_factory.mktemp("s3stream"))
    ck = _checkpoints(d, 6)
    url, state = f"{s3_server.url('stream')}", os.path.join(d, "state")
    for i in range(4):
        rec = json.loads(_cli_ok(s3_server, "publish", url, ck[i], "--state", state, "--keyframe-every", "3",
                                 "--json").stdout)
        assert rec["version"] == i + 1
    return {"url": url, "ck": ck, "state": state, "dir": d}


def test_stream_publish_and_sync_bit_exact(s3_env, s3_stream, tmp_path):
    url, ck = s3_stream["url"], s3_stream["ck"]
    st = open_store(url)
    assert head(st) == 4 and all(st.exists(commit_key(v)) for v in range(1, 5))
    log = json.loads(_cli_ok(s3_env, "log", url, "--json").stdout)
    assert [r["version"] for r in log] == [1, 2, 3, 4] and log[0]["kind"] == "keyframe"
    assert [r["fingerprint"] for r in log] == [deltarefit.fingerprint(p) for p in ck[:4]]
    out = str(tmp_path / "follower.safetensors")
    rep = json.loads(_cli_ok(s3_env, "sync", url, out, "--json").stdout)
    assert rep["version"] == 4 and rep["fingerprint"] == deltarefit.fingerprint(ck[3])
    assert _sha(out) == _sha(ck[3])
    # A follower that has version 2 takes the chain to 4.
    out2 = str(tmp_path / "f2.safetensors")
    _cli_ok(s3_env, "sync", url, out2, "--to", "2")
    assert _sha(out2) == _sha(ck[1])
    rep = json.loads(_cli_ok(s3_env, "sync", url, out2, "--json").stdout)
    assert (rep["from_version"], rep["version"]) == (2, 4) and _sha(out2) == _sha(ck[3])


def test_sync_of_deltas_streams_parts_by_ranged_reads(s3_env, s3_stream, tmp_path):
    """A chain sync plans while its parts arrive through ranged GETs (``Range`` header), bit-exact."""
    from deltarefit.stream import Subscriber

    url, ck = s3_stream["url"], s3_stream["ck"]
    reads: dict[str, set[str]] = {"get_range": set(), "get_to": set()}

    class Counting(S3Store):
        def get_range(self, key, start, length):
            reads["get_range"].add(key)
            return super().get_range(key, start, length)

        def get_to(self, key, path):
            reads["get_to"].add(key)
            return super().get_to(key, path)

    out = str(tmp_path / "f.safetensors")
    Subscriber(url, out, subscriber_id="ranged").sync(to_version=1)  # the keyframe: staged whole
    rep = Subscriber(Counting(url), out, subscriber_id="ranged").sync()
    assert (rep.route, rep.versions_applied) == ("chain", [2, 3, 4]) and _sha(out) == _sha(ck[3])
    assert rep.fingerprint == deltarefit.fingerprint(ck[3])
    deltas = {k for k in reads["get_range"] if k.endswith("/delta")}
    assert len(deltas) == 3 and not reads["get_to"]
    assert rep.bytes_fetched == sum(open_store(url).size(k) for k in deltas)
    assert not os.path.exists(out + ".deltarefit-staging")


GATED = """
import os, sys, time
import deltarefit.cli
from deltarefit.storage import s3
gate_dir, me, need = sys.argv[1], sys.argv[2], int(sys.argv[3])
real = s3.S3Store.create

def create(self, key, data):
    # Every publisher reaches the commit point before any of them commits (or a release file appears).
    open(os.path.join(gate_dir, "ready-" + me), "w").close()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        if len([f for f in os.listdir(gate_dir) if f.startswith("ready-")]) >= need:
            break
        if os.path.exists(os.path.join(gate_dir, "release")):
            break
        time.sleep(0.005)
    return real(self, key, data)

s3.S3Store.create = create
deltarefit.cli.main(sys.argv[4:], prog_name="deltarefit")
"""


def _gated(srv, gate_dir: str, me: str, need: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", GATED, gate_dir, me, str(need), *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(srv))


def _finish(p: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    return p.returncode, out, err


def test_racing_publishers_then_subscriber_during_publish(s3_env, s3_stream, tmp_path):
    """Two `deltarefit publish` processes, both holding their commit at the conditional create until the
    other gets there too, race for version 5 on S3: exactly one commits, the other is refused. Then a
    subscriber syncs while a publisher has uploaded version 6's parts but not committed them (it ends
    at version 5, bit-exact), and again while the commit happens (it ends at 5 or 6, bit-exact)."""
    url, ck = s3_stream["url"], s3_stream["ck"]
    st = open_store(url)
    fps = {p: deltarefit.fingerprint(p) for p in ck}

    # --- two publishers race for version 5
    states = {n: str(tmp_path / f"state{n}") for n in "AB"}
    for s in states.values():
        shutil.copytree(s3_stream["state"], s)
    cks = {"A": ck[4], "B": ck[5]}
    gate = str(tmp_path / "gate5")
    os.mkdir(gate)
    procs = {n: _gated(s3_env, gate, n, 2, "publish", url, cks[n], "--state", states[n], "--json") for n in "AB"}
    res = {n: _finish(p) for n, p in procs.items()}
    assert sorted(r[0] for r in res.values()) == [0, 9], res
    w = next(n for n in "AB" if res[n][0] == 0)
    lo = "B" if w == "A" else "A"
    assert "committed by another publisher first" in res[lo][2], res[lo][2]
    assert sorted(os.listdir(gate)) == ["ready-A", "ready-B"]  # both reached the commit point
    rec = json.loads(res[w][1])
    assert rec["version"] == 5 and rec["fingerprint"] == fps[cks[w]]
    assert head(st) == 5
    parts = ([rec["delta"]["key"]] if rec["delta"] else []) + [p["key"] for _, p in rec["keyframe"]]
    assert set(st.list(vkey(5) + "/")) == set(parts) | {commit_key(5)}  # the loser's parts are gone

    # --- a subscriber syncs while the next version is uploaded but not committed
    nxt = ck[5] if w == "A" else ck[4]  # the checkpoint that lost becomes version 6
    gate6 = str(tmp_path / "gate6")
    os.mkdir(gate6)
    pub = _gated(s3_env, gate6, "P", 2, "publish", url, nxt, "--state", states[w], "--json")
    try:
        t0 = time.monotonic()
        while not os.path.exists(os.path.join(gate6, "ready-P")) and time.monotonic() - t0 < 60:
            assert pub.poll() is None, pub.communicate()
            time.sleep(0.01)
        assert os.path.exists(os.path.join(gate6, "ready-P")), "publisher never reached its commit"
        assert len(st.list(vkey(6) + "/")) >= 1 and not st.exists(commit_key(6))  # parts up, no commit
        sub = str(tmp_path / "sub.safetensors")
        r = json.loads(_cli_ok(s3_env, "sync", url, sub, "--json").stdout)
        assert r["version"] == 5 and _sha(sub) == _sha(cks[w]) and r["fingerprint"] == fps[cks[w]]
        # Release the commit and sync concurrently until the subscriber has version 6.
        open(os.path.join(gate6, "release"), "w").close()
        seen = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            r = json.loads(_cli_ok(s3_env, "sync", url, sub, "--json").stdout)
            seen.append(r["version"])
            assert r["version"] in (5, 6)
            assert _sha(sub) == _sha(cks[w] if r["version"] == 5 else nxt)
            if r["version"] == 6:
                break
    finally:
        code, out, err = _finish(pub)
    assert code == 0, err
    assert json.loads(out)["version"] == 6 and seen[-1] == 6, seen
    assert deltarefit.fingerprint(sub) == fps[nxt]
    with contextlib.suppress(FileNotFoundError):
        assert not any(".tmp-" in f for f in os.listdir(tmp_path))


# ------------------------------------------------------------------------------------------ faults (issue 34)


def _fault_env(srv, fault: str) -> dict[str, str]:
    from conftest_s3 import _free_ports

    if fault == "credentials":
        return subprocess_env(srv, AWS_SECRET_ACCESS_KEY="wrong-secret")
    return subprocess_env(srv, AWS_ENDPOINT_URL=f"http://127.0.0.1:{_free_ports(1)[0]}", AWS_MAX_ATTEMPTS="1")


# Each fault once in the default suite; every pair under `make test-slow`.
@pytest.mark.parametrize(("command", "fault"), [
    ("publish", "credentials"), ("sync", "endpoint"), ("retain", "credentials"),
    pytest.param("publish", "endpoint", marks=pytest.mark.slow),
    pytest.param("sync", "credentials", marks=pytest.mark.slow),
    pytest.param("retain", "endpoint", marks=pytest.mark.slow),
])
def test_s3_faults_are_one_line_and_a_rerun_finishes(s3_env, s3_stream, tmp_path, command, fault):
    """An S3 store that refuses the credentials, or an endpoint nothing listens on: publish, sync and
    retain end in one line naming the store (no traceback, nothing written locally, nothing committed),
    and the same command rerun against the working server finishes bit-exact."""
    ck = s3_stream["ck"]
    if command == "publish":
        url, state = s3_env.url(f"faults-{fault}"), str(tmp_path / "state")
        _cli_ok(s3_env, "publish", url, ck[0], "--state", state)
        args = ["publish", url, ck[1], "--state", state]
    elif command == "sync":
        url = s3_stream["url"]
        args = ["sync", url, str(tmp_path / "ck.safetensors")]
    else:
        url = s3_stream["url"]
        args = ["retain", url, "--dry-run"]
    r = subprocess.run([sys.executable, "-m", "deltarefit", *args], capture_output=True, text=True,
                       timeout=TIMEOUT, env=_fault_env(s3_env, fault), check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("deltarefit: error: ") and url.split("://", 1)[1].split("/", 1)[0] in lines[0], lines
    assert ("credentials" in lines[0]) if fault == "credentials" else ("cannot reach" in lines[0]), lines
    assert not os.path.exists(tmp_path / "ck.safetensors")
    if command == "publish":
        assert head(open_store(url)) == 1  # nothing committed
    _cli_ok(s3_env, *args)
    if command == "publish":
        assert head(open_store(url)) == 2
        _cli_ok(s3_env, "sync", url, str(tmp_path / "new.safetensors"))
        assert _sha(str(tmp_path / "new.safetensors")) == _sha(ck[1])
    elif command == "sync":  # the module's stream: other tests may have published after version 4
        from deltarefit.stream.records import load_commit

        st = open_store(url)
        assert deltarefit.fingerprint(str(tmp_path / "ck.safetensors")) == load_commit(st, head(st)).fingerprint
