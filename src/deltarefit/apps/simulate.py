"""A refit-time model: how long it takes to bring rollout nodes to the trainer's new weights at scale,
shipping the full bf16 checkpoint or a bit-exact delta, through object storage or a relay tree.

Model (all sizes in bytes, rates in bytes/s, ``GB`` = 1e9 B, link figures in Gbit/s):

* Full checkpoint ``S = 2 P`` (bf16). Delta ``D = S / R(c)``: ``R`` is the codec's compression ratio
  at change rate ``c``; by default interpolated in log-log space over our measured ratios
  (``BENCH_RATIOS``, from docs/BENCHMARKS.md), extrapolated past them along the end segments.
* Encode: the trainer's ``shards`` each encode their slice on ``encode_cores`` cores:
  ``encode = S / (shards * encode_cores * encode_rate_per_core)``. Apply: every rollout replica is
  sharded the same way and applies in place on ``apply_cores`` cores per shard. Into a live engine
  (``rollout="engine"``, the default: docs/ENGINES.md) each element costs ``e`` core-ns (the decoder's
  pass over the base) and each changed element ``g`` more: ``apply = P * (e + c * g) / (shards *
  apply_cores)``. Into a checkpoint file (``rollout="file"``: hashes and rewrites its whole slice)
  ``apply = S / (shards * apply_cores * apply_rate_per_core)``. A delta refit runs encode, transfer and apply one after the other (as
  ``deltarefit`` does: publish, then a staged sync); a full-checkpoint transfer has neither.
* Transfer of ``x`` bytes in chunks of ``C`` (streamed: a chunk moves on as soon as it has arrived):
  (a) object storage, upload once then every one of ``nodes`` downloads it, limited by the link ``L``
  between the clusters, each node's fabric link ``F`` and the store's aggregate throughput ``T``:
  ``max(x / min(L, T), nodes * x / min(nodes * F, T)) + C / min(L, T)``;
  (b) a pipelined relay tree (fan-out ``k``, depth ``h``: the levels below the root node): the root
  link once, then each level adds one chunk's latency, and the slowest link sets the pace:
  ``x / min(L, F) + C / L + h * C / F``.
* Crossover: on one flat fabric of bandwidth ``B`` (``L = F = B``, a single datacenter), a full-weight
  broadcast takes ``S / B`` and a delta refit ``encode + apply + D / B``: above
  ``B* = (S - D) / (encode + apply)`` the full weights win.

``deltarefit simulate --references`` reproduces the published figures (see ``references()``).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

GB = 1e9
MiB = 1 << 20

# -- calibration: measured here ---------------------------------------------------------------------
# docs/BENCHMARKS.md, produced by `python -m deltarefit.apps.bench --out /tmp/benchout --synthetic-params 1e8
# --synthetic-change-rate cal 0.035 --threads 2 --markdown docs/BENCHMARKS.md` on this project's 2-core CI machine (AMD EPYC, 23.5 GiB):
# real AdamW steps of the pretrained 22.7M-parameter MiniLM, bf16. Compression ratio (raw bytes / shipped
# bytes) per change rate, for our codec and for our re-implementation of the NeMo-RL and TRL codecs.
BENCH_RATIOS: dict[str, tuple[tuple[float, float], ...]] = {
    "ours": ((0.0061, 316.4), (0.0154, 155.0), (0.0354, 79.4), (0.0400, 71.7)),
    "nemo": ((0.0061, 171.0), (0.0154, 75.6), (0.0354, 36.9), (0.0400, 33.3)),
    "trl": ((0.0061, 69.2), (0.0154, 27.9), (0.0354, 12.3), (0.0400, 11.0)),
}
# Encode and apply throughput (GB/s of raw checkpoint bytes) of the same benchmark with 2 threads on the
# 3.54% pair: encode 0.71, apply 0.56 (0.62-1.34 and 0.49-1.10 over all pairs). Per core: divided by 2.
ENCODE_GBPS_PER_CORE = 0.71 / 2
APPLY_GBPS_PER_CORE = 0.56 / 2
# The engine update step (docs/ENGINES.md, `python -m deltarefit.apps.bench.engine`, same machine): refitting
# a live vLLM engine in place (prepack off, the GPU layout; checked by held digests) on ENGINE_THREADS
# apply threads costs ENGINE_FIXED_S over its ENGINE_ELEMENTS checkpoint elements (the decoder's pass
# over the base) plus ENGINE_CHANGE_NS per changed element (the line the benchmark fits through every
# in-place apply). Per core:
ENGINE_ELEMENTS, ENGINE_THREADS, ENGINE_FIXED_S, ENGINE_CHANGE_NS = 124.7e6, 2, 0.11, 40.3
ENGINE_ELEMENT_NS_CORE = ENGINE_FIXED_S * ENGINE_THREADS / ENGINE_ELEMENTS * 1e9
ENGINE_CHANGE_NS_CORE = ENGINE_CHANGE_NS * ENGINE_THREADS

# -- published reference figures (../shared/REFERENCES.md) -------------------------------------------
# NeMo-DCR (arXiv 2610.08430): 1T parameters at 3% changed, 150 s against 87.5 min for the full checkpoint.
DCR_PARAMS, DCR_CHANGE, DCR_DELTA_S, DCR_FULL_S = 1e12, 0.03, 150.0, 87.5 * 60
# NVIDIA-NeMo/RL sparse-delta refit (docs/design-docs/sparse-delta-refit.md and
# tools/refit_bandwidth_calculator.py): 247.2 GB canonical HF checkpoint, 512 MiB wire buckets, 32 producers,
# balanced binary relay tree; measured end to end at 3% and 5% changed, with the measured zstd wire bytes.
NEMO_RL_BYTES = 247.2e9
NEMO_RL_PRODUCERS = 32
NEMO_RL_CHUNK = 512 * MiB
NEMO_RL_S3_S = (20.234, 25.790)
NEMO_RL_RELAY_S = (24.095, 33.776)
NEMO_RL_S3_WIRE = (5.858e9, 9.765e9)
NEMO_RL_RELAY_WIRE = (5.608e9, 9.346e9)
# MoonshotAI/checkpoint-engine: full-weight update of 1T (Kimi-K2) in about 16-20 s inside one datacenter.
CKPT_ENGINE_PARAMS, CKPT_ENGINE_S = 1e12, (16.0, 20.0)


def gbit(gbps: float) -> float:
    """Gbit/s -> bytes/s."""
    return gbps * 1e9 / 8


def interp_ratio(change: float, codec: str = "ours") -> float:
    """Compression ratio at ``change`` (a fraction): piecewise linear in log(ratio) over log(change)."""
    if change <= 0:
        raise ValueError(f"change rate must be > 0, got {change}")
    pts = BENCH_RATIOS[codec]
    xs = [math.log(c) for c, _ in pts]
    ys = [math.log(r) for _, r in pts]
    x = math.log(change)
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(1.0, math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0)))


def tree_depth(nodes: int, fanout: int) -> int:
    """Levels below the root of a balanced tree of ``nodes`` with ``fanout`` children per node."""
    if nodes <= 1:
        return 0
    if fanout <= 1:
        return nodes - 1
    depth, reach, level = 0, 1, 1
    while reach < nodes:
        level *= fanout
        reach += level
        depth += 1
    return depth


@dataclass(frozen=True)
class Setup:
    params: float = 1e12  # model parameters (bf16: 2 bytes each)
    change: float = 0.03  # fraction of bf16 elements that change per step
    ratio: float | None = None  # compression ratio at ``change``; None: from BENCH_RATIOS[codec]
    codec: str = "ours"
    link_gbps: float = 25.0  # between the trainer's and the rollouts' clusters
    store_gbps: float = 400.0  # object storage, aggregate
    fabric_gbps: float = 400.0  # each rollout node's link inside its cluster (relay hops, downloads)
    nodes: int = 16  # rollout nodes (replicas), each needs the whole update
    fanout: int = 2  # relay tree fan-out
    shards: int = 64  # trainer shards encoding in parallel (a rollout replica is sharded alike)
    encode_cores: float = 8  # per shard
    apply_cores: float = 8  # per shard of a rollout replica
    encode_gbps_core: float = ENCODE_GBPS_PER_CORE
    apply_gbps_core: float = APPLY_GBPS_PER_CORE  # rollout="file"
    rollout: str = "engine"  # "engine": in place into a live engine; "file": into a checkpoint file
    engine_element_ns_core: float = ENGINE_ELEMENT_NS_CORE
    engine_change_ns_core: float = ENGINE_CHANGE_NS_CORE
    chunk_bytes: float = 512 * MiB
    bytes_per_param: float = 2.0

    @property
    def full_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def compression(self) -> float:
        return self.ratio if self.ratio is not None else interp_ratio(self.change, self.codec)


@dataclass
class Estimate:
    setup: Setup
    full_bytes: float
    delta_bytes: float
    ratio: float
    depth: int
    encode_s: float
    apply_s: float
    full_store_s: float  # full checkpoint through object storage (transfer only)
    full_relay_s: float  # full checkpoint through the relay tree (transfer only)
    delta_store_s: float  # encode + transfer through object storage + apply
    delta_relay_s: float  # encode + transfer through the relay tree + apply
    notes: list[str] = field(default_factory=list)

    @property
    def full_best_s(self) -> float:
        return min(self.full_store_s, self.full_relay_s)

    @property
    def delta_best_s(self) -> float:
        return min(self.delta_store_s, self.delta_relay_s)


def store_transfer_s(x: float, s: Setup) -> float:
    L, T, F = gbit(s.link_gbps), gbit(s.store_gbps), gbit(s.fabric_gbps)
    up = x / min(L, T)
    down = s.nodes * x / min(s.nodes * F, T)
    return max(up, down) + min(s.chunk_bytes, x) / min(L, T)


def relay_transfer_s(x: float, s: Setup) -> float:
    L, F = gbit(s.link_gbps), gbit(s.fabric_gbps)
    c = min(s.chunk_bytes, x)
    return x / min(L, F) + c / L + tree_depth(s.nodes, s.fanout) * c / F


def estimate(s: Setup) -> Estimate:
    S = s.full_bytes
    R = s.compression
    D = S / R
    enc = S / (s.shards * s.encode_cores * s.encode_gbps_core * GB)
    if s.rollout == "engine":
        per_param = (s.engine_element_ns_core + s.change * s.engine_change_ns_core) * 1e-9
        app = s.params * per_param / (s.shards * s.apply_cores)
    else:
        app = S / (s.shards * s.apply_cores * s.apply_gbps_core * GB)
    return Estimate(s, S, D, R, tree_depth(s.nodes, s.fanout), enc, app,
                    store_transfer_s(S, s), relay_transfer_s(S, s),
                    enc + store_transfer_s(D, s) + app, enc + relay_transfer_s(D, s) + app)


def flat(s: Setup, gbps: float) -> Setup:
    """The same setup on one flat fabric of ``gbps`` (the link between the clusters and inside them)."""
    return replace(s, link_gbps=gbps, fabric_gbps=gbps)


def crossover_gbps(s: Setup, lo: float = 0.01, hi: float = 1e6) -> float | None:
    """Flat-fabric bandwidth (Gbit/s) above which a full-weight broadcast beats the delta refit, both
    through the relay tree; None if one of them wins over the whole range."""

    def gap(g: float) -> float:
        e = estimate(flat(s, g))
        return e.delta_relay_s - e.full_relay_s

    if gap(lo) >= 0 or gap(hi) <= 0:
        return None
    a, b = math.log(lo), math.log(hi)
    for _ in range(200):
        m = (a + b) / 2
        if gap(math.exp(m)) < 0:
            a = m
        else:
            b = m
    return math.exp((a + b) / 2)


# -- the published references ------------------------------------------------------------------------


@dataclass
class Reference:
    name: str
    published_s: float
    setup: Setup
    path: str  # "full-relay", "delta-relay", "delta-store"
    how: str  # "derives ...", "fit", "predicted"
    ours_ratio: float | None = None  # our codec's ratio at the same change rate (None: not a delta row)

    def model_s(self, setup: Setup | None = None) -> float:
        e = estimate(setup or self.setup)
        return {"full-relay": e.full_relay_s, "delta-relay": e.delta_relay_s, "delta-store": e.delta_store_s,
                "full-store": e.full_store_s}[self.path]

    @property
    def error(self) -> float:
        return self.model_s() / self.published_s - 1

    def ours_s(self) -> float | None:
        if self.ours_ratio is None:
            return None
        return self.model_s(replace(self.setup, ratio=self.ours_ratio, codec="ours"))


@dataclass
class Derivation:
    dcr_link_gbps: float
    s3_link_gbps: float
    s3_fixed_s: float  # the size-proportional part of NeMo-RL's S3 figures (export, compare, encode, apply)
    cores_per_producer: float  # that part as cores of ours per producer
    relay_implied_gbps: float  # what NeMo-RL's relay figures alone imply (a cross-check, not used)
    nemo_ratios: dict[str, tuple[float, float]]
    lines: list[str]


def derive() -> Derivation:
    """What the published figures imply, under the stated assumptions."""
    lines: list[str] = []
    S_dcr = DCR_PARAMS * 2
    dcr_link = S_dcr * 8 / DCR_FULL_S / 1e9
    lines.append(f"NeMo-DCR: full 1T checkpoint ({S_dcr / GB:,.0f} GB bf16) in {DCR_FULL_S / 60:.1f} min over one "
                 f"transport-only path => link {dcr_link:.2f} Gbit/s ({S_dcr / DCR_FULL_S / GB:.3f} GB/s).")
    r3s, r5s = (NEMO_RL_BYTES / w for w in NEMO_RL_S3_WIRE)
    r3z, r5z = (NEMO_RL_BYTES / w for w in NEMO_RL_RELAY_WIRE)
    lines.append(f"NeMo-RL codec (measured wire bytes of 247.2 GB): {r3s:.1f}x / {r5s:.1f}x at 3% / 5% (S3), "
                 f"{r3z:.1f}x / {r5z:.1f}x (relay). Our codec at 3% / 5%: {interp_ratio(0.03):.1f}x / "
                 f"{interp_ratio(0.05):.1f}x (5%: extrapolated).")
    # S3: two points, t = fixed + (D + C) / B  ->  B from the slope, fixed from either point.
    (t3, t5), (d3, d5) = NEMO_RL_S3_S, NEMO_RL_S3_WIRE
    B = (d5 - d3) / (t5 - t3)
    fixed = t3 - (d3 + NEMO_RL_CHUNK) / B
    per_byte = 1 / (ENCODE_GBPS_PER_CORE * GB) + 1 / (APPLY_GBPS_PER_CORE * GB)
    cores = NEMO_RL_BYTES * per_byte / (NEMO_RL_PRODUCERS * fixed)
    lines.append(f"NeMo-RL S3: (5% - 3%) wire bytes / (5% - 3%) seconds => effective S3 path {B * 8 / 1e9:.2f} Gbit/s "
                 f"(their CRT client targets 10 Gbit/s); the rest, {fixed:.1f} s, scales with the checkpoint "
                 f"(export, compare, encode, apply) = {NEMO_RL_BYTES / fixed / GB:.1f} GB/s over {NEMO_RL_PRODUCERS} "
                 f"producers, i.e. {cores:.1f} of our cores per producer at our encode+apply rates.")
    (u3, u5), (w3, w5) = NEMO_RL_RELAY_S, NEMO_RL_RELAY_WIRE
    relay_gbps = (w5 - w3) / (u5 - u3) * 8 / 1e9
    lines.append(f"NeMo-RL relay: its own two points would imply {relay_gbps:.2f} Gbit/s at the root link; we do NOT "
                 f"fit it: the relay rows are predicted with NeMo-DCR's {dcr_link:.2f} Gbit/s link and the S3 rows' "
                 f"per-producer cost.")
    return Derivation(dcr_link, B * 8 / 1e9, fixed, cores, relay_gbps,
                      {"s3": (r3s, r5s), "relay": (r3z, r5z)}, lines)


def references() -> tuple[list[Reference], Derivation]:
    d = derive()
    nemo_params = NEMO_RL_BYTES / 2
    common = dict(encode_gbps_core=ENCODE_GBPS_PER_CORE, apply_gbps_core=APPLY_GBPS_PER_CORE, rollout="file",
                  encode_cores=d.cores_per_producer, apply_cores=d.cores_per_producer, chunk_bytes=NEMO_RL_CHUNK,
                  fabric_gbps=400.0, store_gbps=1e4)
    # NeMo-RL: 32 producers; 8 generation nodes assumed (not published; depth 3 of a binary tree, which
    # adds 3 chunk latencies at 400 Gbit/s: ~0.03 s, so the figure barely depends on it).
    s3 = Setup(params=nemo_params, shards=NEMO_RL_PRODUCERS, nodes=8, fanout=2, link_gbps=d.s3_link_gbps, **common)
    relay = replace(s3, link_gbps=d.dcr_link_gbps)
    # NeMo-DCR: point to point over the derived link; its codec's ratio is not published: NeMo-RL's measured
    # 3% ratio (the same XOR + zstd family; the paper's 35x end-to-end speedup bounds it from below);
    # producers scaled with the model from NeMo-RL's 32 for 123.6B, at the same per-producer cost.
    dcr = Setup(params=DCR_PARAMS, shards=round(NEMO_RL_PRODUCERS * DCR_PARAMS / nemo_params), nodes=1,
                link_gbps=d.dcr_link_gbps, **common)
    r_s3, r_relay = d.nemo_ratios["s3"], d.nemo_ratios["relay"]
    refs = [
        Reference("NeMo-DCR 1T full checkpoint, 3 Gbit/s", DCR_FULL_S, replace(dcr, change=DCR_CHANGE), "full-relay",
                  "derives the link"),
        Reference("NeMo-DCR 1T delta refit at 3%", DCR_DELTA_S, replace(dcr, change=0.03, ratio=r_s3[0]),
                  "delta-relay", "predicted", interp_ratio(0.03)),
        Reference("NeMo-RL 247.2 GB at 3%, S3", NEMO_RL_S3_S[0], replace(s3, change=0.03, ratio=r_s3[0]),
                  "delta-store", "fit (2 points)", interp_ratio(0.03)),
        Reference("NeMo-RL 247.2 GB at 5%, S3", NEMO_RL_S3_S[1], replace(s3, change=0.05, ratio=r_s3[1]),
                  "delta-store", "fit (2 points)", interp_ratio(0.05)),
        Reference("NeMo-RL 247.2 GB at 3%, relay tree", NEMO_RL_RELAY_S[0],
                  replace(relay, change=0.03, ratio=r_relay[0]), "delta-relay", "predicted", interp_ratio(0.03)),
        Reference("NeMo-RL 247.2 GB at 5%, relay tree", NEMO_RL_RELAY_S[1],
                  replace(relay, change=0.05, ratio=r_relay[1]), "delta-relay", "predicted", interp_ratio(0.05)),
    ]
    return refs, d


# -- calibration now -----------------------------------------------------------------------------------


def _write_bf16(path: str, tensors: dict[str, object]) -> None:
    import json

    import numpy as np

    header: dict[str, object] = {}
    off = 0
    for name, a in tensors.items():
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(np.uint64(len(h)).tobytes())
        f.write(h)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


def calibrate(*, change: float = 0.03, elements: int = 32 << 20, seed: int = 0) -> tuple[float, float, float]:
    """Measure (encode GB/s per core, apply GB/s per core, ratio) now, on one core each, on a synthetic
    bf16 pair: N(0, 0.02) weights, ``change`` of them moved by +-1 ulp (90%) or +-2..4 ulp."""
    import numpy as np

    from ..apply import apply
    from ..encode import encode

    rng = np.random.default_rng(seed)
    n_t = 8
    per = elements // n_t
    base, target = {}, {}
    for i in range(n_t):
        f = (rng.standard_normal(per, dtype=np.float32) * 0.02).view(np.uint32)
        b = ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even bf16
        t = b.copy()
        idx = np.flatnonzero(rng.random(per) < change)
        step = np.where(rng.random(idx.size) < 0.9, 1, rng.integers(2, 5, idx.size)).astype(np.int32)
        sign = np.where(rng.random(idx.size) < 0.5, -1, 1)
        mag = (b[idx] & 0x7FFF).astype(np.int32) + sign * step
        t[idx] = ((b[idx] & 0x8000) | np.clip(mag, 1, 0x7F7F)).astype(np.uint16)
        base[f"layer{i}.weight"] = b.reshape(-1, 1024)
        target[f"layer{i}.weight"] = t.reshape(-1, 1024)
    with tempfile.TemporaryDirectory(prefix="deltarefit-calibrate-") as d:
        bp, tp, dp = (os.path.join(d, n) for n in ("base.safetensors", "target.safetensors", "d.delta"))
        _write_bf16(bp, base)
        _write_bf16(tp, target)
        raw = sum(a.nbytes for a in target.values())
        encode(bp, tp, dp + ".warm", threads=1)  # JIT warm-up and page cache
        t = time.perf_counter()
        rep = encode(bp, tp, dp, threads=1)
        enc_s = time.perf_counter() - t
        t = time.perf_counter()
        apply(dp, bp, threads=1)
        app_s = time.perf_counter() - t
    return raw / enc_s / GB, raw / app_s / GB, rep.ratio


# -- presentation --------------------------------------------------------------------------------------


def parse_params(text: str) -> float:
    """'8B', '1T', '70e9', '123.6B' -> parameters."""
    t = text.strip().upper()
    mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:], 1.0)
    num = t[:-1] if t[-1:] in "KMBGT" else t
    v = float(num) * mult
    if not v > 0:
        raise ValueError(f"parameters must be > 0: {text!r}")
    return v


def fmt_params(p: float) -> str:
    return f"{p / 1e12:g}T" if p >= 1e12 else f"{p / 1e9:g}B"


def fmt_s(s: float) -> str:
    if s >= 3 * 3600:
        return f"{s / 3600:.1f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


def render_table(base: Setup, sizes: list[float]) -> tuple[list[str], list[list[str]]]:
    cols = ["model", "full GB", "delta GB", "ratio", "encode", "apply", "full: store", "full: relay",
            "delta: store", "delta: relay", "speed-up", "full wins above"]
    rows = []
    for p in sizes:
        s = replace(base, params=p)
        e = estimate(s)
        x = crossover_gbps(s)
        rows.append([fmt_params(p), f"{e.full_bytes / GB:,.0f}", f"{e.delta_bytes / GB:,.2f}", f"{e.ratio:.1f}x",
                     fmt_s(e.encode_s), fmt_s(e.apply_s), fmt_s(e.full_store_s), fmt_s(e.full_relay_s),
                     fmt_s(e.delta_store_s), fmt_s(e.delta_relay_s), f"{e.full_best_s / e.delta_best_s:.1f}x",
                     f"{x:,.0f} Gbit/s" if x else "never"])
    return cols, rows


def reference_table() -> tuple[list[str], list[list[str]], Derivation, list[Reference]]:
    refs, d = references()
    cols = ["reference", "published", "model (their ratio)", "error", "how", "their ratio", "ours: ratio",
            "ours: model"]
    rows = []
    for r in refs:
        ours = r.ours_s()
        rows.append([r.name, fmt_s(r.published_s), fmt_s(r.model_s()), f"{100 * r.error:+.1f}%", r.how,
                     f"{r.setup.compression:.1f}x" if r.path.startswith("delta") else "-",
                     f"{r.ours_ratio:.1f}x" if r.ours_ratio else "-", fmt_s(ours) if ours is not None else "-"])
    return cols, rows, d, refs


def plot(base: Setup, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(13, 5))
    gbps = [10 ** (i / 20) for i in range(0, 81)]  # 1 .. 10,000 Gbit/s
    nemo = replace(base, codec="nemo", ratio=None)
    ax[0].plot(gbps, [estimate(flat(base, g)).full_relay_s for g in gbps], label="full-weight broadcast")
    ax[0].plot(gbps, [estimate(flat(base, g)).delta_relay_s for g in gbps],
               label=f"delta refit, ours ({base.compression:.0f}x)")
    ax[0].plot(gbps, [estimate(flat(nemo, g)).delta_relay_s for g in gbps], "--",
               label=f"delta refit, NeMo-style ({nemo.compression:.0f}x)")
    x = crossover_gbps(base)
    if x:
        ax[0].axvline(x, color="grey", ls=":", label=f"crossover {x:,.0f} Gbit/s")
    if base.params == CKPT_ENGINE_PARAMS:
        ax[0].axhspan(*CKPT_ENGINE_S, color="tab:red", alpha=0.15, label="checkpoint-engine 1T: 16-20 s")
        ax[0].axvspan(*(base.full_bytes * 8 / t / 1e9 for t in reversed(CKPT_ENGINE_S)), color="tab:red", alpha=0.15)
    ax[0].set_xscale("log")
    ax[0].set_yscale("log")
    ax[0].set_xlabel("bandwidth between trainer and rollouts (Gbit/s, one flat fabric)")
    ax[0].set_ylabel("refit time (s)")
    ax[0].set_title(f"{fmt_params(base.params)} params, {100 * base.change:g}% changed, "
                    f"{base.nodes} rollout nodes")
    ax[0].legend(fontsize="small")
    changes = [10 ** (-2.5 + i / 20) for i in range(0, 31)]  # 0.3% .. 10%
    for codec, style in (("ours", "-"), ("nemo", "--")):
        for path_name, key in (("store", "delta_store_s"), ("relay", "delta_relay_s")):
            ax[1].plot([100 * c for c in changes],
                       [getattr(estimate(replace(base, change=c, codec=codec, ratio=None)), key) for c in changes],
                       style if path_name == "store" else style[:1] + ".", label=f"delta via {path_name}, {codec}")
    e = estimate(base)
    ax[1].axhline(e.full_store_s, color="black", lw=1, label="full checkpoint via store")
    ax[1].axhline(e.full_relay_s, color="grey", lw=1, label="full checkpoint via relay")
    ax[1].set_xscale("log")
    ax[1].set_yscale("log")
    ax[1].set_xlabel("bf16 elements changed per step (%)")
    ax[1].set_ylabel("refit time (s)")
    ax[1].set_title(f"link {base.link_gbps:g} Gbit/s between clusters")
    ax[1].legend(fontsize="small")
    for a in ax:
        a.grid(alpha=0.3, which="both")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _table(title: str, cols: list[str], rows: list[list[str]]):
    from rich.table import Table

    t = Table(title=title)
    for i, c in enumerate(cols):
        t.add_column(c, justify="left" if i == 0 or c == "how" else "right")
    for r in rows:
        t.add_row(*r)
    return t


def run(base: Setup, sizes: list[float], *, do_calibrate: bool = False, show_references: bool = False,
        plot_path: str | None = None) -> None:
    """What ``deltarefit simulate`` prints (and plots)."""
    from rich.console import Console

    out = Console(width=None if sys.stdout.isatty() else 160, highlight=False)
    if show_references:
        cols, rows, d, refs = reference_table()
        out.print("[bold]What the published figures imply[/] (assumptions stated; see deltarefit/apps/simulate.py)")
        for line in d.lines:
            out.print(f"  - {line}")
        out.print("  - Assumed, not published: NeMo-DCR's codec ratio = NeMo-RL's measured 3% ratio; 1T split over "
                  f"{refs[1].setup.shards} producers at NeMo-RL's per-producer cost; NeMo-RL's 8 generation nodes "
                  "(binary tree depth 3) and 400 Gbit/s in-cluster links; object-store throughput not limiting.")
        out.print(_table("Published refit figures reproduced by the model (their codec's ratio, their setup), and "
                         "ours on the same setup", cols, rows))
        worst = max(abs(r.error) for r in refs)
        out.print(f"largest deviation {100 * worst:.1f}%. 'fit' rows define parameters; 'predicted' rows use "
                  "parameters derived from other figures only.")
        S = CKPT_ENGINE_PARAMS * 2
        lo, hi = (S / t * 8 / 1e9 for t in reversed(CKPT_ENGINE_S))
        ours_1t = replace(refs[1].setup, ratio=interp_ratio(0.03), codec="ours")
        x = crossover_gbps(ours_1t)
        at = [estimate(flat(ours_1t, g)) for g in (hi, lo)]
        out.print(f"MoonshotAI/checkpoint-engine: 1T full weights in {CKPT_ENGINE_S[0]:g}-{CKPT_ENGINE_S[1]:g} s "
                  f"inside one datacenter = {lo:,.0f}-{hi:,.0f} Gbit/s effective ({lo / 400:.1f}-{hi / 400:.1f} "
                  f"links of 400 Gbit/s); the model gives {at[0].full_relay_s:.1f}-{at[1].full_relay_s:.1f} s there. "
                  f"On that fabric a delta refit of 1T at 3% on NeMo-DCR's setup with our codec takes "
                  f"{at[0].delta_relay_s:.1f}-{at[1].delta_relay_s:.1f} s; full weights win above "
                  f"{x:,.0f} Gbit/s (with encode + apply on 64 shards x 8 of our cores, the default setup, above "
                  f"{crossover_gbps(Setup(params=1e12)):,.0f} Gbit/s).")
        return
    if do_calibrate:
        enc, app, ratio = calibrate(change=base.change)
        out.print(f"calibrated now on a synthetic bf16 pair ({100 * base.change:g}% changed, {ratio:.1f}x): encode "
                  f"{enc:.3f} GB/s per core, apply {app:.3f} GB/s per core (defaults from docs/BENCHMARKS.md: "
                  f"{ENCODE_GBPS_PER_CORE:.3f} and {APPLY_GBPS_PER_CORE:.3f})")
        base = replace(base, encode_gbps_core=enc, apply_gbps_core=app)
        if base.rollout == "engine":
            out.print("(--calibrate measures the file apply; the engine apply keeps docs/ENGINES.md's figures)")
    src = (f"given ({base.ratio:g}x)" if base.ratio is not None else
           f"{base.codec} codec, interpolated over docs/BENCHMARKS.md at {100 * base.change:g}%")
    out.print(f"[bold]Refit-time model[/]: {100 * base.change:g}% of bf16 elements changed; ratio: {src}; link "
              f"{base.link_gbps:g} Gbit/s between clusters, {base.fabric_gbps:g} Gbit/s inside, object store "
              f"{base.store_gbps:g} Gbit/s aggregate; {base.nodes} rollout nodes, relay fan-out {base.fanout} (depth "
              f"{tree_depth(base.nodes, base.fanout)}); {base.shards} shards x {base.encode_cores:g} encode / "
              f"{base.apply_cores:g} apply cores; encode {base.encode_gbps_core:.3f} GB/s per core; " + (
                  f"apply into live engines (docs/ENGINES.md): {base.engine_element_ns_core:.2f} core-ns per element "
                  f"+ {base.engine_change_ns_core:.1f} per changed element" if base.rollout == "engine" else
                  f"apply into checkpoint files {base.apply_gbps_core:.3f} GB/s per core")
              + f"; {base.chunk_bytes / MiB:g} MiB chunks")
    cols, rows = render_table(base, sizes)
    out.print(_table("Refit time per step: full checkpoint (transfer only) vs delta (encode + transfer + apply)",
                     cols, rows))
    out.print("speed-up: fastest full / fastest delta. full wins above: the bandwidth of one flat fabric (between "
              "and inside the clusters) above which a full-weight broadcast beats the delta refit.")
    big = replace(base, params=max(sizes))
    x = crossover_gbps(big)
    e = estimate(big)
    lo, hi = (CKPT_ENGINE_PARAMS * 2 * 8 / t / 1e9 for t in reversed(CKPT_ENGINE_S))
    if x:
        out.print(f"crossover for {fmt_params(big.params)}: a full-weight broadcast wins above {x:,.0f} Gbit/s "
                  f"({x / 400:.1f} links of 400 Gbit/s), where S/B drops below the delta's encode + apply floor "
                  f"({fmt_s(e.encode_s + e.apply_s)}). MoonshotAI/checkpoint-engine moves 1T in 16-20 s inside one "
                  f"datacenter, i.e. {lo:,.0f}-{hi:,.0f} Gbit/s effective: "
                  + ("there, full weights win." if x < lo else "there, deltas still win." if x > hi else
                     "that is the crossover region."))
    else:
        out.print(f"no crossover for {fmt_params(big.params)} between 0.01 and 1e6 Gbit/s")
    if plot_path:
        try:
            plot(big, plot_path)
            out.print(f"plot: {plot_path}")
        except ImportError as ex:
            out.print(f"plot skipped (matplotlib missing: {ex}); pip install matplotlib")
