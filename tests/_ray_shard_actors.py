"""The actors of tests/test_ray_shard.py: a tiny Llama trained by sharded trainer ranks, and rollout actors
that follow the sharded stream into plain torch tensors (a transformers module, or TP slices).

``TinyRank`` holds its dim-0 shard of the fp32 masters and of AdamW's state (``trainer_layout``, unfused HF
names). Each step it gathers the compute copy from every rank's checkpoint of the previous step (the
sharded checkpoint on the shared disk plays the all-gather), takes the gradient of a causal-LM loss on
a batch every rank draws alike, and steps AdamW on its own shard only; the step's shard is written to a
temporary file and renamed (``steps/step<k>/rank-<r>.pt``), so a step happened whole or not at all and a
restarted rank reads the masters it published.

``ModuleRollout`` answers vLLM's weight-sync calls (what ``RayVLLMWeightSyncClient`` sends) and
``state``, as ``EngineActor`` does, so ``RefitTrainer``'s rounds drive it: ``update_weights`` is
``sync_sharded`` to the version asked for.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import Any

import numpy as np

from deltarefit.integrations.ray_shard import TrainerRank

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5)


def shapes(config: dict | None = None) -> dict[str, tuple[int, ...]]:
    from deltarefit.shard.names import llama_shapes

    return llama_shapes(config or CONFIG)


def rollout_layouts(config: dict | None = None) -> dict[str, list]:
    """The rollout layouts the stream is cut for: the whole module, and TP=2 slices (fused qkv/gate_up)."""
    from deltarefit.shard.names import identity_layout, tp_layout

    s = shapes(config)
    return {"module": [identity_layout(s)], "tp2": [tp_layout(s, 2, r) for r in range(2)]}


def cuts(config: dict | None = None) -> dict:
    from deltarefit.shard.names import cuts_from_layouts

    return cuts_from_layouts([lay for lays in rollout_layouts(config).values() for lay in lays])


def rank_layout(world: int, rank: int, config: dict | None = None):
    from deltarefit.shard.names import trainer_layout

    return trainer_layout(shapes(config), [world], [rank], ["S0"], fuse=False)


def step_file(root: str, step: int, rank: int) -> str:
    return os.path.join(root, "steps", f"step{step}", f"rank-{rank}.pt")


def gather_masters(root: str, step: int, world: int, config: dict | None = None) -> dict[str, np.ndarray]:
    """The full fp32 masters after ``step``: every rank's dim-0 shard, concatenated (test-side reference)."""
    import torch

    shards = [torch.load(step_file(root, step, r))["masters"] for r in range(world)]
    out = {n: torch.cat([s[n] for s in shards]).numpy() for n in shards[0]}
    assert {n: a.shape for n, a in out.items()} == shapes(config), "shards do not tile the checkpoint"
    return out


def export(full: dict[str, np.ndarray], out: str, config: dict) -> str:
    """The bf16 checkpoint of masters ``full`` (``export_full``'s bits, the conversion the parts are
    computed with), with its config and a tokenizer: what a fresh vLLM engine starts from."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from deltarefit.apps.bench.engine_model import build_tokenizer
    from deltarefit.shard.convert import export_full

    os.makedirs(out)
    tensors = {n: torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
               for n, (_, bits) in export_full(full, "BF16").items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg = LlamaConfig(**config)
    cfg.torch_dtype = "bfloat16"
    cfg.save_pretrained(out)
    build_tokenizer(out)
    return out


class TinyRank(TrainerRank):
    """One rank of a sharded tiny-Llama trainer (see the module docstring)."""

    def __init__(self, stream: str, root: str, *, rank: int, world: int, lr: float = 1e-4,
                 config: dict | None = None, **kw: Any) -> None:
        self.root, self.lr = root, lr
        self.config = config or CONFIG
        self.layout = rank_layout(world, rank, self.config)
        super().__init__(stream, self.layout, rank=rank, world=world,
                         state_dir=os.path.join(root, "trainer-state"), cuts=cuts(self.config), **kw)

    def train(self, step: int) -> None:
        """Step ``step`` from every rank's step - 1 (step 0: the seeded init), this rank's shard saved."""
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from deltarefit.shard.names import local_from_full

        if os.path.exists(step_file(self.root, step, self.rank)):
            return
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**self.config)).float()
        if step == 0:
            full = {n: p.detach().numpy() for n, p in model.named_parameters()}
            masters = {n: torch.from_numpy(a.copy()) for n, a in local_from_full(self.layout, full, np.float32).items()}
            opt_state = None
        else:
            for r in range(self.world):  # the other ranks' step - 1 (the driver runs steps in order)
                deadline = time.monotonic() + 300
                while not os.path.exists(step_file(self.root, step - 1, r)):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank {r}'s step {step - 1} is not on disk")
                    time.sleep(0.1)
            full = gather_masters(self.root, step - 1, self.world, self.config)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(torch.from_numpy(full[n]))
            mine = torch.load(step_file(self.root, step - 1, self.rank))
            masters, opt_state = mine["masters"], mine["opt"]
        if step:
            for m in masters.values():
                m.requires_grad_(True)
            opt = torch.optim.AdamW(list(masters.values()), lr=self.lr)
            if opt_state is not None:
                opt.load_state_dict(opt_state)
            gen = torch.Generator().manual_seed(1000 + step)
            ids = torch.randint(4, 40, (4, 32), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            grads = local_from_full(self.layout, {n: p.grad.numpy() for n, p in model.named_parameters()}, np.float32)
            for n, m in masters.items():
                m.grad = torch.from_numpy(grads[n])
            opt.step()
            opt_state = opt.state_dict()
            masters = {n: m.detach() for n, m in masters.items()}
        out = step_file(self.root, step, self.rank)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(out), prefix=f".rank-{self.rank}.")
        os.close(fd)
        torch.save({"masters": masters, "opt": opt_state}, tmp)
        os.replace(tmp, out)

    def masters(self, step: int):
        import torch

        return torch.load(step_file(self.root, step, self.rank))["masters"]

    def stall(self, where: str, marker: str, seconds: float = 600.0) -> None:
        """At the next ``where`` of a publish, write ``marker`` and sleep (the test kills this rank's process
        there): ``.head.json`` (a store create of that suffix: the rank's part is in, its descriptor not),
        ``commit.json`` (the committer: every part in, no commit record), or ``advance`` (the record
        exists, this rank's baseline has not moved to it)."""

        def hold():
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(seconds)
            raise TimeoutError("stalled publish was not killed")

        if where == "advance":
            self.publisher.advance = lambda rec: hold()
            return
        store = self.publisher.store
        real = store.create
        store.create = lambda key, data: hold() if key.endswith(where) else real(key, data)


def _bits(t) -> np.ndarray:
    import torch

    return t.detach().contiguous().view(torch.int16).numpy()


class ModuleRollout:
    """A rollout actor holding a transformers Llama in bf16 (``kind="module"``, identity layout) or the two
    TP slices of one (``kind="tp2"``), following the sharded stream with ``sync_sharded``."""

    def __init__(self, stream: str, state_dir: str, *, kind: str = "module", init_info: dict | None = None,
                 name: str = "rollout") -> None:
        import ray
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        self.name, self.kind, self.stream = name, kind, stream
        ctx = ray.get_runtime_context()
        self.restarted = bool(ctx.was_current_actor_reconstructed)
        self.node_id = ctx.get_node_id()
        self.layouts = rollout_layouts()[kind]
        if kind == "module":
            torch.manual_seed(7)  # not the trainer's init: everything it holds comes from the stream
            self.model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16)
            self.tensors = [self.model]
        else:
            self.tensors = [{n: torch.zeros(lt.shape, dtype=torch.bfloat16) for n, lt in lay.items()}
                            for lay in self.layouts]
        os.makedirs(state_dir, exist_ok=True)
        self.paths = [os.path.join(state_dir, f"{name}-{i}.json") for i in range(len(self.tensors))]
        for p in self.paths:  # these tensors are new: a state file left by an earlier process is not theirs
            if os.path.exists(p):
                os.unlink(p)
        self.init_info: dict | None = None
        self.weight_version: str | None = None
        self.reports: list[dict] = []
        self.caught_up: dict | None = None
        if init_info is not None:
            self.init_weight_transfer_engine({"init_info": init_info})
            self.caught_up = self._sync(None)
            self.weight_version = str(self.caught_up["version"])

    def _sync(self, version: int | None) -> dict:
        from deltarefit.shard.stream import sync_sharded

        t0 = time.perf_counter()
        reps = [sync_sharded(self.stream, t, None if self.kind == "module" else lay, state_path=p, to_version=version)
                for t, lay, p in zip(self.tensors, self.layouts, self.paths, strict=True)]
        out = {"version": reps[0].version, "route": reps[0].route, "bytes_fetched": sum(r.bytes_fetched for r in reps),
               "versions_applied": reps[0].versions_applied, "seconds": time.perf_counter() - t0}
        self.reports.append(out)
        return out

    # -- vLLM's weight-sync calls ------------------------------------------------------------------

    def init_weight_transfer_engine(self, request: Any) -> None:
        info = request["init_info"] if isinstance(request, dict) else request.init_info
        self.init_info = dict(info)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, request: Any) -> None:
        info = request["update_info"] if isinstance(request, dict) else request.update_info
        if not info.get("prepare"):
            self._sync(int(info["version"]))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass

    def update_weight_version(self, new_version: str) -> None:
        self.weight_version = new_version

    # -- inspection --------------------------------------------------------------------------------

    def state(self) -> dict:
        from deltarefit.shard.stream import held_version

        held = [held_version(p) for p in self.paths]
        return {"name": self.name, "pid": os.getpid(), "node_id": self.node_id, "restarted": self.restarted,
                "weight_version": self.weight_version, "fingerprints": [h[1] for h in held if h is not None],
                "held": [h[0] if h else None for h in held], "caught_up": self.caught_up,
                "last": self.reports[-1] if self.reports else None}

    def digests(self) -> list[dict[str, str]]:
        """Per tensor set, the sha256 of each tensor's bits."""
        out = []
        for t in self.tensors:
            items = t.state_dict().items() if hasattr(t, "state_dict") else t.items()
            out.append({n: hashlib.sha256(_bits(v).tobytes()).hexdigest() for n, v in items})
        return out

    def ready(self) -> bool:
        return True


def reference_digests(full: dict[str, np.ndarray], kind: str) -> list[dict[str, str]]:
    """What a rollout of ``kind`` must hold for masters ``full``: ``export_full``'s bf16 bits, in each
    rollout layout, hashed as ``ModuleRollout.digests`` hashes."""
    from deltarefit.shard.convert import export_full
    from deltarefit.shard.names import local_from_full

    bits = {n: b for n, (_, b) in export_full(full, "BF16").items()}
    out = []
    for lay in rollout_layouts()[kind]:
        local = local_from_full(lay, bits, np.uint16)
        out.append({n: hashlib.sha256(np.ascontiguousarray(a).view(np.int16).tobytes()).hexdigest()
                    for n, a in local.items()})
    return out
