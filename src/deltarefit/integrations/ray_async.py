"""vLLM ``AsyncLLM`` (the v1 async engine) in a Ray actor with the deltarefit backend: ``AsyncEngineActor``.

The actor ``EngineActor`` is for an ``AsyncLLM``: the same weight-sync calls with ``LLM``'s names and
arguments, so vLLM's ``RayVLLMWeightSyncClient`` (and ``RefitTrainer``) drives it unchanged, and the same
answers (``state``, ``digests``, ``generate``, ``last_update``, ``collective_rpc``, ``pids``, ``ready``).
It is an async Ray actor: ``generate`` calls run concurrently with each other and with a plan-ahead
update (``prepare_weights``), as an async rollout worker's do.

The engine is built inside the actor's event loop, at its first call (every method waits for it), so
that ``AsyncLLM``'s output handler runs on that loop. Given ``init_info``, that first call also
initializes the backend and syncs to the stream's head before it answers: a restarted actor (Ray's
``max_restarts``) comes back from its checkpoint and catches up through the stream, as ``EngineActor`` does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

from .placement import require_ray
from .ray import engine_kwargs

log = logging.getLogger(__name__)

__all__ = ["AsyncEngineActor"]


def _info(request: Any, key: str) -> Any:
    """``request[key]`` of a dict request, or the attribute of vLLM's request object."""
    return request[key] if isinstance(request, dict) else getattr(request, key)


class AsyncEngineActor:
    """A vLLM ``AsyncLLM`` with the deltarefit backend, as an async Ray actor's class (module docstring).

    Arguments as ``EngineActor``'s: ``model`` (the checkpoint it loads and comes back from), ``init_info``
    (the backend's init; given, the actor initializes it and catches up at every start), ``llm_kwargs``
    (``AsyncEngineArgs`` fields), ``weight_transfer=False`` for a plain engine."""

    def __init__(self, model: str, *, init_info: dict[str, Any] | None = None,
                 llm_kwargs: dict[str, Any] | None = None, weight_transfer: bool = True,
                 name: str = "engine") -> None:
        ray = require_ray()
        self.name = name
        self.model = model
        ctx = ray.get_runtime_context()
        self.restarted = bool(ctx.was_current_actor_reconstructed)
        self.node_id = ctx.get_node_id()
        self._kw = engine_kwargs(llm_kwargs, weight_transfer)
        self._first_init = init_info
        self.engine: Any = None
        self.init_info: dict[str, Any] | None = None
        self.seconds_start: float | None = None
        self.caught_up: dict[str, Any] | None = None
        self._wrote = False  # an update since the last start wrote weights (not a plan-ahead)
        self._open = False  # started and not finished
        self._lock: asyncio.Lock | None = None  # made in the event loop, at the first call
        self._ready = False  # built, and caught up when given init_info
        self._starter: asyncio.Task | None = None  # the task building it

    async def _up(self) -> Any:
        """The engine, built (and caught up) at the first call; every call waits for it."""
        if self._ready or (self._starter is not None and self._starter is asyncio.current_task()):
            return self.engine  # up, or the start's own calls (the backend's init and the catch-up)
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not self._ready:
                self._starter = asyncio.current_task()
                try:
                    await self._start()
                finally:
                    self._starter = None
                log.info("[%s] async engine up in %.1f s (restarted: %s)", self.name, self.seconds_start,
                         self.restarted)
        return self.engine

    async def _start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        t0 = time.perf_counter()
        if self.engine is None:  # a start that failed in its catch-up keeps its engine
            self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=self.model, **self._kw))
        self.seconds_start = time.perf_counter() - t0
        if self._first_init is not None:
            await self.init_weight_transfer_engine({"init_info": self._first_init})
            self.caught_up = await self._catch_up()
        self._ready = True

    async def _catch_up(self) -> dict[str, Any]:
        from ..storage.base import open_store
        from ..stream.records import head

        assert self.init_info is not None
        version = head(open_store(self.init_info["stream"], create=False))
        t0 = time.perf_counter()
        await self.start_weight_update()
        await self.update_weights({"update_info": {"version": version}})
        await self.finish_weight_update(str(version))
        last = await self.last_update()
        return {"version": version, "route": last.get("route"), "seconds": time.perf_counter() - t0}

    # -- vLLM's weight-sync calls (RayVLLMWeightSyncClient sends these) ----------------------------

    async def init_weight_transfer_engine(self, request: Any) -> None:
        """As ``AsyncLLM.init_weight_transfer_engine``; the init the actor already ran is a no-op."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        info = _info(request, "init_info")
        engine = await self._up()  # first: the actor's own init, which the trainer's may repeat
        if info == self.init_info:
            return
        await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        self.init_info = dict(info)

    async def shutdown_weight_transfer_engine(self) -> None:
        await (await self._up()).shutdown_weight_transfer_engine()
        self.init_info = None

    async def start_weight_update(self) -> None:
        """As ``EngineActor.start_weight_update``: an update a failed round left open is finished first."""
        engine = await self._up()
        if self._open:
            log.warning("[%s] finishing the update a failed round left open", self.name)
            await engine.finish_weight_update(None)
        self._wrote = False
        await engine.start_weight_update()
        self._open = True

    async def update_weights(self, request: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        info = _info(request, "update_info")
        await (await self._up()).update_weights(WeightTransferUpdateRequest(update_info=info))
        self._wrote = self._wrote or not (isinstance(info, dict) and info.get("prepare"))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """As ``AsyncLLM.finish_weight_update``; the prefix cache reset after an update that wrote weights."""
        engine = await self._up()
        await engine.finish_weight_update(weight_version)
        self._open = False
        if self._wrote:
            await engine.reset_prefix_cache()
            self._wrote = False

    async def update_weight_version(self, new_version: str) -> None:
        await (await self._up()).update_weight_version(new_version)

    # -- serving and inspection --------------------------------------------------------------------

    async def generate(self, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
        """Greedy token ids per prompt, the prompts submitted concurrently."""
        from vllm import SamplingParams

        engine = await self._up()
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

        async def one(prompt: str) -> list[int]:
            last = None
            async for out in engine.generate(prompt, sp, request_id=f"{self.name}-{uuid.uuid4().hex}"):
                last = out
            assert last is not None
            return list(last.outputs[0].token_ids)

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    async def state(self) -> dict[str, Any]:
        """As ``EngineActor.state``: the stamped weight version and every worker's fingerprint."""
        engine = await self._up()
        fps = [d["fingerprint"] for d in await engine.collective_rpc("deltarefit_live_describe")] \
            if self.init_info is not None else []
        return {"name": self.name, "pid": os.getpid(), "node_id": self.node_id, "restarted": self.restarted,
                "weight_version": await engine.get_weight_version(), "fingerprints": fps,
                "seconds_start": self.seconds_start, "caught_up": self.caught_up, "engine": "AsyncLLM"}

    async def last_update(self) -> dict[str, Any]:
        return (await (await self._up()).collective_rpc("deltarefit_last_update"))[0]

    async def digests(self) -> list[dict[str, str]]:
        return await (await self._up()).collective_rpc("deltarefit_digests")

    async def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        return await (await self._up()).collective_rpc(method, args=args, kwargs=kwargs)

    def pids(self) -> list[int]:
        import psutil

        me = psutil.Process()
        return [me.pid, *(p.pid for p in me.children(recursive=True))]

    async def ready(self) -> bool:
        await self._up()
        return True
