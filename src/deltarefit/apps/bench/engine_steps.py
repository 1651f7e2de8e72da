"""Targets from a real optimizer step: the engine benchmark's and the Ray example's RL-like change rates.

A policy-gradient step of a trained model at an RL learning rate changes a few percent of the bf16
elements a rollout engine serves, most of them by one ulp. A step of a freshly initialized model under a
fresh AdamW does not: Adam's first update is ``lr * sign(grad)`` for every element, so at lr 1e-4 a
fifth to a third of the elements change (the Ray example's ``--toy-step``: 21-30% per step). What brings a step to RL-like rates is the learning rate
and Adam's state, both set here:

* :class:`Stepper` takes a model in fp32 under ``torch.optim.AdamW`` (weight decay 0.01), trains it
  ``warmup`` steps at ``warmup_lr`` on a causal-LM loss over random token ids (so Adam's moments hold a
  few steps of gradient, as a trained model's do), exports the served bf16 copy (the base), and takes the
  gradient of one more batch. A target is that one more AdamW step at a given learning rate, from the
  same state, with the same gradient: ``torch.optim.AdamW`` stepped per tensor over clones of the
  parameter and its state, so the model itself never moves and any number of targets share one base.
  AdamW's update is elementwise, so a step per tensor is the step of the whole model (a test checks the
  bits against ``opt.step()``).
* :meth:`Stepper.lr_for` finds the learning rate whose step changes a given fraction of the bf16
  elements (a secant in log-log space on the measured fraction, which grows with the learning rate).
* :func:`changed` counts the changed bf16 elements of two state dicts, and those that moved by one ulp.

Deterministic for a seed and a torch build (CPU). Measured: on the benchmark's 124.7M Llama (std 0.02,
8 warm-up steps at lr 1e-5) a step at lr 3.2e-7 changed 0.50% of the bf16 elements and at 3.2e-6 3.50%
(docs/ENGINES.md); on the Ray example's Llama (std 0.1, 8 warm-up steps), steps at lr 1e-5 change 2.3-2.6%
(docs/RAY.md). Most changes are one ulp (87-91%).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from typing import Any

WARMUP_STEPS = 8
WARMUP_LR = 1e-5
WEIGHT_DECAY = 0.01
BATCH = (4, 32)  # sequences x tokens per step
TOKENS = (4, 40)  # token ids drawn from [lo, hi): past the special tokens
SAMPLE = 1 << 21  # elements lr_for measures each try on


def lm_loss(model: Any, seed: int) -> Any:
    """The causal-LM loss of ``model`` on a batch of random token ids drawn from a generator seeded ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(*TOKENS, BATCH, generator=gen)
    return model(input_ids=ids, labels=ids).loss


def served_bits(model: Any) -> dict[str, Any]:
    """The bf16 copy of each parameter of ``model`` (what a served export holds), by name."""
    import torch

    return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


def changed(a: dict[str, Any], b: dict[str, Any], *, ulp: bool = True) -> tuple[int, int, int]:
    """``(elements, changed, by one ulp)`` of two bf16 state dicts with the same names and shapes: bits
    compared as integers (no float semantics); one ulp is a magnitude step of 1 with the sign kept
    (counted only with ``ulp``, else 0)."""
    import torch

    n = ch = one = 0
    for k, x in a.items():
        xa, xb = x.reshape(-1).view(torch.int16), b[k].reshape(-1).view(torch.int16)
        diff = xa != xb
        n += xa.numel()
        c = int(diff.sum())
        ch += c
        if ulp and c:
            da, db = xa[diff].to(torch.int32), xb[diff].to(torch.int32)
            one += int((((da ^ db) >= 0) & ((da & 0x7FFF) - (db & 0x7FFF)).abs().eq(1)).sum())
    return n, ch, one


class Stepper:
    """A model in fp32 under AdamW, trained ``warmup`` steps; its base and its one-step targets (see the
    module docstring). ``model`` is trained in place (it must hold fp32 parameters)."""

    def __init__(self, model: Any, *, seed: int = 0, warmup: int = WARMUP_STEPS, warmup_lr: float = WARMUP_LR,
                 weight_decay: float = WEIGHT_DECAY) -> None:
        import torch

        if warmup < 0:
            raise ValueError(f"warmup must be >= 0 steps, got {warmup}")
        self.model, self.warmup, self.warmup_lr = model, warmup, warmup_lr
        self.opt = torch.optim.AdamW(model.parameters(), lr=warmup_lr, weight_decay=weight_decay)
        model.train()
        for i in range(warmup):
            lm_loss(model, seed + i).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.base = served_bits(model)
        lm_loss(model, seed + warmup).backward()  # the measured step's gradient, kept in .grad

    def step(self, lr: float, *, stride: int = 1) -> dict[str, Any]:
        """The served bf16 parameters after one AdamW step at ``lr`` from the base's state (the model and
        its optimizer are left as they were). A parameter with no gradient is not stepped, as in AdamW.
        ``stride`` > 1: only every ``stride``-th element of each flattened parameter, stepped alike (AdamW
        is elementwise), as a flat tensor; compare with :meth:`base_sample`."""
        import torch

        group = self.opt.param_groups[0]
        hyper = {k: group[k] for k in ("betas", "eps", "weight_decay", "amsgrad")}

        def cut(t: Any) -> Any:
            t = t.detach()
            return t if stride == 1 or t.dim() == 0 else t.reshape(-1)[::stride]

        out = {}
        for name, p in self.model.named_parameters():
            if p.grad is None:
                out[name] = cut(self.base[name])
                continue
            q = cut(p).clone().requires_grad_(True)
            q.grad = cut(p.grad).clone()
            one = torch.optim.AdamW([q], lr=lr, **hyper)
            st = self.opt.state.get(p, {})
            one.state[q] = {k: cut(v).clone() for k, v in st.items()}
            one.step()
            out[name] = q.detach().to(torch.bfloat16)
        return out

    def base_sample(self, stride: int) -> dict[str, Any]:
        return {k: v.reshape(-1)[::stride] for k, v in self.base.items()}

    def fraction(self, lr: float, *, stride: int = 1) -> float:
        """The fraction of the bf16 elements a step at ``lr`` changes (over every ``stride``-th element)."""
        n, ch, _ = changed(self.base_sample(stride), self.step(lr, stride=stride), ulp=False)
        return ch / n

    def lr_for(self, rate: float, *, lr0: float = 1e-6, rel: float = 0.02, tries: int = 8,
               log: Callable[[str], None] | None = None) -> tuple[float, float]:
        """``(lr, fraction)``: a learning rate whose step changes ``rate`` of the bf16 elements, to within
        ``rel`` of it (or the closest of ``tries`` measured steps), measured on a sample of the elements
        (every k-th of each flattened tensor, about ``SAMPLE`` in all): :meth:`step` at that ``lr`` then
        changes about ``rate``, and what it changes is what a caller measures."""
        if not 0 < rate < 1:
            raise ValueError(f"rate must be in (0, 1), got {rate}")
        # every stride-th element: a sample of about SAMPLE elements, exact for those (AdamW is elementwise)
        stride = max(1, sum(v.numel() for v in self.base.values()) // SAMPLE)
        pts: list[tuple[float, float]] = []
        lr = lr0
        for _ in range(tries):
            f = self.fraction(lr, stride=stride)
            pts.append((lr, f))
            if log:
                log(f"  lr {lr:.3g}: {f:.3%} changed")
            if abs(f - rate) <= rel * rate:
                break
            lo = [p for p in pts if p[1] < rate]
            hi = [p for p in pts if p[1] > rate]
            if lo and hi:  # secant in log-log space between the closest points on either side
                (a, fa), (b, fb) = max(lo, key=lambda p: p[1]), min(hi, key=lambda p: p[1])
                fa = max(fa, 1e-9)
                t = (math.log(rate) - math.log(fa)) / (math.log(fb) - math.log(fa))
                lr = math.exp(math.log(a) + t * (math.log(b) - math.log(a)))
            else:  # the fraction grows about as the learning rate: scale (at most 100x at once)
                lr *= min(max(rate / max(f, 1e-9), 0.01), 100.0)
        return min(pts, key=lambda p: abs(p[1] - rate))


def export(model: Any, bits: dict[str, Any], out: str) -> None:
    """Save ``model``'s architecture with the bf16 parameters ``bits`` (names of ``model.named_parameters``)
    as a checkpoint directory (``save_pretrained``: config, safetensors). ``model`` is not changed."""
    import torch

    served = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in served.named_parameters():
            p.copy_(bits[name])
    served.save_pretrained(out, safe_serialization=True)


def checkpoint_changed(a: str, b: str) -> tuple[int, int, int]:
    """:func:`changed` of the bf16 tensors of two checkpoint directories' ``model.safetensors``."""
    from safetensors.torch import load_file

    ta, tb = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b))
    if ta.keys() != tb.keys():
        raise ValueError(f"{a} and {b} hold different tensors")
    return changed(ta, tb)
