"""Version chains for the benchmark: consecutive bf16 served copies of a real training run.

A chain is ``v0.safetensors .. v{n-1}.safetensors`` in one directory, exactly one optimizer step
between consecutive versions, each the bf16 served copy (``tensor.to(torch.bfloat16)``, contiguous)
of fp32 master weights trained by a real ``torch.optim.AdamW``; ``chain.json`` beside them is the
manifest (the :class:`Chain` as JSON). Every file is written temp + rename. Deterministic for a
given seed, torch build and thread count.

* :func:`make_adamw_chain`: the pretrained 22.7M MiniLM BERT of :func:`.pairs.make_adamw_pairs`,
  the same self-supervised noisy-gradient loss; after ``steps_warmup`` steps every step is saved.
* :func:`make_rl_chain`: a small LLaMA causal LM (random init; no download), a short supervised
  warm-up on a synthetic language, then GRPO: per prompt, ``group_size`` completions sampled from the
  model itself (``torch.multinomial``), a verifiable reward, group-normalized advantages, a
  policy-gradient loss on the sampled tokens' log-probs, and a fresh AdamW on the fp32 masters.
  ``v_k`` is the policy after RL step ``k + 1``.

  The language: token ``t`` has class ``t % n_classes``; a sentence's next token is a uniformly
  random token of the class after the previous token's (``(c + 1) % n_classes``). A prompt is the
  start of such a sentence; a completion's reward is the fraction of its tokens that follow the rule
  (the first one judged against the prompt's last token). Chance level is ``1 / n_classes``.

``python -m deltarefit.apps.bench.chains OUT_DIR [--kind adamw|rl] [--lr X] [--versions N]`` makes
one chain by hand and prints the per-step change fractions and timings.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...errors import DeltaRefitError, UsageError
from ...io.fsutil import write_atomic
from .pairs import _n_changed, _served_bf16, adamw_run

log = logging.getLogger(__name__)

MANIFEST = "chain.json"
RL_LR = 2e-6  # default RL learning rate: about 2.4-4.3% of the bf16 elements change per step


@dataclass
class Chain:
    """A chain on disk. ``changed_fraction[i]``: the fraction of bf16 elements whose bit patterns
    differ between ``paths[i]`` and ``paths[i + 1]`` (compared as int16). ``rewards``: for an RL
    chain, the mean reward of the rollouts of each saved step (empty otherwise)."""

    name: str
    paths: list[str]
    n_params: int
    changed_fraction: list[float]
    lr: float = 0.0
    rewards: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class RLSetup:
    """Sizes of :func:`make_rl_chain` (the defaults: a 4.2M-parameter model, 64 rollouts a step)."""

    vocab_size: int = 2000
    lang_vocab: int = 64
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 4
    n_classes: int = 8
    sft_steps: int = 60
    sft_lr: float = 1e-3
    sft_batch: int = 16
    sft_len: int = 32
    prompts: int = 8
    group_size: int = 8
    prompt_len: int = 8
    completion_len: int = 16


def _check(n_versions: int, lr: float) -> None:
    if n_versions < 2:
        raise UsageError(f"a chain needs at least 2 versions, got --versions {n_versions}")
    if not lr > 0:
        raise UsageError(f"learning rate must be > 0, got --lr {lr}")


class _Saver:
    """Writes each version as it comes (temp + rename) and the change fraction against the last."""

    def __init__(self, out: Path):
        self.out = out
        self.paths: list[str] = []
        self.fractions: list[float] = []
        self.prev: dict[str, Any] | None = None
        self.n_params = 0

    def save(self, sd: dict[str, Any]) -> None:
        import torch
        from safetensors.torch import save

        if self.prev is not None:
            if sd.keys() != self.prev.keys():
                raise AssertionError("a chain's versions must hold the same tensors")
            bf = [k for k, v in sd.items() if v.dtype == torch.bfloat16]
            total = sum(sd[k].numel() for k in bf)
            changed = sum(_n_changed(self.prev[k], sd[k]) for k in bf)
            self.fractions.append(changed / total if total else 0.0)
        self.n_params = sum(v.numel() for v in sd.values())
        p = self.out / f"v{len(self.paths)}.safetensors"
        write_atomic(str(p), save(sd))
        self.paths.append(str(p))
        self.prev = sd

    def finish(self, name: str, lr: float, t0: float, rewards: list[float] | None = None) -> Chain:
        chain = Chain(
            name, self.paths, self.n_params, self.fractions, lr, rewards or [], time.perf_counter() - t0
        )
        write_atomic(str(self.out / MANIFEST), json.dumps(chain.to_dict(), indent=1).encode())
        return chain


# --------------------------------------------------------------------------------------------------
# AdamW chain


def make_adamw_chain(
    out_dir: str | os.PathLike[str],
    lr: float,
    n_versions: int = 8,
    *,
    steps_warmup: int = 3,
    seed: int = 0,
    batch_size: int = 8,
    seq_len: int = 64,
    weight_decay: float = 0.01,
    proj_dim: int = 16,
) -> Chain:
    """``n_versions`` consecutive AdamW steps of the pretrained MiniLM; see the module docstring."""

    _check(n_versions, lr)
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, step = adamw_run(lr, seed=seed, batch_size=batch_size, seq_len=seq_len, weight_decay=weight_decay,
                            proj_dim=proj_dim)
    for i in range(steps_warmup):
        log.info("adamw lr %g warm-up step %d: loss %.4f", lr, i, step())
    saver = _Saver(out)
    saver.save(_served_bf16(model))
    for i in range(1, n_versions):
        loss = step()
        saver.save(_served_bf16(model))
        log.info("adamw lr %g v%d: loss %.4f, %.3f%% changed", lr, i, loss, 100 * saver.fractions[-1])
    return saver.finish(f"adamw-lr{lr:g}", lr, t0)


# --------------------------------------------------------------------------------------------------
# RL chain


def _sentences(gen: Any, n: int, length: int, s: RLSetup) -> Any:
    """``n`` sentences of the synthetic language (module docstring), int64 ``(n, length)``."""
    import torch

    per_class = s.lang_vocab // s.n_classes
    c0 = torch.randint(0, s.n_classes, (n, 1), generator=gen)
    cls = (c0 + torch.arange(length)) % s.n_classes
    return torch.randint(0, per_class, (n, length), generator=gen) * s.n_classes + cls


def _reward(prev_last: Any, completion: Any, n_classes: int) -> Any:
    """Fraction of completion tokens whose class follows the previous token's, per row (float)."""
    import torch

    seq = torch.cat([prev_last[:, None], completion], dim=1) % n_classes
    return ((seq[:, 1:] - seq[:, :-1]) % n_classes == 1).float().mean(dim=1)


def _cache_kw(o: Any) -> dict[str, Any]:
    """The KV cache of a forward's output, as the keyword the next forward takes (transformers >= 5.24
    renamed ``past_key_values`` to ``cache``)."""
    if getattr(o, "cache", None) is not None:
        return {"cache": o.cache}
    return {"past_key_values": o.past_key_values}


def _sample(model: Any, prompts: Any, n_new: int, gen: Any) -> Any:
    """Completions sampled token by token at temperature 1 from ``model`` (KV cache), ``(B, n_new)``."""
    import torch

    out = []
    with torch.no_grad():
        o = model(input_ids=prompts, use_cache=True)
        for i in range(n_new):
            probs = torch.softmax(o.logits[:, -1].float(), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
            out.append(nxt)
            if i + 1 < n_new:
                o = model(input_ids=nxt, use_cache=True, **_cache_kw(o))
    return torch.cat(out, dim=1)


def _grpo_step(model: Any, opt: Any, gen: Any, s: RLSetup) -> tuple[float, float]:
    """One GRPO step (on-policy, so the clipped ratio is 1 and the surrogate is the plain policy
    gradient; no KL term). Returns (mean reward, loss)."""
    import torch

    prompts = _sentences(gen, s.prompts, s.prompt_len, s).repeat_interleave(s.group_size, dim=0)
    comp = _sample(model, prompts, s.completion_len, gen)
    r = _reward(prompts[:, -1], comp, s.n_classes)
    rg = r.view(s.prompts, s.group_size)
    adv = ((rg - rg.mean(dim=1, keepdim=True)) / (rg.std(dim=1, keepdim=True) + 1e-4)).view(-1)
    seq = torch.cat([prompts, comp], dim=1)
    logits = model(input_ids=seq).logits[:, s.prompt_len - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, comp[..., None]).squeeze(-1)
    loss = -(adv[:, None] * logp).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(r.mean()), float(loss.detach())


def _sft_step(model: Any, opt: Any, gen: Any, s: RLSetup) -> float:
    ids = _sentences(gen, s.sft_batch, s.sft_len, s)
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def make_rl_chain(
    out_dir: str | os.PathLike[str],
    n_versions: int = 9,
    *,
    seed: int = 0,
    lr: float = RL_LR,
    weight_decay: float = 0.01,
    setup: RLSetup | None = None,
) -> Chain:
    """``n_versions`` consecutive GRPO steps of a small LLaMA; see the module docstring. With the
    default setup and ``lr`` 2e-6 about 2.4-4.3% of the bf16 elements change per step."""
    import torch
    import transformers

    _check(n_versions, lr)
    s = setup or RLSetup()
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_heads,
        max_position_embeddings=max(s.sft_len, s.prompt_len + s.completion_len),
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).float()
    model.train()
    sft = torch.optim.AdamW(model.parameters(), lr=s.sft_lr, weight_decay=weight_decay)
    for i in range(s.sft_steps):
        loss = _sft_step(model, sft, gen, s)
        if i % 10 == 0 or i + 1 == s.sft_steps:
            log.info("rl warm-up (supervised) step %d: loss %.4f", i, loss)
    del sft
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    saver = _Saver(out)
    rewards: list[float] = []
    for i in range(n_versions):
        reward, loss = _grpo_step(model, opt, gen, s)
        rewards.append(reward)
        saver.save(_served_bf16(model))
        frac = f", {100 * saver.fractions[-1]:.3f}% changed" if saver.fractions else ""
        log.info("rl lr %g v%d: mean reward %.4f, loss %.4f%s", lr, i, reward, loss, frac)
    return saver.finish(f"rl-grpo-lr{lr:g}", lr, t0, rewards)


# --------------------------------------------------------------------------------------------------
# CLI


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m deltarefit.apps.bench.chains", description="write a chain of bf16 training versions"
    )
    ap.add_argument("out_dir")
    ap.add_argument("--kind", choices=("adamw", "rl"), default="adamw")
    ap.add_argument(
        "--lr", type=float, default=None, help=f"learning rate (default: adamw 1e-5, rl {RL_LR:g})"
    )
    ap.add_argument("--versions", type=int, default=None, help="versions (default: adamw 8, rl 9)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    make: Callable[[], Chain]
    if args.kind == "adamw":
        lr = 1e-5 if args.lr is None else args.lr
        make = functools.partial(make_adamw_chain, args.out_dir, lr, args.versions or 8, seed=args.seed)
    else:
        lr = RL_LR if args.lr is None else args.lr
        make = functools.partial(make_rl_chain, args.out_dir, args.versions or 9, seed=args.seed, lr=lr)
    try:
        chain = make()
    except DeltaRefitError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(
        f"{chain.name}: {len(chain.paths)} versions of {chain.n_params} elements in {os.path.dirname(chain.paths[0])}"
    )
    for i, f in enumerate(chain.changed_fraction):
        rw = f"  (mean reward of v{i + 1}'s rollouts {chain.rewards[i + 1]:.4f})" if chain.rewards else ""
        print(f"  v{i} -> v{i + 1}: {100 * f:.3f}% of bf16 elements changed{rw}")
    print(f"generated in {chain.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
