"""The demo's report: :class:`StepResult`, one row per optimizer step (what was published, its size against
the full checkpoint, the publish and sync times, whether every rollout held it bit for bit, the reward),
and how the rows are shown: the progress lines and the rich table of :class:`Printer`, the plot of
:func:`plot_rows` (matplotlib, optional).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field


@dataclass
class StepResult:
    step: int
    version: int = 0
    keyframe: bool = False
    changed_fraction: float = 0.0
    delta_bytes: int = 0  # bytes of the version's parts in the store (a keyframe: the full file)
    full_bytes: int = 0
    publish_s: float = 0.0  # encode + upload + commit + baseline advance, on the trainer
    sync_s: float = 0.0  # max over rollouts: sync (download, verify, apply) + checks + load into the module
    bit_exact: bool = False
    reward: float = float("nan")  # mean sampled reward of the rollouts generated with this version
    expected_reward: float = float("nan")  # exact expected reward of the served bf16 policy
    per_rollout_s: list[float] = field(default_factory=list)
    problem: str = ""

    @property
    def ratio(self) -> float:
        return self.full_bytes / self.delta_bytes if self.delta_bytes else 0.0


class Printer:
    def __init__(self, quiet: bool) -> None:
        from rich.console import Console

        self.quiet = quiet
        width = None if sys.stdout.isatty() else 140  # pipes and logs: wide enough for the table
        self.out = Console(width=width, highlight=False)
        self.err = Console(stderr=True, width=width, highlight=False)

    def line(self, msg: str) -> None:
        if not self.quiet:
            self.out.print(msg)

    def command(self, cmd: str) -> None:
        """A command to copy: one line, never wrapped, no markup."""
        if not self.quiet:
            self.out.print(f"  {cmd}", soft_wrap=True, markup=False)

    def fail(self, msg: str) -> None:
        self.err.print(f"[bold red]demo failed:[/] {msg}")

    def table(self, rows: list[StepResult], n_rollouts: int, transport: str = "a local store") -> None:
        """The per-step table, 80 columns wide: the full checkpoint's size is said once, in the caption."""
        if self.quiet or not rows:
            return
        from rich import box
        from rich.table import Table

        full = rows[0].full_bytes
        t = Table(title=f"refit per step: trainer + {n_rollouts} rollouts, stream in {transport}",
                  box=box.SIMPLE_HEAD, padding=(0, 1), caption=f"full checkpoint (bf16): {mb(full)} per version")
        for col in TABLE_COLUMNS:
            t.add_column(col, justify="left" if col in ("step", "exact") else "right", no_wrap=True)
        for r in rows:
            t.add_row("init" if r.step == 0 else str(r.step), str(r.version),
                      "keyframe" if r.keyframe else f"{100 * r.changed_fraction:.2f}%", mb(r.delta_bytes),
                      "full" if r.keyframe else f"{r.ratio:.1f}x", f"{r.publish_s:.2f}", f"{r.sync_s:.2f}",
                      "[green]yes[/]" if r.bit_exact else "[red]NO[/]", f"{r.reward:.3f}")
        self.out.print(t)
        self.out.print("step: optimizer steps (init: the starting weights, version (ver) 1, a keyframe). shipped: "
                       "bytes each rollout fetched. pub s: publish (encode, upload, commit) on the trainer; sync s: "
                       "download, verify, apply in place, load (slowest rollout). exact: every rollout's file "
                       "and live weights have the trainer's fingerprint and its output equals the trainer's. "
                       "reward: mean sampled reward.")


# The table's columns, in order (tests parse them back).
TABLE_COLUMNS = ("step", "ver", "changed", "shipped", "ratio", "pub s", "sync s", "exact", "reward")


def mb(n: int) -> str:
    """``n`` bytes for a person: ``45.4 MB``, ``651 kB``."""
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def baseline_s(rows: list[StepResult]) -> float:
    """The run's full-checkpoint refit time: the keyframe's publish + sync (the whole checkpoint through the
    same store, verified), the baseline every delta step is set against."""
    kf = [r.publish_s + r.sync_s for r in rows if r.keyframe]
    return kf[0] if kf else float("nan")


def write_rows(rows: list[StepResult], out_dir: str, summary: dict) -> tuple[str, str]:
    """``steps.json`` (the rows and the summary) and ``steps.csv`` (the rows) in ``out_dir``; their paths."""
    import csv
    import json
    from dataclasses import asdict

    fields = [f for f in asdict(rows[0]) if f != "per_rollout_s"] + ["ratio"]
    js, cs = os.path.join(out_dir, "steps.json"), os.path.join(out_dir, "steps.csv")
    with open(js, "w") as f:
        json.dump({"summary": summary, "steps": [{**asdict(r), "ratio": r.ratio} for r in rows]}, f, indent=1)
    with open(cs, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for r in rows:
            d = {**asdict(r), "ratio": r.ratio}
            w.writerow([d[k] for k in fields])
    return js, cs


def plot_rows(rows: list[StepResult], path: str, n: int) -> None:
    """Reward, bytes shipped and refit seconds per step, each against the full checkpoint, axes from zero,
    the keyframe (the starting weights, shipped whole) marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in rows]
    kf = [r.step for r in rows if r.keyframe]
    fig, ax = plt.subplots(3, 1, figsize=(7, 9), sharex=True)
    ax[0].plot(steps, [r.reward for r in rows], "o-", label="sampled reward (rollouts)")
    ax[0].plot(steps, [r.expected_reward for r in rows], "s--", label="expected reward (served bf16 policy)")
    ax[0].set_ylabel("reward")
    ax[0].set_ylim(0, max(1e-3, 1.15 * max(max(r.reward, r.expected_reward) for r in rows)))
    ax[1].bar(steps, [r.delta_bytes / 1e6 for r in rows], color=["tab:gray" if r.keyframe else "tab:green"
                                                                  for r in rows], label="shipped per rollout")
    ax[1].axhline(rows[0].full_bytes / 1e6, color="tab:red", ls="--", label="full checkpoint")
    ax[1].set_ylabel("MB per version")
    for r in rows:
        if not r.keyframe:
            ax[1].annotate(f"{r.ratio:.0f}x", (r.step, r.delta_bytes / 1e6), ha="center", va="bottom",
                           fontsize="small")
    ax[2].plot(steps, [r.publish_s + r.sync_s for r in rows], "o-", label=f"refit: publish + sync (slowest of {n})")
    ax[2].plot(steps, [r.sync_s for r in rows], "s-", label="sync + load (rollout)")
    ax[2].axhline(baseline_s(rows), color="tab:red", ls="--", label="full checkpoint (the keyframe's refit)")
    ax[2].set_ylabel("seconds")
    ax[2].set_xlabel("optimizer step (0: starting weights)")
    ax[2].set_xticks(steps)
    for a in ax:
        a.set_ylim(bottom=0)
        a.grid(alpha=0.3)
        for k in kf:
            a.axvspan(k - 0.4, k + 0.4, color="tab:gray", alpha=0.12, lw=0)
        a.legend(fontsize="small", loc="center right", framealpha=0.9)
    if kf:
        ax[1].text(kf[0], rows[0].full_bytes / 1e6 * 0.5, "keyframe", ha="center", rotation=90, fontsize="small")
    fig.suptitle("deltarefit demo: all-MiniLM-L6-v2 RL refit per step (bf16, AdamW)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
