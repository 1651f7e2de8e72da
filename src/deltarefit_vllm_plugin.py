"""vLLM's ``vllm.general_plugins`` hook for deltarefit: registers the ``deltarefit`` weight-transfer backend.

It lives outside the ``deltarefit`` package on purpose. vLLM runs general plugins in every process
before it patches its Triton kernels, a pass over every loaded module's namespace; importing
``deltarefit`` there would load numba's llvmlite, whose library wrapper answers any attribute and
breaks that pass (the worker dies at start). Registration is by module path, so the backend module
(``deltarefit.engines.vllm_backend``) is imported only when vLLM creates the engine.
"""

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
