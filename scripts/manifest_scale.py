"""What a large real model's delta manifest costs: expanded and compressed size, the reader's memory
budget (FORMAT.md, "Memory before trust") against what it charges and what it actually keeps.

``PYTHONPATH=src python scripts/manifest_scale.py [--tensors 1000000] [--sums] [--op same|patch]``
writes, with ``DeltaWriter``, the manifest of an MoE model's tensors (``model.layers.L.mlp.experts.E.
{gate,up,down}_proj.weight`` and their FP8 ``weight_scale_inv``, attention and norms, 61 layers;
256 experts a layer give about 95k tensors, the count follows ``--tensors``), every tensor with its own
random digest (as real ones have), and reads it back with ``DeltaReader`` under tracemalloc. ``--op
patch`` gives every tensor one chunk record (a delta that changes every tensor), ``same`` none (the
densest manifest: nothing but names and digests). Prints the figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import tracemalloc

from deltarefit import format as fmt
from deltarefit.integrity import fingerprint_from_digests


def names(n: int) -> list[str]:
    out: list[str] = []
    layers = 61
    experts = max(1, (n // layers - 12) // 6)
    for layer in range(layers):
        p = f"model.layers.{layer}"
        out += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        out += [f"{p}.self_attn.{k}.weight" for k in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                       "o_proj", "q_a_layernorm", "kv_a_layernorm")]
        out += [f"{p}.mlp.gate.weight", f"{p}.mlp.gate.e_score_correction_bias", f"{p}.mlp.shared_experts.weight"]
        for e in range(experts):
            for w in ("down_proj", "gate_proj", "up_proj"):
                out += [f"{p}.mlp.experts.{e}.{w}.weight", f"{p}.mlp.experts.{e}.{w}.weight_scale_inv"]
    return sorted(out[:n], key=lambda s: s.encode())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=1_000_000)
    ap.add_argument("--sums", action="store_true", help="additive digests too (a stream Publisher's default)")
    ap.add_argument("--op", choices=("same", "patch"), default="same")
    a = ap.parse_args(argv)
    ns = names(a.tensors)
    digests = {n: os.urandom(32) for n in ns}
    tensors = []
    for i, n in enumerate(ns):
        add = os.urandom(16) if a.sums else None
        base = fmt.TensorMeta("F8_E4M3", (2048, 7168), digests[n], add)
        target = base if a.op == "same" else fmt.TensorMeta("F8_E4M3", (2048, 7168), os.urandom(32), add)
        changed = 1 if a.op == "patch" else 0
        tensors.append(fmt.TensorEntry(n, a.op, base, target, changed, i * changed, changed).to_json())
    tfp = fingerprint_from_digests({t["name"]: bytes.fromhex(t["target"]["digest"]) for t in tensors})
    man = {"format": "deltarefit.delta", "version": fmt.VERSION, "segment_bytes": 1 << 20, "hash": "blake3-128",
           "base_fingerprint": fingerprint_from_digests(digests), "target_fingerprint": tfp, "tensors": tensors,
           "stats": {}}
    with tempfile.TemporaryDirectory(prefix="deltarefit-scale-") as tmp:
        path = os.path.join(tmp, "m.delta")
        w = fmt.DeltaWriter(path, durable=False)
        for i in range(len(ns) if a.op == "patch" else 0):
            w.add_chunk(i, 0, 4, 1, b"x", 0, bytes(16), bytes(16))
        t0 = time.perf_counter()
        w.finish(man)
        t_write = time.perf_counter() - t0
        text = len(fmt.writer.json.dumps(man, separators=(",", ":"), sort_keys=True))
        del man, tensors
        with open(path, "rb") as f:
            head = fmt.HEADER.unpack(f.read(fmt.HEADER_SIZE))
        man_len, tab_len = head[7], head[9]
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            r = fmt.DeltaReader(path)
            err = ""
        except Exception as e:
            r, err = None, f"{type(e).__name__}: {e}"
        t_read = time.perf_counter() - t0
        kept, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        budget = fmt.memory_budget(man_len + tab_len)
    mib = 1 << 20
    print(f"{len(ns)} tensors, op {a.op}, sums {a.sums}: manifest {text / mib:.1f} MiB of text, {man_len / mib:.1f} MiB "
          f"compressed ({text / man_len:.1f}:1, limit {fmt.manifest_limit(man_len) / mib:.0f} MiB); table "
          f"{tab_len / mib:.1f} MiB")
    print(f"reader: budget {budget / mib:.0f} MiB (32 MiB + 32 x {(man_len + tab_len) / mib:.1f} MiB), kept "
          f"{kept / mib:.0f} MiB, traced peak {peak / mib:.0f} MiB; write {t_write:.1f} s, read {t_read:.1f} s "
          f"{'OK' if r else err}")
    return 0 if r else 1


if __name__ == "__main__":
    sys.exit(main())
