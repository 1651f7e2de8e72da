#!/usr/bin/env python3
"""Format 2 on the GPU: the device decoder and encoder of encodings 6/7 (``deltarefit.gpu.ulp2``),
checked and timed on one bf16 tensor pair with a fraction of its elements moved by +-1 ulp.

    python scripts/gpu_ulp2_check.py [--melems 1024] [--rate 0.03] [--batch 1024]

Prints, in GB/s of checkpoint (the bf16 bytes of the tensor):
* copy: a device-to-device copy of the tensor (the memory-bandwidth reference);
* device decode: ``decode_chunks`` of every segment's ulp2 payload (host table parse + one launch per
  batch and variant, staged positions and target bits), then the scatter into a device copy of the
  base; the result is checked bit for bit against the target;
* device encode: ``encode_chunks`` of every segment (counts, both variants, the used tails to the
  host); its payloads are checked against the host encoder's (``codec.ulp2.encode_ulp2``, where that
  module exists) on the first ``--check`` segments.
``scripts/gpu_check.py --ulp2`` and ``scripts/gpu_encode_check.py`` print the same rows. Exits 1 if a
check fails.

Without a GPU, a smoke run through Triton's interpreter:

    TRITON_INTERPRET=1 python scripts/gpu_ulp2_check.py --device cpu --melems 0.002 --batch 4 --reps 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))


def rows(device: str, elements: int, rate: float, batch: int, reps: int, check: int, say=print) -> bool:
    """Print the format-2 rows (see the module docstring); False if a check failed."""
    import numpy as np
    import torch

    from deltarefit.dtypes import dtype
    from deltarefit.gpu import ulp2 as U
    from deltarefit.integrity import SEGMENT_BYTES

    dev = torch.device(device)
    if not U.available(dev):
        say(f"format 2 rows skipped: the ulp2 kernels cannot run on {dev} "
            "(CUDA, or a CPU with TRITON_INTERPRET=1 set before the first import)")
        return True
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    dt = dtype("BF16")
    per = SEGMENT_BYTES // 2
    g = torch.Generator(device="cpu").manual_seed(7)
    base = (torch.randn(elements, generator=g) * 0.02).to(torch.bfloat16).view(torch.int16).to(dev)
    target = base.clone()
    k = max(1, int(elements * rate))
    idx = torch.randperm(elements, generator=g)[:k].to(dev)
    target[idx] += (torch.randint(0, 2, (k,), generator=g).to(dev) * 2 - 1).to(torch.int16)
    nseg = -(-elements // per)
    gb = elements * 2 / 1e9

    def best(fn) -> tuple[float, object]:
        out, t = None, float("inf")
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            out = fn()
            sync()
            t = min(t, time.perf_counter() - t0)
        return t, out

    dst = torch.empty_like(base)
    t_copy, _ = best(lambda: dst.copy_(base))
    say(f"format 2: {elements} bf16 elements ({nseg} segments), {rate:.1%} changed by +-1 ulp, on {dev}")
    say(f"copy            : {gb / t_copy:9.2f} GB/s")

    def encode_all():
        out = []
        for s0 in range(0, nseg, batch):
            lo, hi = s0 * per, min(elements, (s0 + batch) * per)
            out += U.encode_chunks(dt, base[lo:hi], target[lo:hi], per)
        return out

    t_enc, chunks = best(encode_all)
    total = sum(len(c.payload) for c in chunks if c is not None)
    say(f"device encode   : {gb / t_enc:9.2f} GB/s ({total} payload bytes, "
        f"{8 * total / max(k, 1):.2f} bits per change)")
    ok = True
    try:
        from deltarefit.codec.ulp2 import encode_ulp2
    except ImportError:
        say("host encoder comparison skipped: deltarefit.codec.ulp2 is not in this tree")
    else:
        bh, th = base.cpu().numpy().view(np.uint16), target.cpu().numpy().view(np.uint16)
        for s in range(min(check, nseg)):
            host = encode_ulp2(dt, bh[s * per:(s + 1) * per], th[s * per:(s + 1) * per])
            if host != chunks[s]:
                say(f"MISMATCH: segment {s}: device payload differs from the host encoder's")
                ok = False
        say(f"host encoder    : {'same bytes' if ok else 'DIFFERENT'} on {min(check, nseg)} segments")

    def decode_all():
        img = base.clone()
        for s0 in range(0, nseg, batch):
            items = [((s - s0) * per, min(per, elements - s * per), chunks[s].n_changed, chunks[s].payload)
                     for s in range(s0, min(nseg, s0 + batch)) if chunks[s] is not None]
            pos, val, offs, status = U.decode_chunks(dt, base[s0 * per:], items)
            if status.any():
                raise RuntimeError(f"device decode refused a chunk: status {status[status != 0][0]}")
            starts = torch.from_numpy(np.repeat([it[0] for it in items], np.diff(offs))).to(dev)
            img[s0 * per + starts + pos] = val
        return img

    t_dec, img = best(decode_all)
    same = bool(torch.equal(img, target))
    ok &= same
    say(f"device decode   : {gb / t_dec:9.2f} GB/s (decode + scatter; {'bit-exact' if same else 'WRONG BITS'};"
        f" {t_dec / t_copy:.1f}x a copy)")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--melems", type=float, default=1024.0, help="elements of the pair, in Mi (default 1024)")
    ap.add_argument("--rate", type=float, default=0.03)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=1024, help="segments per launch")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--check", type=int, default=8, help="segments compared with the host encoder")
    a = ap.parse_args()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible to torch; nothing to check")
        return 2
    ok = rows(a.device, max(1, int(a.melems * (1 << 20))), a.rate, a.batch, a.reps, a.check,
              say=lambda *x: print(*x, flush=True))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
