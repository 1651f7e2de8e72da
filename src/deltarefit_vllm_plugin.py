"""vLLM's ``vllm.general_plugins`` hook for deltarefit: registers the ``deltarefit`` weight-transfer backend.

It lives outside the ``deltarefit`` package on purpose. vLLM runs general plugins in every process
before it patches its Triton kernels, a pass over every loaded module's namespace; importing
``deltarefit`` there would load numba's llvmlite, whose library wrapper answers any attribute and
breaks that pass (the worker dies at start). Registration is by module path, so the backend module
(``deltarefit.engines.vllm_backend``) is imported only when vLLM creates the engine.

In the engine-core process (the one that loads plugins from ``vllm.v1.engine.core``), it also wraps
``EngineCore.collective_rpc`` so that while a ``deltarefit`` ``update_weights`` call runs in the
workers, the engine core waits for their replies on its shared-memory queues' notify socket instead
of spinning on a core (``shm_broadcast.SpinCondition`` busy-loops with ``sched_yield`` for up to
``busy_loop_s`` = 1 s after each read). The engine is paused for the update, so the spin buys
nothing there, and it takes a core from the apply threads: on this project's 2-core machine it used
0.24-0.33 s of CPU during a 0.33-0.36 s refit. Any other call, or another backend, is left as it is;
where vLLM's internals differ (no such attributes), the wrapper does nothing.
"""

import sys

BACKEND = "deltarefit"
MODULE = "deltarefit.engines.vllm_backend"


def register() -> None:
    """Register the worker and trainer engines (idempotent: vLLM may call it more than once)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, MODULE, "DeltaRefitWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, MODULE, "DeltaRefitTrainerWeightTransferEngine")
    core = sys.modules.get("vllm.v1.engine.core")  # imported here only in the engine-core process
    cls = getattr(core, "EngineCore", None)
    if cls is not None and not getattr(cls.collective_rpc, "_deltarefit_quiet", False):
        cls.collective_rpc = quiet_during_update(cls.collective_rpc)


def _spin_conditions(engine_core) -> list:
    """The spin conditions the engine core waits on for its workers' replies (empty where vLLM has none)."""
    out = []
    for mq in getattr(getattr(engine_core, "model_executor", None), "response_mqs", None) or ():
        cond = getattr(mq, "_spin_condition", None)
        if cond is not None and isinstance(getattr(cond, "busy_loop_s", None), (int, float)):
            out.append(cond)
    return out


def quiet_during_update(rpc):
    """``EngineCore.collective_rpc`` with no busy loop while a ``deltarefit`` update runs (module docstring)."""

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        cfg = getattr(getattr(self, "vllm_config", None), "weight_transfer_config", None)
        if method != "update_weights" or getattr(cfg, "backend", None) != BACKEND:
            return rpc(self, method, timeout, args, kwargs)
        conds = _spin_conditions(self)
        saved = [c.busy_loop_s for c in conds]
        for c in conds:
            c.busy_loop_s = 0.0
        try:
            return rpc(self, method, timeout, args, kwargs)
        finally:
            for c, s in zip(conds, saved, strict=True):
                c.busy_loop_s = s

    collective_rpc._deltarefit_quiet = True
    collective_rpc.__wrapped__ = rpc
    collective_rpc.__doc__ = rpc.__doc__
    return collective_rpc
