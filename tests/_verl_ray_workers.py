"""Ray worker classes for tests/test_verl.py's run of verl's own ``CheckpointEngineManager`` (imported by the Ray
workers, with tests/ on their path). As verl's own checkpoint-engine tests build them
(tests/checkpoint_engine/test_utils.py in verl's repository), on the CPU:

* ``Trainer``: a verl ``Worker`` holding a small model trained by AdamW, with the two methods verl's manager
  calls on the actor group, as ``ActorRolloutRefWorker`` has them (``verl/workers/engine_workers.py``):
  ``update_weights`` (its engine's ``send_weights`` of the per-tensor parameters) and
  ``execute_checkpoint_engine``; its engine built as that worker builds it.
* ``Rollout``: verl's ``CheckpointEngineWorker`` with an adapter that keeps what it is handed.
* ``Replica``: a ``RolloutReplica`` over those workers, with no server (its abort/release/resume calls,
  made on its servers, have none to reach).
"""

from __future__ import annotations

import torch
from _verl_rounds import model, served, train_step
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.import_utils import import_external_libs
from verl.workers.rollout import BaseRollout, RolloutReplica


class Trainer(Worker):
    def __init__(self, checkpoint_engine_config) -> None:
        super().__init__()
        self.model = model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        cfg = checkpoint_engine_config
        backend = cfg.backend
        engine_kwargs = cfg.engine_kwargs.get(backend, {})
        import_external_libs(cfg.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            backend, is_master=(self.rank == 0), bucket_size=cfg.update_weights_bucket_megabytes << 20, **engine_kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train(self, step: int) -> None:
        train_step(self.model, self.opt, step)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def served(self) -> dict[str, torch.Tensor]:
        return served(self.model)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        per_tensor_param = ((n, t.detach()) for n, t in self.model.state_dict().items())
        return await self.checkpoint_engine.send_weights(per_tensor_param, global_steps=global_steps) or {}

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class RecordingRollout(BaseRollout):
    def __init__(self) -> None:
        self.received: dict[str, torch.Tensor] = {}

    async def resume(self, tags):
        pass

    async def release(self):
        pass

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
        from verl.workers.rollout.utils import ensure_async_iterator

        self.received = {}
        async for name, t in ensure_async_iterator(weights):
            self.received[name] = t.clone()


class Rollout(CheckpointEngineWorker):
    def __init__(self, rollout_config) -> None:
        super().__init__(rollout_config, None, server_adapter=RecordingRollout())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def received(self) -> dict[str, torch.Tensor]:
        return self.server_adapter.received

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def copy_path(self) -> str:
        return self.checkpoint_engine.checkpoint


class Replica(RolloutReplica):
    async def launch_servers(self):
        pass
