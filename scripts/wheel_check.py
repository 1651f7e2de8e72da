"""The release as a user installs it (``make test-wheel``; .ci/run runs it after ``make test``).

    python scripts/wheel_check.py [--keep]

1. ``python -m build`` (an sdist, then the wheel built from it, in build's isolated environment).
2. The wheel's contents: the library, the command line, the vLLM plugin, the demo, the native sources and
   the licence; no tests, no data, no numba cache or in-place build left in the checkout.
3. A fresh venv that holds torch 2.13.0 first (a user's environment; the CPU build this machine has on
   disk), then the wheel with its ``demo`` extra, under a constraint that torch stays 2.13.0: pip must find
   the wheel's ranges satisfied by the torch that is there, or fail (it never resolves a torch of its own).
4. From outside the checkout, with that venv's ``deltarefit``: ``--version`` and the installed metadata,
   entry points and plugin equal to the checkout's release; an encode / apply / verify round trip; the
   demo's first step (``deltarefit demo --steps 1 --rollouts 1``).
5. The sdist installed again with no C compiler (``CC=false``): the install succeeds without the native
   kernels, and the same round trip runs on the numba kernels.

Every step prints its time; any failure exits non-zero naming the step.
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH = "torch==2.13.0"  # the CPU build on disk here; a user's own torch in its place is the point of the ranges


def release() -> str:
    ns: dict[str, str] = {}
    with open(os.path.join(ROOT, "src", "deltarefit", "_release.py"), encoding="utf-8") as f:
        exec(f.read(), ns)
    return ns["RELEASE"]


class Failed(Exception):
    pass


def run(cmd: list[str], *, cwd: str | None = None, env: dict[str, str] | None = None, quiet: bool = False) -> str:
    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, check=False, cwd=cwd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise Failed(f"exit {r.returncode}: {' '.join(cmd)}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    if not quiet:
        sys.stdout.write(r.stdout)
    return r.stdout


def check_contents(whl: str, version: str) -> None:
    names = zipfile.ZipFile(whl).namelist()
    must = ["deltarefit/__init__.py", "deltarefit/cli/__init__.py", "deltarefit/apps/demo.py",
            "deltarefit/codec/_native.c", "deltarefit/_sigbus.c", "deltarefit_vllm_plugin.py",
            f"deltarefit-{version}.dist-info/licenses/LICENSE", f"deltarefit-{version}.dist-info/entry_points.txt"]
    missing = [n for n in must if n not in names]
    if missing:
        raise Failed(f"{os.path.basename(whl)} lacks {missing}")
    bad = [n for n in names if n.startswith(("tests/", "out/", "docs/", "scripts/", "examples/"))
           or "__pycache__" in n or n.endswith((".nbi", ".nbc", ".safetensors", ".delta", ".pyc"))]
    if bad:
        raise Failed(f"{os.path.basename(whl)} holds what it must not: {bad[:10]}")
    compiled = [n for n in names if n.endswith(".so")]
    entry = zipfile.ZipFile(whl).read(f"deltarefit-{version}.dist-info/entry_points.txt").decode()
    for line in ("deltarefit = deltarefit.cli:main", "deltarefit = deltarefit_vllm_plugin:register"):
        if line not in entry:
            raise Failed(f"entry_points.txt lacks {line!r}:\n{entry}")
    print(f"{os.path.basename(whl)}: {len(names)} files, compiled {compiled or 'none'}; no tests, no data")


ROUND_TRIP = r"""
import importlib.metadata as md, os, subprocess, sys, sysconfig
import numpy as np
from safetensors.numpy import save_file
import deltarefit, deltarefit_vllm_plugin

want, native = sys.argv[1], sys.argv[2] == "native"
site = sysconfig.get_paths()["purelib"]
for mod in (deltarefit, deltarefit_vllm_plugin):
    assert os.path.realpath(mod.__file__).startswith(os.path.realpath(site)), (mod.__file__, site)
assert deltarefit.__version__ == md.version("deltarefit") == deltarefit_vllm_plugin.__version__ == want
ep = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "deltarefit"]
assert len(ep) == 1 and ep[0].value == "deltarefit_vllm_plugin:register" and ep[0].dist.version == want, ep
try:
    import deltarefit.codec._native  # noqa: F401
    has_native = True
except ImportError:
    has_native = False
assert has_native == native, f"native kernels: expected {native}, found {has_native}"

rng = np.random.default_rng(7)
base = {f"layers.{i}.weight": rng.integers(0, 1 << 16, (512, 256), dtype=np.uint16).view(np.float16)
        for i in range(3)}
target = {k: v.copy() for k, v in base.items()}
for v in target.values():
    flat = v.reshape(-1).view(np.uint16)
    idx = rng.choice(flat.size, flat.size // 30, replace=False)
    flat[idx] ^= 1
save_file(base, "a.safetensors"); save_file(target, "b.safetensors"); save_file(base, "r.safetensors")
cli = os.path.join(os.path.dirname(sys.executable), "deltarefit")
out = subprocess.run([cli, "--version"], capture_output=True, text=True, check=True).stdout.strip()
assert out == f"deltarefit, version {want}", out
subprocess.run([cli, "encode", "a.safetensors", "b.safetensors", "-o", "d.delta"], check=True)
subprocess.run([cli, "apply", "d.delta", "r.safetensors"], check=True)
fp = subprocess.run([cli, "fingerprint", "b.safetensors", "-q"], capture_output=True, text=True, check=True)
subprocess.run([cli, "verify", "r.safetensors", fp.stdout.split()[-1]], check=True)
rep = deltarefit.apply("d.delta", "r.safetensors")  # the library call: a second apply is a no-op, verified
print(f"round trip verified ({'native' if has_native else 'numba'} kernels), {os.path.getsize('d.delta'):,} "
      f"byte delta, fingerprint {rep.target_fingerprint[:16]}...")
"""


def main(argv: list[str]) -> int:
    keep = "--keep" in argv
    version = release()
    work = tempfile.mkdtemp(prefix="deltarefit-wheel-")
    times: list[tuple[str, float]] = []
    step = "start"
    try:
        def timed(name: str) -> None:
            nonlocal step
            times.append((name, time.perf_counter()))
            step = name
            print(f"== {name}", flush=True)

        timed("build the sdist and the wheel (python -m build)")
        run([sys.executable, "-m", "build", "--outdir", os.path.join(work, "dist"), ROOT], quiet=True)
        whl, = glob.glob(os.path.join(work, "dist", f"deltarefit-{version}-*.whl"))
        sdist, = glob.glob(os.path.join(work, "dist", f"deltarefit-{version}.tar.gz"))
        check_contents(whl, version)

        timed(f"a fresh venv with {TORCH}, then the wheel with its demo extra")
        venv = os.path.join(work, "venv")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # the venv's own
        env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env.get("PATH", "")
        run([sys.executable, "-m", "venv", venv], env=env)
        py = os.path.join(venv, "bin", "python")
        pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        run([*pip, TORCH], env=env)
        keep_torch = os.path.join(work, "keep-torch.txt")
        with open(keep_torch, "w", encoding="utf-8") as f:
            f.write(TORCH + "\n")
        show = [py, "-c", "import torch; print(torch.__version__, torch.__file__)"]
        before = run(show, env=env, quiet=True)
        run([*pip, "-c", keep_torch, f"{whl}[demo]"], env=env)
        after = run(show, env=env, quiet=True)
        if before != after:
            raise Failed(f"installing the wheel replaced torch: {before.strip()} -> {after.strip()}")
        run([py, "-m", "pip", "check"], env=env)
        print(f"torch kept: {after.strip()}")

        timed("from the installed wheel: --version, metadata, plugin, encode/apply/verify round trip")
        cwd = os.path.join(work, "user")
        os.mkdir(cwd)
        with open(os.path.join(work, "round_trip.py"), "w", encoding="utf-8") as f:
            f.write(ROUND_TRIP)
        run([py, os.path.join(work, "round_trip.py"), version, "native"], cwd=cwd, env=env)

        timed("the demo's first step from the installed wheel")
        run([os.path.join(venv, "bin", "deltarefit"), "demo", "--steps", "1", "--rollouts", "1", "--out",
             os.path.join(cwd, "demo")], cwd=cwd, env=env)

        timed("the sdist installed without a C compiler (CC=false): numba kernels")
        run([*pip, "--force-reinstall", "--no-deps", "--no-cache-dir", sdist], env={**env, "CC": "false"})
        run([py, os.path.join(work, "round_trip.py"), version, "numba"], cwd=cwd, env=env)
        timed("done")
    except Failed as e:
        print(f"wheel check failed at '{step}': {e}", file=sys.stderr)
        return 1
    finally:
        if keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("wheel check passed; seconds per step:")
    for (name, t0), (_, t1) in itertools.pairwise(times):
        print(f"  {t1 - t0:6.1f}  {name}")
    print(f"  {times[-1][1] - times[0][1]:6.1f}  in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
