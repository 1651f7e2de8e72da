"""Integrations with the distributed runtimes RL frameworks run on.

Each submodule imports its runtime lazily: ``import deltarefit`` never imports Ray (or vLLM).

* ``deltarefit.integrations.ray``: vLLM engines in Ray actors refitted through the ``deltarefit``
  weight-transfer backend, driven by vLLM's own ``RayVLLMWeightSyncClient`` (see docs/RAY.md).
"""

__all__: list[str] = []
