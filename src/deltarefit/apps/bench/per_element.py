"""Cost per changed element of an in-place refit, per core: decode, scatter, read-back and digest, beside
the fixed cost per refit, for the file, torch-tensor and engine-like targets.

``python -m deltarefit.apps.bench.per_element [--params 3.2e7] [--rates 0.01,0.035,0.05] [--reps 3]
[--formats 1,2] [--work DIR] [--json FILE]`` builds held-out-like synthetic bf16 pairs
(``pairs.make_synthetic_pair``, calibrated on the real AdamW step of the pretrained MiniLM at lr 3e-6, kept
in ``DIR/calibration.json``), one per rate, encodes each both ways (with additive digests) in each format
version asked for (FORMAT.md; 1: the serial range coder, 2: interleaved rANS lanes) and prints, on one
thread, per format:

* **stages**, each timed alone over every chunk of the delta (best of ``--reps`` passes), in ns per
  changed element: *decode* (``apply.host._decode``: the payload read and hash check, and the decoder),
  and per target what its apply does with each decoded chunk:

  - file and torch targets (segment hashes): *scatter*, the post-image built (a copy of the segment and
    the scatter into it); *read-back*, the segment compared with that image after the write; *digest*,
    BLAKE3 of the post-image. These are per segment, not per change: divided by the changes only to sit
    in the same table.
  - engine-like target (held additive digests, ``engines.vllm.worker.LiveEngine`` over a plain module,
    no vLLM): *decode* as its held-digest plan calls it (``host.held_decode``: the decoder takes the
    digest's move in its pass, where the tree has it); *scatter*, ``elements.put`` into the parameter;
    *read-back*, ``elements.equal_at``; *digest*, what is left of the digest's move after the decode
    (``additive.move``, old bits gathered and both mixed, where the decoder did not take it).

* **apply**, end to end with one thread (``deltarefit.apply`` of the file, ``apply_to_tensors``,
  ``LiveEngine.apply``), best of ``--reps`` forward and backward applies; and the fit of those times over
  the rates: fixed seconds per refit plus ns per changed element.

Stages are in-memory and cache-warm where the data fits; read them as the cost of one core's work, not
of a refit's wall time (which ``apply`` gives).

``--json FILE`` writes ``{"params", "kernels", "rows": [...], "detail": [...]}``: one row per (format, rate,
target), ``{"format", "rate", "target", "decode_ns", "apply_ns", "changed", "delta_bytes"}`` (ns per changed
element; ``apply_ns`` is the whole one-thread apply), and the full figures per format under ``detail``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

TARGETS = ("file", "torch", "engine")
STAGES = ("decode", "scatter", "read-back", "digest")


def _best(f, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def calibration(work: Path) -> Any:
    """The calibration of the real AdamW pair (MiniLM, lr 3e-6), made once into ``work``."""
    from .pairs import Calibration, calibrate, make_adamw_pairs
    from .report import CALIBRATION_LR

    path = work / "calibration.json"
    if not path.exists():
        pair = make_adamw_pairs(work / "adamw", (CALIBRATION_LR,))[0]
        calibrate(pair.base, pair.target).save(path)
    return Calibration.load(path)


def make_pairs(work: Path, params: float, rates: list[float], fmt: int = 2) -> list[dict[str, Any]]:
    """Per rate: the synthetic pair and its deltas both ways (with additive digests) in format version
    ``fmt``, made once."""
    from deltarefit import encode

    from .pairs import make_synthetic_pair

    cal = calibration(work)
    out = []
    for j, rate in enumerate(rates):
        tag = f"{int(params):.0e}".replace("+", "") + f"-{100 * rate:g}pct"
        base, target = work / f"synth_base_{tag}.safetensors", work / f"synth_target_{tag}.safetensors"
        if not target.exists():
            make_synthetic_pair(work, params, change_rate=rate, calibration=cal, seed=1000 * (j + 1))
        fwd, back = work / f"{tag}.f{fmt}.fwd.delta", work / f"{tag}.f{fmt}.back.delta"
        if not back.exists():
            encode(str(base), str(target), str(fwd), sums=True, format_version=fmt)
            encode(str(target), str(base), str(back), sums=True, format_version=fmt)
        out.append({"rate": rate, "tag": tag, "base": str(base), "target": str(target), "fwd": str(fwd),
                    "back": str(back), "format": fmt, "delta_bytes": os.path.getsize(fwd)})
    return out


def _chunks(delta: str, base: str) -> tuple[Any, list[tuple[Any, Any, np.ndarray]], int]:
    """(reader, [(entry, record, base segment view)], changed elements) of a delta over its base."""
    from deltarefit.format import DeltaReader
    from deltarefit.integrity import SEGMENT_BYTES

    from ._st import read_raw, tensor_index

    d = DeltaReader(delta)
    raw = {n: read_raw(i) for n, i in tensor_index(base).items()}
    out = []
    for e in d.tensors:
        flat = raw[e.name]
        per = SEGMENT_BYTES // flat.itemsize
        for r in d.chunks(e):
            out.append((e, r, flat[r.chunk_index * per:(r.chunk_index + 1) * per]))
    return d, out, sum(r.n_changed for _, r, _ in out)


def stages(delta: str, base: str, reps: int) -> dict[str, dict[str, float]]:
    """Seconds of each stage over every chunk of ``delta`` on this thread (module docstring), per target kind:
    "segments" (file and torch targets) and "held" (the engine-like target)."""
    from deltarefit.apply import host
    from deltarefit.apply.host import _changes, _decode, _moved, _patched_copy
    from deltarefit.codec import elements
    from deltarefit.integrity import seg_hash

    # The held-digest plan's decode and digest: where the decoder takes the digest's move in its pass
    # (``host.held_decode``), its decode does, and the digest stage is what is left of it.
    held_decode = host.held_decode(_decode) if hasattr(host, "held_decode") else _decode
    moved_by = getattr(host, "_moved_by", lambda e, r, v, patch, p, x: _moved(e, r, v, p, x))
    d, chunks, _ = _chunks(delta, base)
    with d:
        patches = [_decode(d, e, r, v) for e, r, v in chunks]
        dec = _best(lambda: [_decode(d, e, r, v) for e, r, v in chunks], reps)
        held_patches = [held_decode(d, e, r, v) for e, r, v in chunks]
        changes = [_changes(p, v) for p, (_, _, v) in zip(patches, chunks, strict=True)]
        images = [_patched_copy(v, p).copy() for p, (_, _, v) in zip(patches, chunks, strict=True)]
        dst = [v.copy() for _, _, v in chunks]  # the target's memory (a writable copy of each segment)
        seg = {
            "decode": dec,
            "scatter": _best(lambda: [_patched_copy(v, p) for p, (_, _, v) in zip(patches, chunks, strict=True)],
                             reps),
            "read-back": _best(lambda: [np.array_equal(a, b) for a, b in zip(dst, images, strict=True)], reps),
            "digest": _best(lambda: [seg_hash(img) for img in images], reps),
        }
        held = {
            "decode": _best(lambda: [held_decode(d, e, r, v) for e, r, v in chunks], reps),
            "scatter": _best(lambda: [elements.put(t, p, x) for t, (p, x) in zip(dst, changes, strict=True)], reps),
            "read-back": _best(lambda: [elements.equal_at(t, p, x) for t, (p, x) in zip(dst, changes, strict=True)],
                               reps),
            "digest": _best(lambda: [moved_by(e, r, v, hp, p, x) for (e, r, v), hp, (p, x)
                                     in zip(chunks, held_patches, changes, strict=True)], reps),
        }
    return {"segments": seg, "held": held}


class _Flat:
    """An engine-like model: one bf16 parameter per checkpoint tensor, loaded by copy (what
    ``LiveEngine`` captures without vLLM)."""

    def __new__(cls, base: str):
        import torch

        from ._st import tensor_index

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layers = torch.nn.ModuleDict()
                for name, info in tensor_index(base).items():
                    _, key, _ = name.split(".")
                    m = torch.nn.Module()
                    m.weight = torch.nn.Parameter(torch.zeros(info.shape, dtype=torch.bfloat16), requires_grad=False)
                    self.layers[key] = m

            def load_weights(self, weights) -> set[str]:
                params = dict(self.named_parameters())
                for name, w in weights:
                    params[name].data.copy_(w)
                return set()

        return Model()


def applies(p: dict[str, Any], work: Path, reps: int) -> dict[str, float]:
    """Best seconds of one apply on one thread, per target (forward and backward, alternating)."""
    import shutil

    from safetensors.torch import load_file

    import deltarefit
    from deltarefit.apply.tensors import apply_to_tensors
    from deltarefit.engines.vllm.worker import LiveEngine

    out: dict[str, float] = {}
    copy = work / "apply-copy.safetensors"
    shutil.copyfile(p["base"], copy)
    tensors = load_file(p["base"])
    ckdir = work / f"engine-{p['tag']}-f{p['format']}"
    ckdir.mkdir(exist_ok=True)
    if not (ckdir / "model.safetensors").exists():
        os.link(p["base"], ckdir / "model.safetensors")
    model = _Flat(p["base"])
    model.load_weights(load_file(p["base"]).items())  # what the engine serves before its first refit
    with _Torch1():
        eng = LiveEngine(model, None, str(ckdir), threads=1)
    def engine(delta: str) -> None:
        if eng.apply(delta).check != "held digests":
            raise RuntimeError(f"{delta}: the engine-like target did not check through its held digests")

    runs = {
        "file": lambda delta: deltarefit.apply(delta, str(copy), threads=1),
        "torch": lambda delta: apply_to_tensors(delta, tensors, threads=1),
        "engine": engine,
    }
    for kind, run in runs.items():
        best = float("inf")
        for _ in range(reps):
            for delta in (p["fwd"], p["back"]):
                t = time.perf_counter()
                run(delta)
                best = min(best, time.perf_counter() - t)
        out[kind] = best
    return out


class _Torch1:
    """torch on one intra-op thread meanwhile (the engine's capture copies tensors)."""

    def __enter__(self) -> None:
        import torch

        self.was = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.set_num_threads(self.was)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (xs, ys)."""
    a = np.vstack([np.ones(len(xs)), np.asarray(xs, float)]).T
    (c0, c1), *_ = np.linalg.lstsq(a, np.asarray(ys, float), rcond=None)
    return float(c0), float(c1)


def run_format(params: float, rates: list[float], reps: int, work: Path, fmt: int) -> dict[str, Any]:
    """The figures of one format version (module docstring)."""
    from deltarefit.codec.native import kernels_in_use

    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for p in make_pairs(work, params, rates, fmt):
        _, _, changed = _chunks(p["fwd"], p["base"])
        st = stages(p["fwd"], p["base"], reps)
        ap = applies(p, work, reps)
        rows.append({"rate": p["rate"], "changed": changed, "stages": st, "apply": ap,
                     "delta_bytes": p["delta_bytes"]})
    fits = {k: fit([r["changed"] for r in rows], [r["apply"][k] for r in rows]) for k in TARGETS}
    return {"format": fmt, "params": int(params), "kernels": kernels_in_use(), "rows": rows, "fits": fits}


def run(params: float, rates: list[float], reps: int, work: Path, formats: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    """Every format's figures, and the flat rows ``--json`` writes (module docstring)."""
    detail = [run_format(params, rates, reps, work, fmt) for fmt in formats]
    return {"params": int(params), "kernels": detail[0]["kernels"], "rows": flat_rows(detail), "detail": detail}


def flat_rows(detail: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows ``--json`` writes, one per (format, rate, target), from ``run_format``'s results."""
    flat = []
    for res in detail:
        for r in res["rows"]:
            m = r["changed"]
            for kind in TARGETS:
                st = r["stages"]["held" if kind == "engine" else "segments"]
                flat.append({"format": res["format"], "rate": r["rate"], "target": "engine-like" if kind == "engine"
                             else kind, "decode_ns": 1e9 * st["decode"] / m, "apply_ns": 1e9 * r["apply"][kind] / m,
                             "changed": m, "delta_bytes": r["delta_bytes"]})
    return flat


def render(res: dict[str, Any]) -> str:
    out = [render_format(d) for d in res["detail"]]
    if len(res["detail"]) > 1:
        out.append(render_ratios(res))
    return "\n\n".join(out)


def render_ratios(res: dict[str, Any]) -> str:
    """Each later format against the first, per rate and target: decode and apply speed-ups, delta size."""
    first = res["detail"][0]["format"]
    by = {(r["format"], r["rate"], r["target"]): r for r in res["rows"]}
    lines = [f"against format {first}: decode and apply speed-up per changed element, delta size"]
    for d in res["detail"][1:]:
        for r in d["rows"]:
            for kind in TARGETS:
                t = "engine-like" if kind == "engine" else kind
                a, b = by[(first, r["rate"], t)], by[(d["format"], r["rate"], t)]
                lines.append(f"  format {d['format']} {100 * r['rate']:5.2f}% {t:<11} decode {a['decode_ns']:6.2f} -> "
                             f"{b['decode_ns']:6.2f} ns ({a['decode_ns'] / b['decode_ns']:4.1f}x)  apply "
                             f"{a['apply_ns']:6.2f} -> {b['apply_ns']:6.2f} ns ({a['apply_ns'] / b['apply_ns']:4.1f}x)  "
                             f"size {b['delta_bytes'] / a['delta_bytes']:.4f}x")
    return "\n".join(lines)


def render_format(res: dict[str, Any]) -> str:
    lines = [f"format {res['format']}: {res['params']:,} bf16 parameters per pair; {res['kernels']}; one thread; "
             "ns per changed element"]
    head = f"  {'target':<7} {'changed':>8} {'elements':>11} " + " ".join(f"{s:>9}" for s in STAGES) + \
        f" {'sum':>7} {'apply':>9} {'apply/chg':>9}"
    lines.append(head)
    for r in res["rows"]:
        m = r["changed"]
        for kind in TARGETS:
            st = r["stages"]["held" if kind == "engine" else "segments"]
            ns = [1e9 * st[s] / m for s in STAGES]
            a = r["apply"][kind]
            lines.append(f"  {kind:<7} {100 * r['rate']:7.2f}% {m:>11,} " + " ".join(f"{x:9.2f}" for x in ns) +
                         f" {sum(ns):7.2f} {a:8.3f}s {1e9 * a / m:9.2f}")
    lines.append("  apply fitted over the rates: fixed seconds per refit + ns per changed element")
    for kind in TARGETS:
        c0, c1 = res["fits"][kind]
        lines.append(f"  {kind:<7} {c0:7.3f} s + {1e9 * c1:6.2f} ns per changed element")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.bench.per_element",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=3.2e7, help="bf16 parameters per pair (default 3.2e7)")
    ap.add_argument("--rates", default="0.01,0.035,0.05", help="fractions changed (default 0.01,0.035,0.05)")
    ap.add_argument("--reps", type=int, default=3, help="timed passes per figure, best taken (default 3)")
    ap.add_argument("--formats", default="1,2", help="format versions to run, the first the baseline (default 1,2)")
    ap.add_argument("--work", default=None, help="pairs and deltas, kept for reruns (default: a private temp "
                    "directory, removed)")
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args(argv)
    import tempfile

    formats = tuple(int(x) for x in a.formats.split(","))
    with tempfile.TemporaryDirectory(prefix="deltarefit-per-element-") as tmp:
        res = run(a.params, [float(x) for x in a.rates.split(",")], a.reps, Path(a.work or tmp), formats)
    print(render(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
