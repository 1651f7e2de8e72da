"""One worker of ``deltarefit.apps.bench.live_tp`` (run as ``python -m deltarefit.apps.bench.live_tp_worker
JSON``): holds its tensor-parallel slices of the benchmark's checkpoint in a torch module, as an
engine's loader leaves them, and times held-digest refits of them in place through a collective
``LiveTarget`` over a real gloo group on loopback, against a full reload of the target's slices.

argv[1] is a JSON object: rank, world, port, dir (the benchmark's directory: ``base/``, per rate
``<rate>/target/``, ``<rate>/fwd.delta`` and ``<rate>/back.delta``), rates, repeat, threads, and out
(rank 0 writes its results there as JSON).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time

# Tensors split by rows (column-parallel: each worker its rows) and by columns (row-parallel).
COLUMN_PARALLEL = ("q_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def _split_dim(name: str) -> int | None:
    """0 (rows), 1 (columns) or None (replicated) for a checkpoint tensor of the benchmark's model."""
    kind = name.rsplit(".", 2)[-2]
    return 0 if kind in COLUMN_PARALLEL else 1 if kind in ROW_PARALLEL else None


def main(argv: list[str]) -> int:
    import numpy as np
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from ...apply.protocol import commit, plan_apply, run_apply
    from ...apply.tensors import _TorchTarget
    from ...engines.capture import capture_layout, placed_params
    from ...engines.live import TargetUnion, state_through
    from ...engines.vllm.worker import _Group
    from ...format import DeltaReader

    a = json.loads(argv[1])
    rank, world = a["rank"], a["world"]
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a['port']}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
    barrier = dist.barrier if world > 1 else (lambda: None)
    base = load_file(os.path.join(a["dir"], "base", "model.safetensors"))
    specs = {n: (t.dtype, tuple(t.shape)) for n, t in base.items()}

    class Slices(torch.nn.Module):
        """Each checkpoint tensor as this worker's slice of it (a parameter per tensor)."""

        def __init__(self) -> None:
            super().__init__()
            self.keys = sorted(specs)
            for i, n in enumerate(self.keys):
                shape = list(specs[n][1])
                d = _split_dim(n)
                if d is not None:
                    shape[d] //= world
                self.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(shape, dtype=specs[n][0]),
                                                                    requires_grad=False))

        def load_weights(self, weights) -> None:
            for name, w in weights:
                d = _split_dim(name)
                if d is not None:
                    n = w.shape[d] // world
                    getattr(self, f"p{self.keys.index(name)}").data.copy_(w.narrow(d, rank * n, n))
                else:
                    getattr(self, f"p{self.keys.index(name)}").data.copy_(w)

    m = Slices()
    with torch.no_grad():
        m.load_weights(base.items())
    del base
    params = dict(m.named_parameters())
    lay = capture_layout(m.load_weights, params, specs)
    params = placed_params(params, lay.placements)
    group = _Group(dist.group.WORLD if world > 1 else None)
    names = sorted(specs)
    shared = {n for n in names if _split_dim(n) is not None} if world > 1 else set()
    live = group.target(params, {n: lay.placements[n] for n in names},
                        {n: ("BF16", specs[n][1]) for n in names}, shared)
    union = TargetUnion(live, _TorchTarget({}))
    sums = {n: state_through(union, n)[1] for n in names}

    def refit(path: str) -> tuple[float, object]:
        barrier()
        t0 = time.perf_counter()
        with DeltaReader(path) as d:
            rep = run_apply(d, union, journal=None, threads=a["threads"], held=sums)
        barrier()
        sums.update(rep.sums)
        return time.perf_counter() - t0, rep

    def ahead(path: str) -> float:
        """One process: planned ahead (``plan_apply``, untimed), then the update alone (``commit``, which
        reads the changed elements again before writing): what an engine that plans while it serves pauses."""
        with DeltaReader(path) as d:
            prep = plan_apply(d, union, journal=None, threads=a["threads"], held=sums, ahead=True)
            t0 = time.perf_counter()
            rep = commit(prep, recheck=True)
            dt = time.perf_counter() - t0
        sums.update(rep.sums)
        return dt

    def reload(ckpt: str) -> float:
        barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            m.load_weights(load_file(os.path.join(ckpt, "model.safetensors")).items())
        barrier()
        return time.perf_counter() - t0

    out = []
    for rate in a["rates"]:
        rd = os.path.join(a["dir"], f"{rate:g}")
        fwd, back = os.path.join(rd, "fwd.delta"), os.path.join(rd, "back.delta")
        refit(fwd)  # warm-up round trip: first-call costs (kernels, pools)
        refit(back)
        times, rep = [], None
        for _ in range(a["repeat"]):
            for path in (fwd, back):
                t, rep = refit(path)
                times.append(t)
        pauses = []
        for _ in range(a["repeat"] if world == 1 else 0):
            for path in (fwd, back):
                pauses.append(ahead(path))
        reloads = []
        for _ in range(a["repeat"]):
            reloads.append(reload(os.path.join(rd, "target")))
            reloads.append(reload(os.path.join(a["dir"], "base")))
        # after the reloads the module holds the base again, as the held digests say
        held_ok = all(state_through(union, n)[1] == sums[n] for n in names)
        out.append({"rate": rate, "in_place": statistics.median(times), "in_place_range": [min(times), max(times)],
                    "reload": statistics.median(reloads), "reload_range": [min(reloads), max(reloads)],
                    "ahead": statistics.median(pauses) if pauses else None,
                    "ahead_range": [min(pauses), max(pauses)] if pauses else None,
                    "held": rep.held, "split_chunks": rep.split_chunks, "split_decoded": rep.split_decoded,
                    "elsewhere": rep.elsewhere, "chunks": rep.chunks_applied, "held_ok": held_ok})
    if rank == 0:
        with open(a["out"], "w") as f:
            json.dump({"world": world, "threads": a["threads"], "rates": out,
                       "elements": int(sum(np.prod(s) for _, s in specs.values()))}, f)
    if world > 1:
        # Every worker leaves together (a gloo group torn down under a peer's pair threads aborts it).
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
