"""Version streams, library and command line: real checkpoints from real AdamW steps of a tiny BERT,
real stores on disk, real processes. Version v of the stream is always ``step_{v:03d}.safetensors``.

Tests whose docstring starts "Regression" failed on commit 9639647 (the bug is described there) and pass
once it is fixed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
from _stream_util import (
    ENV,
    TIMEOUT,
    chain_fingerprints,
    check_stream_whole,
    commits,
    flip_tensor_byte,
    read_bytes,
    run,
    run_ok,
    session_chain,
    sha,
)

import deltarefit
from deltarefit.errors import BaseMismatchError, UsageError
from deltarefit.signing import SIGNATURE_ALG, SignatureError
from deltarefit.storage import LocalStore, MemoryStore, StoreError
from deltarefit.stream import Publisher, PublishError, StreamError, Subscriber
from deltarefit.stream.records import commit_key, head, list_versions, prepared_key, vkey
from deltarefit.stream.retention import retain
from deltarefit.stream.subscriber import state_path

HEAD = 23  # versions 1..23 = steps 1..23
KF_EVERY = 5
KF_RATIO = 1000.0  # keyframes only every KF_EVERY versions (and the first), never by size
KEYFRAMES = [1, 5, 10, 15, 20]


def _publisher(store, state_dir, **kw) -> Publisher:
    kw.setdefault("keyframe_every", KF_EVERY)
    kw.setdefault("keyframe_ratio", KF_RATIO)
    return Publisher(store, state_dir, **kw)


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def chain(tmp_path_factory) -> list[str]:
    """step_000 .. step_023: bf16 exports of real AdamW steps of a tiny BERT (once per session)."""
    return session_chain(tmp_path_factory)


@pytest.fixture(scope="session")
def chain_fps(chain) -> list[str]:
    return chain_fingerprints(chain)


@pytest.fixture(scope="module")
def published(tmp_path_factory, chain):
    """A stream of 23 versions, published one by one with a follower syncing after every publish.
    Returns the pristine store and publisher state (copied by ``stream`` before any test changes
    them) and what was observed along the way."""
    d = tmp_path_factory.mktemp("published")
    store = LocalStore(str(d / "store"))
    pub = _publisher(store, str(d / "pub"))
    follower = Subscriber(store, str(d / "follower.safetensors"), subscriber_id="follower")
    seen = []
    for v in range(1, HEAD + 1):
        rec = pub.publish(chain[v], step=v)
        rep = follower.sync()
        seen.append({"rec": rec, "rep": rep, "sha": sha(follower.checkpoint),
                     "fp": deltarefit.fingerprint(follower.checkpoint), "current": follower.current(),
                     "state": pub.state()})
    return {"root": str(d), "store": str(d / "store"), "pub": str(d / "pub"), "seen": seen}


class Stream:
    def __init__(self, root: str) -> None:
        self.root = root
        self.url = os.path.join(root, "store")
        self.store = LocalStore(self.url)
        self.pub_state = os.path.join(root, "pub")
        self.recs = commits(self.store)

    def path(self, key: str) -> str:
        return os.path.join(self.url, *key.split("/"))

    def part_keys(self) -> set[str]:
        return {k for k in self.store.list("v/") if len(k.split("/")) >= 4}

    def edit_commit(self, version: int, fn) -> None:
        d = json.loads(self.store.get(commit_key(version)))
        fn(d)
        self.store.put(commit_key(version), json.dumps(d, sort_keys=True, indent=1).encode())


@pytest.fixture
def stream(published, tmp_path):
    """A private copy of the 23-version stream (store and publisher state)."""
    root = tmp_path / "s"
    shutil.copytree(published["store"], root / "store")
    shutil.copytree(published["pub"], root / "pub")
    return Stream(str(root))


def _new_sub(stream: Stream, tmp_path, name: str, **kw) -> Subscriber:
    return Subscriber(stream.store, str(tmp_path / f"{name}.safetensors"), subscriber_id=name, **kw)


def _exact(path: str, step_file: str, fp: str) -> None:
    assert deltarefit.fingerprint(path) == fp
    assert sha(path) == sha(step_file)  # the exports carry no metadata: equal tensors, equal files


# ------------------------------------------------------------------------------------------ the chain


def test_chain_published_and_followed_bit_exact(published, chain, chain_fps):
    seen = published["seen"]
    assert len(seen) == HEAD >= 20
    for v, s in enumerate(seen, start=1):
        rec, rep = s["rec"], s["rep"]
        assert rec.version == v and rec.step == v and rec.fingerprint == chain_fps[v]
        assert rec.parent == (None if v == 1 else chain_fps[v - 1])
        assert rec.kind == ("keyframe" if v in KEYFRAMES else "delta"), v
        assert (rec.delta is None) == (v == 1)
        assert s["state"].version == v and s["state"].fingerprint == chain_fps[v]
        # The follower: bit-exact at every step, and stamped with the version it holds.
        assert rep.version == v and rep.from_version == v - 1 and rep.versions_applied == [v]
        assert rep.fingerprint == s["fp"] == chain_fps[v]
        assert s["sha"] == sha(chain[v])
        assert s["current"] == (v, chain_fps[v])
        if v == 1:
            assert rep.route == "keyframe" and rep.bytes_fetched == rec.part_bytes
        else:  # one delta is always cheaper than a whole keyframe
            assert rep.route == "chain" and rep.bytes_fetched == rec.delta.bytes


def test_log_json_lists_versions_parents_kinds_sizes(published, chain_fps):
    r = run_ok("log", published["store"], "--json")
    rows = json.loads(r.stdout)
    assert [row["version"] for row in rows] == list(range(1, HEAD + 1))
    st = LocalStore(published["store"])
    for row in rows:
        v = row["version"]
        assert row["fingerprint"] == chain_fps[v] and row["step"] == v and row["signed"] is False
        assert row["parent"] == (None if v == 1 else rows[v - 2]["fingerprint"])
        assert row["kind"] == ("keyframe" if v in KEYFRAMES else "delta")
        rec = commits(st)[v]
        # Sizes are the sizes of the stored objects.
        if v == 1:
            assert row["delta_bytes"] is None
        else:
            assert row["delta_bytes"] == st.size(rec.delta.key) == rec.delta.bytes
            assert row["ratio"] == pytest.approx(row["full_bytes"] / row["delta_bytes"])
        if v in KEYFRAMES:
            assert row["keyframe_bytes"] == sum(st.size(p.key) for _, p in rec.keyframe) > row["full_bytes"] > 0
        else:
            assert row["keyframe_bytes"] is None
    text = run_ok("log", published["store"]).stdout.splitlines()
    assert len(text) == HEAD and text[0].startswith("v1 ") and "keyframe" in text[4]


def test_late_joiner_restores_from_newest_keyframe(stream, tmp_path, chain, chain_fps):
    sub = _new_sub(stream, tmp_path, "late")
    rep = sub.sync(to_version=17)
    r = stream.recs
    assert rep.route == "keyframe" and rep.from_version == 0 and rep.versions_applied == [15, 16, 17]
    assert rep.bytes_fetched == r[15].keyframe[0][1].bytes + r[16].delta.bytes + r[17].delta.bytes
    _exact(sub.checkpoint, chain[17], chain_fps[17])
    assert sub.current() == (17, chain_fps[17])
    # The same through the command line, for a checkpoint path that does not exist yet.
    ck = str(tmp_path / "cli_late.safetensors")
    out = json.loads(run_ok("sync", stream.url, ck, "--to", "17", "--id", "cli-late", "--json").stdout)
    assert out["route"] == "keyframe" and out["version"] == 17 and out["versions_applied"] == [15, 16, 17]
    _exact(ck, chain[17], chain_fps[17])


def _cheapest(recs, start: int, target: int) -> tuple[str, int]:
    """The cheapest route from ``start`` to ``target``, computed from the commit records."""
    vs = range(start + 1, target + 1)
    best = ("chain", sum(recs[v].delta.bytes for v in vs))
    for k in vs:
        if recs[k].keyframe:
            cost = sum(p.bytes for _, p in recs[k].keyframe) + sum(recs[v].delta.bytes for v in vs if v > k)
            if cost < best[1]:
                best = ("keyframe", cost)
    return best


def test_cheapest_route_and_to(stream, tmp_path, chain, chain_fps):
    sub = _new_sub(stream, tmp_path, "three")
    assert sub.sync(to_version=3).version == 3
    route, cost = _cheapest(stream.recs, 3, 22)
    chain_cost = sum(stream.recs[v].delta.bytes for v in range(4, 23))
    assert route == "keyframe" and cost < chain_cost  # this stream: a keyframe beats 19 deltas
    rep = sub.sync(to_version=22)
    assert (rep.route, rep.bytes_fetched, rep.version) == (route, cost, 22)
    assert rep.versions_applied == [20, 21, 22]
    _exact(sub.checkpoint, chain[22], chain_fps[22])
    # Near the head the chain is cheaper than the keyframe: 17 -> 21.
    sub2 = _new_sub(stream, tmp_path, "seventeen")
    sub2.sync(to_version=17)
    route, cost = _cheapest(stream.recs, 17, 21)
    assert route == "chain"
    rep = sub2.sync(to_version=21)
    assert (rep.route, rep.bytes_fetched, rep.versions_applied) == ("chain", cost, [18, 19, 20, 21])
    _exact(sub2.checkpoint, chain[21], chain_fps[21])
    # --to V stops at V, then a plain sync goes on to the head.
    ck = str(tmp_path / "to.safetensors")
    out = json.loads(run_ok("sync", stream.url, ck, "--to", "9", "--id", "to9", "--json").stdout)
    assert out["version"] == 9 and json.loads(read_bytes(state_path(ck)))["version"] == 9
    _exact(ck, chain[9], chain_fps[9])
    r = run_ok("sync", stream.url, ck, "--id", "to9")
    assert "version 9 -> 23" in r.stdout and chain_fps[23] in r.stdout
    _exact(ck, chain[23], chain_fps[23])
    # Nothing left beside the checkpoints.
    assert not [f for f in os.listdir(tmp_path) if "staging" in f or "journal" in f or ".tmp-" in f]
    # A version that does not exist.
    r = run("sync", stream.url, ck, "--to", "24", "--id", "to9")
    assert r.returncode == 9 and "no committed version 24" in r.stderr


def test_memory_staging_takes_routes_of_deltas_and_keyframes_stay_beside(stream, tmp_path, chain, chain_fps,
                                                                         monkeypatch):
    """A subscriber with ``memory_staging`` (an engine's, in a tmpfs) stages a route of deltas there, a
    route with a keyframe beside the checkpoint (it is renamed into place), and a route of deltas that
    takes more than a quarter of the room left there beside the checkpoint too; each ends bit-exact
    with nothing left in either place."""
    ck = str(tmp_path / "eng.safetensors")
    staged: list[str] = []

    def hook(path: str) -> str:
        staged.append(os.path.dirname(path))
        return deltarefit.apply(path, ck).target_fingerprint

    sub = Subscriber(stream.store, ck, subscriber_id="eng", apply_hook=hook)
    sub.memory_staging = str(tmp_path / "mem" / "staging")
    os.makedirs(os.path.dirname(sub.memory_staging))
    rep = sub.sync(to_version=17)  # a late joiner: the keyframe at 15, then the deltas 16 and 17
    assert rep.route == "keyframe" and rep.versions_applied == [15, 16, 17]
    assert staged == [sub.staging, sub.staging]
    _exact(ck, chain[17], chain_fps[17])
    staged.clear()
    rep = sub.sync(to_version=19)
    assert rep.route == "chain" and rep.versions_applied == [18, 19]
    assert staged == [sub.memory_staging] * 2
    _exact(ck, chain[19], chain_fps[19])
    need = stream.recs[20].delta.bytes + stream.recs[21].delta.bytes
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=4 * need - 4))
    staged.clear()
    assert sub.sync(to_version=21).versions_applied == [20, 21]
    assert staged == [sub.staging] * 2
    _exact(ck, chain[21], chain_fps[21])
    assert not os.path.exists(sub.memory_staging) and not os.path.exists(sub.staging)


def test_adopts_checkpoint_by_fingerprint(stream, tmp_path, chain, chain_fps):
    ck = str(tmp_path / "seven.safetensors")
    shutil.copyfile(chain[7], ck)
    sub = Subscriber(stream.store, ck, subscriber_id="seven")
    assert sub.current() is None
    rep = sub.sync(to_version=7)
    assert (rep.from_version, rep.version, rep.route, rep.bytes_fetched) == (7, 7, "none", 0)
    assert sub.current() == (7, chain_fps[7]) and sha(ck) == sha(chain[7])
    rep = sub.sync()
    assert rep.from_version == 7 and rep.version == HEAD
    _exact(ck, chain[HEAD], chain_fps[HEAD])
    # A checkpoint that is no version of the stream is refused, untouched.
    other = str(tmp_path / "other.safetensors")
    shutil.copyfile(chain[0], other)  # step 0 was never published
    before = sha(other)
    with pytest.raises(StreamError, match="is no version of"):
        Subscriber(stream.store, other, subscriber_id="other").sync()
    assert sha(other) == before and not os.path.exists(state_path(other))


def test_wrong_parent_refused_nothing_written(stream, tmp_path, chain):
    sub = _new_sub(stream, tmp_path, "ten")
    sub.sync(to_version=10)
    flip_tensor_byte(sub.checkpoint)
    before, state_before = sha(sub.checkpoint), read_bytes(state_path(sub.checkpoint))
    with pytest.raises((BaseMismatchError, StreamError)):
        sub.sync(to_version=12)  # the chain route: the delta's base is not what the file holds
    assert sha(sub.checkpoint) == before and read_bytes(state_path(sub.checkpoint)) == state_before
    assert not os.path.exists(sub.checkpoint + ".deltarefit-journal")
    r = run("sync", stream.url, sub.checkpoint, "--to", "12", "--id", "ten")
    assert r.returncode in (5, 9) and r.stderr.startswith("deltarefit: error:") and "Traceback" not in r.stderr
    assert sha(sub.checkpoint) == before and read_bytes(state_path(sub.checkpoint)) == state_before


# ------------------------------------------------------------------------------------------ racing publishers


class BarrierStore(LocalStore):
    """A real LocalStore whose commit-record ``create`` waits until both publishers reach it, so that
    the race is decided by the store's conditional create and nothing else."""

    def __init__(self, root: str, barrier: threading.Barrier) -> None:
        super().__init__(root)
        self.barrier = barrier

    def create(self, key: str, data: bytes) -> bool:
        if key.endswith("/commit.json"):
            self.barrier.wait(timeout=30)
        return super().create(key, data)


def test_racing_publishers_one_wins_loser_follows(stream, chain, chain_fps, tmp_path):
    sa, sb = str(tmp_path / "pubA"), str(tmp_path / "pubB")
    shutil.copytree(stream.pub_state, sa)
    shutil.copytree(stream.pub_state, sb)
    barrier = threading.Barrier(2)
    pubs = {"A": _publisher(BarrierStore(stream.url, barrier), sa, publisher_id="A"),
            "B": _publisher(BarrierStore(stream.url, barrier), sb, publisher_id="B")}
    ckpt = {"A": chain[0], "B": chain[1]}  # both differ from the head (step 23)
    out: dict[str, object] = {}

    def go(name: str) -> None:
        try:
            out[name] = pubs[name].publish(ckpt[name])
        except BaseException as e:
            out[name] = e

    ts = [threading.Thread(target=go, args=(n,)) for n in "AB"]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    won = [n for n in "AB" if not isinstance(out[n], BaseException)]
    lost = [n for n in "AB" if isinstance(out[n], BaseException)]
    assert len(won) == 1 and len(lost) == 1, out
    w, lo = won[0], lost[0]
    assert isinstance(out[lo], PublishError) and "another publisher" in str(out[lo])
    rec = out[w]
    v = HEAD + 1
    assert rec.version == v and rec.publisher == w
    assert head(stream.store) == v and list_versions(stream.store)[-1] == v
    # Only the winner's parts (and its commit record) under v/N/.
    parts = {p.key for p in ([rec.delta] if rec.delta else []) + [p for _, p in rec.keyframe]}
    assert set(stream.store.list(vkey(v) + "/")) == parts | {commit_key(v)}
    assert json.loads(stream.store.get(commit_key(v)))["publisher"] == w
    # The loser's state did not move; recover() makes its baseline follow the winner.
    loser = pubs[lo]
    assert loser.state().version == HEAD
    st = loser.recover()
    assert (st.version, st.fingerprint) == (v, deltarefit.fingerprint(ckpt[w]))
    assert sha(loser.baseline) == sha(ckpt[w]) == sha(pubs[w].baseline)
    # ... and it can publish the next version on top of the winner's.
    rec2 = _publisher(stream.store, {"A": sa, "B": sb}[lo]).publish(chain[5])
    assert rec2.version == v + 1 and rec2.parent == st.fingerprint
    sub = _new_sub(stream, tmp_path, "after-race")
    sub.sync()
    _exact(sub.checkpoint, chain[5], chain_fps[5])
    check_stream_whole(stream.store)


def test_republishing_head_is_a_no_op(stream, chain, chain_fps):
    """Regression (bug found in 9639647): publisher.py:219-224: publishing a checkpoint that already is the
    head encodes a delta into state_dir/staging and returns the existing version without removing it: a
    delta-sized file is left in the publisher's state directory
    """
    pub = _publisher(stream.store, stream.pub_state)
    before = sorted(stream.store.list())
    rec = pub.publish(chain[HEAD])
    assert rec.version == HEAD and rec.fingerprint == chain_fps[HEAD]
    assert sorted(stream.store.list()) == before and pub.state().version == HEAD
    assert sorted(os.listdir(stream.pub_state)) == ["baseline.hashes", "baseline.safetensors", "format.json",
                                                     "publisher.json"]


GATED = """
import os, sys, time
import deltarefit.cli, deltarefit.stream.publisher, deltarefit.encode, deltarefit.apply  # warm imports
gate = sys.argv[1]
open(f"{gate}.{os.getpid()}.ready", "w").close()  # imported: the test opens the gate once all are
t0 = time.monotonic()
while not os.path.exists(gate) and time.monotonic() - t0 < 60:
    time.sleep(0.001)
deltarefit.cli.main(sys.argv[2:], prog_name="deltarefit")
"""


def wait_ready(gate: str, procs) -> None:
    """Until every process has written ``GATE.PID.ready`` (or one exited, or 60 s passed)."""
    t0 = time.monotonic()
    while not all(os.path.exists(f"{gate}.{p.pid}.ready") for p in procs):
        assert time.monotonic() - t0 < 60 and all(p.poll() is None for p in procs), "a racer never got ready"
        time.sleep(0.005)


def test_racing_publish_processes(stream, chain, chain_fps, tmp_path):
    """Two real `deltarefit publish` processes on one state: per round exactly one commits. Both
    processes import first and wait on a gate file, so the race is not decided by import times."""
    rounds = 3
    base_state = stream.pub_state
    for rnd in range(rounds):
        v = HEAD + 1 + rnd
        states = {n: str(tmp_path / f"r{rnd}{n}") for n in "AB"}
        for s in states.values():
            shutil.copytree(base_state, s)
        ck = {"A": chain[2 * rnd], "B": chain[2 * rnd + 1]}
        gate = str(tmp_path / f"gate{rnd}")
        procs = {n: subprocess.Popen([sys.executable, "-c", GATED, gate, "publish", stream.url, ck[n], "--state",
                                      states[n], "--keyframe-every", str(KF_EVERY), "--keyframe-ratio",
                                      str(KF_RATIO), "--json"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
                 for n in "AB"}
        wait_ready(gate, procs.values())  # both have imported (they are waiting on the gate)
        open(gate, "w").close()
        res = {}
        for n, p in procs.items():
            try:
                o, e = p.communicate(timeout=TIMEOUT)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
            res[n] = (p.returncode, o, e)
        codes = sorted(r[0] for r in res.values())
        assert codes == [0, 9], res
        w = next(n for n in "AB" if res[n][0] == 0)
        lo = "B" if w == "A" else "A"
        assert "committed by another publisher first" in res[lo][2]
        rec = json.loads(res[w][1])
        assert rec["version"] == v and rec["fingerprint"] == deltarefit.fingerprint(ck[w])
        assert head(stream.store) == v
        parts = [rec["delta"]["key"]] if rec["delta"] else []
        parts += [p["key"] for _, p in rec["keyframe"]]
        assert set(stream.store.list(vkey(v) + "/")) == set(parts) | {commit_key(v)}
        # The loser follows the winner through recover (library) and matches it bit for bit.
        st = _publisher(stream.store, states[lo]).recover()
        assert (st.version, st.fingerprint) == (v, rec["fingerprint"])
        assert sha(os.path.join(states[lo], "baseline.safetensors")) == sha(ck[w])
        base_state = states[w]
    recs = check_stream_whole(stream.store)
    assert max(recs) == HEAD + rounds


# ------------------------------------------------------------------------------------------ joint commit


def _prepare_loop(sub: Subscriber, stop: threading.Event, got: list, errors: list) -> None:
    try:
        while not stop.is_set():
            v = sub.prepare()
            if v is not None:
                got.append(v)
                return
            time.sleep(0.02)
    except BaseException as e:
        errors.append(e)


def _joint_round(pub: Publisher, ckpt: str, subs: list[Subscriber]):
    stop = threading.Event()
    got: dict[str, list] = {s.id: [] for s in subs}
    errors: list = []
    result: list = []

    def publish() -> None:
        try:
            result.append(pub.publish(ckpt))
        except BaseException as e:
            result.append(e)
        finally:
            stop.set()

    ts = [threading.Thread(target=_prepare_loop, args=(s, stop, got[s.id], errors)) for s in subs]
    ts.append(threading.Thread(target=publish))
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in ts)
    assert not errors, errors
    return result[0], got


def test_joint_commit(tmp_path, chain, chain_fps):
    store = LocalStore(str(tmp_path / "store"))
    setup = _publisher(store, str(tmp_path / "pub"))
    for v in range(1, 5):
        setup.publish(chain[v])
    subs = [Subscriber(LocalStore(store.url), str(tmp_path / f"{n}.safetensors"), subscriber_id=n)
            for n in ("s1", "s2")]
    for s in subs:
        s.sync()
    shas = {s.id: sha(s.checkpoint) for s in subs}
    # Both acknowledge: version 5 commits.
    pub = _publisher(LocalStore(store.url), str(tmp_path / "pub"), quorum=2, ack_timeout=30)
    rec, got = _joint_round(pub, chain[5], subs)
    assert not isinstance(rec, BaseException), rec
    assert rec.version == 5 and got == {"s1": [5], "s2": [5]}
    assert {s.id: sha(s.checkpoint) for s in subs} == shas  # prepare never writes the checkpoint
    assert not store.exists(prepared_key(5))
    for n in ("s1", "s2"):
        ack = json.loads(store.get(f"acks/{5:012d}/{n}.json"))
        assert ack["ok"] is True and ack["fingerprint"] == chain_fps[5]
    for s in subs:
        assert s.sync().version == 5
        _exact(s.checkpoint, chain[5], chain_fps[5])
    # s2's checkpoint is wrong (one byte): it acknowledges ok=false; 1 of 2 in time is a failure.
    flip_tensor_byte(subs[1].checkpoint)
    bad_sha = sha(subs[1].checkpoint)
    st_before, base_before = pub.state(), sha(pub.baseline)
    pub_short = _publisher(LocalStore(store.url), str(tmp_path / "pub"), quorum=2, ack_timeout=1.5)
    t0 = time.monotonic()
    res, got = _joint_round(pub_short, chain[6], subs)
    assert isinstance(res, PublishError) and "1 of 2" in str(res), res
    assert time.monotonic() - t0 < 20
    assert got["s1"] == [6] and got["s2"] == []
    nack = json.loads(store.get(f"acks/{6:012d}/s2.json"))
    assert nack["ok"] is False and nack["why"]
    assert not store.exists(commit_key(6)) and head(store) == 5
    assert store.list(vkey(6) + "/") == []  # parts removed, proposal withdrawn
    assert pub.state() == st_before and sha(pub.baseline) == base_before
    assert sha(subs[1].checkpoint) == bad_sha and sha(subs[0].checkpoint) == sha(chain[5])
    # The bad checkpoint is repaired; the next joint publish commits.
    shutil.copyfile(chain[5], subs[1].checkpoint)
    rec, got = _joint_round(_publisher(LocalStore(store.url), str(tmp_path / "pub"), quorum=2, ack_timeout=30),
                            chain[6], subs)
    assert not isinstance(rec, BaseException), rec
    assert rec.version == 6 and rec.parent == chain_fps[5]
    for s in subs:
        s.sync()
        _exact(s.checkpoint, chain[6], chain_fps[6])
    check_stream_whole(store)


def test_joint_commit_with_quorum_all_waits_for_every_live_subscriber(tmp_path, chain, chain_fps):
    from deltarefit.stream.publisher import ALL

    store = LocalStore(str(tmp_path / "store"))
    setup = _publisher(store, str(tmp_path / "pub"))
    for v in range(1, 3):
        setup.publish(chain[v])
    subs = [Subscriber(LocalStore(store.url), str(tmp_path / f"{n}.safetensors"), subscriber_id=n)
            for n in ("a", "b", "c")]
    for s in subs:
        s.sync()  # each sync records a heartbeat: three live subscribers
    # Only two of the three answer: with quorum "all" that is not enough.
    res, got = _joint_round(_publisher(LocalStore(store.url), str(tmp_path / "pub"), quorum=ALL, ack_timeout=1.5),
                            chain[3], subs[:2])
    assert isinstance(res, PublishError) and "2 of 3" in str(res), res
    assert head(store) == 2
    # All three answer: it commits.
    rec, got = _joint_round(_publisher(LocalStore(store.url), str(tmp_path / "pub"), quorum=ALL, ack_timeout=30),
                            chain[3], subs)
    assert not isinstance(rec, BaseException), rec
    assert rec.version == 3 and all(got[s.id] == [3] for s in subs)
    r = run("publish", store.url, chain[4], "--state", str(tmp_path / "pub"), "--quorum", "most")
    assert r.returncode == 2 and "--quorum" in r.stderr


def test_prepare_with_nothing_proposed(stream, tmp_path):
    sub = _new_sub(stream, tmp_path, "idle")
    assert sub.prepare() is None  # no checkpoint yet
    sub.sync()
    before = sha(sub.checkpoint)
    assert sub.prepare() is None and sha(sub.checkpoint) == before
    r = run_ok("sync", stream.url, sub.checkpoint, "--id", "idle", "--prepare")
    assert "nothing to acknowledge" in r.stdout


# ------------------------------------------------------------------------------------------ tampering


@pytest.fixture
def signed(tmp_path, chain):
    key = str(tmp_path / "key.pem")
    run_ok("keygen", key)
    assert os.path.exists(key + ".pub") and (os.stat(key).st_mode & 0o777) == 0o600
    store = LocalStore(str(tmp_path / "signed"))
    pub = _publisher(store, str(tmp_path / "spub"), signing_key=key)
    for v in range(1, 4):
        pub.publish(chain[v])
    # The last one through the command line.
    run_ok("publish", store.url, chain[4], "--state", str(tmp_path / "spub"), "--sign", key,
           "--keyframe-every", str(KF_EVERY), "--keyframe-ratio", str(KF_RATIO))
    return store, key


def test_signed_stream_and_tampered_record(signed, tmp_path, chain, chain_fps):
    store, key = signed
    assert all(json.loads(store.get(commit_key(v)))["signature"]["alg"] == SIGNATURE_ALG for v in range(1, 5))
    assert all(row["signed"] for row in json.loads(run_ok("log", store.url, "--json").stdout))
    ck = str(tmp_path / "sub.safetensors")
    run_ok("sync", store.url, ck, "--to", "3", "--verify-key", key + ".pub", "--id", "sig")
    _exact(ck, chain[3], chain_fps[3])
    # Edit version 4's record: another fingerprint, signature kept.
    d = json.loads(store.get(commit_key(4)))
    d["fingerprint"] = chain_fps[7]
    store.put(commit_key(4), json.dumps(d, sort_keys=True, indent=1).encode())
    before, st_before = sha(ck), read_bytes(state_path(ck))
    with pytest.raises(SignatureError, match="does not verify"):
        Subscriber(store, ck, subscriber_id="sig", public_key=key + ".pub").sync()
    r = run("sync", store.url, ck, "--verify-key", key + ".pub", "--id", "sig")
    assert r.returncode == 8 and "signature does not verify" in r.stderr and "Traceback" not in r.stderr
    assert sha(ck) == before and read_bytes(state_path(ck)) == st_before
    # A wrong key refuses even the untouched records.
    other = str(tmp_path / "other.pem")
    run_ok("keygen", other)
    ck2 = str(tmp_path / "sub2.safetensors")
    r = run("sync", store.url, ck2, "--to", "3", "--verify-key", other + ".pub", "--id", "sig2")
    assert r.returncode == 8 and "does not verify" in r.stderr and not os.path.exists(ck2)


def test_unsigned_stream_refused_with_verify_key(stream, signed, tmp_path):
    _, key = signed
    ck = str(tmp_path / "u.safetensors")
    r = run("sync", stream.url, ck, "--verify-key", key + ".pub", "--id", "unsigned")
    assert r.returncode == 8 and "not signed" in r.stderr and not os.path.exists(ck)
    with pytest.raises(SignatureError, match="not signed"):
        Subscriber(stream.store, ck, public_key=key + ".pub").sync()


def test_altered_part_refused_nothing_applied(stream, tmp_path, chain, chain_fps):
    sub = _new_sub(stream, tmp_path, "alt")
    sub.sync(to_version=21)
    before, st_before = sha(sub.checkpoint), read_bytes(state_path(sub.checkpoint))
    p = stream.path(stream.recs[23].delta.key)
    with open(p, "r+b") as f:  # same length, one byte different, near the end (a payload)
        f.seek(os.path.getsize(p) - 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(StreamError, match="part does not match"):
        sub.sync()
    # Nothing applied: not even version 22, whose part is fine (everything is staged first).
    assert sha(sub.checkpoint) == before and read_bytes(state_path(sub.checkpoint)) == st_before
    r = run("sync", stream.url, sub.checkpoint, "--id", "alt")
    assert r.returncode == 9 and "part does not match" in r.stderr
    assert sha(sub.checkpoint) == before and sub.current() == (21, chain_fps[21])


@pytest.mark.parametrize("key", ["other-version", "dotdot"])
def test_part_key_outside_its_version_refused(stream, tmp_path, key):
    sub = _new_sub(stream, tmp_path, "outside")
    sub.sync(to_version=22)
    before = sha(sub.checkpoint)
    other = stream.recs[3].delta.key
    bad = other if key == "other-version" else f"{vkey(23)}/../../{other}"
    stream.edit_commit(23, lambda d: d["delta"].update(key=bad))
    with pytest.raises(StreamError, match="outside its version"):
        sub.sync()
    r = run("log", stream.url)
    assert r.returncode == 9 and "outside its version" in r.stderr
    assert sha(sub.checkpoint) == before and sub.current()[0] == 22


def test_edited_fingerprint_in_unsigned_head_record_refused(stream, tmp_path, chain_fps):
    """Regression (bug found in 9639647): subscriber.py:169-170 records rec.fingerprint after a delta apply
    without comparing it with the fingerprint the delta reached: an unsigned head record with an edited
    fingerprint is synced and the false fingerprint is written to the state file
    """
    sub = _new_sub(stream, tmp_path, "fp")
    sub.sync(to_version=22)
    stream.edit_commit(23, lambda d: d.update(fingerprint="f" * 64))
    with contextlib.suppress(StreamError, deltarefit.VerificationError):
        sub.sync()
    # Whatever happens, the recorded fingerprint must be the checkpoint's.
    cur = sub.current()
    assert cur[1] == deltarefit.fingerprint(sub.checkpoint)
    assert cur[1] != "f" * 64


# ------------------------------------------------------------------------------------------ retention


def _heartbeat_age(store, sub_id: str, seconds: float) -> None:
    d = json.loads(store.get(f"subs/{sub_id}.json"))
    d["updated"] = time.time() - seconds
    store.put(f"subs/{sub_id}.json", json.dumps(d).encode())


def _expected_kept(recs, cut: int, k: int) -> set[str]:
    keep = {p.key for _, p in recs[k].keyframe}
    keep |= {r.delta.key for v, r in recs.items() if r.delta and v > cut}
    return keep


def test_retention_keeps_what_live_subscribers_need(stream, tmp_path, chain, chain_fps):
    store = stream.store
    store.delete("subs/follower.json")  # the fixture's follower: not part of this scenario
    s4, s19 = _new_sub(stream, tmp_path, "s4"), _new_sub(stream, tmp_path, "s19")
    s4.sync(to_version=4)
    s19.sync(to_version=19)
    dry = json.loads(run_ok("retain", stream.url, "--dry-run", "--json").stdout)
    assert dry["deleted"] and all(store.exists(k) for k in dry["deleted"])
    rep = json.loads(run_ok("retain", stream.url, "--json").stdout)
    assert (rep["head"], rep["keyframe"], rep["oldest_live"]) == (HEAD, 20, 4)
    assert rep["deleted"] == dry["deleted"]
    keep = _expected_kept(stream.recs, cut=4, k=20)
    assert stream.part_keys() == keep
    assert rep["kept_bytes"] == sum(store.size(k) for k in keep)
    assert list_versions(store) == list(range(1, HEAD + 1))  # records are history: all kept
    for s in (s4, s19, _new_sub(stream, tmp_path, "fresh")):
        assert s.sync().version == HEAD
        _exact(s.checkpoint, chain[HEAD], chain_fps[HEAD])


def test_retention_stale_subscriber_pruned_then_keyframe(stream, tmp_path, chain, chain_fps):
    store = stream.store
    store.delete("subs/follower.json")
    s4, s19 = _new_sub(stream, tmp_path, "s4"), _new_sub(stream, tmp_path, "s19")
    s4.sync(to_version=4)
    s19.sync(to_version=19)
    _heartbeat_age(store, "s4", 7200)
    rep = retain(store, ttl=3600)
    assert rep.oldest_live == 19
    assert stream.part_keys() == _expected_kept(stream.recs, cut=19, k=20)
    assert not store.exists(stream.recs[5].delta.key)  # s4's chain is gone
    # s4 syncs through the newest keyframe; s19 along its chain.
    rep4 = s4.sync()
    assert rep4.route == "keyframe" and rep4.versions_applied == [20, 21, 22, 23]
    _exact(s4.checkpoint, chain[HEAD], chain_fps[HEAD])
    rep19 = s19.sync()
    assert rep19.route == "chain" and rep19.versions_applied == [20, 21, 22, 23]
    _exact(s19.checkpoint, chain[HEAD], chain_fps[HEAD])
    # ttl 0: nobody is live; everything up to the newest keyframe goes, and a new subscriber still syncs.
    rep = retain(store, ttl=0)
    assert rep.oldest_live is None
    assert stream.part_keys() == _expected_kept(stream.recs, cut=20, k=20)
    new = _new_sub(stream, tmp_path, "new")
    assert new.sync().route == "keyframe"
    _exact(new.checkpoint, chain[HEAD], chain_fps[HEAD])


def test_stale_subscriber_falls_back_to_existing_keyframe_route(stream, tmp_path, chain, chain_fps):
    """Regression (bug found in 9639647): subscriber.py:196-215 (_route) picks the cheapest route from the
    commit records without checking that its parts still exist; the chain 19..23 (pruned by retention) is
    chosen over keyframe 20, and get_to's KeyError escapes at line 154 (not even a StreamError)
    """
    store = stream.store
    store.delete("subs/follower.json")
    s18, s19 = _new_sub(stream, tmp_path, "s18"), _new_sub(stream, tmp_path, "s19")
    s18.sync(to_version=18)
    s19.sync(to_version=19)
    _heartbeat_age(store, "s18", 7200)
    retain(store, ttl=3600)
    assert not store.exists(stream.recs[19].delta.key)
    assert _cheapest(stream.recs, 18, HEAD)[0] == "chain"  # by the records, the chain would be cheapest
    rep = s18.sync()
    assert rep.route == "keyframe" and rep.version == HEAD
    _exact(s18.checkpoint, chain[HEAD], chain_fps[HEAD])


def test_no_route_after_pruning_is_a_clear_stream_error(stream, tmp_path, chain):
    """Regression (bug found in 9639647): with every route pruned, sync raises KeyError from get_to
    (subscriber.py:154) instead of the StreamError 'no route ...' (subscriber.py:210); the CLI then exits
    1 with a traceback instead of exit 9
    """
    store = stream.store
    store.delete("subs/follower.json")
    s4 = _new_sub(stream, tmp_path, "s4")
    s4.sync(to_version=4)
    retain(store, ttl=0)  # s4 is not live: deltas up to 20 and keyframes 1..15 go
    before = sha(s4.checkpoint)
    r = run("sync", stream.url, s4.checkpoint, "--to", "12", "--id", "s4")
    assert sha(s4.checkpoint) == before
    assert r.returncode == 9 and "no route" in r.stderr, r.stderr
    with pytest.raises(StreamError, match="no route"):
        s4.sync(to_version=12)


def test_orphan_parts_removed_only_after_grace(stream, tmp_path, chain):
    store = stream.store
    d23 = stream.path(stream.recs[23].delta.key)
    dead = f"{vkey(HEAD + 1)}/deadbeef0001/delta"  # a publish that died before committing
    loser = f"{vkey(HEAD)}/deadbeef0002/delta"  # a losing attempt on a committed version
    store.put_file(dead, d23)
    store.put_file(loser, d23)
    rep = retain(store, orphan_grace=3600)
    assert dead not in rep.deleted and loser not in rep.deleted
    assert store.exists(dead) and store.exists(loser)
    old = time.time() - 7200
    for k in (dead, loser):
        os.utime(stream.path(k), (old, old))
    r = json.loads(run_ok("retain", stream.url, "--orphan-grace", "3600", "--json").stdout)
    # an orphan of the next version may be a publish still uploading: kept until that version is
    # committed (issue 34: a retain deleted the parts of a slow publish, which then committed them)
    assert dead not in r["deleted"] and loser in r["deleted"]
    assert store.exists(dead) and not store.exists(loser)
    assert list_versions(store) == list(range(1, HEAD + 1))


def test_proposed_parts_survive_retention(stream, tmp_path, chain):
    """A joint publish waiting for acks: its parts are not orphans, even once older than the grace."""
    pub = _publisher(LocalStore(stream.url), stream.pub_state, quorum=1, ack_timeout=3)
    res: list = []
    t = threading.Thread(target=lambda: res.append(_try(pub.publish, chain[0])))
    t.start()
    try:
        deadline = time.monotonic() + 20
        while not stream.store.exists(prepared_key(HEAD + 1)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stream.store.exists(prepared_key(HEAD + 1))
        parts = [k for k in stream.store.list(vkey(HEAD + 1) + "/") if len(k.split("/")) >= 4]
        old = time.time() - 7200
        for k in parts:  # uploaded long ago (a slow upload), proposed just now
            os.utime(stream.path(k), (old, old))
        rep = retain(LocalStore(stream.url), orphan_grace=60, unsafe_short_grace=True)
        assert not [k for k in rep.deleted if k.startswith(vkey(HEAD + 1))]
        assert parts and all(stream.store.exists(k) for k in parts)
        assert stream.store.exists(prepared_key(HEAD + 1))
    finally:
        t.join(timeout=30)
    assert isinstance(res[0], PublishError)  # nobody acknowledged
    assert stream.store.list(vkey(HEAD + 1) + "/") == []


def _try(fn, *a):
    try:
        return fn(*a)
    except BaseException as e:
        return e


# ------------------------------------------------------------------------------------------ compose


def test_compose_chain_of_stream_deltas(stream, tmp_path, chain, chain_fps):
    deltas = []
    for v in range(5, 13):
        dest = str(tmp_path / f"d{v:02d}.delta")
        stream.store.get_to(stream.recs[v].delta.key, dest)
        deltas.append(dest)
    out = str(tmp_path / "composed.delta")
    r = run_ok("compose", *deltas, "-o", out, "--base", chain[4])
    assert chain_fps[12] in r.stdout
    assert os.path.getsize(out) <= sum(os.path.getsize(d) for d in deltas)
    work = str(tmp_path / "work.safetensors")
    shutil.copyfile(chain[4], work)
    deltarefit.apply(out, work)
    _exact(work, chain[12], chain_fps[12])
    # A non-chain (a gap) is refused, a wrong base too; nothing is written.
    bad = str(tmp_path / "bad.delta")
    r = run("compose", deltas[0], deltas[2], "-o", bad, "--base", chain[4])
    assert r.returncode == 2 and "not a chain" in r.stderr and not os.path.exists(bad)
    r = run("compose", *deltas, "-o", bad, "--base", chain[5])
    assert r.returncode == 5 and not os.path.exists(bad)
    from deltarefit.compose import compose

    with pytest.raises(UsageError, match="not a chain"):
        compose([deltas[1], deltas[0]], bad, base=chain[4])  # out of order
    assert not os.path.exists(bad)


# ------------------------------------------------------------------------------------------ stores


@pytest.fixture(params=["memory", "local"])
def any_store(request, tmp_path):
    if request.param == "memory":
        return MemoryStore(f"contract-{tmp_path.name}")
    return LocalStore(str(tmp_path / "store"))


def test_store_contract(any_store, tmp_path):
    s = any_store
    assert s.list() == [] and not s.exists("a/b")
    s.put("a/b", b"one")
    assert s.get("a/b") == b"one" and s.exists("a/b") and s.size("a/b") == 3
    s.put("a/b", b"two!")  # overwrite, whole
    assert s.get("a/b") == b"two!" and s.size("a/b") == 4
    for op in (s.get, s.size):
        with pytest.raises(KeyError):
            op("a/missing")
    with pytest.raises(KeyError):
        s.get_to("a/missing", str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x")
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(100_000))
    s.put_file("f/big", str(src))
    s.get_to("f/big", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes() == s.get("f/big")
    # Conditional create: exactly once.
    assert s.create("v/1/commit.json", b"first") is True
    assert s.create("v/1/commit.json", b"second") is False
    assert s.get("v/1/commit.json") == b"first"
    s.put("v/2/x/part", b"p")
    s.put("v/10/commit.json", b"c")
    assert s.list("v/") == ["v/1/commit.json", "v/10/commit.json", "v/2/x/part"]
    assert s.list("v/2/") == ["v/2/x/part"] and s.list("nope/") == []
    assert s.list() == sorted(["a/b", "f/big", "v/1/commit.json", "v/10/commit.json", "v/2/x/part"])
    s.delete("v/2/x/part")
    s.delete("v/2/x/part")  # deleting a missing key is not an error
    assert not s.exists("v/2/x/part") and s.list("v/2/") == []
    with pytest.raises(KeyError):
        s.get("v/2/x/part")
    for bad in ("", "/abs", "a//b", "a/../b", "./a", "a/."):
        with pytest.raises(UsageError):
            s.put(bad, b"x")
        with pytest.raises(UsageError):
            s.create(bad, b"x")


def test_store_create_race_across_objects(any_store, tmp_path):
    """Of many racing creators (threads, each with its own store object, as separate processes
    would have) exactly one wins, and the object holds its bytes whole."""
    objs = [any_store if isinstance(any_store, MemoryStore) else LocalStore(any_store.url) for _ in range(6)]
    _race(objs, rounds=30)


def _race(objs, rounds: int) -> None:
    barrier = threading.Barrier(len(objs))
    wins: dict[int, list] = {k: [] for k in range(rounds)}
    errors: list = []

    def worker(i: int) -> None:
        for k in range(rounds):
            barrier.wait(timeout=30)
            try:
                if objs[i].create(f"race/{k}/commit.json", (f"writer {i};" * 5000).encode()):
                    wins[k].append(i)
            except Exception as e:
                errors.append(e)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(len(objs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not errors, f"{len(errors)} errors, e.g. {errors[0]!r}"
    for k, w in wins.items():
        assert len(w) == 1, (k, w)
        assert objs[0].get(f"race/{k}/commit.json") == (f"writer {w[0]};" * 5000).encode()


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_store_create_race_one_object_many_threads(kind, tmp_path):
    """Threads sharing one store object race create(): exactly one wins, no errors.

    Regression (bug found in 9639647): local.py:30 named temp files f'{path}.tmp-{pid}-{id(self)}',
    shared by threads using one LocalStore object; racing create() (and put()) on one key collided on it
    and raised StoreError ('create failed'/'write failed') instead of returning False.
    """
    s = MemoryStore("race-one") if kind == "memory" else LocalStore(str(tmp_path / "store"))
    _race([s] * 6, rounds=30)


def test_directory_checkpoints_are_created_and_replaced_from_keyframes(stream, tmp_path, chain, chain_fps):
    os.makedirs(tmp_path / "r")
    d = str(tmp_path / "r" / "rollout")  # no .safetensors suffix: a directory checkpoint
    sub = Subscriber(stream.store, d, subscriber_id="dir")
    rep = sub.sync(to_version=12)
    assert rep.route == "keyframe" and os.path.isdir(d) and sub.current() == (12, chain_fps[12])
    assert deltarefit.fingerprint(d) == chain_fps[12]
    # What an engine needs beside the weights lives in the same directory and must survive.
    for name, text in (("config.json", '{"model_type": "bert"}'), ("tokenizer.json", "{}")):
        with open(os.path.join(d, name), "w") as f:
            f.write(text)
    # The deltas after 12 are pruned: the only route left replaces the directory with keyframe 20.
    for v in range(13, 21):
        stream.store.delete(commits(stream.store)[v].delta.key)
    rep = sub.sync()
    assert rep.route == "keyframe" and rep.version == HEAD
    assert deltarefit.fingerprint(d) == chain_fps[HEAD]
    with open(os.path.join(d, "config.json")) as f:
        assert f.read() == '{"model_type": "bert"}'
    assert os.path.exists(os.path.join(d, "tokenizer.json"))
    assert os.listdir(tmp_path / "r") == ["rollout"]  # no old copy, temp or staging left beside it


def test_memory_store_named_is_shared(tmp_path):
    from deltarefit.storage import open_store

    a = open_store(f"memory://named-{tmp_path.name}")
    b = open_store(f"memory://named-{tmp_path.name}")
    a.put("k", b"v")
    assert b.get("k") == b"v" and isinstance(open_store(str(tmp_path / "d")), LocalStore)
    from deltarefit.storage.s3 import S3Store

    s3 = open_store("s3://bucket/x")  # no network at construction
    assert isinstance(s3, S3Store) and (s3.bucket, s3.prefix) == ("bucket", "x")
    with pytest.raises(StoreError):
        LocalStore("/proc/definitely/not/writable")


# ------------------------------------------------------------------------------------ baseline advance


@pytest.mark.parametrize("advance", ["copy", "apply"])
def test_baseline_follows_each_commit_by_either_route(tmp_path, chain, chain_fps, advance):
    store = LocalStore(str(tmp_path / "store"))
    pub = _publisher(store, str(tmp_path / "pub"), advance=advance)
    for v in range(4):  # a keyframe, then deltas
        rec = pub.publish(chain[v])
        assert rec.fingerprint == chain_fps[v]
        assert deltarefit.fingerprint(pub.baseline) == chain_fps[v]
        assert pub.state().fingerprint == chain_fps[v]
    assert [f for f in os.listdir(pub.state_dir) if ".tmp-" in f] == []


def test_checkpoint_rewritten_after_encoding_is_not_copied(tmp_path, chain, chain_fps, monkeypatch):
    """The trainer overwrites its export while the publish is still uploading: the baseline must
    become the committed version (by applying its delta), not the new file."""
    import deltarefit.stream.publisher as P

    pub = _publisher(LocalStore(str(tmp_path / "store")), str(tmp_path / "pub"), advance="copy")
    pub.publish(chain[0])
    export = str(tmp_path / "export.safetensors")
    shutil.copyfile(chain[1], export)
    real_encode = P.encode_delta

    def encode_then_rewrite(base, target, out, **kw):
        rep = real_encode(base, target, out, **kw)
        shutil.copyfile(chain[2], target)  # the next step's export lands on the same path
        return rep

    monkeypatch.setattr(P, "encode_delta", encode_then_rewrite)
    rec = pub.publish(export)
    assert rec.kind == "delta" and rec.fingerprint == chain_fps[1]
    assert deltarefit.fingerprint(pub.baseline) == chain_fps[1]
    assert [f for f in os.listdir(pub.state_dir) if ".tmp-" in f] == []


def _dead_pid() -> int:
    """The pid of a process that has exited (a killed writer's temp names it)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _plant(paths: list[str]) -> list[str]:
    for s in paths:
        os.makedirs(os.path.dirname(s), exist_ok=True)
        with open(s, "wb") as f:
            f.write(b"half a copy")
    return paths


def test_copies_left_by_a_killed_publish_are_removed(tmp_path, chain, chain_fps):
    """Every file the publisher writes atomically in its state directory, and its history book's files:
    a temp a killed publish left of any of them is gone after the next publish."""
    pub = _publisher(LocalStore(str(tmp_path / "store")), str(tmp_path / "pub"))
    pub.publish(chain[0])
    pid = _dead_pid()
    names = [pub.baseline, pub.keyframe_copy, pub.keyframe_copy + ".json", pub.known_path, pub.state_path,
             os.path.join(pub.state_dir, "pending.json"), os.path.join(pub.state_dir, "attempt.json")]
    stale = _plant([f"{n}.tmp-{pid}" for n in names]
                   + [os.path.join(pub.book_path, f"HEAD.json.tmp-{pid}"),
                      os.path.join(pub.book_path, f"{'0' * 64}.moves.tmp-{pid}")])
    assert pub.publish(chain[1]).fingerprint == chain_fps[1]
    assert [s for s in stale if os.path.exists(s)] == []
    assert [f for f in os.listdir(pub.state_dir) if ".tmp-" in f] == []
    assert deltarefit.fingerprint(pub.baseline) == chain_fps[1]


def test_a_keyframe_install_killed_then_a_chain_sync_leaves_no_copy_behind(stream, tmp_path, chain, chain_fps):
    """A sync killed inside a keyframe's install leaves the copy it was building, or the directory it
    replaced, beside the checkpoint; the next sync may take a chain route, and removes them all the
    same. While the checkpoint is missing, the replaced copy stays (the install takes it away)."""
    ck = str(tmp_path / "sub.safetensors")
    shutil.copyfile(chain[HEAD - 2], ck)
    sub = Subscriber(stream.store, ck, subscriber_id="sub")
    sub.sync(to_version=HEAD - 2)
    tmp, old = ck + ".deltarefit-keyframe.tmp", ck + ".deltarefit-old"
    with open(tmp, "wb") as f:
        f.write(b"half a checkpoint")
    os.makedirs(old)
    with open(os.path.join(old, "model.safetensors"), "wb") as f:
        f.write(b"the replaced copy")
    rep = sub.sync()
    assert rep.route == "chain"
    _exact(ck, chain[HEAD], chain_fps[HEAD])
    assert not os.path.lexists(tmp) and not os.path.lexists(old)
    from deltarefit.stream.route import remove_keyframe_leftovers

    missing = str(tmp_path / "missing.safetensors")
    os.makedirs(missing + ".deltarefit-old")
    os.makedirs(missing + ".deltarefit-keyframe.tmp")
    assert remove_keyframe_leftovers(missing) == [missing + ".deltarefit-keyframe.tmp"]
    assert os.path.isdir(missing + ".deltarefit-old")


def test_temps_left_by_a_killed_sync_are_removed(stream, tmp_path, chain, chain_fps):
    """A subscriber's version record is written atomically beside its checkpoint: a temp a killed sync
    left of it (or of the checkpoint) is gone after the next sync, and a live writer's temp stays."""
    ck = str(tmp_path / "sub.safetensors")
    shutil.copyfile(chain[HEAD - 3], ck)
    sub = Subscriber(stream.store, ck, subscriber_id="sub")
    sub.sync(to_version=HEAD - 3)
    sub.sync(to_version=HEAD - 2)
    pid = _dead_pid()
    stale = _plant([f"{state_path(ck)}.tmp-{pid}", f"{ck}.tmp-{pid}"])
    live = _plant([f"{state_path(ck)}.tmp-{os.getppid()}"])  # a live process other than this one
    sub.sync()
    _exact(ck, chain[HEAD], chain_fps[HEAD])
    assert [s for s in stale if os.path.exists(s)] == []
    assert all(os.path.exists(s) for s in live)


def test_unknown_advance_is_refused(tmp_path):
    with pytest.raises(UsageError, match="advance"):
        Publisher(LocalStore(str(tmp_path / "store")), str(tmp_path / "pub"), advance="move")


def test_retention_keeps_orphans_of_unknown_age(stream):
    """A store that keeps no timestamps (memory) keeps every orphan, whatever the grace: its age is
    unknown, and it may be an upload in progress (``chain.older_than``). The rest of the policy is the
    same as on a store with timestamps."""
    mem = MemoryStore(f"no-mtime-{os.path.basename(os.path.dirname(stream.root))}")
    for k in [*stream.store.list("v/"), *stream.store.list("subs/"), "HEAD"]:
        mem.put(k, stream.store.get(k))
    expected = set(retain(stream.store, orphan_grace=0, dry_run=True, unsafe_short_grace=True).deleted)
    assert expected, "the stream has parts the policy drops"
    dead = f"{vkey(HEAD + 1)}/deadbeef0001/delta"  # a publish still uploading, or one that died
    loser = f"{vkey(HEAD)}/deadbeef0002/delta"  # a losing attempt on a committed version
    mem.put(dead, b"partial upload")
    mem.put(loser, b"losing attempt")
    rep = retain(mem, orphan_grace=0, unsafe_short_grace=True)
    assert set(rep.deleted) == expected
    assert mem.exists(dead) and mem.exists(loser)
