"""Tensor-parallel refit in place: held-digest refits of workers' slices against a full reload of them.

``python -m deltarefit.apps.bench.live_tp [--tp 1,2] [--rates 0.005,0.015,0.035] [--hidden 2048] [--mlp 8192]
[--layers 2] [--repeat 3] [--threads N] [--markdown OUT] [--json OUT]`` builds a checkpoint of Llama-shaped
blocks (per layer: ``q_proj`` and ``up_proj`` column-parallel, ``o_proj`` and ``down_proj`` row-parallel, a
replicated norm; bf16, random), targets with that fraction of every tensor's elements moved by one ulp,
and the deltas base -> target -> base (``deltarefit.encode``, with additive digests). For each
tensor-parallel size it starts that many worker processes (``live_tp_worker``; a gloo group on loopback
for more than one), each holding its slices in a torch module, and times, after a warm-up round trip:

* in place: ``run_apply`` through a ``LiveTarget`` with held digests, as a vLLM worker runs it (a row-parallel
  weight's segments are split between the workers: each is decoded by one of them, which sends the others
  its changes);
* full reload: the target's checkpoint read (from the page cache) and every worker's slices copied from it
  through the module's loader, as an engine's weight reload does, checking nothing.

Times are medians over ``2 x repeat`` refits (forward and back), between barriers: the wall time of the
slowest worker. Nothing here needs vLLM or a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from .engine_model import perturb_bits


def build(root: str, *, hidden: int, mlp: int, layers: int, rates: list[float], seed: int = 0) -> int:
    """The benchmark's checkpoint, targets and deltas under ``root`` (see the module docstring); the
    number of elements."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from ...encode import encode

    g = torch.Generator().manual_seed(seed)
    base: dict[str, torch.Tensor] = {}
    for i in range(layers):
        pre = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (hidden, hidden)), ("self_attn.o_proj", (hidden, hidden)),
                            ("mlp.up_proj", (mlp, hidden)), ("mlp.down_proj", (hidden, mlp))):
            base[pre + name + ".weight"] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        base[pre + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    os.makedirs(os.path.join(root, "base"))
    save_file(base, os.path.join(root, "base", "model.safetensors"))
    rng = np.random.default_rng(seed + 1)
    for rate in rates:
        rd = os.path.join(root, f"{rate:g}")
        os.makedirs(os.path.join(rd, "target"))
        target = {n: torch.from_numpy(perturb_bits(t.view(torch.int16).numpy().view(np.uint16), rate, rng)
                                      .view(np.int16)).view(torch.bfloat16) for n, t in base.items()}
        save_file(target, os.path.join(rd, "target", "model.safetensors"))
        encode(os.path.join(root, "base"), os.path.join(rd, "target"), os.path.join(rd, "fwd.delta"), sums=True)
        encode(os.path.join(rd, "target"), os.path.join(root, "base"), os.path.join(rd, "back.delta"), sums=True)
    return sum(t.numel() for t in base.values())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tp(root: str, world: int, rates: list[float], repeat: int, threads: int) -> dict:
    """Run ``world`` workers over the benchmark in ``root``; rank 0's results."""
    out = os.path.join(root, f"tp{world}.json")
    port = _port()
    procs = []
    for rank in range(world):
        arg = {"rank": rank, "world": world, "port": port, "dir": root, "rates": rates, "repeat": repeat,
               "threads": threads, "out": out}
        procs.append(subprocess.Popen([sys.executable, "-m", "deltarefit.apps.bench.live_tp_worker", json.dumps(arg)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    errs = []
    for p in procs:
        _, err = p.communicate(timeout=3600)
        if p.returncode != 0:
            errs.append(err[-3000:])
    if errs:
        raise RuntimeError(f"a worker of tensor parallel {world} failed:\n{errs[0]}")
    with open(out) as f:
        return json.load(f)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def render(results: list[dict], cfg: dict) -> str:
    lines = [
        "| TP | threads per worker | changed | in place (s): median (min-max) | planned ahead: the update (s) "
        "| full reload (s): median (min-max) | reload / in place | split chunks (decoded by rank 0) "
        "| held digests moved exactly |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for r in res["rates"]:
            lo, hi = r["in_place_range"]
            rlo, rhi = r["reload_range"]
            ahead = "-"
            if r.get("ahead") is not None:
                alo, ahi = r["ahead_range"]
                ahead = f"{r['ahead']:.3f} ({alo:.3f}-{ahi:.3f})"
            lines.append(f"| {res['world']} | {res['threads']} | {100 * r['rate']:.2f}% | {r['in_place']:.3f} "
                         f"({lo:.3f}-{hi:.3f}) | {ahead} | {r['reload']:.3f} ({rlo:.3f}-{rhi:.3f}) | "
                         f"{r['reload'] / r['in_place']:.1f}x | {r['split_chunks']} ({r['split_decoded']}) | "
                         f"{'yes' if r['held_ok'] else 'NO'} |")
    head = (f"# Tensor-parallel refit in place\n\nProduced by `python -m deltarefit.apps.bench.live_tp {cfg['argv']}`: "
            f"{cfg['elements'] / 1e6:.1f}M bf16 elements ({cfg['layers']} layers, hidden {cfg['hidden']}, MLP "
            f"{cfg['mlp']}) on {os.cpu_count()} CPUs ({cfg['cpu']}).")
    method = (
        "* Workers: one process per tensor-parallel rank, each holding its slices in a torch module "
        "(`q_proj`, `up_proj` by rows, `o_proj`, `down_proj` by columns, norms whole); at TP 2 a gloo group on "
        "loopback and, the workers sharing a host, a shared-memory window for split segments.\n"
        "* In place: `run_apply` through a `LiveTarget` checked by held digests, as a vLLM worker runs it. Every "
        "segment of a row-parallel weight is split between the workers: each is decoded by one of them (the "
        "column \"split chunks\"; in brackets, how many rank 0 decoded), which sends the others its changes.\n"
        "* Planned ahead (one worker): the same refit planned first (`apply.protocol.plan_apply`, read-only, as "
        "`LiveEngine.prepare` runs it while an engine serves), then only its update timed (`apply.protocol.commit`: "
        "the changed elements read again and checked against the plan, then written and read back): the pause "
        "an engine that plans while it serves takes.\n"
        "* Full reload: the target's checkpoint read from the page cache and each worker's slices copied from it "
        f"through the module's loader. It checks nothing, and the {2 * cfg['elements'] / 1e6:.0f} MB it reads had "
        "to arrive on the node and be written there first, which is not counted.\n"
        "* Times: medians over forward and back refits (min-max in brackets), between barriers, after a warm-up "
        "round trip. \"Held digests moved exactly\": after the runs, every tensor re-hashed matches the digest "
        "the refits moved.\n")
    return head + "\n\n" + method + "\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.bench.live_tp", description=__doc__.splitlines()[0])
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma-separated (default 1,2)")
    ap.add_argument("--rates", default="0.005,0.015,0.035", help="fractions of elements changed")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--mlp", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="apply threads per worker (default: CPUs / TP)")
    ap.add_argument("--markdown", help="write the table there")
    ap.add_argument("--json", help="write the results there")
    args = ap.parse_args(argv)
    tps = [int(x) for x in args.tp.split(",")]
    rates = [float(x) for x in args.rates.split(",")]
    if any(args.hidden % t or args.mlp % t for t in tps):
        ap.error("hidden and mlp must be multiples of every TP size")
    root = tempfile.mkdtemp(prefix="deltarefit-bench-tp-")
    try:
        t0 = time.perf_counter()
        n = build(root, hidden=args.hidden, mlp=args.mlp, layers=args.layers, rates=rates)
        print(f"built {n / 1e6:.1f}M elements and {2 * len(rates)} deltas in {time.perf_counter() - t0:.1f} s",
              flush=True)
        results = []
        for t in tps:
            threads = args.threads or max(1, (os.cpu_count() or 1) // t)
            results.append(run_tp(root, t, rates, args.repeat, threads))
            print(f"TP {t} done", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cfg = {"argv": " ".join(argv if argv is not None else sys.argv[1:]), "elements": n, "layers": args.layers,
           "hidden": args.hidden, "mlp": args.mlp, "cpu": _cpu_model()}
    text = render(results, cfg)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
