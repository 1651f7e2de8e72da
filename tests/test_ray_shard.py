"""A trainer sharded over Ray actors (``deltarefit.integrations.ray_shard``) on a 3-node ``ray.cluster_utils.Cluster``.

Two trainer-rank actors (``tests/_ray_shard_actors.TinyRank``, one placement group on the trainer's node)
each hold their dim-0 shard of a tiny Llama's fp32 masters and AdamW state, take a real AdamW step on it
and publish their part of each version with ``ShardStreamPublisher`` (rank 0 commits once both parts are
in the store). Two rollout actors on the engine nodes follow the sharded stream with ``sync_sharded``: one
into a transformers module (whole tensors), one into the TP=2 slices of one (fused qkv/gate_up). Each
refit is ``RefitTrainer``'s round, driven through vLLM's ``RayVLLMWeightSyncClient``: committed for the
trainer only when both rollouts report the version and its fingerprint.

Real SIGKILLs in the middle of a publish: rank 1 between its part and its descriptor, the committer
(rank 0) before its commit record, and rank 1 after the commit record, before its baseline moved to it.
Ray restarts each; the driver asks it again with the same attempt (the first two publish the step then,
the third finds it committed); versions lost must be 0. At every version every rollout must hold ``export_full``'s bf16 bits of the
gathered masters, bit for bit.

Marked ``slow`` and ``ray``; skipped where Ray or vLLM is not installed (``make test-ray`` builds the venv).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ray = pytest.importorskip("ray", reason="Ray is not installed here (make test-ray installs it)")
pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm builds a venv with it)")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)
import _ray_shard_actors as A  # noqa: E402
import ray_refit  # noqa: E402  (examples/ray_refit.py: the cluster)
from test_ray import _poll, cluster  # noqa: E402, F401  (the 3-node cluster fixture, as test_ray_heal)

pytest_plugins = ["conftest_s3"]  # the SeaweedFS S3 server (s3_server, s3_env)

WAIT = 600  # seconds: the bound of any wait for an actor call
WORLD = 2
ROLLOUTS = {"rollout-a": ({"engine_a": 1.0}, "module"), "rollout-b": ({"engine_b": 1.0}, "tp2")}


class Run:
    """The sharded trainer's ranks, its consumers and the driver, on one stream. ``consumers``: "rollouts"
    (two ``ModuleRollout``s) or "vllm" (two ``EngineActor``s started from the export of version 1)."""

    def __init__(self, stream: str, root: str, *, consumers: str = "rollouts", config: dict | None = None) -> None:
        from deltarefit.integrations.ray_shard import ShardRefitTrainer, start_trainer_ranks

        self.root, self.stream, self.kind = root, stream, consumers
        self.config = config or A.CONFIG
        self.ranks = start_trainer_ranks(A.TinyRank, WORLD, stream, root, resources={"trainer": 1.0 / WORLD},
                                         max_restarts=3, config=self.config)
        ray.get([r.train.remote(0) for r in self.ranks], timeout=WAIT)
        names = list(ROLLOUTS) if consumers == "rollouts" else list(ray_refit.ENGINES)
        self.refit = ShardRefitTrainer(self.ranks, names, stream, os.path.join(root, "driver"), engine_version=1)
        self.results = {0: self.refit.publish(0)}
        assert self.results[0]["version"] == 1 and self.results[0]["keyframe"]
        self.consumers = self._start_rollouts() if consumers == "rollouts" else self._start_engines()
        self.at = {1: self.snapshot()}

    def _start_rollouts(self) -> dict:
        from deltarefit.integrations.placement import placed

        out = {}
        for name, (res, kind) in ROLLOUTS.items():
            out[name] = ray.remote(A.ModuleRollout).options(**placed(res, name, max_restarts=3)).remote(
                self.stream, os.path.join(self.root, "rollout-state", name), kind=kind,
                init_info={"stream": self.stream, "version": 1}, name=name)
        ray.get([h.ready.remote() for h in out.values()], timeout=WAIT)
        return out

    def _start_engines(self) -> dict:
        from deltarefit.integrations.ray import start_engines

        v1 = self.served(0)
        hs = start_engines(v1, list(ray_refit.ENGINES.values()), names=list(ray_refit.ENGINES),
                           init_info={"stream": self.stream, "version": 1}, llm_kwargs=ray_refit.LLM_KWARGS,
                           max_restarts=3, timeout=WAIT)
        return dict(zip(ray_refit.ENGINES, hs, strict=True))

    def served(self, step: int) -> str:
        """The bf16 export of ``step``'s gathered masters (written once): a fresh engine's checkpoint."""
        out = os.path.join(self.root, "served", f"step{step}")
        if not os.path.isdir(out):
            A.export(A.gather_masters(self.root, step, WORLD, self.config), out, self.config)
        return out

    def snapshot(self) -> dict:
        """Per consumer: its state (version, fingerprints), its digests (and an engine's greedy tokens)."""
        calls = [(h.state.remote(), h.digests.remote(),
                  h.generate.remote(ray_refit.PROMPTS) if self.kind == "vllm" else h.ready.remote())
                 for h in self.consumers.values()]
        got = ray.get([x for c in calls for x in c], timeout=WAIT)
        return {n: {"state": got[3 * i], "digests": got[3 * i + 1], "tokens": got[3 * i + 2]}
                for i, n in enumerate(self.consumers)}

    def train(self, step: int) -> None:
        ray.get([r.train.remote(step) for r in self.ranks], timeout=WAIT)

    def refit_step(self, step: int, pub: dict | None = None) -> dict:
        pub = pub or self.refit.publish(step)
        rep = self.refit.refit()
        assert rep.version == pub["version"] == self.refit.committed, (pub, rep)
        self.results[step] = {"publish": pub, "refit": rep}
        self.at[rep.version] = self.snapshot()
        for name, s in self.at[rep.version].items():
            assert s["state"]["weight_version"] == str(rep.version), (name, s["state"])
            assert s["state"]["fingerprints"] and set(s["state"]["fingerprints"]) == {pub["fingerprint"]}, s["state"]
        return pub

    def killed_mid_publish(self, step: int, rank: int, where: str) -> dict:
        """Publish ``step`` with rank ``rank`` held at ``where`` (``TinyRank.stall``) and its process killed
        there with SIGKILL; the driver's publish goes on once Ray restarted it."""
        from deltarefit.storage.base import open_store
        from deltarefit.stream.chain import head

        marker = os.path.join(self.root, f"stalled-{step}-{rank}")
        ray.get(self.ranks[rank].stall.remote(where, marker), timeout=WAIT)
        pid = ray.get(self.ranks[rank].pid.remote(), timeout=WAIT)
        out: dict = {}
        th = threading.Thread(target=lambda: out.update(pub=self.refit.publish(step)), daemon=True)
        th.start()
        _poll(f"rank {rank} held at {where}", lambda: os.path.exists(marker))
        before = head(open_store(self.refit.store.url))
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        th.join(WAIT)
        assert not th.is_alive() and "pub" in out, out
        pub = out["pub"]
        pub["back_s"] = time.monotonic() - t_kill
        assert pub["restarts"] == [rank], pub
        mine = pub["ranks"][rank]
        assert mine["restarted"], mine
        assert ray.get(self.ranks[rank].pid.remote(), timeout=WAIT) != pid  # a new process
        if where == "advance":  # committed before the kill: the restarted rank finds its step in the stream
            assert before == pub["version"] and mine["resumed"], (before, pub)
        else:  # nothing committed while the rank was held: its rerun published the step
            assert before == pub["version"] - 1 and not mine["resumed"], (before, pub)
        return pub

    def check_bit_exact(self, steps: int) -> None:
        """Every rollout at every version equals export_full of that step's gathered masters, and every
        version moved the weights."""
        for step in range(steps + 1):
            full = A.gather_masters(self.root, step, WORLD, self.config)
            for name, (_, kind) in ROLLOUTS.items():
                want = A.reference_digests(full, kind)
                got = self.at[step + 1][name]["digests"]
                assert [sorted(k for k in w if g.get(k) != w[k]) for w, g in zip(want, got, strict=True)] == \
                    [[] for _ in want], (step, name)
                assert [set(w) for w in want] == [set(g) for g in got]
            self.check_moved(step)

    def check_moved(self, step: int) -> None:
        if step:
            for name in self.consumers:
                prev, got = self.at[step][name]["digests"], self.at[step + 1][name]["digests"]
                assert any(p[k] != g[k] for p, g in zip(prev, got, strict=True) for k in g), (step, name)

    def check_fresh_engines(self, steps: int) -> dict:
        """Every engine at every version after the first equals a fresh engine started from that
        version's export (digests of every weight as its kernels read it, and greedy tokens). The ranks
        and engines are stopped first (the fresh engine takes the trainer's node)."""
        from deltarefit.integrations.ray import EngineActor

        served = {step + 1: self.served(step) for step in range(1, steps + 1)}
        from ray.util import get_placement_group, remove_placement_group

        for h in [*self.consumers.values(), *self.ranks]:
            ray.kill(h, no_restart=True)
        remove_placement_group(get_placement_group("deltarefit-trainer-ranks"))  # its bundles hold the node
        fresh_cls = ray.remote(EngineActor).options(resources={"trainer": 1.0}, num_cpus=1)
        differing = {}
        for v, ck in served.items():
            ref = fresh_cls.remote(ck, llm_kwargs=ray_refit.LLM_KWARGS, weight_transfer=False, name=f"fresh-{v}")
            want_d, want_t = ray.get([ref.digests.remote(), ref.generate.remote(ray_refit.PROMPTS)], timeout=WAIT)
            ray.kill(ref)
            for name, s in self.at[v].items():
                assert s["tokens"] == want_t, (v, name)
                differing[(v, name)] = sorted(k for k in want_d[0] if s["digests"][0].get(k) != want_d[0][k])
            self.check_moved(v - 1)
        assert all(d == [] for d in differing.values()), differing
        return differing

    def check_versions(self, steps: int) -> None:
        from deltarefit.shard.stream import load_shard_commit
        from deltarefit.stream.chain import head

        store = self.refit.store
        got = [load_shard_commit(store, v).step for v in range(1, head(store) + 1)]
        assert got == list(range(steps + 1)), got  # every step exactly one version, in order: 0 lost


def test_sharded_trainer_ranks_publish_and_rollouts_follow_bit_exact_through_rank_kills(cluster, tmp_path):  # noqa: F811 (the fixture)
    from deltarefit.errors import DeltaRefitError

    root = str(tmp_path / "run")
    os.makedirs(root)
    run = Run(os.path.join(root, "stream"), root)
    # each rank on the trainer's node, holding half of every tensor's rows (its own part, both non-empty)
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    for name, (res, _) in ROLLOUTS.items():
        assert set(res) <= set(nodes[run.at[1][name]["state"]["node_id"]]), name
    assert all(r["part_bytes"] for r in run.results[0]["ranks"]), run.results[0]
    for step in (1, 2):
        run.train(step)
        run.refit_step(step)
    # version 4: rank 1 killed between its part and its descriptor (its part in the store, not described)
    run.train(3)
    run.refit_step(3, run.killed_mid_publish(3, 1, ".head.json"))
    # version 5: the committer killed once every part is in, before the commit record
    run.train(4)
    run.refit_step(4, run.killed_mid_publish(4, 0, "commit.json"))
    # version 6: rank 1 killed once the record exists, before its baseline moved to it
    run.train(5)
    run.refit_step(5, run.killed_mid_publish(5, 1, "advance"))
    # the same step again is the version it already is (every rank resumed, nothing uploaded); an older
    # step is refused by every rank, with nothing written
    again = run.refit.publish(5)
    assert again["version"] == 6 and all(r["resumed"] for r in again["ranks"]), again
    with pytest.raises(DeltaRefitError, match="step 4 is behind"):
        run.refit.publish(4)
    run.check_versions(5)
    run.check_bit_exact(5)
    for step in range(1, 6):
        assert run.results[step]["refit"].rounds == 1, run.results[step]
        assert run.results[step]["publish"]["keyframe"] is False
    # the rollouts followed the chain (one version per refit) and were never restarted
    for s in run.at[6].values():
        assert s["state"]["last"]["route"] == "chain" and s["state"]["last"]["versions_applied"] == [6], s
        assert not s["state"]["restarted"]
    print({"rank_back_s": {k: v["publish"]["back_s"] for k, v in run.results.items() if k and "back_s" in v["publish"]},
           "publish_s": {k: max(r["seconds"] for r in v["publish"]["ranks"]) for k, v in run.results.items() if k},
           "refit_round_s": {k: v["refit"].seconds_round for k, v in run.results.items() if k}})


def test_sharded_trainer_in_s3(s3_env, cluster, tmp_path):  # noqa: F811 (the fixture)
    """The same loop with the stream in S3 (SeaweedFS on loopback; every node inherits the endpoint and
    credentials): 2 AdamW steps, each rank's part uploaded to S3, each rollout fetching from S3."""
    root = str(tmp_path / "run")
    os.makedirs(root)
    stream = s3_env.url(f"rayshard-{uuid.uuid4().hex[:8]}")
    assert stream.startswith("s3://")
    run = Run(stream, root)
    for step in (1, 2):
        run.train(step)
        run.refit_step(step)
    run.check_versions(2)
    run.check_bit_exact(2)
    for s in run.at[3].values():
        assert s["state"]["last"]["bytes_fetched"] > 0, s


def test_vllm_engines_follow_the_sharded_trainer_bit_exact_through_rank_kills(cluster, tmp_path):  # noqa: F811 (the fixture)
    """vLLM engine actors (``EngineActor``, TP=1, the deltarefit backend following the sharded stream) on
    the engine nodes, started from the export of version 1; 4 AdamW steps, rank 1 killed between its part
    and its descriptor at version 3 and the committer before its commit record at version 4; every
    refit one round, 0 versions lost, every engine equal to a fresh engine at every version."""
    root = str(tmp_path / "run")
    os.makedirs(root)
    run = Run(os.path.join(root, "stream"), root, consumers="vllm", config=ray_refit.CONFIG)
    for name, s in run.at[1].items():
        assert s["state"]["weight_version"] == "1" and s["state"]["fingerprints"] == [run.results[0]["fingerprint"]], \
            (name, s["state"])
    run.train(1)
    run.refit_step(1)
    run.train(2)
    run.refit_step(2, run.killed_mid_publish(2, 1, ".head.json"))
    run.train(3)
    run.refit_step(3, run.killed_mid_publish(3, 0, "commit.json"))
    run.train(4)
    run.refit_step(4)
    run.check_versions(4)
    for step in range(1, 5):
        assert run.results[step]["refit"].rounds == 1, run.results[step]
    pids = {n: s["state"]["pid"] for n, s in run.at[1].items()}
    assert {n: s["state"]["pid"] for n, s in run.at[5].items()} == pids  # no engine restarted
    run.check_fresh_engines(4)
    print({"rank_back_s": {k: v["publish"]["back_s"] for k, v in run.results.items() if k and "back_s" in v["publish"]},
           "refit_round_s": {k: v["refit"].seconds_round for k, v in run.results.items() if k}})
