"""Chain mode of the benchmark: a version stream coded with and without its history (encoding 5).

    python -m deltarefit.apps.bench.chain CHAIN_DIR [CHAIN_DIR ...] [--markdown F] [--json F]

A chain directory holds ``v0.safetensors``, ``v1.safetensors``, ... (``bench.chains`` makes real
ones: AdamW steps of a pretrained model, RL steps of a causal LM). For each step ``t`` it reports:

* the delta without history (what ``deltarefit encode`` writes), and with it: the trainer's
  ``HistoryBook`` advanced after every step as a publisher's would be; sizes, ratios, how much
  smaller, and the encodings chosen;
* both encodes' wall time, and both verified applies' (each into its own copy of ``v{t-1}``, the
  history one through a rollout's book), so the speed cost of the history is measured on the same
  pair in the same run;
* two entropy bounds over the bf16 tensors (other dtypes as in ``bench.entropy``): H(D | base
  exponent, tensor), the memoryless bound of ``bench.entropy``, and H(D | base exponent, history
  state, tensor), the same with each element's history state (FORMAT.md, "Encoding 5") added to
  its context. Both are zeroth-order and free of model cost: a codec that adapts per chunk can
  beat them, and the per-chunk adaptation of encoding 1 often does.

The chain's versions are read one tensor at a time, but the states need the last three versions'
moves of every element, so this benchmark holds about a byte per element of the model: it is a
benchmark for models that fit a host, not a production path (which keeps its books on disk).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ._st import iter_pair
from .entropy import _xlog2x, bf16_tensor_bits, other_tensor_bits, ulp_distance


@dataclass
class StepResult:
    step: int
    changed_fraction: float
    full_bytes: int
    v1_bytes: int
    hist_bytes: int
    hist_chunks: int
    chunks: int
    encode_v1_s: float
    encode_hist_s: float
    apply_v1_s: float
    apply_hist_s: float
    bound_v1_bytes: float
    bound_hist_bytes: float

    @property
    def smaller(self) -> float:
        return 1 - self.hist_bytes / max(self.v1_bytes, 1)

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["smaller"] = self.smaller
        return d


@dataclass
class ChainResult:
    name: str
    n_params: int
    steps: list[StepResult] = field(default_factory=list)
    about: str = ""  # from the chain's chain.json (bench.chains), when it has one
    made_by: str = ""

    def steady(self, first: int = 3) -> StepResult | None:
        """Steps ``first`` on, summed (the history holds three versions from step 4 on; step 3 has two)."""
        rows = [s for s in self.steps if s.step >= first]
        if not rows:
            return None
        keys = ("full_bytes", "v1_bytes", "hist_bytes", "hist_chunks", "chunks", "encode_v1_s", "encode_hist_s",
                "apply_v1_s", "apply_hist_s", "bound_v1_bytes", "bound_hist_bytes")
        tot = {k: sum(getattr(s, k) for s in rows) for k in keys}
        cf = sum(s.changed_fraction for s in rows) / len(rows)
        return StepResult(first, cf, **tot)


def chain_paths(d: str) -> list[str]:
    vs = sorted((int(f[1:-12]), f) for f in os.listdir(d) if f.startswith("v") and f.endswith(".safetensors"))
    if len(vs) < 2 or [v for v, _ in vs] != list(range(len(vs))):
        raise SystemExit(f"{d}: expected v0.safetensors, v1.safetensors, ... (at least two)")
    return [os.path.join(d, f) for _, f in vs]


def _states_of(sig: list[np.ndarray]) -> np.ndarray:
    """History states (``codec.history.STATE_TABLE`` low bits) from the last moves, newest first."""
    from ...codec.history import DEPTH, STATE_TABLE

    s = [sig[i] if i < len(sig) else np.zeros_like(sig[0]) for i in range(DEPTH)]
    idx = (s[0].astype(np.int64) + 1) * 9 + (s[1].astype(np.int64) + 1) * 3 + (s[2].astype(np.int64) + 1)
    return (STATE_TABLE[idx] & 127).astype(np.int64)


def hist_tensor_bits(b: np.ndarray, t: np.ndarray, states: np.ndarray) -> float:
    """``sum_c n_c * H(D | c)`` for one bf16 tensor, context c = (base exponent, history state)."""
    b, t = b.ravel(), t.ravel()
    c = ((b >> 7) & 0xFF).astype(np.int64) + 256 * states
    n_c = np.bincount(c, minlength=256 * 8)
    changed = b != t
    if not changed.any():
        return 0.0
    cc = c[changed]
    d = ulp_distance(b[changed], t[changed]).astype(np.int64)
    _, cnt = np.unique((cc << 18) | (d + (1 << 17)), return_counts=True)
    zeros = n_c - np.bincount(cc, minlength=256 * 8)
    return max(0.0, _xlog2x(n_c) - _xlog2x(cnt) - _xlog2x(zeros))


def _encodings(path: str) -> tuple[int, int]:
    from ...codec.chunk import HIST_ENCODINGS
    from ...format import DeltaReader

    with DeltaReader(path) as r:
        recs = [c for e in r.tensors for c in r.chunks(e)]
    return sum(c.encoding in HIST_ENCODINGS for c in recs), len(recs)


def run_chain(d: str, *, threads: int | None = None, log=print) -> ChainResult:
    from ... import apply as apply_mod
    from ... import encode as encode_mod
    from ...history_book import HistoryBook

    paths = chain_paths(d)
    res = ChainResult(os.path.basename(os.path.normpath(d)), 0)
    meta_path = os.path.join(d, "chain.json")
    if os.path.exists(meta_path):
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        kind = "rl" if "rl" in str(meta.get("name", "")) else "adamw"
        res.about = (f"A real {'GRPO run of a small causal LM' if kind == 'rl' else 'AdamW run of the pretrained MiniLM'}"
                     f", lr {meta.get('lr')}, {len(paths)} versions.")
        res.made_by = (f"python -m deltarefit.apps.bench.chains DIR --kind {kind} --lr {meta.get('lr')} "
                       f"--versions {len(paths)}")
    moves: dict[str, list[np.ndarray]] = {}  # per bf16 tensor: signs of the last moves, newest first
    with tempfile.TemporaryDirectory(prefix="bench-chain-") as w:
        tbook, rbook = HistoryBook(os.path.join(w, "tbook")), HistoryBook(os.path.join(w, "rbook"))
        roll_h, roll_p = os.path.join(w, "roll_h.safetensors"), os.path.join(w, "roll_p.safetensors")
        shutil.copy(paths[0], roll_h)
        shutil.copy(paths[0], roll_p)
        for t in range(1, len(paths)):
            base, target = paths[t - 1], paths[t]
            dp, dh = os.path.join(w, f"p{t}.delta"), os.path.join(w, f"h{t}.delta")
            t0 = time.perf_counter()
            rp = encode_mod.encode(base, target, dp, threads=threads, durable=False)
            t1 = time.perf_counter()
            rh = encode_mod.encode(base, target, dh, threads=threads, durable=False, history=tbook)
            t2 = time.perf_counter()
            tbook.commit(rh.target_fingerprint, rh.moves, parent=rh.base_fingerprint, durable=False)
            t3 = time.perf_counter()
            apply_mod.apply(dp, roll_p, threads=threads)
            t4 = time.perf_counter()
            apply_mod.apply(dh, roll_h, threads=threads, history=rbook)
            t5 = time.perf_counter()
            bv1 = bh = 0.0
            for info, b, tt in iter_pair(base, target):
                if info.dtype != "BF16":
                    x = other_tensor_bits(b, tt)
                    bv1 += x
                    bh += x
                    continue
                sig = moves.get(info.name, [])
                bv1 += bf16_tensor_bits(b, tt)
                bh += hist_tensor_bits(b, tt, _states_of(sig)) if sig else bf16_tensor_bits(b, tt)
                dd = np.sign(ulp_distance(b.ravel(), tt.ravel())).astype(np.int8)
                moves[info.name] = [dd, *sig][:3]
            if t == 1:
                res.n_params = rp.total_elements
            nh, nc = _encodings(dh)
            s = StepResult(t, rp.changed_fraction, rp.full_bytes, rp.delta_bytes, rh.delta_bytes, nh, nc,
                           t1 - t0, (t2 - t1) + (t3 - t2), t4 - t3, t5 - t4, bv1 / 8, bh / 8)
            res.steps.append(s)
            log(f"{res.name} step {t}: {100 * s.changed_fraction:.2f}% changed; v1 {s.v1_bytes:,} B "
                f"({s.full_bytes / s.v1_bytes:.1f}x), history {s.hist_bytes:,} B ({s.full_bytes / s.hist_bytes:.1f}x, "
                f"{100 * s.smaller:+.1f}% smaller, {nh}/{nc} chunks ulp_hist); bounds {s.bound_v1_bytes:,.0f} / "
                f"{s.bound_hist_bytes:,.0f} B; encode {s.encode_v1_s:.2f} / {s.encode_hist_s:.2f} s, "
                f"apply {s.apply_v1_s:.2f} / {s.apply_hist_s:.2f} s")
        for a, b in ((roll_p, paths[-1]), (roll_h, paths[-1])):
            if not all(np.array_equal(x, y) for _, x, y in iter_pair(a, b)):
                raise SystemExit(f"{a}: not bit-equal to {b} after the chain")
    return res


def markdown(results: list[ChainResult], command: str, machine: str) -> str:
    out = ["# Version chains coded with their history (encoding 5)", "",
           f"Produced by `{command}` on {machine}. Every step's two deltas were applied, verified, into their "
           "own copies of the chain's first version, and both copies were bit-equal to the last version at "
           "the end. Sizes are delta files; bounds are H(D | exponent, tensor) and H(D | exponent, history "
           "state, tensor) (module docstring of `deltarefit.apps.bench.chain`). Times are wall seconds of "
           "the library calls (the history encode includes its book's commit).", ""]
    for r in results:
        how = f" Made by `{r.made_by}`." if r.made_by else ""
        out += [f"## {r.name} ({r.n_params / 1e6:.1f}M parameters)", "", f"{r.about}{how}".strip(), "",
                "| step | changed | v1 bytes (x) | history bytes (x) | smaller | ulp_hist chunks | bound v1 | "
                "bound history | encode v1 / hist s | apply v1 / hist s |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        rows = list(r.steps)
        st = r.steady()
        for s in [*rows, *([st] if st else [])]:
            label = str(s.step) if s in rows else f"{st.step}+ (sum)"
            out.append(f"| {label} | {100 * s.changed_fraction:.2f}% | {s.v1_bytes:,} ({s.full_bytes / s.v1_bytes:.1f}x) | "
                       f"{s.hist_bytes:,} ({s.full_bytes / s.hist_bytes:.1f}x) | {100 * s.smaller:.1f}% | "
                       f"{s.hist_chunks}/{s.chunks} | {s.bound_v1_bytes:,.0f} | {s.bound_hist_bytes:,.0f} | "
                       f"{s.encode_v1_s:.2f} / {s.encode_hist_s:.2f} | {s.apply_v1_s:.2f} / {s.apply_hist_s:.2f} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("chains", nargs="+")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--machine", default="this machine")
    a = ap.parse_args(argv)
    results = [run_chain(d, threads=a.threads) for d in a.chains]
    cmd = "python -m deltarefit.apps.bench.chain " + shlex.join(argv if argv is not None else sys.argv[1:])
    if a.markdown:
        with open(a.markdown, "w", encoding="utf-8") as f:
            f.write(markdown(results, cmd, a.machine) + "\n")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump([{"name": r.name, "n_params": r.n_params, "steps": [s.to_dict() for s in r.steps]}
                       for r in results], f, indent=1)


if __name__ == "__main__":
    main()
