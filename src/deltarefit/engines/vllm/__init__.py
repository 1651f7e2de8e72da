"""vLLM: refit a running engine in place from deltarefit deltas.

* ``extension``  the worker extension ``DeltaRefitWorkerExtension`` (``worker_extension_cls``, by its path
                 ``deltarefit.engines.vllm.DeltaRefitWorkerExtension``): in-place refit, or apply to the
                 on-disk checkpoint and reload the touched layers
* ``driver``     what the process holding the ``LLM`` calls: ``refit_engine``, ``refit_engine_in_place``,
                 ``prepare_refit_in_place``, ``reload_engine``, ``sync_engine``, ``engine_digests``
* ``worker``     one worker's live refit state (``LiveEngine``): layout captured and checked, host copies of
                 what must go through vLLM's reload, ``apply(delta)``
* ``build``      the steps that build a ``LiveEngine`` (partition over the group, kernel checks, host
                 copies, the proof that vLLM's reload takes them)
* ``refit``      what an apply keeps and returns: ``MemoryJournal``, ``LiveRefitReport``, ``PreparedRefit``
* ``group``      the worker's tensor-parallel group (``WorkerGroup``, a ``shard.group.Group``)
* ``backend``    the ``deltarefit`` weight-transfer backend (worker and trainer engines); imports vLLM
* ``holder``     the live engine as what holds a stream's version (``EngineHolder``, a
                 ``stream.holder.Holder``), and the subscriber the backend syncs it with
* ``sharded``    the live engine following a sharded stream (``ShardFollower``: ``shard.sync.sync_sharded``
                 into its captured layout, then its own steps after an apply); chosen by the backend
                 from the stream's records
* ``layers``     checkpoint tensor names grouped by the engine layer they load into

Importing this package imports neither vLLM nor torch.
"""

from .driver import (
    engine_digests,
    prepare_refit_in_place,
    refit_engine,
    refit_engine_in_place,
    reload_engine,
    sync_engine,
)
from .extension import EXTENSION, LOCK_NAME, DeltaRefitWorkerExtension
from .layers import layer_key, reload_set

__all__ = ["EXTENSION", "LOCK_NAME", "DeltaRefitWorkerExtension", "engine_digests", "layer_key",
           "prepare_refit_in_place", "refit_engine", "refit_engine_in_place", "reload_engine", "reload_set",
           "sync_engine"]
