"""``deltarefit simulate``: a refit-time model of how long it takes to bring rollout nodes to the trainer's
new weights at scale, shipping the full bf16 checkpoint or a bit-exact delta, through object storage or
a relay tree. This module prints it (:func:`run`) and measures its codec figures now
(:func:`calibrate`); the model itself (its formulas in its docstring) is ``simulate_model``, the
published figures it reproduces ``simulate_refs`` (``deltarefit simulate --references``), the tables
and the plot ``simulate_render``. Their names are re-exported here.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import replace

from .simulate_model import (  # noqa: F401 (the model's names, re-exported)
    APPLY_GBPS_PER_CORE,
    BENCH_RATIOS,
    ENCODE_GBPS_PER_CORE,
    ENGINE_CHANGE_NS,
    ENGINE_CHANGE_NS_CORE,
    ENGINE_ELEMENT_NS_CORE,
    ENGINE_ELEMENTS,
    ENGINE_FIXED_S,
    ENGINE_THREADS,
    GB,
    Estimate,
    MiB,
    Setup,
    crossover_gbps,
    estimate,
    flat,
    gbit,
    interp_ratio,
    relay_transfer_s,
    store_transfer_s,
    tree_depth,
)
from .simulate_refs import (  # noqa: F401 (the published figures, re-exported)
    CKPT_ENGINE_PARAMS,
    CKPT_ENGINE_S,
    DCR_CHANGE,
    DCR_DELTA_S,
    DCR_FULL_S,
    DCR_PARAMS,
    NEMO_RL_BYTES,
    NEMO_RL_CHUNK,
    NEMO_RL_PRODUCERS,
    NEMO_RL_RELAY_S,
    NEMO_RL_RELAY_WIRE,
    NEMO_RL_S3_S,
    NEMO_RL_S3_WIRE,
    Derivation,
    Reference,
    derive,
    references,
)
from .simulate_render import (  # noqa: F401 (the tables and the plot, re-exported)
    DELTA_COLS,
    REF_COLS,
    REF_HOW_COLS,
    TIME_COLS,
    WIDTH,
    _table,
    columns,
    fmt_params,
    fmt_s,
    parse_params,
    plot,
    reference_table,
    render_table,
)


def _write_bf16(path: str, tensors: dict[str, object]) -> None:
    import json

    import numpy as np

    header: dict[str, object] = {}
    off = 0
    for name, a in tensors.items():
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(np.uint64(len(h)).tobytes())
        f.write(h)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


def calibrate(*, change: float = 0.03, elements: int = 32 << 20, seed: int = 0) -> tuple[float, float, float]:
    """Measure (encode GB/s per core, apply GB/s per core, ratio) now, on one core each, on a synthetic
    bf16 pair: N(0, 0.02) weights, ``change`` of them moved by +-1 ulp (90%) or +-2..4 ulp."""
    import numpy as np

    from ..apply.files import apply
    from ..encode import encode

    rng = np.random.default_rng(seed)
    n_t = 8
    per = elements // n_t
    base, target = {}, {}
    for i in range(n_t):
        f = (rng.standard_normal(per, dtype=np.float32) * 0.02).view(np.uint32)
        b = ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even bf16
        t = b.copy()
        idx = np.flatnonzero(rng.random(per) < change)
        step = np.where(rng.random(idx.size) < 0.9, 1, rng.integers(2, 5, idx.size)).astype(np.int32)
        sign = np.where(rng.random(idx.size) < 0.5, -1, 1)
        mag = (b[idx] & 0x7FFF).astype(np.int32) + sign * step
        t[idx] = ((b[idx] & 0x8000) | np.clip(mag, 1, 0x7F7F)).astype(np.uint16)
        base[f"layer{i}.weight"] = b.reshape(-1, 1024)
        target[f"layer{i}.weight"] = t.reshape(-1, 1024)
    with tempfile.TemporaryDirectory(prefix="deltarefit-calibrate-") as d:
        bp, tp, dp = (os.path.join(d, n) for n in ("base.safetensors", "target.safetensors", "d.delta"))
        _write_bf16(bp, base)
        _write_bf16(tp, target)
        raw = sum(a.nbytes for a in target.values())
        encode(bp, tp, dp + ".warm", threads=1)  # JIT warm-up and page cache
        t = time.perf_counter()
        rep = encode(bp, tp, dp, threads=1)
        enc_s = time.perf_counter() - t
        t = time.perf_counter()
        apply(dp, bp, threads=1)
        app_s = time.perf_counter() - t
    return raw / enc_s / GB, raw / app_s / GB, rep.ratio


def run(base: Setup, sizes: list[float], *, do_calibrate: bool = False, show_references: bool = False,
        plot_path: str | None = None) -> None:
    """What ``deltarefit simulate`` prints (and plots)."""
    from rich.console import Console

    out = Console(width=None if sys.stdout.isatty() else WIDTH, highlight=False)
    if show_references:
        _print_references(out)
        return
    if do_calibrate:
        enc, app, ratio = calibrate(change=base.change)
        out.print(f"calibrated now on a synthetic bf16 pair ({100 * base.change:g}% changed, {ratio:.1f}x): encode "
                  f"{enc:.3f} GB/s per core, apply {app:.3f} GB/s per core (defaults from docs/BENCHMARKS.md: "
                  f"{ENCODE_GBPS_PER_CORE:.3f} and {APPLY_GBPS_PER_CORE:.3f})")
        base = replace(base, encode_gbps_core=enc, apply_gbps_core=app)
        if base.rollout == "engine":
            out.print("(--calibrate measures the file apply; the engine apply keeps docs/ENGINES.md's figures)")
    src = (f"given ({base.ratio:g}x)" if base.ratio is not None else
           f"{base.codec} codec, interpolated over docs/BENCHMARKS.md at {100 * base.change:g}%")
    out.print(f"[bold]Refit-time model[/]: {100 * base.change:g}% of bf16 elements changed; ratio: {src}; link "
              f"{base.link_gbps:g} Gbit/s between clusters, {base.fabric_gbps:g} Gbit/s inside, object store "
              f"{base.store_gbps:g} Gbit/s aggregate; {base.nodes} rollout nodes, relay fan-out {base.fanout} (depth "
              f"{tree_depth(base.nodes, base.fanout)}); {base.shards} shards x {base.encode_cores:g} encode / "
              f"{base.apply_cores:g} apply cores; encode {base.encode_gbps_core:.3f} GB/s per core; " + (
                  f"apply into live engines (docs/ENGINES.md): {base.engine_element_ns_core:.2f} core-ns per element "
                  f"+ {base.engine_change_ns_core:.1f} per changed element" if base.rollout == "engine" else
                  f"apply into checkpoint files {base.apply_gbps_core:.3f} GB/s per core")
              + f"; {base.chunk_bytes / MiB:g} MiB chunks")
    cols, rows = render_table(base, sizes)
    for title, keep in (("What one step ships, and its cost at each end", DELTA_COLS),
                        ("Refit time per step: full (transfer) vs delta (encode + transfer + apply)",
                         TIME_COLS)):
        out.print(_table(title, *columns(cols, rows, keep)))
    out.print("speed-up: fastest full / fastest delta. full wins above: the bandwidth of one flat fabric (between "
              "and inside the clusters) above which a full-weight broadcast beats the delta refit.")
    big = replace(base, params=max(sizes))
    x = crossover_gbps(big)
    e = estimate(big)
    lo, hi = (CKPT_ENGINE_PARAMS * 2 * 8 / t / 1e9 for t in reversed(CKPT_ENGINE_S))
    if x:
        out.print(f"crossover for {fmt_params(big.params)}: a full-weight broadcast wins above {x:,.0f} Gbit/s "
                  f"({x / 400:.1f} links of 400 Gbit/s), where S/B drops below the delta's encode + apply floor "
                  f"({fmt_s(e.encode_s + e.apply_s)}). MoonshotAI/checkpoint-engine moves 1T in 16-20 s inside one "
                  f"datacenter, i.e. {lo:,.0f}-{hi:,.0f} Gbit/s effective: "
                  + ("there, full weights win." if x < lo else "there, deltas still win." if x > hi else
                     "that is the crossover region."))
    else:
        out.print(f"no crossover for {fmt_params(big.params)} between 0.01 and 1e6 Gbit/s")
    if plot_path:
        try:
            plot(big, plot_path)
            out.print(f"plot: {plot_path}")
        except ImportError as ex:
            out.print(f"plot skipped (matplotlib missing: {ex}); pip install matplotlib")


def _print_references(out) -> None:
    """``--references``: what the published figures imply, the model against them, checkpoint-engine's."""
    cols, rows, d, refs = reference_table()
    out.print("[bold]What the published figures imply[/] (assumptions stated; see deltarefit/apps/simulate.py)")
    for line in d.lines:
        out.print(f"  - {line}")
    out.print("  - Assumed, not published: NeMo-DCR's codec ratio = NeMo-RL's measured 3% ratio; 1T split over "
              f"{refs[1].setup.shards} producers at NeMo-RL's per-producer cost; NeMo-RL's 8 generation nodes "
              "(binary tree depth 3) and 400 Gbit/s in-cluster links; object-store throughput not limiting.")
    numbered = [[str(i), *r] for i, r in enumerate(rows, 1)]
    out.print(_table("Published refit figures and the model (their codec's ratio and setup)",
                     *columns(["#", *cols], numbered, REF_COLS)))
    out.print(_table("How each row was used, and ours on the same setup", *columns(["#", *cols], numbered,
                                                                                  REF_HOW_COLS)))
    worst = max(abs(r.error) for r in refs)
    out.print(f"largest deviation {100 * worst:.1f}%. 'fit' rows define parameters; 'predicted' rows use "
              "parameters derived from other figures only.")
    S = CKPT_ENGINE_PARAMS * 2
    lo, hi = (S / t * 8 / 1e9 for t in reversed(CKPT_ENGINE_S))
    ours_1t = replace(refs[1].setup, ratio=interp_ratio(0.03), codec="ours")
    x = crossover_gbps(ours_1t)
    at = [estimate(flat(ours_1t, g)) for g in (hi, lo)]
    out.print(f"MoonshotAI/checkpoint-engine: 1T full weights in {CKPT_ENGINE_S[0]:g}-{CKPT_ENGINE_S[1]:g} s "
              f"inside one datacenter = {lo:,.0f}-{hi:,.0f} Gbit/s effective ({lo / 400:.1f}-{hi / 400:.1f} "
              f"links of 400 Gbit/s); the model gives {at[0].full_relay_s:.1f}-{at[1].full_relay_s:.1f} s there. "
              f"On that fabric a delta refit of 1T at 3% on NeMo-DCR's setup with our codec takes "
              f"{at[0].delta_relay_s:.1f}-{at[1].delta_relay_s:.1f} s; full weights win above "
              f"{x:,.0f} Gbit/s (with encode + apply on 64 shards x 8 of our cores, the default setup, above "
              f"{crossover_gbps(Setup(params=1e12)):,.0f} Gbit/s).")
