"""Refit running inference engines in place from deltarefit deltas.

* ``capture``: where an engine's own weight loader puts each checkpoint element, captured as affine pieces
  without writing a byte.
* ``live``: engine parameters as an apply target (``LiveTarget``), read and written through those pieces;
  tensors split across a tensor-parallel group are assembled over the group. ``placement``: where a
  checkpoint tensor's elements are in parameters; ``union``: live placements beside host copies as one
  target, and a tensor's digests as a target reads it.
* ``vllm``: vLLM (``vllm/``): the worker extension (``worker_extension_cls``), the driver calls, one worker's
  live refit state (``LiveEngine``) and the ``deltarefit`` weight-transfer backend.

Importing this package imports no engine.
"""
