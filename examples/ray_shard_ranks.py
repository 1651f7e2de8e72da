"""The sharded trainer of ``examples/ray_refit.py --trainer-ranks N`` (and tests/test_ray_shard.py): a tiny
Llama trained by trainer-rank Ray actors, each holding its own shard (``integrations.ray_shard.TrainerRank``).

``TinyRank`` holds its dim-0 shard of the fp32 masters and of AdamW's state (``trainer_layout``, unfused HF
names). Each step it gathers the compute copy from every rank's checkpoint of the previous step (the
sharded checkpoint on the shared disk plays the all-gather: no process group, so a rank can die and come
back alone), takes the gradient of a causal-LM loss on a batch every rank draws alike, and steps AdamW
on its own shard only; the step's shard is written to a temporary file and renamed
(``steps/step<k>/rank-<r>.pt``), so a step happened whole or not at all and a restarted rank reads the
masters it published. ``export`` writes the bf16 checkpoint of gathered masters (``export_full``): what a
vLLM engine starts from.
"""

from __future__ import annotations

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
    cfg.dtype = "bfloat16"
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
