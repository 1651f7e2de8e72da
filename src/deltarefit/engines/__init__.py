"""Refit running inference engines in place from deltarefit deltas.

* ``capture``: where an engine's own weight loader puts each checkpoint element, captured as affine pieces
  without writing a byte.
* ``live``: engine parameters as an apply target (``LiveTarget``), read and written through those pieces;
  tensors split across a tensor-parallel group are assembled over the group.
* ``vllm_live``: one vLLM worker's live refit state (``LiveEngine``): layout captured and checked, host
  copies of what must go through vLLM's reload, ``apply(delta)``.
* ``vllm_backend``: the ``deltarefit`` vLLM weight-transfer backend (worker and trainer engines).
* ``vllm``: the worker extension (``worker_extension_cls``): in-place refit, or apply to the on-disk
  checkpoint and reload the touched layers.

Importing this package imports no engine.
"""
