"""Refit running inference engines in place from deltarefit deltas.

``deltarefit.engines.vllm``: a vLLM worker extension (``worker_extension_cls``) that applies a delta to the
checkpoint the engine was loaded from and reloads only the changed tensors through vLLM's own loader.
Importing this package imports no engine.
"""
