"""Integrations with the distributed runtimes RL frameworks run on.

Each submodule imports its runtime lazily: ``import deltarefit`` never imports Ray, vLLM or verl.

* ``deltarefit.integrations.ray``: vLLM engines in Ray actors refitted through the ``deltarefit``
  weight-transfer backend, driven by vLLM's own ``RayVLLMWeightSyncClient`` (see docs/RAY.md).
* ``deltarefit.integrations.ray_shard``: a trainer sharded over Ray actors, each rank publishing its own
  shard's part of every version (``shard.ShardStreamPublisher``), refitted with the same rounds.
* ``deltarefit.integrations.trl``: TRL's vLLM server mode synced through a stream, switched on by
  ``enable(stream=...)`` before the trainer is built; ``python -m deltarefit.integrations.trl.serve`` starts
  the server (see docs/FRAMEWORKS.md).
* ``deltarefit.integrations.verl``: a verl checkpoint engine, ``deltarefit`` in verl's
  ``CheckpointEngineRegistry`` (``checkpoint_engine.custom_backend_module``): the trainer publishes each sync
  from memory, every rollout worker follows the stream to it, verified (see docs/FRAMEWORKS.md).
"""

__all__: list[str] = []
