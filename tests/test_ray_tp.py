"""deltarefit on Ray with a tensor-parallel engine: an ``EngineActor`` whose ``LLM`` runs TP=2
(``distributed_executor_backend="mp"``: two vLLM workers under the actor), in a placement group of one
bundle of 2 CPUs on its engine node, driven by vLLM's ``RayVLLMWeightSyncClient`` through ``RefitTrainer``.

CPU set-up as tests/test_vllm_live.py's TP=2 tests: one core per worker (``VLLM_CPU_OMP_THREADS_BIND=0|1``)
and the CPU weight prepack off (the layout a GPU engine has), given to the actor through ``runtime_env``.
Two real AdamW steps; at each version both workers hold the version's fingerprint, and the engine equals
a fresh TP=2 engine started from that version's checkpoint, worker by worker, bit for bit. Marked ``slow``
and ``ray`` (``make test-ray``).
"""

from __future__ import annotations

import json
import os

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ray = pytest.importorskip("ray", reason="Ray is not installed here (make test-ray installs it)")
pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm builds a venv with it)")

from test_ray import WAIT, _snapshot, cluster  # noqa: E402, F401, I001

import ray_refit  # noqa: E402  (examples/ray_refit.py: test_ray put examples/ on sys.path)
from test_ray_heal import _differing  # noqa: E402

TP_ENV = {"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "DELTAREFIT_TEST_NO_PREPACK": "1"}}
TP_KWARGS = dict(ray_refit.LLM_KWARGS, tensor_parallel_size=2, distributed_executor_backend="mp")


def test_tp2_engine_actor_follows_the_trainer_bit_exact(cluster, tmp_path):  # noqa: F811 (the fixture)
    from deltarefit.integrations.ray import EngineActor, start_engines
    from deltarefit.storage.local import LocalStore
    from deltarefit.stream.records import head, load_commit

    root = str(tmp_path / "run")
    os.makedirs(root)
    base = ray_refit.build_base(os.path.join(root, "base"))
    stream = os.path.join(root, "stream")
    trainer = ray.remote(ray_refit.TinyTrainer).options(resources={"trainer": 1.0}, num_cpus=1, max_task_retries=0,
                                                        name="trainer").remote(root, stream, base, ["engine-tp"])
    assert ray.get(trainer.publish_base.remote(), timeout=WAIT) == 1
    (engine,) = start_engines(base, [ray_refit.ENGINES["engine-a"]], names=["engine-tp"], num_cpus=2,
                              init_info={"stream": stream, "version": 1}, llm_kwargs=TP_KWARGS, runtime_env=TP_ENV)
    at, served, seconds = {}, {}, {}
    for k in (1, 2):
        r = ray.get(trainer.step.remote(k), timeout=WAIT)
        served[r["version"]], seconds[r["version"]] = r["served"], r["refit"]["seconds_round"]
        at[r["version"]] = snap = _snapshot({"engine-tp": engine})["engine-tp"]
        assert r["committed"] == r["version"] and r["refit"]["rounds"] == 1, r
        assert snap["state"]["weight_version"] == str(r["version"]), snap["state"]
        assert snap["state"]["fingerprints"] == [r["refit"]["fingerprint"]] * 2, snap["state"]  # both workers
        assert len(snap["digests"]) == 2 and snap["digests"][0] != snap["digests"][1]  # two shards
    store = LocalStore(stream)
    assert [load_commit(store, v).step for v in range(1, head(store) + 1)] == [0, 1, 2]  # 0 lost
    ray.kill(engine, no_restart=True)
    ray.kill(trainer, no_restart=True)

    fresh_cls = ray.remote(EngineActor).options(resources=ray_refit.ENGINES["engine-b"], num_cpus=2,
                                                runtime_env=TP_ENV)
    differing = {}
    for v, ck in served.items():
        ref = fresh_cls.remote(ck, llm_kwargs=TP_KWARGS, weight_transfer=False, name=f"fresh-tp-{v}")
        want_d, want_t = ray.get([ref.digests.remote(), ref.generate.remote(ray_refit.PROMPTS)], timeout=WAIT)
        ray.kill(ref)
        assert at[v]["tokens"] == want_t, v
        differing[v] = [_differing(w, g) for w, g in zip(want_d, at[v]["digests"], strict=True)]
    assert all(d == [[], []] for d in differing.values()), differing
    assert _differing(at[2]["digests"][0], at[3]["digests"][0]), "version 3 holds version 2's weights"
    print(json.dumps({"tp2_refit_round_s": seconds, "tp2_engine_start_s": at[2]["state"]["seconds_start"]}))
