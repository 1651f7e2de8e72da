"""deltarefit on Ray with vLLM's ``AsyncLLM`` (the v1 async engine) in the engine actors
(``integrations.ray_async.AsyncEngineActor``), on the 3-node cluster of tests/test_ray.py.

The trainer actor is the same (a tiny Llama, a real AdamW step per version), and so is the client: vLLM's
``RayVLLMWeightSyncClient`` through ``RefitTrainer``. Version 2 is one round; version 3 is planned by the
engines while they serve (``prepare``: the async actors answer ``generate`` calls meanwhile), then written in
the pause. Before version 4, engine-a's actor process is killed (SIGKILL): Ray restarts it, and its first
call builds the ``AsyncLLM`` from its checkpoint and catches up through the stream before it answers; the
round is acknowledged by both, engine-b never restarted. At every version each engine acknowledges the
version's fingerprint and equals a fresh ``LLM`` engine started from that version's checkpoint, bit for
bit (digests and greedy tokens). Versions lost: 0.
Marked ``slow`` and ``ray`` (``make test-ray``).
"""

from __future__ import annotations

import json
import os
import signal

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ray = pytest.importorskip("ray", reason="Ray is not installed here (make test-ray installs it)")
pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm builds a venv with it)")

from test_ray import WAIT, _alive, _check_acked, _poll, _snapshot, cluster  # noqa: E402, F401, I001

import ray_refit  # noqa: E402  (examples/ray_refit.py: test_ray put examples/ on sys.path)
from test_ray_heal import _differing, _fresh_digests  # noqa: E402


def test_asyncllm_engine_actors_follow_the_trainer_bit_exact(cluster, tmp_path):  # noqa: F811 (the fixture)
    from deltarefit.integrations.ray_async import AsyncEngineActor
    from deltarefit.storage.local import LocalStore
    from deltarefit.stream.records import head, load_commit

    root = str(tmp_path / "run")
    os.makedirs(root)
    trainer, handles, _base = ray_refit.start(root, actor_cls=AsyncEngineActor)
    engines = dict(zip(ray_refit.ENGINES, handles, strict=True))
    first = _snapshot(engines)
    assert all(s["state"]["engine"] == "AsyncLLM" and s["state"]["weight_version"] == "1" for s in first.values())
    at, served, rounds = {}, {}, {}
    for k, prepare in ((1, False), (2, True)):
        ref = trainer.step.remote(k, prepare=prepare)
        # the async engines serve while the trainer trains, publishes, (has them plan,) and refits
        during = ray.get([e.generate.remote(ray_refit.PROMPTS) for e in handles], timeout=WAIT)
        assert all([len(t) for t in toks] == [16] * len(ray_refit.PROMPTS) for toks in during)
        r = ray.get(ref, timeout=WAIT)
        served[r["version"]], rounds[r["version"]] = r["served"], r["refit"]["rounds"]
        at[r["version"]] = _snapshot(engines)
        _check_acked(r, at[r["version"]], r["version"])
        assert r["refit"]["rounds"] == 1, r
        for name, e in engines.items():
            last = ray.get(e.last_update.remote(), timeout=WAIT)
            assert last["route"] == "chain" and last["versions_applied"] == [r["version"]], (name, last)
            assert (last["bytes_fetched"] > 0) != prepare, (name, last)  # a planned version was fetched before
    # version 4: engine-a's actor process killed (SIGKILL) before the step; Ray restarts it, its first call
    # builds the AsyncLLM from its checkpoint and catches up through the stream before it answers
    pids_a = ray.get(engines["engine-a"].pids.remote(), timeout=WAIT)
    pid_b = at[3]["engine-b"]["state"]["pid"]
    os.kill(pids_a[0], signal.SIGKILL)
    _poll("engine-a's processes gone", lambda: not any(_alive(p) for p in pids_a), timeout=120)
    r = ray.get(trainer.step.remote(3), timeout=WAIT)
    served[4], rounds[4] = r["served"], r["refit"]["rounds"]
    at[4] = _snapshot(engines)
    _check_acked(r, at[4], 4)
    sa, sb = at[4]["engine-a"]["state"], at[4]["engine-b"]["state"]
    assert sa["restarted"] and sa["pid"] != pids_a[0] and sa["caught_up"]["version"] in (3, 4), sa
    assert not sb["restarted"] and sb["pid"] == pid_b, sb  # no other engine restarted
    store = LocalStore(os.path.join(root, "stream"))
    assert [load_commit(store, v).step for v in range(1, head(store) + 1)] == [0, 1, 2, 3]  # 0 lost

    for h in handles:
        ray.kill(h, no_restart=True)
    ray.kill(trainer, no_restart=True)
    want = _fresh_digests(served)
    for v, (want_d, want_t) in want.items():
        assert _differing(at[v - 1]["engine-a"]["digests"][0] if v > 2 else first["engine-a"]["digests"][0],
                          at[v]["engine-a"]["digests"][0]), v  # the version moved the weights
        for name, s in at[v].items():
            assert s["tokens"] == want_t, (v, name)
            assert _differing(want_d[0], s["digests"][0]) == [], (v, name)
    print(json.dumps({"async_rounds": rounds, "caught_up_after_kill": sa["caught_up"]}))
