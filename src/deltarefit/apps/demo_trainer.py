"""The demo's trainer side: the fp32 master under AdamW and its bf16 view, the loop that publishes each
bf16 export to the version stream, has every rollout sync to it and checks their replies (fingerprints,
stamps, model output bit for bit), and the REINFORCE step on the batch stamped with the version it just
published. :func:`train` runs that loop and prints the report; it returns False at the first mismatch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from .demo_report import Printer, StepResult, baseline_s, plot_rows, write_rows
from .demo_rollout import Rollouts
from .demo_task import (
    CANDIDATES,
    PROMPTS,
    SAMPLES,
    answer_probs,
    make_task,
    model_dir,
    out_hash,
    quiet_transformers,
    served_forward,
)


@dataclass
class _Policy:
    """The trainer's state: the fp32 master and its optimizer, its own bf16 view of what it serves, the
    task's tensors and the stream's publisher."""

    master: Any
    opt: Any
    served: Any
    ids: Any
    head: Any
    target: Any
    pub: Any
    n_params: int
    prev_export: dict | None = None


def _load_policy(store: str, trainer_dir: str, lr: float, seed: int) -> _Policy:
    import copy

    import torch

    from ..stream.publisher import Publisher

    transformers = quiet_transformers()
    master = transformers.AutoModel.from_pretrained(model_dir()).float().eval()  # eval: no dropout
    n_params = sum(x.numel() for x in master.parameters())
    opt = torch.optim.AdamW(master.parameters(), lr=lr)
    ids, head, target = make_task(seed, master.config.vocab_size, master.config.hidden_size)
    served = copy.deepcopy(master).to(torch.bfloat16)  # the trainer's own view of what it serves
    pub = Publisher(store, os.path.join(trainer_dir, "publisher"), publisher_id="trainer")
    return _Policy(master, opt, served, ids, head, target, pub, n_params)


def _announce(p: Printer, procs: Rollouts, pol: _Policy, out_dir: str, store: str, where: str, lr: float) -> None:
    n = len(procs.procs)
    p.line(f"[bold]deltarefit demo[/]: RL refit over a version stream, 1 trainer + {n} rollout processes")
    p.line(f"  store    {store}  ({where})")
    p.line(f"  trainer  pid {os.getpid()}: all-MiniLM-L6-v2 {pol.n_params / 1e6:.1f}M params, fp32 + AdamW "
           f"lr={lr:g}, REINFORCE on stamped rollouts; publishes each bf16 export")
    for i, (pr, path) in enumerate(zip(procs.procs, procs.paths, strict=True)):
        p.line(f"  rollout {i} pid {pr.pid}: bf16 copy {os.path.relpath(path, out_dir)}; syncs, verifies, samples "
               f"{SAMPLES} answers x {PROMPTS} prompts, stamps its version")
    p.line(f"  task     {PROMPTS} prompts x {CANDIDATES} candidate answers scored by a fixed head on the \\[CLS] "
           f"embedding; reward 1 if answer = prompt i's target (i mod {CANDIDATES})")


def _wait_ready(p: Printer, procs: Rollouts, t_start: float) -> bool:
    """Every rollout's ready line (False, reported, when one did not start); prints the kernels' load time."""
    ready = procs.collect()
    for i, msg in sorted(ready.items()):
        if not msg.get("ready"):
            p.fail(f"rollout {i} did not start: {msg.get('error')}")
            return False
    p.line(f"  ready in {time.perf_counter() - t_start:.1f} s")
    warm = [m["kernels_s"] for m in ready.values() if m.get("kernels_s") is not None]
    if warm:
        p.line(f"  kernels  loaded by each rollout before its first sync in {max(warm):.1f} s at most (numba "
               "compiles them on the first run after an install, then loads them from its cache)")
    return True


def _reinforce(pol: _Policy, batch: dict[int, dict]) -> None:
    """One REINFORCE step (per-prompt mean baseline) on the rollouts' stamped samples."""
    import torch

    actions = torch.cat([torch.tensor(batch[i]["actions"]) for i in sorted(batch)], dim=1)
    reward = (actions == pol.target[:, None]).float()  # the verifiable reward, recomputed here
    adv = reward - reward.mean(dim=1, keepdim=True)
    logp = (pol.master(input_ids=pol.ids).last_hidden_state[:, 0] @ pol.head.T).log_softmax(-1)
    loss = -(adv * logp.gather(1, actions)).mean()
    loss.backward()
    pol.opt.step()
    pol.opt.zero_grad(set_to_none=True)


def _publish(pol: _Policy, row: StepResult, step: int):
    """Publish the fp32 master from memory, served as bf16 (``publish_tensors``: no checkpoint written);
    fills ``row``'s sizes and time. Returns (the commit record, the trainer's own bf16 export made with
    torch, and its fingerprint computed from that export: independent of the publisher's conversion)."""
    from ..apply.tensors import state_dict_fingerprint

    export = _export(pol.master)
    want_fp = state_dict_fingerprint(export)  # from memory, independently of the publisher and the codec
    if pol.prev_export is not None:
        row.changed_fraction = _changed(pol.prev_export, export)
    pol.prev_export = export
    t = time.perf_counter()
    rec = pol.pub.publish_tensors(pol.master.state_dict(), served="BF16", step=step)
    row.publish_s = time.perf_counter() - t
    row.version, row.keyframe, row.full_bytes = rec.version, rec.delta is None, rec.full_bytes
    row.delta_bytes = rec.delta.bytes if rec.delta is not None else rec.part_bytes
    return rec, export, want_fp


def _refit_rollouts(pol: _Policy, procs: Rollouts, row: StepResult, step: int, rec, export: dict,
                    want_fp: str) -> dict[int, dict]:
    """Have every rollout sync to the published version, verify, generate and stamp; check the replies
    against the trainer's own bf16 forward. Sets ``row.problem`` on a mismatch; returns the replies."""
    import torch

    pol.served.load_state_dict(export)
    hidden = served_forward(pol.served, pol.ids)
    want_hash = out_hash(hidden)
    row.expected_reward = float(answer_probs(hidden, pol.head).gather(1, pol.target[:, None]).mean())
    procs.send({"cmd": "refit", "step": step, "version": rec.version, "fingerprint": want_fp})
    replies = procs.collect()
    row.problem = _check(step, rec.version, want_fp, want_hash, replies)
    if not row.problem:
        row.per_rollout_s = [replies[i]["refit_s"] for i in sorted(replies)]
        row.sync_s = max(row.per_rollout_s)
        row.bit_exact = True
        all_actions = torch.cat([torch.tensor(replies[i]["actions"]) for i in sorted(replies)], dim=1)
        row.reward = float((all_actions == pol.target[:, None]).float().mean())
    return replies


def train(p: Printer, procs: Rollouts, out_dir: str, store: str, trainer_dir: str, steps: int, lr: float,
          seed: int, t_start: float, plot: bool, where: str, label: str) -> bool:
    """Load the policy, wait for the rollouts, run ``steps`` + 1 publishes (the first a keyframe) with a
    refit of every rollout after each, and print the report. True iff every step was bit-exact."""
    p.line("  loading the trainer's model (torch, transformers, all-MiniLM-L6-v2) while the rollouts start ...")
    pol = _load_policy(store, trainer_dir, lr, seed)
    n = len(procs.procs)
    _announce(p, procs, pol, out_dir, store, where, lr)
    p.line(f"  waiting for the {n} rollouts: each loads torch, the model and the codec's kernels (numba compiles "
           "them on a first run) ...")
    if not _wait_ready(p, procs, t_start):
        return False
    rows: list[StepResult] = []
    batch: dict[int, dict] | None = None
    ok = True
    for step in range(steps + 1):
        row = StepResult(step)
        # -- trainer: one REINFORCE step on the batch stamped with the version it published last.
        if batch is not None:
            _reinforce(pol, batch)
        rec, export, want_fp = _publish(pol, row, step)
        rows.append(row)
        if rec.fingerprint != want_fp:
            row.problem = (f"step {step}: the commit record's fingerprint {rec.fingerprint[:16]}… is not the "
                           f"trainer's export {want_fp[:16]}…")
        else:
            # -- rollouts: sync to the new version, verify, generate, stamp.
            batch = _refit_rollouts(pol, procs, row, step, rec, export, want_fp)
        if row.problem:
            p.fail(row.problem)
            ok = False
            break
        _keep(pol, out_dir, store, rec, export, step == 0 or step == steps)
        what = (f"keyframe {row.delta_bytes:,} B" if row.keyframe else
                f"{100 * row.changed_fraction:.2f}% changed, delta {row.delta_bytes:,} B ({row.ratio:.1f}x)")
        p.line(f"step {step}: v{row.version} {what}; publish {row.publish_s:.2f} s, sync {row.sync_s:.2f} s (max of "
               f"{n}), bit-exact, stamped v{row.version}; reward {row.reward:.3f} (exp. {row.expected_reward:.3f})")
    p.line(f"stopping the {n} rollouts (each exits once its last reply is sent) and writing the report ...")
    procs.close()
    _finish(p, rows, n, label, out_dir, plot, ok, steps, t_start)
    return ok


def _keep(pol: _Policy, out_dir: str, store: str, rec, export: dict, checkpoint: bool) -> None:
    """Stable paths for the next steps: each version's delta as ``deltas/vNNNN.delta`` (fetched from the
    store and checked against its record), and the first and last versions' bf16 weights as
    ``checkpoints/vNNNN.safetensors``."""
    from safetensors.torch import save_file

    from ..storage.base import open_store
    from ..stream.records import fetch_part

    if rec.delta is not None:
        fetch_part(open_store(store), rec.delta, os.path.join(out_dir, "deltas", f"v{rec.version:04d}.delta"))
    if checkpoint:
        os.makedirs(os.path.join(out_dir, "checkpoints"), exist_ok=True)
        save_file(export, os.path.join(out_dir, "checkpoints", f"v{rec.version:04d}.safetensors"),
                  metadata={"format": "pt"})


def _next_steps(p: Printer, out_dir: str, last: int) -> None:
    """Commands that run on this run's files, as a new user types them."""
    rel = os.path.relpath(out_dir)
    out = rel if not rel.startswith("..") else out_dir
    first, end = f"{out}/checkpoints/v0001.safetensors", f"{out}/checkpoints/v{last:04d}.safetensors"
    p.line("[bold]next steps[/] (the CLI is .venv/bin/deltarefit; `source .venv/bin/activate` puts it on PATH):")
    for cmd in (f"deltarefit log {out}/store",
                f"deltarefit encode {first} {end} -o {out}/v1-to-v{last}.delta",
                f"cp {first} {out}/rollout.safetensors",
                f"deltarefit apply {out}/v1-to-v{last}.delta {out}/rollout.safetensors",
                f"deltarefit verify {out}/rollout.safetensors $(deltarefit fingerprint {end})",
                f"deltarefit sync {out}/store {out}/follower.safetensors"):
        p.command(cmd)


def _finish(p: Printer, rows: list[StepResult], n: int, label: str, out_dir: str, plot: bool, ok: bool,
            steps: int, t_start: float) -> None:
    """The table, the plot and (when every step passed) the totals."""
    p.table(rows, n, label)
    if rows:
        deltas = [r for r in rows if not r.keyframe]
        summary = {"ok": ok, "steps": steps, "rollouts": n, "versions": len(rows),
                   "full_bytes": rows[0].full_bytes, "shipped_delta_bytes": sum(r.delta_bytes for r in deltas),
                   "full_refit_s": baseline_s(rows), "seconds": time.perf_counter() - t_start}
        js, cs = write_rows(rows, out_dir, summary)
        p.line(f"rows: {js} and {cs}")
    if plot and rows:
        png = os.path.join(out_dir, "refit.png")
        try:
            plot_rows(rows, png, n)
            p.line(f"plot: {png}")
        except ImportError as e:
            p.line(f"plot skipped (matplotlib missing: {e}); pip install matplotlib")
    if ok:
        deltas = [r for r in rows if not r.keyframe]
        shipped = sum(r.delta_bytes for r in deltas)
        full = sum(r.full_bytes for r in deltas)
        p.line(f"all {steps} steps bit-exact on {n} rollouts: shipped {shipped:,} B of deltas, not {full:,} B of "
               f"checkpoints ({full / max(shipped, 1):.1f}x less per rollout)")
        mean_refit = sum(r.publish_s + r.sync_s for r in deltas) / max(len(deltas), 1)
        mean_delta = shipped / max(len(deltas), 1)
        p.line(f"refit per step {mean_refit:.2f} s on average, {baseline_s(rows):.2f} s for the full checkpoint "
               "(the keyframe's refit): a local disk moves the whole file about as fast. Over a 1 Gbit/s link "
               f"per rollout the full checkpoint alone takes {8 * rows[0].full_bytes / 1e9:.2f} s on the wire, "
               f"a delta {8 * mean_delta / 1e9:.3f} s (bytes / link rate).")
        p.line(f"reward {rows[0].reward:.3f} -> {rows[-1].reward:.3f} (expected {rows[0].expected_reward:.3f} -> "
               f"{rows[-1].expected_reward:.3f}); {time.perf_counter() - t_start:.1f} s in all")
        _next_steps(p, out_dir, rows[-1].version)


def _check(step: int, version: int, want_fp: str, want_hash: str, replies: dict[int, dict]) -> str:
    """'' if every rollout holds the published version bit for bit and stamped its batch with it."""
    for i, r in sorted(replies.items()):
        if not r.get("ok"):
            return f"step {step}: rollout {i}: {r.get('error')}"
        if r.get("policy_version") != version:
            return (f"step {step}: stamping error: rollout {i} stamped its batch with policy version "
                    f"{r.get('policy_version')}, the trainer expects version {version}")
        if r.get("fingerprint") != want_fp or r.get("live_fingerprint") != want_fp:
            return f"step {step}: rollout {i}: fingerprint {str(r.get('fingerprint'))[:16]}… is not {want_fp[:16]}…"
        if r.get("out_hash") != want_hash:
            return f"step {step}: rollout {i}: model output differs from the trainer's bf16 export"
    return ""


def _export(model) -> dict:
    """The served checkpoint: every floating tensor of the fp32 master rounded to bf16."""
    import torch

    return {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).contiguous()
            for k, v in model.state_dict().items()}


def _changed(prev: dict, new: dict) -> float:
    import torch

    changed = total = 0
    for k, v in new.items():
        a, b = prev[k].contiguous(), v.contiguous()
        if a.dtype == torch.bfloat16:
            changed += int((a.view(torch.int16) != b.view(torch.int16)).sum())
        else:
            changed += int((a != b).sum())
        total += v.numel()
    return changed / total
