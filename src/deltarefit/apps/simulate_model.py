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

Pure arithmetic: nothing here reads a file, measures or prints. The published figures the model is
checked against are in ``simulate_refs``; ``deltarefit simulate`` (``simulate.run``) prints and plots it.
"""

from __future__ import annotations

import math
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
ENGINE_ELEMENTS, ENGINE_THREADS, ENGINE_FIXED_S, ENGINE_CHANGE_NS = 124.7e6, 2, 0.08, 20.5
ENGINE_ELEMENT_NS_CORE = ENGINE_FIXED_S * ENGINE_THREADS / ENGINE_ELEMENTS * 1e9
ENGINE_CHANGE_NS_CORE = ENGINE_CHANGE_NS * ENGINE_THREADS


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
