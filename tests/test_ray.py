"""deltarefit on Ray (``deltarefit.integrations.ray``): a 3-node ``ray.cluster_utils.Cluster`` on this machine.

The trainer's node runs the trainer actor (``examples/ray_refit.py``'s ``TinyTrainer``: a tiny Llama in
fp32, a real AdamW step per version); two engine nodes each run a vLLM engine actor with the
``deltarefit`` weight-transfer backend in its own placement group. Every refit is driven by vLLM's own
``RayVLLMWeightSyncClient`` through ``DeltaRefitTrainerWeightTransferEngine``; the engines fetch their
deltas from the stream (a local directory store) themselves.

Along the way, real SIGKILLs: an engine actor's process in the middle of an update (its worker has
written half of a segment), and the trainer actor's process in the middle of a publish (its parts half
uploaded). Ray restarts both (``max_restarts``); versions lost must be 0. At every version, every engine
must equal a fresh engine started from that version's checkpoint, bit for bit (every parameter, buffer
and linear kernel: ``deltarefit_digests``) and in its greedy tokens.

Marked ``slow`` and ``ray``; skipped where Ray or vLLM is not installed (``make test-ray`` builds the venv).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ray = pytest.importorskip("ray", reason="Ray is not installed here (make test-ray installs it)")
pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm builds a venv with it)")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)
import ray_refit  # noqa: E402  (examples/ray_refit.py)
from _ray_faults import stall_mid_write  # noqa: E402
from _vllm_env import vllm_processes_env  # noqa: E402

pytest_plugins = ["conftest_s3"]  # the SeaweedFS S3 server (s3_server, s3_env)

WAIT = 900  # seconds: the bound of any wait for an actor call (an engine's start on 2 busy cores included)


def _poll(what: str, cond, timeout: float = 300.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


def _when_back(call, timeout: float = WAIT):
    """``ray.get(call())``, asked again while Ray answers that the actor is restarting (it does so at once)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(call(), timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """The cluster's processes inherit this environment: AMX off in every vLLM process (tests/_vllm_env.py),
    the examples and tests importable by the actors."""
    vllm_processes_env(monkeypatch, tmp_path)
    tests = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.environ["PYTHONPATH"], ray_refit.SRC, EXAMPLES, tests]))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    c = ray_refit.start_cluster()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _snapshot(engines: dict) -> dict:
    """Per engine: its state (version, fingerprints, pid), its digests and its greedy tokens."""
    out = {}
    for name, e in engines.items():
        st, dg, toks = ray.get([e.state.remote(), e.digests.remote(), e.generate.remote(ray_refit.PROMPTS)],
                               timeout=WAIT)
        out[name] = {"state": st, "digests": dg, "tokens": toks}
    return out


def _check_acked(r: dict, snap: dict, version: int) -> None:
    assert r["version"] == version and r["committed"] == version, r
    fp = r["refit"]["fingerprint"]
    for name, s in snap.items():
        assert s["state"]["weight_version"] == str(version), (name, s["state"])
        assert s["state"]["fingerprints"] == [fp], (name, s["state"])


def test_engines_on_three_nodes_follow_the_trainer_bit_exact_through_kills(cluster, tmp_path):
    from deltarefit.integrations.ray import EngineActor
    from deltarefit.storage.local import LocalStore
    from deltarefit.stream.records import commit_key, head, load_commit

    root = str(tmp_path / "run")
    os.makedirs(root)
    trainer, handles, base = ray_refit.start(root)
    engines = dict(zip(ray_refit.ENGINES, handles, strict=True))
    stream = os.path.join(root, "stream")
    store = LocalStore(stream)

    # each engine on its own node (the node with its custom resource), the trainer on the trainer's
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    first = _snapshot(engines)
    for name, res in ray_refit.ENGINES.items():
        assert set(res) <= set(nodes[first[name]["state"]["node_id"]]), (name, nodes)
    assert len({s["state"]["node_id"] for s in first.values()}) == 2
    at: dict[int, dict] = {1: first}
    results = {}

    def step(k: int, **kw) -> dict:
        r = ray.get(trainer.step.remote(k, **kw), timeout=WAIT)
        results[k] = r
        at[r["version"]] = _snapshot(engines)
        _check_acked(r, at[r["version"]], r["version"])
        return r

    # version 2: one real AdamW step, refitted through vLLM's Ray client
    r = step(1)
    assert r["kind"] == "delta" and r["refit"]["rounds"] == 1, r

    # version 3: engine-a's process killed in the middle of its update (half a segment written)
    a, b = engines["engine-a"], engines["engine-b"]
    marker = str(tmp_path / "engine-a-stalled")
    ray.get(a.collective_rpc.remote(stall_mid_write, args=(marker,)), timeout=WAIT)
    pids_a = ray.get(a.pids.remote(), timeout=WAIT)
    pid_b = at[2]["engine-b"]["state"]["pid"]
    ref = trainer.step.remote(2)
    _poll("engine-a stalled mid-write", lambda: os.path.exists(marker))
    os.kill(pids_a[0], signal.SIGKILL)
    t_kill = time.monotonic()
    # the other engine keeps serving while engine-a is down and the round waits for it
    served = ray.get(b.generate.remote(ray_refit.PROMPTS), timeout=WAIT)
    assert [len(t) for t in served] == [16] * len(ray_refit.PROMPTS)
    assert not ray.wait([ref], timeout=0)[0], "the round finished before engine-a came back"
    r = ray.get(ref, timeout=WAIT)
    results[2] = r
    back_s = time.monotonic() - t_kill
    at[3] = _snapshot(engines)
    _check_acked(r, at[3], 3)
    assert r["refit"]["rounds"] == 2 and len(r["refit"]["failures"]) == 1, r
    assert "Actor" in r["refit"]["failures"][0], r  # the round failed on the dead actor, not on a refusal
    sa, sb = at[3]["engine-a"]["state"], at[3]["engine-b"]["state"]
    assert sa["restarted"] and sa["pid"] != pids_a[0], sa
    assert sa["caught_up"]["version"] in (2, 3), sa  # from its checkpoint (version 1) through the stream
    assert not sb["restarted"] and sb["pid"] == pid_b, sb  # no other engine restarted
    _poll("the killed engine's processes gone", lambda: not any(_alive(p) for p in pids_a), timeout=120)
    lag = 3 - 3  # back at the version the trainer committed in the same refit
    assert lag <= 2

    # version 4, then version 5 with the trainer's process killed mid-publish
    step(3)
    tpid = ray.get(trainer.pid.remote(), timeout=WAIT)
    rate = max(results[3]["delta_bytes"] / 6.0, 64 << 10)  # about 6 s of upload
    ref = trainer.step.remote(4, publish_rate=rate)
    parts = os.path.join(stream, "v", f"{5:012d}", "*", "*")
    _poll("a part of version 5 uploading", lambda: glob.glob(parts) or glob.glob(parts + "/*"))
    assert not os.path.exists(os.path.join(stream, commit_key(5)))
    os.kill(tpid, signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(ref, timeout=WAIT)
    assert head(store) == 4  # the publish was cut before its commit
    assert _when_back(trainer.pid.remote) != tpid  # restarted by Ray: a new process
    r = step(4)  # the restarted trainer resumes: the same step, published once
    assert r["restarted"] and r["version"] == 5, r

    # version 6: planned by the engines while they serve, then written in the pause
    r = step(5, prepare=True)
    assert r["version"] == 6 and r["refit"]["rounds"] == 1, r

    # versions lost: every step is exactly one committed version, in order, and every engine acknowledged it
    steps = [load_commit(store, v).step for v in range(1, head(store) + 1)]
    lost = [k for k in range(6) if k not in steps]
    assert lost == [] and steps == [0, 1, 2, 3, 4, 5], steps
    assert sorted(at) == [1, 2, 3, 4, 5, 6]

    # every engine at every version equals a fresh engine started from that version's checkpoint
    for h in handles:
        ray.kill(h, no_restart=True)
    ray.kill(trainer, no_restart=True)
    fresh_cls = ray.remote(EngineActor).options(resources={"trainer": 1.0}, num_cpus=1)
    differing = {}
    for v in range(2, 7):
        ck = base if v == 1 else results[v - 1]["served"]
        ref_engine = fresh_cls.remote(ck, llm_kwargs=ray_refit.LLM_KWARGS, weight_transfer=False, name=f"fresh-{v}")
        want_d, want_t = ray.get([ref_engine.digests.remote(), ref_engine.generate.remote(ray_refit.PROMPTS)],
                                 timeout=WAIT)
        ray.kill(ref_engine)
        for name, s in at[v].items():
            assert s["tokens"] == want_t, (v, name)
            differing[(v, name)] = sorted(k for k in want_d[0] if s["digests"][0].get(k) != want_d[0][k])
    assert all(d == [] for d in differing.values()), differing
    # and every version moved the weights (so a refit that did not happen could not pass as one)
    for v in range(2, 7):
        moved = [k for k, d in at[v]["engine-b"]["digests"][0].items() if at[v - 1]["engine-b"]["digests"][0][k] != d]
        assert moved, f"version {v} holds the same weights as version {v - 1}"
    print(json.dumps({"engine_back_in_step_s": back_s,
                      "refit_round_s": {k: r["refit"]["seconds_round"] for k, r in results.items()},
                      "refit_s": {k: r["refit"]["seconds"] for k, r in results.items()},
                      "failures": {k: r["refit"]["failures"] for k, r in results.items() if r["refit"]["failures"]}},
                     indent=1))


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _http_run(tmp_path, **server_kw) -> tuple[str, object, list]:
    """A run's base checkpoint and stream, the trainer actor (version 1 published, HTTP transport) and
    ``vllm serve`` actors server-a and server-b on the two engine nodes (``server_kw``: more of
    ``start_servers``' arguments): (stream, trainer, server handles)."""
    from deltarefit.integrations.ray_http import start_servers

    root = str(tmp_path / "run")
    os.makedirs(root)
    base = ray_refit.build_base(os.path.join(root, "base"))
    stream = os.path.join(root, "stream")
    names = ["server-a", "server-b"]
    trainer = ray.remote(ray_refit.TinyTrainer).options(resources={"trainer": 1.0}, num_cpus=1, max_restarts=1,
                                                        max_task_retries=0, name="trainer").remote(
        root, stream, base, names, transport="http")
    assert ray.get(trainer.publish_base.remote(), timeout=WAIT) == 1
    serve_args = ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "8",
                  "--seed", "0"]
    handles = start_servers(base, [{"engine_a": 1.0}, {"engine_b": 1.0}], _free_ports(2), names=names,
                            init_info={"stream": stream, "version": 1}, serve_args=serve_args, **server_kw)
    return stream, trainer, handles


def test_vllm_serve_actors_follow_the_trainer_through_vllms_http_client(cluster, tmp_path):
    """The same loop with ``vllm serve`` in the engine actors (``ray_http.ServerActor``), driven over HTTP by
    vLLM's ``HTTPVLLMWeightSyncClient`` (``RefitTrainer(transport="http")``). One server's actor is killed
    (SIGKILL) between versions: its server dies with it, Ray restarts it from its checkpoint, it catches up
    through the stream, and the next refit is acknowledged by both. 3 real AdamW steps; at versions 2-4
    every server equals a fresh engine bit for bit."""
    from deltarefit.integrations.ray import EngineActor

    _, trainer, handles = _http_run(tmp_path)
    servers = dict(zip(["server-a", "server-b"], handles, strict=True))
    at, served = {}, {}

    def step(k: int) -> dict:
        r = ray.get(trainer.step.remote(k), timeout=WAIT)
        served[r["version"]] = r["served"]
        at[r["version"]] = {}
        for n, s in servers.items():
            st, dg = ray.get([s.state.remote(), s.digests.remote()], timeout=WAIT)
            at[r["version"]][n] = {"state": st, "digests": dg}
        fp = r["refit"]["fingerprint"]
        for n, snap in at[r["version"]].items():
            assert snap["state"]["weight_version"] == str(r["version"]), (n, snap["state"])
            assert snap["state"]["fingerprints"] == [fp], (n, snap["state"])
        assert r["committed"] == r["version"]
        return r

    assert step(1)["refit"]["rounds"] == 1
    pids_a = ray.get(servers["server-a"].pids.remote(), timeout=WAIT)
    pid_b = at[2]["server-b"]["state"]["pid"]
    os.kill(pids_a[0], signal.SIGKILL)
    _poll("server-a's vllm serve gone with its actor", lambda: not any(_alive(p) for p in pids_a), timeout=120)
    r = step(2)
    assert r["refit"]["rounds"] == 2 and len(r["refit"]["failures"]) == 1, r
    sa, sb = at[3]["server-a"]["state"], at[3]["server-b"]["state"]
    assert sa["restarted"] and sa["pid"] != pids_a[0], sa
    assert not sb["restarted"] and sb["pid"] == pid_b, sb
    step(3)
    assert sorted(at) == [2, 3, 4]

    for h in handles:
        ray.kill(h, no_restart=True)
    ray.kill(trainer, no_restart=True)
    fresh_cls = ray.remote(EngineActor).options(resources={"trainer": 1.0}, num_cpus=1)
    differing = {}
    for v in (2, 3, 4):
        ref_engine = fresh_cls.remote(served[v], llm_kwargs=ray_refit.LLM_KWARGS, weight_transfer=False)
        want = ray.get(ref_engine.digests.remote(), timeout=WAIT)[0]
        ray.kill(ref_engine)
        for n, snap in at[v].items():
            differing[(v, n)] = sorted(k for k in want if snap["digests"][0].get(k) != want[k])
    assert all(d == [] for d in differing.values()), differing
    print(json.dumps({"http_failures": r["refit"]["failures"]}))


def test_engines_follow_a_stream_in_s3(s3_env, cluster, tmp_path):
    """The loop with the stream in S3 (the SeaweedFS server on loopback; every node of the cluster gets its
    endpoint and credentials from the environment): 2 real AdamW steps, each engine fetches its deltas
    from S3 itself (bytes fetched > 0, the chain route), and at versions 2 and 3 every engine equals a
    fresh engine bit for bit."""
    import uuid

    from deltarefit.integrations.ray import EngineActor

    root = str(tmp_path / "run")
    os.makedirs(root)
    stream = s3_env.url(f"ray-{uuid.uuid4().hex[:8]}")
    assert stream.startswith("s3://")
    trainer, handles, _base = ray_refit.start(root, stream=stream)
    engines = dict(zip(ray_refit.ENGINES, handles, strict=True))
    at, served = {}, {}
    for k in (1, 2):
        r = ray.get(trainer.step.remote(k), timeout=WAIT)
        served[r["version"]] = r["served"]
        at[r["version"]] = snap = _snapshot(engines)
        _check_acked(r, snap, r["version"])
        for name, e in engines.items():
            last = ray.get(e.last_update.remote(), timeout=WAIT)
            assert last["route"] == "chain" and last["bytes_fetched"] > 0, (name, last)
    for h in handles:
        ray.kill(h, no_restart=True)
    ray.kill(trainer, no_restart=True)
    fresh_cls = ray.remote(EngineActor).options(resources={"trainer": 1.0}, num_cpus=1)
    for v in (2, 3):
        ref_engine = fresh_cls.remote(served[v], llm_kwargs=ray_refit.LLM_KWARGS, weight_transfer=False)
        want_d, want_t = ray.get([ref_engine.digests.remote(), ref_engine.generate.remote(ray_refit.PROMPTS)],
                                 timeout=WAIT)
        ray.kill(ref_engine)
        for name, s in at[v].items():
            assert s["tokens"] == want_t, (v, name)
            assert sorted(k for k in want_d[0] if s["digests"][0].get(k) != want_d[0][k]) == [], (v, name)
