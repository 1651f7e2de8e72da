"""verl's weight-sync round, in the order ``verl.checkpoint_engine.CheckpointEngineManager.update_weights``
(verl 0.9.1) drives it, over checkpoint engines built by the caller: every worker's ``prepare`` (actors
first, then rollouts), the backend class's ``build_topology``, every ``init_process_group`` with its slice
of the topology, the trainer's ``send_weights`` beside every rollout's update (here: its
``receive_weights`` collected), then every ``finalize``. Shared by test_verl_engine (deltarefit's side,
no verl) and test_verl (verl's real classes).

And a small model trained by AdamW, whose served (bf16) weights change a little every step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import torch


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Linear(64, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 64), torch.nn.LayerNorm(64))


def train_step(m: torch.nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
    g = torch.Generator().manual_seed(1000 + k)
    ids = torch.randint(0, 256, (8, 16), generator=g)
    loss = m(ids).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def served(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the rollouts must receive: the parameters as bf16 (torch's round to nearest even)."""
    return {n: t.detach().to(torch.bfloat16).contiguous() for n, t in m.state_dict().items()}


def same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for n, t in want.items():
        g = got[n]
        assert (g.dtype, tuple(g.shape)) == (t.dtype, tuple(t.shape)), n
        assert torch.equal(g.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), n


async def run_round(cls: type, trainers: list[Any], rollouts: list[Any], weights: Callable[[], Any],
                    step: int | None, receive: Callable[[Any, int | None], Awaitable[Any]] | None = None
                    ) -> tuple[list[Any], list[Any]]:
    """One round; returns (the trainers' send_weights results, each rollout's result). ``weights()`` gives
    each trainer rank its own iterable of the same weights (each rank walks its gather). ``receive`` is
    how a rollout takes part (default: collect its ``receive_weights`` into a dict)."""
    metadata = [e.prepare() for e in trainers] + [e.prepare() for e in rollouts]
    a_kw, r_kw = cls.build_topology(len(trainers), len(rollouts), metadata)
    for i, e in enumerate(trainers):
        e.init_process_group(**{k: v[i] for k, v in a_kw.items()})
    for i, e in enumerate(rollouts):
        e.init_process_group(**{k: v[i] for k, v in r_kw.items()})

    async def collect(e: Any, s: int | None) -> dict[str, torch.Tensor]:
        return {n: t async for n, t in e.receive_weights(global_steps=s)}

    receive = receive or collect
    try:
        out = await asyncio.gather(*(e.send_weights(weights(), global_steps=step) for e in trainers),
                                   *(receive(e, step) for e in rollouts), return_exceptions=True)
    finally:
        for e in [*trainers, *rollouts]:
            e.finalize()
    return out[:len(trainers)], out[len(trainers):]
