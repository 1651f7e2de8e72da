"""The actors of tests/test_ray_shard.py: the example's sharded trainer ranks (``examples/ray_shard_ranks.py``)
with a fault injection, and rollout actors that follow the sharded stream into plain torch tensors (a
transformers module, or TP slices).

``ModuleRollout`` answers vLLM's weight-sync calls (what ``RayVLLMWeightSyncClient`` sends) and
``state``, as ``EngineActor`` does, so ``RefitTrainer``'s rounds drive it: ``update_weights`` is
``sync_sharded`` to the version asked for.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import numpy as np
import ray_shard_ranks
from ray_shard_ranks import CONFIG, export, gather_masters, rollout_layouts  # noqa: F401 (the test's names)


class TinyRank(ray_shard_ranks.TinyRank):
    """The example's rank, plus ``stall``: a publish held at a chosen point (the test kills it there)."""

    def stall(self, where: str, marker: str, seconds: float = 600.0) -> None:
        """At the next ``where`` of a publish, write ``marker`` and sleep (the test kills this rank's process
        there): ``.head.json`` (a store create of that suffix: the rank's part is in, its descriptor not),
        ``commit.json`` (the committer: every part in, no commit record), or ``advance`` (the record
        exists, this rank's baseline has not moved to it)."""

        def hold():
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(seconds)
            raise TimeoutError("stalled publish was not killed")

        if where == "advance":
            self.publisher.advance = lambda rec: hold()
            return
        store = self.publisher.store
        real = store.create
        store.create = lambda key, data: hold() if key.endswith(where) else real(key, data)



def _bits(t) -> np.ndarray:
    import torch

    return t.detach().contiguous().view(torch.int16).numpy()


class ModuleRollout:
    """A rollout actor holding a transformers Llama in bf16 (``kind="module"``, identity layout) or the two
    TP slices of one (``kind="tp2"``), following the sharded stream with ``sync_sharded``."""

    def __init__(self, stream: str, state_dir: str, *, kind: str = "module", init_info: dict | None = None,
                 name: str = "rollout") -> None:
        import ray
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        self.name, self.kind, self.stream = name, kind, stream
        ctx = ray.get_runtime_context()
        self.restarted = bool(ctx.was_current_actor_reconstructed)
        self.node_id = ctx.get_node_id()
        self.layouts = rollout_layouts()[kind]
        if kind == "module":
            torch.manual_seed(7)  # not the trainer's init: everything it holds comes from the stream
            self.model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16)
            self.tensors = [self.model]
        else:
            self.tensors = [{n: torch.zeros(lt.shape, dtype=torch.bfloat16) for n, lt in lay.items()}
                            for lay in self.layouts]
        os.makedirs(state_dir, exist_ok=True)
        self.paths = [os.path.join(state_dir, f"{name}-{i}.json") for i in range(len(self.tensors))]
        for p in self.paths:  # these tensors are new: a state file left by an earlier process is not theirs
            if os.path.exists(p):
                os.unlink(p)
        self.init_info: dict | None = None
        self.weight_version: str | None = None
        self.reports: list[dict] = []
        self.caught_up: dict | None = None
        if init_info is not None:
            self.init_weight_transfer_engine({"init_info": init_info})
            self.caught_up = self._sync(None)
            self.weight_version = str(self.caught_up["version"])

    def _sync(self, version: int | None) -> dict:
        from deltarefit.shard.stream import sync_sharded

        t0 = time.perf_counter()
        reps = [sync_sharded(self.stream, t, None if self.kind == "module" else lay, state_path=p, to_version=version)
                for t, lay, p in zip(self.tensors, self.layouts, self.paths, strict=True)]
        out = {"version": reps[0].version, "route": reps[0].route, "bytes_fetched": sum(r.bytes_fetched for r in reps),
               "versions_applied": reps[0].versions_applied, "seconds": time.perf_counter() - t0}
        self.reports.append(out)
        return out

    # -- vLLM's weight-sync calls ------------------------------------------------------------------

    def init_weight_transfer_engine(self, request: Any) -> None:
        info = request["init_info"] if isinstance(request, dict) else request.init_info
        self.init_info = dict(info)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, request: Any) -> None:
        info = request["update_info"] if isinstance(request, dict) else request.update_info
        if not info.get("prepare"):
            self._sync(int(info["version"]))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass

    def update_weight_version(self, new_version: str) -> None:
        self.weight_version = new_version

    # -- inspection --------------------------------------------------------------------------------

    def state(self) -> dict:
        from deltarefit.shard.stream import held_version

        held = [held_version(p) for p in self.paths]
        return {"name": self.name, "pid": os.getpid(), "node_id": self.node_id, "restarted": self.restarted,
                "weight_version": self.weight_version, "fingerprints": [h[1] for h in held if h is not None],
                "held": [h[0] if h else None for h in held], "caught_up": self.caught_up,
                "last": self.reports[-1] if self.reports else None}

    def digests(self) -> list[dict[str, str]]:
        """Per tensor set, the sha256 of each tensor's bits."""
        out = []
        for t in self.tensors:
            items = t.state_dict().items() if hasattr(t, "state_dict") else t.items()
            out.append({n: hashlib.sha256(_bits(v).tobytes()).hexdigest() for n, v in items})
        return out

    def ready(self) -> bool:
        return True


def reference_digests(full: dict[str, np.ndarray], kind: str) -> list[dict[str, str]]:
    """What a rollout of ``kind`` must hold for masters ``full``: ``export_full``'s bf16 bits, in each
    rollout layout, hashed as ``ModuleRollout.digests`` hashes."""
    from deltarefit.shard.convert import export_full
    from deltarefit.shard.names import local_from_full

    bits = {n: b for n, (_, b) in export_full(full, "BF16").items()}
    out = []
    for lay in rollout_layouts()[kind]:
        local = local_from_full(lay, bits, np.uint16)
        out.append({n: hashlib.sha256(np.ascontiguousarray(a).view(np.int16).tobytes()).hexdigest()
                    for n, a in local.items()})
    return out
