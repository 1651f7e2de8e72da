"""GPU encode and apply check: the fused Triton scan, the hashes, the device apply and the end-to-end
encoder, against a copy and the obvious torch ops, on one bf16 tensor pair with a fraction of
elements moved by +-1 ulp. One prepared run (about 8 minutes on one H200 at the defaults):

    python scripts/gpu_encode_check.py [--gelems 2] [--rate 0.03] [--threads 16] [--device cuda]

Prints, in GB/s of checkpoint scanned (the bf16 bytes of one tensor):
* copy: a device-to-device copy of the tensor (the memory-bandwidth reference);
* obvious: compare, nonzero, gather of both values, to the host (what a plain torch diff costs);
* fused scan: ``gpu.scan.scan_batch`` over every segment (compare, contexts, per-tile histograms, the
  scan over tiles, compaction; results left on the device), at the default launch shape and a few
  others (``--sweep``);
* scan to host: ``gpu.encode.scan_segments`` (the fused scan plus the copy of the compact changes);
* rank map: ``gpu.scan.context_perm`` of every base segment (the apply's device step);
* hashes: BLAKE3 segment hashes of both tensors;
* end to end: ``encode_tensors`` to a delta file on the host (range coding on ``--threads`` cores);
* device apply: ``apply_to_device_tensors`` of that delta to a device copy of the base, checked bit
  for bit against the target;
and checks that the delta bytes equal the host encoder's on the first ``--check-elems`` of the pair;
then format 2's rows (``scripts/gpu_ulp2_check.py``: device decode and device encode of encodings 6/7
against a copy, on the first ``--ulp2-melems`` Mi elements).
Exits 1 if a check fails.

Without a GPU, a smoke run of the same code through Triton's interpreter (hashes then on the host):

    TRITON_INTERPRET=1 python scripts/gpu_encode_check.py --device cpu --elements 600000 --threads 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))


def timed(fn, sync, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gelems", type=float, default=2.0, help="elements of the pair, in Gi (default 2)")
    ap.add_argument("--elements", type=int, default=None, help="elements of the pair (overrides --gelems)")
    ap.add_argument("--rate", type=float, default=0.03)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--batch", type=int, default=64, help="segments per scan batch")
    ap.add_argument("--check-elems", type=int, default=32 << 20, help="elements checked against the host encoder")
    ap.add_argument("--sweep", default="32:8192,64:16384,128:16384",
                    help="extra scan launch shapes block:tile[,...] ('' for none)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ulp2-melems", type=float, default=512.0,
                    help="elements (Mi) of the format-2 device decode/encode rows (0: none)")
    a = ap.parse_args()
    import torch

    from deltarefit.dtypes import dtype
    from deltarefit.gpu import scan as S
    from deltarefit.gpu.apply import apply_to_device_tensors
    from deltarefit.gpu.encode import _seg_hashes as seg_hashes
    from deltarefit.gpu.encode import encode_tensors, scan_segments
    from deltarefit.integrity import SEGMENT_BYTES

    dev = torch.device(a.device)
    if not S.available(dev):
        print(f"the fused scan cannot run on {dev}: {S.unavailable_reason(dev)}", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n = a.elements if a.elements is not None else int(a.gelems * (1 << 30))
    g = torch.Generator(device=dev).manual_seed(0)
    base = (torch.randn(n, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    target = base.clone()
    bits = target.view(torch.int16)
    idx = torch.randint(0, n, (int(n * a.rate),), device=dev, generator=g)
    bits[idx] += torch.where(torch.rand(idx.numel(), device=dev, generator=g) < 0.5, 1, -1).to(torch.int16)
    nbytes = n * 2
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu, Triton interpreter"
    print(f"device {dev} ({name}), {n:,} bf16 elements ({nbytes / 1e9:.3f} GB), {a.rate:.1%} moved by +-1 ulp, "
          f"torch {torch.__version__}", flush=True)
    reps = a.reps if dev.type == "cuda" else 1

    def gbps(sec: float) -> str:
        return f"{nbytes / sec / 1e9:8.2f} GB/s ({sec * 1e3:.1f} ms)"

    scratch = [torch.empty_like(base)]
    print("copy           ", gbps(timed(lambda: scratch[0].copy_(base), sync, reps)), flush=True)
    scratch.clear()

    def obvious() -> None:
        b, t = base.view(torch.int16), target.view(torch.int16)
        pos = torch.nonzero(b != t).reshape(-1)
        (b[pos].cpu(), t[pos].cpu(), pos.cpu())

    print("obvious        ", gbps(timed(obvious, sync, reps)), flush=True)
    dt = dtype("BF16")
    per = SEGMENT_BYTES // 2
    n_seg = -(-nbytes // SEGMENT_BYTES)
    bi, ti = base.view(torch.int16), target.view(torch.int16)

    def fused(cfg) -> None:
        for first in range(0, n_seg, a.batch):
            c = min(a.batch, n_seg - first)
            S.scan_batch(bi[first * per:(first + c) * per], ti[first * per:(first + c) * per], dt, c, config=cfg)

    print("fused scan     ", gbps(timed(lambda: fused(None), sync, reps)), "default shape", flush=True)
    for spec in filter(None, a.sweep.split(",")):
        blk, tile = (int(x) for x in spec.split(":"))
        cfg = S.ScanConfig(block=blk, tile=tile)
        print("fused scan     ", gbps(timed(lambda cfg=cfg: fused(cfg), sync, reps)), cfg, flush=True)

    def to_host() -> None:
        for first in range(0, n_seg, a.batch):
            scan_segments(base, target, "BF16", first, min(a.batch, n_seg - first), scan="triton")

    print("scan to host   ", gbps(timed(to_host, sync, reps)), flush=True)

    def rank_map() -> None:
        for k in range(n_seg):
            S.context_perm(bi[k * per:(k + 1) * per], dt)

    print("rank map       ", gbps(timed(rank_map, sync, reps)), flush=True)
    print("hashes         ", gbps(timed(lambda: (seg_hashes(base, "auto"), seg_hashes(target, "auto")), sync, reps)),
          flush=True)
    ok = True
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        rep = encode_tensors({"w": base}, {"w": target}, os.path.join(d, "dev.delta"), threads=a.threads,
                             batch_segments=a.batch, scan="triton")
        sync()
        sec = time.perf_counter() - t
        print(f"end to end     {gbps(sec)}: {rep.delta_bytes:,} bytes, {rep.ratio:.1f}x, "
              f"{rep.changed_fraction:.2%} changed", flush=True)
        live = {"w": base.clone()}
        sync()
        t = time.perf_counter()
        arep = apply_to_device_tensors(os.path.join(d, "dev.delta"), live, scan="triton")
        sync()
        sec = time.perf_counter() - t
        exact = bool(torch.equal(live["w"].view(torch.int16), target.view(torch.int16)))
        ok &= exact
        print(f"device apply   {gbps(sec)}: {arep.chunks_applied} chunks, bit-exact: {'yes' if exact else 'NO'}",
              flush=True)
        del live
        # Byte identity with the host encoder on a slice.
        from safetensors.torch import save_file

        import deltarefit

        k = min(n, a.check_elems)
        save_file({"w": base[:k].cpu()}, os.path.join(d, "b.safetensors"))
        save_file({"w": target[:k].cpu()}, os.path.join(d, "t.safetensors"))
        deltarefit.encode(os.path.join(d, "b.safetensors"), os.path.join(d, "t.safetensors"), os.path.join(d, "h"),
                          threads=a.threads)
        encode_tensors({"w": base[:k]}, {"w": target[:k]}, os.path.join(d, "g"), threads=a.threads, scan="triton")
        same = open(os.path.join(d, "h"), "rb").read() == open(os.path.join(d, "g"), "rb").read()
        ok &= same
        print(f"identical to the host encoder on {k:,} elements: {'yes' if same else 'NO'}", flush=True)
    if a.ulp2_melems > 0:  # format 2's device decoder and encoder (scripts/gpu_ulp2_check.py's rows)
        from gpu_ulp2_check import rows as ulp2_rows

        ok &= ulp2_rows(a.device, min(n, int(a.ulp2_melems * (1 << 20))), a.rate, 1024, reps, 8,
                        say=lambda *x: print(*x, flush=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
