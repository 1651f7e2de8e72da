"""deltarefit on Ray: failures that heal, beyond one killed process (``make test-ray``).

* A node whose engines all died: engine-a's node is removed from the 3-node ``ray.cluster_utils.Cluster``
  (its raylet and every process on it killed) in the middle of an update, and a node with the same
  resource is added back. Ray reschedules engine-a's placement group there and restarts the actor
  (``max_restarts``); it comes back from its checkpoint, catches up through the stream, and the round
  is acknowledged by both engines. engine-b keeps serving and is never restarted.
* A ``vllm serve`` actor killed in the middle of an update (its worker has written half of a segment):
  the HTTP round fails on it, the other server is finished and resumed at once, Ray restarts the actor,
  which starts a new server, catches up, and the round driven again is acknowledged by both.

In both, versions lost: 0, and at every version every engine equals a fresh engine started from that
version's checkpoint, bit for bit. Marked ``slow`` and ``ray`` as tests/test_ray.py, whose cluster
fixture and helpers these tests share.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ray = pytest.importorskip("ray", reason="Ray is not installed here (make test-ray installs it)")
pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm builds a venv with it)")

from test_ray import WAIT, _alive, _check_acked, _http_run, _poll, _snapshot, cluster  # noqa: E402, F401, I001

import ray_refit  # noqa: E402  (examples/ray_refit.py: test_ray put examples/ on sys.path)
from _ray_faults import STALLING_EXTENSION, stall_mid_write  # noqa: E402



def _fresh_digests(checkpoints: dict[int, str], tokens: bool = True) -> dict[int, tuple]:
    """Per version, a fresh engine's digests (and greedy tokens) from that version's checkpoint, on the
    trainer's node: the reference every refitted engine must equal."""
    from deltarefit.integrations.ray import EngineActor

    fresh_cls = ray.remote(EngineActor).options(resources={"trainer": 1.0}, num_cpus=1)
    out = {}
    for v, ck in checkpoints.items():
        e = fresh_cls.remote(ck, llm_kwargs=ray_refit.LLM_KWARGS, weight_transfer=False, name=f"fresh-{v}")
        calls = [e.digests.remote()] + ([e.generate.remote(ray_refit.PROMPTS)] if tokens else [])
        out[v] = tuple(ray.get(calls, timeout=WAIT))
        ray.kill(e)
    return out


def _describe(pid: int) -> str:
    import psutil

    try:
        return f"{pid} {' '.join(psutil.Process(pid).cmdline())[:80]}"
    except psutil.Error:
        return f"{pid} (gone)"


def _differing(want: dict[str, str], got: dict[str, str]) -> list[str]:
    return sorted(k for k in want if got.get(k) != want[k])


def test_a_node_whose_engines_all_died_rejoins_and_catches_up(cluster, tmp_path):  # noqa: F811 (the fixture)
    from deltarefit.storage.local import LocalStore
    from deltarefit.stream.records import head, load_commit

    root = str(tmp_path / "run")
    os.makedirs(root)
    trainer, handles, base = ray_refit.start(root)
    engines = dict(zip(ray_refit.ENGINES, handles, strict=True))
    store = LocalStore(os.path.join(root, "stream"))
    a, b = engines["engine-a"], engines["engine-b"]
    at: dict[int, dict] = {1: _snapshot(engines)}
    served: dict[int, str] = {1: base}
    results: dict[int, dict] = {}

    def acked(r: dict) -> dict:
        results[r["version"]], served[r["version"]] = r, r["served"]
        at[r["version"]] = _snapshot(engines)
        _check_acked(r, at[r["version"]], r["version"])
        return r

    assert acked(ray.get(trainer.step.remote(1), timeout=WAIT))["refit"]["rounds"] == 1  # version 2

    # version 3: engine-a's node removed while its worker is half way through a segment write
    node_a = at[2]["engine-a"]["state"]["node_id"]
    victim = next(n for n in cluster.worker_nodes if n.node_id == node_a)
    pids_a = ray.get(a.pids.remote(), timeout=WAIT)
    pid_b = at[2]["engine-b"]["state"]["pid"]
    marker = str(tmp_path / "engine-a-stalled")
    ray.get(a.collective_rpc.remote(stall_mid_write, args=(marker,)), timeout=WAIT)
    ref = trainer.step.remote(2)
    _poll("engine-a stalled mid-write", lambda: os.path.exists(marker))
    cluster.remove_node(victim, allow_graceful=False)  # the node's raylet, object store, agents: SIGKILL
    t_removed = time.monotonic()
    _poll("engine-a's node dead for Ray", lambda: not any(n["NodeID"] == node_a and n["Alive"] for n in ray.nodes()))
    # A lost machine takes every process on it down at once. On one machine, the actor's process outlives its
    # raylet while its main thread waits on its stalled worker; it and its vLLM processes get the SIGKILL the
    # machine's loss would have given them (the survivors are reported).
    survivors = [_describe(p) for p in pids_a if _alive(p)]
    for p in pids_a:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    _poll("engine-a's processes gone with its node", lambda: not any(_alive(p) for p in pids_a), timeout=120)
    # no node holds engine_a now: engine-a cannot come back, the round waits, engine-b keeps serving
    served_b = ray.get(b.generate.remote(ray_refit.PROMPTS), timeout=WAIT)
    assert [len(t) for t in served_b] == [16] * len(ray_refit.PROMPTS)
    assert not ray.wait([ref], timeout=0)[0], "the round finished while engine-a had no node"
    # a node with engine-a's resource joins: Ray reschedules the placement group there and restarts engine-a
    new = cluster.add_node(num_cpus=2, resources=ray_refit.ENGINES["engine-a"], object_store_memory=128 << 20)
    cluster.wait_for_nodes()
    r = acked(ray.get(ref, timeout=WAIT))
    back_s = time.monotonic() - t_removed
    assert r["version"] == 3 and r["refit"]["rounds"] >= 2, r
    assert any("Actor" in f for f in r["refit"]["failures"]), r  # a round failed on the dead actor
    sa, sb = at[3]["engine-a"]["state"], at[3]["engine-b"]["state"]
    assert sa["restarted"] and sa["node_id"] == new.node_id != node_a, sa  # on the node that joined
    assert sa["caught_up"]["version"] in (2, 3), sa  # from its checkpoint (version 1) through the stream
    assert not sb["restarted"] and sb["pid"] == pid_b, sb  # the other node's engine was never restarted

    # version 4: one round, both engines, engine-a still on the new node
    r = acked(ray.get(trainer.step.remote(3), timeout=WAIT))
    assert r["refit"]["rounds"] == 1 and at[4]["engine-a"]["state"]["node_id"] == new.node_id, r

    # versions lost: 0
    steps = [load_commit(store, v).step for v in range(1, head(store) + 1)]
    assert steps == [0, 1, 2, 3], steps

    # every engine at every version equals a fresh engine from that version's checkpoint, bit for bit
    for h in handles:
        ray.kill(h, no_restart=True)
    ray.kill(trainer, no_restart=True)
    want = _fresh_digests({v: served[v] for v in (2, 3, 4)})
    differing = {}
    for v, (want_d, want_t) in want.items():
        for name, s in at[v].items():
            assert s["tokens"] == want_t, (v, name)
            differing[(v, name)] = _differing(want_d[0], s["digests"][0])
    assert all(d == [] for d in differing.values()), differing
    for v in (3, 4):  # every version moved the weights
        assert _differing(at[v - 1]["engine-b"]["digests"][0], at[v]["engine-b"]["digests"][0]), v
    print(json.dumps({"node_rejoined_in_step_s": back_s, "caught_up": sa["caught_up"], "survivors": survivors,
                      "failures": r["refit"]["failures"] or results[3]["refit"]["failures"]}))


def test_vllm_serve_actor_killed_mid_update_heals(cluster, tmp_path):  # noqa: F811 (the fixture)
    from deltarefit.storage.local import LocalStore
    from deltarefit.stream.records import head, load_commit

    stream, trainer, handles = _http_run(tmp_path, extension=STALLING_EXTENSION)
    servers = dict(zip(["server-a", "server-b"], handles, strict=True))
    at: dict[int, dict] = {}
    served: dict[int, str] = {}

    def acked(r: dict) -> dict:
        served[r["version"]] = r["served"]
        at[r["version"]] = {}
        for n, s in servers.items():
            st, dg = ray.get([s.state.remote(), s.digests.remote()], timeout=WAIT)
            at[r["version"]][n] = {"state": st, "digests": dg}
            assert st["weight_version"] == str(r["version"]) and st["fingerprints"] == [r["refit"]["fingerprint"]], \
                (n, st)
        assert r["committed"] == r["version"], r
        return r

    assert acked(ray.get(trainer.step.remote(1), timeout=WAIT))["refit"]["rounds"] == 1  # version 2

    # version 3: server-a's actor killed while its server's worker is half way through a segment write
    sa_srv = servers["server-a"]
    pids_a = ray.get(sa_srv.pids.remote(), timeout=WAIT)
    pid_b = at[2]["server-b"]["state"]["pid"]
    marker = str(tmp_path / "server-a-stalled")
    ray.get(sa_srv.collective_rpc.remote("deltarefit_test_stall", (marker,)), timeout=WAIT)
    ref = trainer.step.remote(2)
    _poll("server-a stalled mid-write", lambda: os.path.exists(marker))
    os.kill(pids_a[0], signal.SIGKILL)  # the actor; its vllm serve gets SIGKILL from the kernel with it
    t_kill = time.monotonic()
    _poll("server-a's processes gone with its actor", lambda: not any(_alive(p) for p in pids_a), timeout=120)
    # server-b is finished and resumed when the round fails on server-a: it serves while server-a restarts
    toks = ray.get(servers["server-b"].generate.remote(ray_refit.PROMPTS), timeout=WAIT)
    assert [len(t) for t in toks] == [16] * len(ray_refit.PROMPTS), toks
    assert not ray.wait([ref], timeout=0)[0], "the round finished before server-a came back"
    r = acked(ray.get(ref, timeout=WAIT))
    back_s = time.monotonic() - t_kill
    assert r["version"] == 3 and r["refit"]["rounds"] == 2 and len(r["refit"]["failures"]) == 1, r
    assert "update_weights failed" in r["refit"]["failures"][0], r  # failed in the update, not before it
    sa, sb = at[3]["server-a"]["state"], at[3]["server-b"]["state"]
    assert sa["restarted"] and sa["pid"] != pids_a[0] and sa["server_pid"] not in pids_a, sa
    assert sa["caught_up"]["version"] in (2, 3), sa
    assert not sb["restarted"] and sb["pid"] == pid_b, sb

    assert acked(ray.get(trainer.step.remote(3), timeout=WAIT))["refit"]["rounds"] == 1  # version 4
    store = LocalStore(stream)
    assert [load_commit(store, v).step for v in range(1, head(store) + 1)] == [0, 1, 2, 3]  # 0 lost

    for h in handles:
        ray.kill(h, no_restart=True)
    ray.kill(trainer, no_restart=True)
    want = _fresh_digests({v: served[v] for v in (2, 3, 4)}, tokens=False)
    differing = {(v, n): _differing(want[v][0][0], snap["digests"][0]) for v in want for n, snap in at[v].items()}
    assert all(d == [] for d in differing.values()), differing
    print(json.dumps({"server_back_in_step_s": back_s, "failures": r["refit"]["failures"]}))
