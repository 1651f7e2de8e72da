"""deltarefit on Ray: vLLM engines in Ray actors kept in step with the trainer through a version stream.

The pieces a Ray-based RL framework composes (docs/RAY.md):

* ``EngineActor``: a vLLM ``LLM`` inside a Ray actor, started with
  ``weight_transfer_config={"backend": "deltarefit"}``. Its weight-sync methods have ``LLM``'s names and
  arguments, so vLLM's own ``RayVLLMWeightSyncClient`` drives it as it drives any ``LLM`` actor. Given the
  stream (``init_info``), it initializes the backend itself, so that when Ray restarts it
  (``max_restarts``) after its process died, it comes back from its checkpoint (what it was loaded
  from: an in-place refit writes nothing there) and catches up through the stream (the subscriber's
  cheapest route: the chain, a catch-up delta or a keyframe) before it answers any call.
* ``start_engines``: one placement group per engine (a ``STRICT_PACK`` bundle holding the node's custom
  resource), actors created with ``max_restarts``.
* ``RefitTrainer``: on the trainer's side (its actor), a ``Publisher`` inside vLLM's trainer engine
  ``DeltaRefitTrainerWeightTransferEngine`` over a ``RayVLLMWeightSyncClient``. ``publish`` commits a
  checkpoint to the stream, ``prepare`` has the engines plan it while they serve, ``refit`` drives the
  pause (start, update, finish). A version is committed *for the trainer* (``committed.json`` in its
  state directory, ``RefitTrainer.committed``) only once every engine acknowledged it: each reports the
  version and the fingerprint its workers hold, and both must be the version's. A round an engine did
  not finish (its process died, its update was refused) commits nothing; the trainer waits for every
  engine to answer again (a restarted one has caught up by then) and drives the same round again.
  Killed and restarted itself, the trainer resumes: ``Publisher.recover`` finishes a publish that
  committed, drops one that did not, and publishing the same checkpoint again returns its version.

The payload never travels through Ray: each engine's workers fetch their parts from the stream (a
directory or ``s3://``) themselves. Ray carries the calls, versions, fingerprints and digests only.

Ray is imported when these functions run, never by ``import deltarefit``; without it they raise
``UsageError`` naming the install.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import DeltaRefitError, UsageError
from ..io.fsutil import write_atomic
from .placement import BACKEND, READY_TIMEOUT, placed, require_ray

log = logging.getLogger(__name__)

# Bounded waits: an engine or trainer that does not answer fails the call instead of blocking it.
ROUND_TIMEOUT = 600.0  # a whole refit round, retries included

__all__ = ["EngineActor", "RefitReport", "RefitTrainer", "ray_client", "require_ray", "start_engines"]


def ray_client(handles: list[Any]) -> Any:
    """vLLM's ``RayVLLMWeightSyncClient`` over ``handles``, with ``prepare_weights``: the backend's
    plan-while-serving update (``DeltaRefitTrainerWeightTransferEngine.prepare_weights`` calls it). The
    four calls of the round trip are vLLM's own."""
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

    class _Client(RayVLLMWeightSyncClient):
        def prepare_weights(self, version: int) -> None:
            """Have every engine plan ``version`` while it serves; nothing is written, no cache reset."""
            self.start_weight_update()
            try:
                self.update_weights({"version": version, "prepare": True})
            finally:
                self.finish_weight_update(None)

    return _Client(list(handles))


def engine_kwargs(llm_kwargs: dict[str, Any] | None, weight_transfer: bool) -> dict[str, Any]:
    """An engine actor's vLLM arguments: ``llm_kwargs`` with the deltarefit worker extension, and the
    deltarefit weight-transfer backend unless ``weight_transfer`` is False (a plain reference engine)."""
    from ..engines.vllm import EXTENSION

    kw = {"worker_extension_cls": EXTENSION, **(llm_kwargs or {})}
    if weight_transfer:
        kw["weight_transfer_config"] = {"backend": BACKEND}
    return kw


class EngineActor:
    """A vLLM ``LLM`` with the deltarefit backend, as a Ray actor's class (``start_engines`` wraps it).

    ``model``: the checkpoint directory it loads (and comes back from when restarted). ``init_info``:
    the backend's init (``{"stream": ..., "version": ...}``); given, the actor initializes the backend
    and syncs to the stream's head itself at every start. ``llm_kwargs``: passed to ``LLM``.
    ``weight_transfer=False`` starts a plain engine (a fresh reference to compare with).
    """

    def __init__(self, model: str, *, init_info: dict[str, Any] | None = None,
                 llm_kwargs: dict[str, Any] | None = None, weight_transfer: bool = True,
                 name: str = "engine") -> None:
        ray = require_ray()
        from vllm import LLM

        self.name = name
        self.model = model
        ctx = ray.get_runtime_context()
        self.restarted = bool(ctx.was_current_actor_reconstructed)
        self.node_id = ctx.get_node_id()
        kw = engine_kwargs(llm_kwargs, weight_transfer)
        t0 = time.perf_counter()
        self.llm = LLM(model=model, **kw)
        self.seconds_start = time.perf_counter() - t0
        self.init_info: dict[str, Any] | None = None
        self._wrote = False  # an update since the last start wrote weights (not a plan-ahead)
        self._open = False  # started and not finished
        self.caught_up: dict[str, Any] | None = None
        if init_info is not None:
            self.init_weight_transfer_engine({"init_info": init_info})
            self.caught_up = self._catch_up()
        log.info("[%s] engine up in %.1f s (restarted: %s)", name, self.seconds_start, self.restarted)

    def _catch_up(self) -> dict[str, Any]:
        """Sync to the stream's head (nothing to do at a first start from the head's checkpoint)."""
        from ..storage.base import open_store
        from ..stream.records import head

        assert self.init_info is not None
        version = head(open_store(self.init_info["stream"], create=False))
        t0 = time.perf_counter()
        self.start_weight_update()
        self.update_weights({"update_info": {"version": version}})
        self.finish_weight_update(str(version))
        last = self.last_update()
        return {"version": version, "route": last.get("route"), "seconds": time.perf_counter() - t0}

    # -- vLLM's weight-sync calls (RayVLLMWeightSyncClient sends these) ----------------------------

    def init_weight_transfer_engine(self, request: Any) -> None:
        """As ``LLM.init_weight_transfer_engine``; the same init a second time (the trainer's, after the
        actor initialized itself) is a no-op, not a second layout capture."""
        info = request["init_info"] if isinstance(request, dict) else request.init_info
        if info == self.init_info:
            return
        self.llm.init_weight_transfer_engine(request)
        self.init_info = dict(info)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()
        self.init_info = None

    def start_weight_update(self) -> None:
        """As ``LLM.start_weight_update``. An update left open here by a round that failed elsewhere
        (another engine died mid-round, so the trainer never sent this one its finish) is finished
        first: vLLM refuses a start while one is open, and the round is driven again from its start.
        The backend writes nothing at finish, and no version is stamped."""
        if self._open:
            log.warning("[%s] finishing the update a failed round left open", self.name)
            self.llm.finish_weight_update(None)
        self._wrote = False
        self.llm.start_weight_update()
        self._open = True

    def update_weights(self, request: Any) -> None:
        info = request["update_info"] if isinstance(request, dict) else request.update_info
        self.llm.update_weights(request)
        self._wrote = self._wrote or not (isinstance(info, dict) and info.get("prepare"))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """As ``LLM.finish_weight_update`` (vLLM's Ray client sends the version apart, by
        ``update_weight_version``); the prefix cache is reset after an update that wrote weights: its
        blocks were computed with the old ones."""
        self.llm.finish_weight_update(weight_version)
        self._open = False
        if self._wrote:
            self.llm.reset_prefix_cache()
            self._wrote = False

    def update_weight_version(self, new_version: str) -> None:
        self.llm.update_weight_version(new_version)

    # -- serving and inspection --------------------------------------------------------------------

    def generate(self, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
        """Greedy token ids per prompt."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in self.llm.generate(prompts, sp, use_tqdm=False)]

    def state(self) -> dict[str, Any]:
        """What the trainer's acknowledgement reads: the weight version vLLM stamped and the fingerprint
        every worker holds (each worker's backend state), plus where and what this actor is."""
        fps = [d["fingerprint"] for d in self.llm.collective_rpc("deltarefit_live_describe")] \
            if self.init_info is not None else []
        return {"name": self.name, "pid": os.getpid(), "node_id": self.node_id, "restarted": self.restarted,
                "weight_version": self.llm.llm_engine.get_weight_version(), "fingerprints": fps,
                "seconds_start": self.seconds_start, "caught_up": self.caught_up}

    def last_update(self) -> dict[str, Any]:
        """Worker 0's report of the last update (route, versions applied, bytes fetched)."""
        return self.llm.collective_rpc("deltarefit_last_update")[0]

    def digests(self) -> list[dict[str, str]]:
        """Per worker, the sha256 of what it computes with (``deltarefit_digests``): equal across two
        engines iff they hold the same weights bit for bit."""
        return self.llm.collective_rpc("deltarefit_digests")

    def full_reload(self, checkpoint: str) -> float:
        """Reload every weight from ``checkpoint`` (vLLM's loader; the figure a delta refit is compared
        with): seconds."""
        from ..engines.vllm.driver import reload_engine

        return reload_engine(self.llm, checkpoint)["seconds"]

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        return self.llm.collective_rpc(method, args=args, kwargs=kwargs)

    def pids(self) -> list[int]:
        """This actor's process and every process under it (vLLM's engine core and workers)."""
        import psutil

        me = psutil.Process()
        return [me.pid, *(p.pid for p in me.children(recursive=True))]

    def ready(self) -> bool:
        return True


def start_engines(model: str, resources: list[dict[str, float]], *, init_info: dict[str, Any] | None = None,
                  llm_kwargs: dict[str, Any] | None = None, max_restarts: int = 3, num_cpus: float = 1,
                  runtime_env: dict[str, Any] | None = None, names: list[str] | None = None,
                  timeout: float = READY_TIMEOUT, actor_cls: type | None = None) -> list[Any]:
    """One ``EngineActor`` per entry of ``resources`` (the custom resources of the node it must run on),
    each in its own placement group (one ``STRICT_PACK`` bundle: ``num_cpus`` CPUs and those resources),
    restarted by Ray up to ``max_restarts`` times. Returns the handles once every engine answers.
    In-flight calls are not retried (``max_task_retries=0``): a round an engine died in fails, and the
    trainer drives it again (``RefitTrainer.refit``). ``actor_cls``: ``EngineActor`` by default;
    ``ray_async.AsyncEngineActor`` for ``AsyncLLM`` engines."""
    ray = require_ray()
    names = names or [f"engine-{i}" for i in range(len(resources))]
    handles = []
    for name, res in zip(names, resources, strict=True):
        actor = ray.remote(actor_cls or EngineActor).options(**placed(res, name, num_cpus=num_cpus, max_restarts=max_restarts,
                                                         runtime_env=runtime_env, timeout=timeout))
        handles.append(actor.remote(model, init_info=init_info, llm_kwargs=llm_kwargs, name=name))
    ray.get([h.ready.remote() for h in handles], timeout=timeout)
    return handles


@dataclass
class RefitReport:
    """One ``RefitTrainer.refit``: the version every engine acknowledged, how many rounds it took, and
    why the failed ones failed."""

    version: int
    fingerprint: str
    rounds: int
    seconds: float  # the whole refit, retries and waits for restarted engines included
    seconds_round: float  # the round that every engine acknowledged: start, update, finish
    failures: list[str] = field(default_factory=list)
    engines: list[dict[str, Any]] = field(default_factory=list)  # each engine's state at the ack


class RefitTrainer:
    """The trainer's side: publishes each step to the stream and brings every engine to it.

    ``engines``: the engine actors' handles, or their names (named actors, looked up at the first
    round: a restarted trainer finds the engines so, and the stream's first version can be published
    before any engine exists). ``stream``: the store URL the engines read (a directory
    or ``s3://``). ``state_dir``: the trainer's own state (the publisher's baseline and
    ``committed.json``) on its node's disk; a restarted trainer given the same directory resumes.
    ``engine_version``: the version the engines were started from. ``publish_rate`` (bytes/s) paces
    the trainer's uploads (link emulation, ``open_store(rate=)``). ``format_version``: of the deltas (1 or 2;
    None: the stream's, 2 for a new one).
    """

    def __init__(self, engines: list[Any], stream: str, state_dir: str, *, engine_version: int | None = None,
                 keyframe_every: int = 20, publish_rate: float | None = None, max_rounds: int = 3,
                 round_timeout: float = ROUND_TIMEOUT, ready_timeout: float = READY_TIMEOUT,
                 transport: str = "ray", format_version: int | None = None) -> None:
        require_ray()
        if max_rounds < 1:
            raise UsageError(f"max_rounds must be >= 1, got {max_rounds}")
        if transport not in ("ray", "http"):
            raise UsageError(f"transport must be 'ray' (EngineActor) or 'http' (ray_http.ServerActor), not {transport!r}")
        self.transport = transport
        self._engines = list(engines)
        self.state_dir = os.path.abspath(state_dir)
        os.makedirs(self.state_dir, exist_ok=True)
        self.transfer = self._make_transfer(stream, keyframe_every=keyframe_every, engine_version=engine_version,
                                            publish_rate=publish_rate, format_version=format_version)
        self.max_rounds = max_rounds
        self.round_timeout = round_timeout
        self.ready_timeout = ready_timeout
        self.committed_path = os.path.join(self.state_dir, "committed.json")

    def _make_transfer(self, stream: str, *, keyframe_every: int, engine_version: int | None,
                       publish_rate: float | None, format_version: int | None = None) -> Any:
        """The trainer engine whose ``send_weights`` / ``prepare_weights`` drive a round: vLLM's
        ``DeltaRefitTrainerWeightTransferEngine`` with its ``Publisher`` (``ray_shard`` plugs in the
        sharded stream's, whose trainer ranks publish)."""
        from ..engines.vllm.backend import DeltaRefitTrainerInitInfo, DeltaRefitTrainerWeightTransferEngine

        info = DeltaRefitTrainerInitInfo(rank=0, stream=stream, state_dir=os.path.join(self.state_dir, "publisher"),
                                         keyframe_every=keyframe_every, engine_version=engine_version,
                                         format_version=format_version)
        transfer = DeltaRefitTrainerWeightTransferEngine.trainer_init(info, client=None)
        if publish_rate:
            from ..storage.base import open_store

            transfer.publisher.store = open_store(stream, rate=publish_rate)
        return transfer

    @property
    def store(self) -> Any:
        """The stream's store (what the engines follow)."""
        return self.transfer.publisher.store

    def fingerprint(self, version: int) -> str:
        """The fingerprint every worker must hold at ``version`` (its commit record's)."""
        from ..stream.records import load_commit

        return load_commit(self.store, version).fingerprint

    @property
    def engines(self) -> list[Any]:
        """The engines' handles (names resolved once, on first use)."""
        if any(isinstance(e, str) for e in self._engines):
            ray = require_ray()
            self._engines = [ray.get_actor(e) if isinstance(e, str) else e for e in self._engines]
        if self.transfer.client is None and self.transport == "ray":
            self.transfer.client = ray_client(self._engines)
        elif self.transfer.client is None:
            from .ray_http import HTTPFanOut

            ray = require_ray()
            self.transfer.client = HTTPFanOut(ray.get([h.get_url.remote() for h in self._engines],
                                                      timeout=self.ready_timeout))
            # A ServerActor initializes the backend itself at every start (and follows the stream from
            # there): a second init from here would name the version it started from, not the one it holds.
            self.transfer.engines_ready = True
        return self._engines

    @property
    def committed(self) -> int | None:
        """The newest version every engine acknowledged (None before the first)."""
        try:
            with open(self.committed_path) as f:
                return int(json.load(f)["version"])
        except FileNotFoundError:
            return None

    def publish(self, checkpoint: str, *, step: int | None = None) -> Any:
        """Commit ``checkpoint`` (the served weights) to the stream; its commit record. The same
        checkpoint again returns the version it already is (a resumed publish)."""
        return self.transfer.publisher.publish(checkpoint, step=step)

    def prepare(self) -> int:
        """Have every engine plan the stream's head while it serves (``prepare_weights``); the version."""
        self.engines  # noqa: B018 (resolves the handles and the client)
        return self.transfer.prepare_weights()

    def refit(self) -> RefitReport:
        """Bring every engine to the stream's head through vLLM's client (``send_weights``: start,
        update, finish) and commit the version for the trainer once every engine acknowledged it.
        A failed round (an engine died or refused) is driven again once every engine answers, up to
        ``max_rounds`` rounds within ``round_timeout`` s; then ``DeltaRefitError`` names the failures."""
        ray = require_ray()
        from ..stream.chain import head

        engines = self.engines
        version = head(self.store)
        fp = self.fingerprint(version)
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.round_timeout
        failures: list[str] = []
        for rounds in range(1, self.max_rounds + 1):
            t_round = time.perf_counter()
            try:
                got = self.transfer.send_weights()
                if got != version:
                    raise DeltaRefitError(f"the stream moved on during the refit ({version} -> {got})")
                seconds_round = time.perf_counter() - t_round
                states = ray.get([h.state.remote() for h in engines], timeout=self._left(deadline))
                wrong = [s for s in states if s["weight_version"] != str(version)
                         or any(f != fp for f in s["fingerprints"]) or not s["fingerprints"]]
                if wrong:
                    raise DeltaRefitError(f"engines not at version {version} ({fp[:16]}…) after its round: "
                                          + ", ".join(f"{s['name']} at {s['weight_version']}" for s in wrong))
            except (ray.exceptions.RayError, DeltaRefitError, OSError) as e:  # OSError: an HTTP call
                failures.append(f"round {rounds}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                log.warning("refit to version %d: %s", version, failures[-1])
                if rounds == self.max_rounds or time.monotonic() >= deadline:
                    raise DeltaRefitError(f"version {version} not acknowledged by every engine after {rounds} "
                                          f"rounds: {'; '.join(failures)}") from None
                self.wait_ready(timeout=self._left(deadline))
                continue
            write_atomic(self.committed_path, json.dumps({"version": version, "fingerprint": fp}).encode())
            return RefitReport(version, fp, rounds, time.perf_counter() - t0, seconds_round, failures, states)
        raise AssertionError("unreachable")

    def wait_ready(self, timeout: float | None = None, *, handles: list[Any] | None = None) -> None:
        """Wait until every engine (or every actor of ``handles``) answers ``ready`` (a restarted engine
        has caught up with the stream by then). Ray answers a call to a restarting actor with
        ``ActorUnavailableError`` at once, so this asks again until ``timeout``; an actor Ray gave up on
        (``ActorDiedError``) fails it at once."""
        ray = require_ray()
        deadline = time.monotonic() + (timeout or self.ready_timeout)
        pending = list(self.engines if handles is None else handles)
        while pending:
            waiting = []
            for h in pending:
                try:
                    ray.get(h.ready.remote(), timeout=self._left(deadline))
                except ray.exceptions.ActorUnavailableError:
                    waiting.append(h)
            if waiting and time.monotonic() >= deadline:
                raise DeltaRefitError(f"{len(waiting)} actors did not come back within "
                                      f"{timeout or self.ready_timeout:.0f} s")
            if waiting:
                time.sleep(0.5)
            pending = waiting

    def _left(self, deadline: float) -> float:
        return max(1.0, deadline - time.monotonic())
