#!/usr/bin/env python3
"""GPU check: BLAKE3 segment hashes on the device equal the CPU ``blake3`` package's, and how fast they are.

Run from the repository root on a CUDA machine:  ``python scripts/gpu_check.py [--gib 8]``

1. Prints the device and what it runs: the Triton kernels (``deltarefit.gpu.blake3_triton``) when
   ``import triton`` works, and the pure-torch reference (``deltarefit.gpu.blake3_torch``) always.
2. Verifies every implementation (each Triton launch config tried) against ``blake3`` on the CPU: edge
   lengths, non-power-of-two chunk trees, 64 MiB (+ a ragged tail) of random bytes, unaligned views, and
   whole-message digests.
3. Times hashing of a ``--gib`` GiB buffer of random bf16 values already on the GPU (warm-up, then
   ``torch.cuda.synchronize()``-bracketed repetitions), beside ``dst.copy_(src)`` and a read-only
   reduction over the same buffer as bandwidth references. The big buffer's hashes are cross-checked:
   every config against the torch reference (all segments) and sampled segments (across the 2 GiB and
   4 GiB offsets) against the CPU.
4. With ``--ulp2 MELEMS``: format 2's rows (``scripts/gpu_ulp2_check.py``): the device decode and
   encode of encodings 6/7 on a bf16 pair, in GB/s beside a copy, checked bit for bit.

Exit status: 0 all hashes matched, 1 a mismatch, 2 no CUDA device or a missing package.
Needs torch (CUDA build), numpy, blake3; triton optional. The rest of deltarefit's dependencies are not
needed: without them only ``deltarefit.integrity`` and ``deltarefit.gpu`` are loaded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def say(*a: object) -> None:
    print(*a, flush=True)


def elapsed() -> float:
    return time.perf_counter() - T0


def _import_gpu_module() -> tuple[types.ModuleType, types.ModuleType, str]:
    """``(blake3_triton, blake3_torch, how)``: the installed package, else the source tree's modules only."""
    sys.path.insert(0, str(ROOT / "src"))
    try:
        import deltarefit  # noqa: F401  (full package: numba, safetensors, ... present)

        how = "deltarefit package"
    except ImportError as e:
        # Load deltarefit.integrity and deltarefit.gpu without the package __init__ and its dependencies.
        for name in [m for m in sys.modules if m == "deltarefit" or m.startswith("deltarefit.")]:
            del sys.modules[name]
        pkg = types.ModuleType("deltarefit")
        pkg.__path__ = [str(ROOT / "src" / "deltarefit")]
        sys.modules["deltarefit"] = pkg
        how = f"deltarefit source modules only (package import failed: {e})"
    from deltarefit.gpu import blake3_torch, blake3_triton

    return blake3_triton, blake3_torch, how


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=8.0, help="size of the timed buffer (GiB)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per implementation")
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke run of this script "
                    "(with TRITON_INTERPRET=1 for the kernels)")
    ap.add_argument("--quick", action="store_true", help="smoke run: few small cases, one Triton config")
    ap.add_argument("--ulp2", type=float, default=0.0, metavar="MELEMS",
                    help="also print format 2's device decode/encode rows on MELEMS Mi bf16 elements "
                    "(scripts/gpu_ulp2_check.py; needs the whole deltarefit package)")
    args = ap.parse_args()

    try:
        import blake3
        import numpy as np
        import torch
    except ImportError as e:
        say(f"missing package: {e}")
        return 2
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        say(f"no CUDA device visible to torch {torch.__version__} (a CPU build?); nothing to check")
        return 2
    bt, bref, how = _import_gpu_module()

    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        say(f"device: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
            f"{p.total_memory / 2**30:.0f} GiB; torch {torch.__version__} (CUDA {torch.version.cuda})")
    else:
        say(f"device: {dev} (smoke run); torch {torch.__version__}")

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()
    if bt.HAVE_TRITON:
        import triton

        say(f"using: Triton {triton.__version__} kernels + the torch reference; {how}")
    else:
        say(f"using: torch reference only (import triton failed: {bt.TRITON_IMPORT_ERROR}); {how}")

    # ----------------------------------------------------------------------------------- correctness
    rng = np.random.default_rng(2024)
    big = 2 * MIB if args.quick else 64 * MIB
    host = rng.integers(0, 256, big + 12345, dtype=np.uint8)
    dbuf = torch.from_numpy(host).to(dev)

    def expected(a: np.ndarray) -> list[bytes]:
        return [blake3.blake3(a[i:i + MIB]).digest(16) for i in range(0, a.size, MIB)]

    lengths = [0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 3 * 1024 + 5, MIB - 1, MIB, MIB + 1, 3 * MIB + 777,
               3 * 1024, 5 * 1024 + 1, 7 * 1024 + 9, MIB + 3 * 1024 + 1, 2 * MIB + 700 * 1024 + 13,
               big, big + 12345]
    cases: list[tuple[str, int, int]] = [(f"len {n}", 0, n) for n in lengths]
    cases += [(f"offset {o} len {3 * MIB + 5}", o, 3 * MIB + 5) for o in (1, 2, 3, 4, 8)]
    if args.quick:
        cases = [(f"len {n}", 0, n) for n in (0, 65, 1025, MIB + 5 * 1024 + 7)] + [("offset 1 len 1031", 1, 1031)]
    want = {(o, n): expected(host[o:o + n]) for _, o, n in cases}

    def rows(h: torch.Tensor) -> list[bytes]:
        return [bytes(r) for r in h.cpu().numpy()]

    # name -> Triton launch config, or None for the torch reference (verified first: it is also the
    # cross-check for the big buffer).
    impls: dict[str, object] = {"torch-ref": None}
    interpreted = bt.HAVE_TRITON and type(bt._k.chunk_cv_kernel).__name__ == "InterpretedFunction"
    if bt.HAVE_TRITON and dev.type != "cuda" and not interpreted:
        say("triton kernels skipped: on the CPU they need TRITON_INTERPRET=1")
    elif bt.HAVE_TRITON:
        configs = [bt.KernelConfig(128, 4, 1), bt.KernelConfig(128, 4, 2), bt.KernelConfig(256, 4, 1),
                   bt.KernelConfig(256, 8, 2), bt.KernelConfig(64, 2, 1), bt.KernelConfig(256, 8, 1)]
        for cfg in configs[:1] if args.quick else configs:
            impls[f"triton tile={cfg.tile} warps={cfg.num_warps} load={cfg.load}"] = cfg

    def hash_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        cfg = impls[name]
        if cfg is None:
            return lambda r: bref.segment_hashes_torch(r, batch_chunks=1 << 20)
        return lambda r: bt.segment_hashes_gpu(r, config=cfg)  # type: ignore[arg-type]

    failed = False
    ok_impls: list[str] = []
    triton_error = ""
    for name, cfg in impls.items():
        if cfg is not None and (triton_error or elapsed() > 100):
            say(f"verify {name}: skipped ({'triton unusable' if triton_error else 'time budget'})")
            continue
        t = time.perf_counter()
        fn = hash_fn(name)
        try:
            bad = [label for label, o, n in cases if rows(fn(dbuf[o:o + n])) != want[(o, n)]]
            if cfg is not None:
                for n in (0, 1025) if args.quick else (0, 1, 1024, 5 * 1024 + 1, 3 * MIB + 5):
                    if bt.blake3_gpu(dbuf[:n], 32, config=cfg) != blake3.blake3(host[:n]).digest(32):
                        bad.append(f"whole-message len {n}")
        except Exception as e:  # e.g. Triton cannot build its launcher: no gcc / Python.h on this machine
            if cfg is None:
                raise
            triton_error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            say(f"verify {name}: triton kernels could not run ({triton_error}); Triton needs a C compiler "
                "(gcc, or CC=...) and the Python headers to build its launcher. Falling back to torch-ref.")
            continue
        if bad:
            failed = True
            say(f"verify {name}: MISMATCH in {len(bad)} cases: {', '.join(bad[:6])}")
        else:
            ok_impls.append(name)
            say(f"verify {name}: OK ({len(cases)} segment cases{'' if cfg is None else ' + whole-message'}; "
                f"{time.perf_counter() - t:.1f} s incl. compile)")
    del dbuf

    # ----------------------------------------------------------------------------------------- speed
    nbytes = int(args.gib * 2**30) // 1024 * 1024
    x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=dev)  # random bf16 weights
    raw = x.view(torch.uint8)
    gb = nbytes / 1e9

    def timed(fn: Callable[[], object], reps: int) -> tuple[float, float, object]:
        out = fn()  # warm-up (and compile)
        sync()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            out = fn()
            sync()
            ts.append(time.perf_counter() - t)
        return min(ts), statistics.median(ts), out

    dst = torch.empty_like(raw)
    t_copy, m_copy, _ = timed(lambda: dst.copy_(raw), args.reps)
    dst = torch.empty(0, dtype=torch.uint8, device=dev)  # free the copy target's memory
    t_read, m_read, _ = timed(lambda: raw.view(torch.int32).amax(), args.reps)
    say(f"buffer: {nbytes / 2**30:.2f} GiB of random bf16 on {dev} ({-(-nbytes // MIB)} segments)")
    say(f"copy  {'dst.copy_(src)':32s}: {gb / t_copy:8.1f} GB/s (best; median {gb / m_copy:.1f}) "
        f"= {2 * gb / t_copy:.1f} GB/s of DRAM traffic (read + write)")
    say(f"read  {'int32 amax':32s}: {gb / t_read:8.1f} GB/s (best; median {gb / m_read:.1f}) read-only reference")

    results: dict[str, tuple[float, float, torch.Tensor]] = {}
    for name in [n for n in ok_impls if impls[n] is not None] + [n for n in ok_impls if impls[n] is None]:
        reps = args.reps if impls[name] is not None else 1  # the reference is slow: one pass after warm-up
        fn = hash_fn(name)
        t_b, t_m, out = timed(lambda fn=fn: fn(raw), reps)
        results[name] = (t_b, t_m, out)  # type: ignore[assignment]
        say(f"hash  {name:32s}: {gb / t_b:8.1f} GB/s (best of {reps}; median {gb / t_m:.1f})")

    # Cross-checks on the big buffer (byte offsets past 2**31 and 2**32 exist only here).
    names = list(results)
    if names:
        base = results[names[0]][2]
        nseg = base.shape[0]
        differ = [n for n in names[1:] if not torch.equal(results[n][2], base)]
        sample = sorted({i for i in (0, 1, 2047, 2048, 4095, 4096, 6144, nseg // 2, nseg - 2, nseg - 1)
                         if 0 <= i < nseg})
        bad = [i for i in sample if bytes(base[i].cpu().numpy())
               != blake3.blake3(raw[i * MIB:(i + 1) * MIB].cpu().numpy()).digest(16)]
        failed |= bool(differ or bad)
        say(f"cross-check big buffer: {len(names)} implementations "
            + (f"agree on all {nseg} segments" if not differ else f"DISAGREE ({', '.join(differ)} vs {names[0]})")
            + f"; CPU blake3 on segments {sample}: " + ("OK" if not bad else f"MISMATCH {bad}"))

    triton_res = {k: v for k, v in results.items() if k != "torch-ref"}
    if triton_res:
        best = min(triton_res, key=lambda k: triton_res[k][0])
        rate = gb / triton_res[best][0]
        say(f"summary: best {best}: {rate:.1f} GB/s = {rate / (gb / t_copy):.2f}x copy, "
            f"{rate / (gb / t_read):.2f}x read-only bandwidth")
    if args.ulp2 > 0:
        try:
            from gpu_ulp2_check import rows as ulp2_rows

            failed |= not ulp2_rows(args.device, int(args.ulp2 * MIB), 0.03, 1024, args.reps, 8, say=say)
        except ImportError as e:
            say(f"format 2 rows skipped: {e}")
    say(f"result: {'FAIL (hash mismatch)' if failed else 'PASS: every hash matched the CPU blake3 package'}; "
        f"{elapsed():.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
