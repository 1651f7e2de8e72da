"""Where `deltarefit apply` and `deltarefit encode` spend their time, beside the tools that bound them.

For one pair (base, target), each figure the median (min-max) of ``repeat`` runs, every file in the
page cache:

* **Baselines**: ``cp`` of the target into a new file (no fsync); ``zstd -1 -T{threads}`` of the target
  into a file; ``b3sum`` of the base on one thread and on ``threads`` (the hashing ceiling; absent,
  and said so, where the binary is not installed); BLAKE3 of the base's 1 MiB segments in this
  process (the ``blake3`` package, the library's hash) on one thread, on a pool of ``threads``, and
  of the whole file with ``max_threads=threads``, each over the mapped file.
* **Fixed costs**: a bare ``python -c pass``, ``import deltarefit.cli``, and a command's whole start
  (``deltarefit fingerprint`` of a four-element checkpoint), each in a new process.
* **Apply stages**, driven one by one on a fresh copy of the base (fsynced first, as an installed
  checkpoint is), through the library's own steps: ``hash`` (every segment of the copy, as the plan
  hashes them: ``fingerprint_checkpoint``), ``plan`` (``protocol.plan_apply``: hashes, decodes, checks;
  read only), ``decode`` (plan less hash: the decode and the post-image hash), ``write``
  (``protocol.commit``: journal, write, read back, verify), ``flush`` (``Checkpoint.flush``: msync and
  fsync of what the write left dirty).
* **Encode stages**: ``hash`` (every segment of base and target, ``encode.known_hashes``), the encode
  without its fsync (``durable=False``), and with it: ``scan+code`` is the former less the hashes, and
  ``fsync`` the latter less the former.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


def timed(f: Callable[[], object]) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()[-400:]}")


def stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def fresh_copy(src: str, dst: str) -> None:
    """``dst`` a new copy of ``src``, fsynced (its pages clean in the page cache)."""
    if os.path.exists(dst):
        os.unlink(dst)
    shutil.copyfile(src, dst)
    with open(dst, "rb") as f:
        os.fsync(f.fileno())


def _seg_pool_hash(path: str, threads: int) -> float:
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    import blake3

    from deltarefit.integrity import SEGMENT_BYTES

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        mv = memoryview(mm)
        try:
            offs = range(0, len(mm), SEGMENT_BYTES)
            t = time.perf_counter()
            if threads <= 1:
                for o in offs:
                    blake3.blake3(mv[o:o + SEGMENT_BYTES]).digest(16)
            else:
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(lambda o: blake3.blake3(mv[o:o + SEGMENT_BYTES]).digest(16), offs))
            return time.perf_counter() - t
        finally:
            mv.release()


def _whole_hash(path: str, threads: int) -> float:
    import mmap

    import blake3

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        t = time.perf_counter()
        blake3.blake3(mm, max_threads=threads).digest()
        return time.perf_counter() - t


def baselines(base: str, target: str, work: str, threads: int, repeat: int) -> dict[str, Any]:
    """The tools' figures (module docstring, "Baselines"); a tool not installed is named in ``missing``."""
    out: dict[str, Any] = {"missing": []}
    times: dict[str, list[float]] = {}
    copy = os.path.join(work, "cp-out.safetensors")
    zout = os.path.join(work, "zstd-out.zst")
    tools = {"cp": ["cp", target, copy],
             "zstd": ["zstd", "-1", f"-T{threads}", "-q", "-f", target, "-o", zout],
             "b3sum_1": ["b3sum", "--num-threads", "1", base],
             "b3sum_n": ["b3sum", "--num-threads", str(threads), base]}
    for k, cmd in tools.items():
        if shutil.which(cmd[0]) is None:
            out["missing"].append(cmd[0])
            continue
        times[k] = []
        for _ in range(repeat):
            if k == "cp" and os.path.exists(copy):
                os.unlink(copy)
            times[k].append(timed(lambda cmd=cmd: run(cmd)))
    for p in (copy, zout):
        if os.path.exists(p):
            os.unlink(p)
    times["blake3_1"] = [_seg_pool_hash(base, 1) for _ in range(repeat)]
    times["blake3_pool"] = [_seg_pool_hash(base, threads) for _ in range(repeat)]
    times["blake3_whole"] = [_whole_hash(base, threads) for _ in range(repeat)]
    out.update({k: stats(v) for k, v in times.items()})
    out["missing"] = sorted(set(out["missing"]))
    return out


def tiny_checkpoint(path: str) -> str:
    """A safetensors file of one bf16 tensor of four elements (written byte by byte: no torch needed)."""
    import json

    header = json.dumps({"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}).encode()
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + bytes(range(8)))
    return path


def fixed_costs(env: dict[str, str], repeat: int, work: str) -> dict[str, Any]:
    """A bare interpreter's start, the CLI's imports, and a command's whole start (``deltarefit
    fingerprint`` of a four-element checkpoint: imports, numpy, its BLAS, the native kernels, one file),
    each in a new process (``env``: bytecode cached)."""
    tiny = tiny_checkpoint(os.path.join(work, "tiny.safetensors"))
    start = [sys.executable, "-m", "deltarefit", "fingerprint", tiny]
    run([sys.executable, "-c", "import deltarefit.cli"], env)  # fills the bytecode cache (untimed)
    run(start, env)
    bare, imp, cmd = [], [], []
    for _ in range(repeat):  # alternating: a change of the machine's load falls on all three alike
        bare.append(timed(lambda: run([sys.executable, "-c", "pass"], env)))
        imp.append(timed(lambda: run([sys.executable, "-c", "import deltarefit.cli"], env)))
        cmd.append(timed(lambda: run(start, env)))
    os.unlink(tiny)
    return {"python": stats(bare), "import_cli": stats(imp), "start": stats(cmd),
            "imports": statistics.median(imp) - statistics.median(bare),
            "start_less_python": statistics.median(cmd) - statistics.median(bare)}


def apply_stages(delta: str, base: str, copy: str, threads: int | None, repeat: int, want: str) -> dict[str, Any]:
    """The apply's stages (module docstring), each run on a fresh copy of ``base``; checked against ``want``."""
    from deltarefit.apply.journal import Journal, journal_path
    from deltarefit.apply.protocol import commit, plan_apply
    from deltarefit.checkpoint.read import fingerprint_checkpoint, open_checkpoint
    from deltarefit.format import DeltaReader

    times: dict[str, list[float]] = {"hash": [], "plan": [], "write": [], "flush": []}
    for _ in range(repeat):
        fresh_copy(base, copy)
        with open_checkpoint(copy) as ck:
            times["hash"].append(timed(lambda ck=ck: fingerprint_checkpoint(ck, threads=threads)))
        with DeltaReader(delta) as d, open_checkpoint(copy, writable=True) as ck:
            journal = Journal(journal_path(copy), d.target_fingerprint)
            t0 = time.perf_counter()
            prep = plan_apply(d, ck, journal=journal, threads=threads)
            t1 = time.perf_counter()
            rep = commit(prep)
            t2 = time.perf_counter()
            ck.flush()
            t3 = time.perf_counter()
            journal.remove()
        if rep.target_fingerprint != want:
            raise RuntimeError("apply stages: the result is not the target")
        times["plan"].append(t1 - t0)
        times["write"].append(t2 - t1)
        times["flush"].append(t3 - t2)
    out = {k: stats(v) for k, v in times.items()}
    out["decode"] = out["plan"]["median"] - out["hash"]["median"]
    return out


def encode_stages(base: str, target: str, delta: str, threads: int | None, repeat: int) -> dict[str, Any]:
    """The encode's stages (module docstring)."""
    import deltarefit
    from deltarefit.encode import known_hashes

    times: dict[str, list[float]] = {"hash": [], "nondurable": [], "durable": []}
    for _ in range(repeat):
        times["hash"].append(timed(lambda: (known_hashes(base, threads=threads), known_hashes(target, threads=threads))))
        times["nondurable"].append(timed(lambda: deltarefit.encode(base, target, delta, threads=threads, durable=False)))
        times["durable"].append(timed(lambda: deltarefit.encode(base, target, delta, threads=threads)))
    out = {k: stats(v) for k, v in times.items()}
    out["scan_code"] = out["nondurable"]["median"] - out["hash"]["median"]
    out["fsync"] = out["durable"]["median"] - out["nondurable"]["median"]
    return out


def _f(s: dict[str, float]) -> str:
    return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


def render(r: dict[str, Any]) -> list[str]:
    """Markdown lines of one pair's stage figures (``measure_pair(stages=True)``)."""
    b, fx, a, e = r["baselines"], r["fixed"], r["apply_stages"], r["encode_stages"]
    gb = r["bytes"] / 1e9
    n = r["threads"]

    def rate(k: str) -> str:
        return f"{_f(b[k])} ({gb / b[k]['median']:.2f} GB/s)" if k in b else "not installed"

    lines = [f"### {r['pair']}: bounds and stages ({n} threads)", "",
             "| what | seconds, median (min-max) |", "|---|---|",
             f"| `cp` of the target | {rate('cp')} |",
             f"| `zstd -1 -T{n}` of the target | {rate('zstd')} |",
             f"| `b3sum --num-threads 1` of the base | {rate('b3sum_1')} |",
             f"| `b3sum --num-threads {n}` of the base | {rate('b3sum_n')} |",
             f"| BLAKE3 in Python, 1 MiB segments, 1 thread | {rate('blake3_1')} |",
             f"| BLAKE3 in Python, 1 MiB segments, pool of {n} | {rate('blake3_pool')} |",
             f"| BLAKE3 in Python, whole file, max_threads={n} | {rate('blake3_whole')} |",
             f"| `python -c pass` | {_f(fx['python'])} |",
             f"| `python -c 'import deltarefit.cli'` | {_f(fx['import_cli'])} (imports {fx['imports']:.3f}) |",
             f"| `deltarefit fingerprint` of a 4-element checkpoint | {_f(fx['start'])} (less `python -c pass`: "
             f"{fx['start_less_python']:.3f}) |",
             f"| apply: hash (every segment of the base) | {rate_of(a['hash'], gb)} |",
             f"| apply: plan (hash, decode, check; read only) | {_f(a['plan'])} (decode and post-image check: plan "
             f"less hash {a['decode']:.3f}) |",
             f"| apply: write (journal, write, read back, verify) | {_f(a['write'])} |",
             f"| apply: flush (msync + fsync) | {_f(a['flush'])} |",
             f"| encode: hash (base and target) | {_f(e['hash'])} |",
             f"| encode without fsync | {_f(e['nondurable'])} (scan+code: less the hashes {e['scan_code']:.3f}) |",
             f"| encode, fsynced | {_f(e['durable'])} (fsync {e['fsync']:.3f}) |", ""]
    missing = b.get("missing") or []
    if missing:
        lines += [f"Not installed here: {', '.join(missing)}.", ""]
    return lines


def rate_of(s: dict[str, float], gb: float) -> str:
    return f"{_f(s)} ({gb / s['median']:.2f} GB/s)"


def summary(r: dict[str, Any]) -> str:
    """One printed line of the stage figures."""
    b, fx, a, e = r["baselines"], r["fixed"], r["apply_stages"], r["encode_stages"]
    med = {k: v["median"] for k, v in b.items() if isinstance(v, dict)}
    return (f"  bounds: {', '.join(f'{k} {v:.3f}' for k, v in med.items())} s; imports {fx['imports']:.3f} s, "
            f"command start {fx['start_less_python']:.3f} s "
            f"(python {fx['python']['median']:.3f}); apply hash {a['hash']['median']:.3f} plan "
            f"{a['plan']['median']:.3f} (decode {a['decode']:.3f}) write {a['write']['median']:.3f} flush "
            f"{a['flush']['median']:.3f}; encode hash {e['hash']['median']:.3f} scan+code {e['scan_code']:.3f} "
            f"fsync {e['fsync']:.3f}")
