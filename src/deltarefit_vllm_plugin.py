"""vLLM's ``vllm.general_plugins`` hook for deltarefit: registers the ``deltarefit`` weight-transfer backend.

It lives outside the ``deltarefit`` package on purpose. vLLM runs general plugins in every process
before it patches its Triton kernels, a pass over every loaded module's namespace; importing
``deltarefit`` there would load numba's llvmlite, whose library wrapper answers any attribute and
breaks that pass (the worker dies at start). Registration is by module path, so the backend module
(``deltarefit.engines.vllm.backend``) is imported only when vLLM creates the engine.

In the engine-core process (the one that loads plugins from ``vllm.v1.engine.core``), it also wraps
``EngineCore.collective_rpc`` so that while a ``deltarefit`` ``update_weights`` call runs in the
workers, the engine core waits for their replies on its shared-memory queues' notify socket instead
of spinning on a core (``shm_broadcast.SpinCondition`` busy-loops with ``sched_yield`` for up to
``busy_loop_s`` = 1 s after each read). The engine is paused for the update, so the spin buys
nothing there, and it takes a core from the apply threads: on this project's 2-core machine it used
0.24-0.33 s of CPU during a 0.33-0.36 s refit. Any other call, or another backend, is left as it is;
where vLLM's internals differ (no such attributes), the wrapper does nothing.

The same wrapper reads every worker's reply to a failed call of the ``deltarefit`` backend
(``WEIGHT_TRANSFER_CALLS``: init, start, update, finish, shutdown). vLLM 0.32's
multiprocess executor reads its workers' replies in rank order and raises at the first failure,
leaving the later workers' replies in their queues, where the next call (any call: the next step's
forward pass, or the rerun of the update) reads them as its own. In a tensor-parallel group a
refused update fails in every worker (they agree), so without this the engine would answer every
call after a failed update with the previous call's reply. During the update each reply queue's
``dequeue`` hands the executor a failure as a success and keeps it; once every reply is read, the
call raises as vLLM does (``Worker failed with error '...'``), naming each distinct failure.
"""

import sys

BACKEND = "deltarefit"
MODULE = "deltarefit.engines.vllm.backend"
# The engine core's calls into the weight-transfer engine: every worker's reply is read when one fails.
WEIGHT_TRANSFER_CALLS = frozenset({"init_weight_transfer_engine", "start_weight_update", "update_weights",
                                   "finish_weight_update", "shutdown_weight_transfer_engine"})


def __getattr__(name: str) -> str:
    """``__version__``: the release of the deltarefit this plugin registers (``deltarefit.__version__``), read
    on first use, so that vLLM's loading of the plugin imports nothing of deltarefit."""
    if name == "__version__":
        from deltarefit._release import RELEASE

        return RELEASE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def _success_status():
    """The status vLLM's workers reply with on success (None where vLLM's internals differ)."""
    mod = sys.modules.get("vllm.v1.executor.multiproc_executor")
    status = getattr(getattr(getattr(mod, "WorkerProc", None), "ResponseStatus", None), "SUCCESS", None)
    return status


def _read_every_reply(engine_core, failures: list, success) -> list:
    """Wrap the ``dequeue`` of each of the executor's reply queues (module docstring): a failure reply is
    kept in ``failures`` and handed on as a success. The queues wrapped (their wrappers to remove)."""
    mqs = list(getattr(getattr(engine_core, "model_executor", None), "response_mqs", None) or ())
    if success is None or len(mqs) < 2 or not all(callable(getattr(mq, "dequeue", None)) for mq in mqs):
        return []

    def wrap(real):
        def dequeue(*a, **k):
            got = real(*a, **k)
            if isinstance(got, tuple) and len(got) == 2 and got[0] != success:
                failures.append(got[1])
                return success, None
            return got

        return dequeue

    for mq in mqs:
        mq.dequeue = wrap(mq.dequeue)
    return mqs


def quiet_during_update(rpc):
    """``EngineCore.collective_rpc`` with no busy loop while a ``deltarefit`` update runs, and every worker's
    reply read when it fails (module docstring)."""

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        cfg = getattr(getattr(self, "vllm_config", None), "weight_transfer_config", None)
        if method not in WEIGHT_TRANSFER_CALLS or getattr(cfg, "backend", None) != BACKEND:
            return rpc(self, method, timeout, args, kwargs)
        conds = _spin_conditions(self) if method == "update_weights" else []
        saved = [c.busy_loop_s for c in conds]
        for c in conds:
            c.busy_loop_s = 0.0
        failures: list = []
        wrapped = _read_every_reply(self, failures, _success_status())
        try:
            out = rpc(self, method, timeout, args, kwargs)
        finally:
            for mq in wrapped:
                vars(mq).pop("dequeue", None)
            for c, s in zip(conds, saved, strict=True):
                c.busy_loop_s = s
        if failures:
            distinct = list(dict.fromkeys(str(f) for f in failures))
            raise RuntimeError(f"Worker failed with error '{'; '.join(distinct)}', please check the stack trace "
                               "above for the root cause")
        return out

    collective_rpc._deltarefit_quiet = True
    collective_rpc.__wrapped__ = rpc
    collective_rpc.__doc__ = rpc.__doc__
    return collective_rpc
