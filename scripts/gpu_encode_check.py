"""GPU encode check: the device compare-and-compact scan and the end-to-end encoder, against the
obvious torch ops, on one bf16 tensor pair with a fraction of elements moved by +-1 ulp.

    python scripts/gpu_encode_check.py [--gelems 2] [--rate 0.03] [--device cuda|cpu] [--threads N]

Prints, in GB/s of checkpoint (bf16 bytes of one tensor):
* copy: a device-to-device copy of the tensor (the memory-bandwidth reference);
* obvious: compare, nonzero, gather of both values (what a plain torch diff costs);
* scan: ``deltarefit.gpu.encode.scan_segments`` over every segment (compare, contexts, ranks, gather,
  to host), without hashing;
* hashes: BLAKE3 segment hashes of both tensors;
* end to end: ``encode_tensors`` to a delta file on the host (entropy coding on ``--threads`` cores);
and checks that the delta bytes equal the host encoder's on the first 64 MiB of the pair.
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
    ap.add_argument("--rate", type=float, default=0.03)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    import torch

    from deltarefit.gpu.encode import _seg_hashes as seg_hashes
    from deltarefit.gpu.encode import encode_tensors, scan_segments
    from deltarefit.integrity import SEGMENT_BYTES

    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n = int(a.gelems * (1 << 30))
    g = torch.Generator(device=dev).manual_seed(0)
    base = (torch.randn(n, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    target = base.clone()
    bits = target.view(torch.int16)
    idx = torch.randint(0, n, (int(n * a.rate),), device=dev, generator=g)
    bits[idx] += torch.where(torch.rand(idx.numel(), device=dev, generator=g) < 0.5, 1, -1).to(torch.int16)
    nbytes = n * 2
    print(f"device {dev} ({torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}), {n:,} bf16 elements "
          f"({nbytes / 1e9:.2f} GB), {a.rate:.1%} moved by +-1 ulp, torch {torch.__version__}", flush=True)

    def gbps(sec: float) -> str:
        return f"{nbytes / sec / 1e9:8.1f} GB/s ({sec * 1e3:.1f} ms)"

    scratch = [torch.empty_like(base)]
    print("copy      ", gbps(timed(lambda: scratch[0].copy_(base), sync)), flush=True)
    scratch.clear()

    def obvious() -> None:
        b, t = base.view(torch.int16), target.view(torch.int16)
        pos = torch.nonzero(b != t).reshape(-1)
        (b[pos].cpu(), t[pos].cpu(), pos.cpu())

    print("obvious   ", gbps(timed(obvious, sync)), flush=True)
    n_seg = nbytes // SEGMENT_BYTES
    batch = 256

    def scan() -> None:
        for first in range(0, n_seg, batch):
            scan_segments(base, target, "BF16", first, min(batch, n_seg - first))

    print("scan      ", gbps(timed(scan, sync, reps=2)), flush=True)
    print("hashes    ", gbps(timed(lambda: (seg_hashes(base, "auto"), seg_hashes(target, "auto")), sync, reps=2)),
          flush=True)
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        rep = encode_tensors({"w": base}, {"w": target}, os.path.join(d, "dev.delta"), threads=a.threads,
                             batch_segments=batch)
        sync()
        sec = time.perf_counter() - t
        print(f"end to end {gbps(sec)}: {rep.delta_bytes:,} bytes, {rep.ratio:.1f}x, "
              f"{rep.changed_fraction:.2%} changed", flush=True)
        # Byte identity with the host encoder on a slice.
        from safetensors.torch import save_file

        import deltarefit

        k = min(n, 32 << 20)
        bs, ts = {"w": base[:k].cpu()}, {"w": target[:k].cpu()}
        save_file(bs, os.path.join(d, "b.safetensors"))
        save_file(ts, os.path.join(d, "t.safetensors"))
        deltarefit.encode(os.path.join(d, "b.safetensors"), os.path.join(d, "t.safetensors"), os.path.join(d, "h"))
        encode_tensors({"w": base[:k]}, {"w": target[:k]}, os.path.join(d, "g"), threads=a.threads)
        same = open(os.path.join(d, "h"), "rb").read() == open(os.path.join(d, "g"), "rb").read()
        print(f"identical to the host encoder on {k:,} elements: {'yes' if same else 'NO'}", flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
