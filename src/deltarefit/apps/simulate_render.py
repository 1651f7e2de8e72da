"""How the refit-time model is shown: the parameter-count parser and the figure formats, the table of
refit times per model size (:func:`render_table`), the table of published figures against the model
(:func:`reference_table`), the rich table they are printed in, and the two-panel plot (:func:`plot`,
matplotlib, optional). Nothing here prints; ``simulate.run`` does.
"""

from __future__ import annotations

import os
from dataclasses import replace

from .simulate_model import GB, Setup, crossover_gbps, estimate, flat
from .simulate_refs import CKPT_ENGINE_PARAMS, CKPT_ENGINE_S, Derivation, Reference, references

# Every table fits 80 columns (the console's width when standard output is not a terminal): the model's
# twelve columns are printed as two tables, the published figures' eight as two numbered ones.
WIDTH = 80
DELTA_COLS = ("model", "full GB", "delta GB", "ratio", "encode", "apply", "full wins above")
TIME_COLS = ("model", "full: store", "full: relay", "delta: store", "delta: relay", "speed-up")
REF_COLS = ("#", "reference", "published", "model", "error")
REF_HOW_COLS = ("#", "how", "their ratio", "ours: ratio", "ours: model")


def columns(cols: list[str], rows: list[list[str]], keep: tuple[str, ...]) -> tuple[list[str], list[list[str]]]:
    """The columns named in ``keep`` (in that order) of a table's ``cols`` and ``rows``."""
    idx = [cols.index(c) for c in keep]
    return [cols[i] for i in idx], [[r[i] for i in idx] for r in rows]


def parse_params(text: str) -> float:
    """'8B', '1T', '70e9', '123.6B' -> parameters."""
    t = text.strip().upper()
    mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:], 1.0)
    num = t[:-1] if t[-1:] in "KMBGT" else t
    v = float(num) * mult
    if not v > 0:
        raise ValueError(f"parameters must be > 0: {text!r}")
    return v


def fmt_params(p: float) -> str:
    return f"{p / 1e12:g}T" if p >= 1e12 else f"{p / 1e9:g}B"


def fmt_s(s: float) -> str:
    if s >= 3 * 3600:
        return f"{s / 3600:.1f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


def render_table(base: Setup, sizes: list[float]) -> tuple[list[str], list[list[str]]]:
    cols = ["model", "full GB", "delta GB", "ratio", "encode", "apply", "full: store", "full: relay",
            "delta: store", "delta: relay", "speed-up", "full wins above"]
    rows = []
    for p in sizes:
        s = replace(base, params=p)
        e = estimate(s)
        x = crossover_gbps(s)
        rows.append([fmt_params(p), f"{e.full_bytes / GB:,.0f}", f"{e.delta_bytes / GB:,.2f}", f"{e.ratio:.1f}x",
                     fmt_s(e.encode_s), fmt_s(e.apply_s), fmt_s(e.full_store_s), fmt_s(e.full_relay_s),
                     fmt_s(e.delta_store_s), fmt_s(e.delta_relay_s), f"{e.full_best_s / e.delta_best_s:.1f}x",
                     f"{x:,.0f} Gbit/s" if x else "never"])
    return cols, rows


def reference_table() -> tuple[list[str], list[list[str]], Derivation, list[Reference]]:
    refs, d = references()
    cols = ["reference", "published", "model", "error", "how", "their ratio", "ours: ratio", "ours: model"]
    rows = []
    for r in refs:
        ours = r.ours_s()
        rows.append([r.name, fmt_s(r.published_s), fmt_s(r.model_s()), f"{100 * r.error:+.1f}%", r.how,
                     f"{r.setup.compression:.1f}x" if r.path.startswith("delta") else "-",
                     f"{r.ours_ratio:.1f}x" if r.ours_ratio else "-", fmt_s(ours) if ours is not None else "-"])
    return cols, rows, d, refs


def plot(base: Setup, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(13, 5))
    gbps = [10 ** (i / 20) for i in range(0, 81)]  # 1 .. 10,000 Gbit/s
    nemo = replace(base, codec="nemo", ratio=None)
    ax[0].plot(gbps, [estimate(flat(base, g)).full_relay_s for g in gbps], label="full-weight broadcast")
    ax[0].plot(gbps, [estimate(flat(base, g)).delta_relay_s for g in gbps],
               label=f"delta refit, ours ({base.compression:.0f}x)")
    ax[0].plot(gbps, [estimate(flat(nemo, g)).delta_relay_s for g in gbps], "--",
               label=f"delta refit, NeMo-style ({nemo.compression:.0f}x)")
    x = crossover_gbps(base)
    if x:
        ax[0].axvline(x, color="grey", ls=":", label=f"crossover {x:,.0f} Gbit/s")
    if base.params == CKPT_ENGINE_PARAMS:
        ax[0].axhspan(*CKPT_ENGINE_S, color="tab:red", alpha=0.15, label="checkpoint-engine 1T: 16-20 s")
        ax[0].axvspan(*(base.full_bytes * 8 / t / 1e9 for t in reversed(CKPT_ENGINE_S)), color="tab:red", alpha=0.15)
    ax[0].set_xscale("log")
    ax[0].set_yscale("log")
    ax[0].set_xlabel("bandwidth between trainer and rollouts (Gbit/s, one flat fabric)")
    ax[0].set_ylabel("refit time (s)")
    ax[0].set_title(f"{fmt_params(base.params)} params, {100 * base.change:g}% changed, "
                    f"{base.nodes} rollout nodes")
    ax[0].legend(fontsize="small")
    changes = [10 ** (-2.5 + i / 20) for i in range(0, 31)]  # 0.3% .. 10%
    for codec, style in (("ours", "-"), ("nemo", "--")):
        for path_name, key in (("store", "delta_store_s"), ("relay", "delta_relay_s")):
            ax[1].plot([100 * c for c in changes],
                       [getattr(estimate(replace(base, change=c, codec=codec, ratio=None)), key) for c in changes],
                       style if path_name == "store" else style[:1] + ".", label=f"delta via {path_name}, {codec}")
    e = estimate(base)
    ax[1].axhline(e.full_store_s, color="black", lw=1, label="full checkpoint via store")
    ax[1].axhline(e.full_relay_s, color="grey", lw=1, label="full checkpoint via relay")
    ax[1].set_xscale("log")
    ax[1].set_yscale("log")
    ax[1].set_xlabel("bf16 elements changed per step (%)")
    ax[1].set_ylabel("refit time (s)")
    ax[1].set_title(f"link {base.link_gbps:g} Gbit/s between clusters")
    ax[1].legend(fontsize="small")
    for a in ax:
        a.grid(alpha=0.3, which="both")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _table(title: str, cols: list[str], rows: list[list[str]]):
    from rich.table import Table

    t = Table(title=title)
    for i, c in enumerate(cols):
        left = c in ("reference", "how") or (i == 0 and c != "#")
        t.add_column(c, justify="left" if left else "right", no_wrap=True)
    for r in rows:
        t.add_row(*r)
    return t

