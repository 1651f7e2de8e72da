"""The demo's report: :class:`StepResult`, one row per optimizer step (what was published, its size against
the full checkpoint, the publish and sync times, whether every rollout held it bit for bit, the reward),
and how the rows are shown: the progress lines and the rich table of :class:`Printer`, the plot of
:func:`plot_rows` (matplotlib, optional).
"""

from __future__ import annotations

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

    def fail(self, msg: str) -> None:
        self.err.print(f"[bold red]demo failed:[/] {msg}")

    def table(self, rows: list[StepResult], n_rollouts: int, transport: str = "a local store") -> None:
        if self.quiet or not rows:
            return
        from rich.table import Table

        t = Table(title=f"deltarefit refit demo: all-MiniLM-L6-v2, trainer + {n_rollouts} rollout processes, "
                        f"version stream in {transport}")
        for col in ("step", "version", "changed %", "delta bytes", "full bytes", "ratio", "publish s", "sync s",
                    "bit-exact", "reward", "expected"):
            t.add_column(col, justify="left" if col == "bit-exact" else "right")
        for r in rows:
            t.add_row(str(r.step), str(r.version), "keyframe" if r.keyframe else f"{100 * r.changed_fraction:.2f}",
                      f"{r.delta_bytes:,}", f"{r.full_bytes:,}", f"{r.ratio:.1f}x", f"{r.publish_s:.2f}",
                      f"{r.sync_s:.2f}", "[green]yes[/]" if r.bit_exact else "[red]NO[/]",
                      f"{r.reward:.3f}", f"{r.expected_reward:.3f}")
        self.out.print(t)
        self.out.print("publish s: encode + upload + commit + advance the trainer's baseline (trainer); sync s: "
                       "sync (download, verify, apply in place) + fingerprint checks + load into the live module, "
                       "the slowest rollout. bit-exact: every rollout's file and live weights have the fingerprint "
                       "of the trainer's export, and its model output equals the trainer's bit for bit. reward: "
                       "mean of the sampled rewards; expected: the served bf16 policy's expected reward.")


def plot_rows(rows: list[StepResult], path: str, n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = [r for r in rows if not r.keyframe]
    fig, ax = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    steps = [r.step for r in d]
    ax[0].plot(steps, [100 * r.changed_fraction for r in d], "o-")
    ax[0].set_ylabel("bf16 elements changed (%)")
    ax[1].plot(steps, [r.ratio for r in d], "o-", color="tab:green")
    ax[1].set_ylabel("checkpoint / delta (x)")
    ax[2].plot(steps, [r.publish_s for r in d], "o-", label="publish (trainer)")
    ax[2].plot(steps, [r.sync_s for r in d], "s-", label=f"sync + load (slowest of {n} rollouts)")
    ax[2].plot(steps, [r.publish_s + r.sync_s for r in d], "^-", label="refit (publish + sync)")
    ax[2].set_ylabel("seconds")
    ax[2].set_xlabel("optimizer step")
    ax[2].legend(fontsize="small")
    for a in ax:
        a.grid(alpha=0.3)
    fig.suptitle("deltarefit demo: all-MiniLM-L6-v2 refit per step (bf16, AdamW)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
