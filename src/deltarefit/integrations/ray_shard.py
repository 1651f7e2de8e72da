"""A trainer sharded over several Ray actors, publishing each step as a sharded version (docs/RAY.md).

The pieces, beside ``integrations.ray``'s engine side:

* ``TrainerRank``: the base of a trainer-rank actor. Each rank holds its own shard of the model (its
  fp32 masters in its ``shard.names.trainer_layout``) and publishes its part of each step with
  ``ShardStreamPublisher``, in two calls from the driver: ``upload`` (every rank uploads its part under
  the attempt the driver hands out and returns its ref: key, bytes, BLAKE3) and ``finish`` (the
  committer, rank 0, commits with the refs the driver gathered through Ray, never with what it reads
  back from the store, where a store writer could plant a part; every rank then advances). No process
  group, so a rank can die and come back without tearing one down. A subclass says what its
  masters are at a step (``masters``); they must be the same after a restart (read from its own
  checkpoint of that step), so a republished part holds the same bytes.
* ``start_trainer_ranks``: the rank actors in one placement group (one bundle per rank, packed on the
  trainer's node), restarted by Ray up to ``max_restarts`` times.
* ``ShardRefitTrainer``: the driver. ``publish(step)`` has every rank upload its part of the step under
  one attempt, then hands every ref to every rank's ``finish``; a rank whose process died in the middle
  of either (``RayActorError``) is asked the same again, same attempt, once Ray restarted it. A rank
  whose upload is refused (its key already held other bytes) fails the step: nothing is committed. ``refit()`` is ``RefitTrainer``'s round: every engine brought to the
  stream's head through vLLM's client, the version committed for the trainer (``committed.json``) only
  when every engine reports it and every worker holds its fingerprint (the sharded record's).

**Resume.** A rank killed anywhere in a publish leaves either no commit record (its part, whole or
absent, under the attempt: the rerun creates the same bytes again, or finds them there), or a record
its saved baseline has not reached (``recover`` follows it on the rerun). A rank asked for a step the
stream already holds (the head record's ``step``: the version was committed before the rank died)
returns that record: each step is one version, none lost, none twice.

The payload never travels through Ray: parts go from each rank to the store, and engines read them
from there. Ray carries the calls, the attempt id, the parts' refs (as plain dicts), versions and
fingerprints.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from ..errors import DeltaRefitError, UsageError
from .placement import READY_TIMEOUT, require_ray
from .ray import ROUND_TIMEOUT, RefitTrainer

log = logging.getLogger(__name__)

PUBLISH_TIMEOUT = 600.0  # a rank waiting for the others' parts (or the commit): a restarted rank's rerun included

__all__ = ["ShardRefitTrainer", "TrainerRank", "start_trainer_ranks"]


class TrainerRank:
    """One trainer rank as a Ray actor's class: its shard of the model and its part of each version.

    ``stream``: the store URL. ``layout``: the rank's ``trainer_layout``. ``cuts``: the rollout
    layouts' slice boundaries (``cuts_from_layouts``). ``state_dir``: where the rank saves its baseline
    slice (``rank-<r>.npz``; on its node's disk, kept across a restart). Subclasses implement
    ``masters(step)``: ``{local name: fp32 tensor}``, the same whenever it is asked for the same step.
    """

    def __init__(self, stream: str, layout: Mapping[str, Any], *, rank: int, world: int, state_dir: str,
                 cuts: Mapping[str, Any] | None = None, served: str = "BF16", keyframe_every: int = 20,
                 timeout: float = PUBLISH_TIMEOUT, signing_key: str | None = None, format_version: int = 2) -> None:
        ray = require_ray()
        from ..shard.stream import ShardStreamPublisher

        self.rank, self.world, self.stream = rank, world, stream
        ctx = ray.get_runtime_context()
        self.restarted = bool(ctx.was_current_actor_reconstructed)
        self.publisher = ShardStreamPublisher(stream, layout, served, cuts=cuts, rank=rank, world=world,
                                              state_dir=state_dir, timeout=timeout, poll=0.1,
                                              keyframe_every=keyframe_every, signing_key=signing_key,
                                              format_version=format_version)

    def masters(self, step: int) -> Mapping[str, Any]:
        """This rank's fp32 master shard after ``step`` (a subclass's)."""
        raise NotImplementedError

    def _resumed(self, step: int) -> dict[str, Any] | None:
        """The summary of ``step``'s version where the stream holds it already (after ``recover``: this rank's
        baseline is at the head), else None; refused where the stream is past ``step``."""
        from ..shard.stream import load_shard_commit

        sp = self.publisher
        t0 = time.perf_counter()
        v = sp.recover()
        if not v:
            return None
        rec = load_shard_commit(sp.store, v)
        if rec.step == step:
            return self._summary(rec, resumed=True, seconds=time.perf_counter() - t0)
        if rec.step is not None and rec.step > step:
            raise UsageError(f"rank {self.rank}: the stream holds step {rec.step} (version {v}); step {step} "
                             "is behind it")
        return None

    def upload(self, step: int, attempt: str) -> dict[str, Any]:
        """Phase one of ``step``'s version: this rank's part under ``attempt``. Returns ``{"version", "ref"}``
        (the ref as a plain dict, for the driver to hand to the committer), or ``{"resumed": summary}``
        where the stream holds the step already (a rerun after a restart)."""
        done = self._resumed(step)
        if done is not None:
            return {"resumed": done}
        t0 = time.perf_counter()
        ref = self.publisher.upload(self.masters(step), attempt)
        self._upload_s = time.perf_counter() - t0
        return {"version": self.publisher.version + 1, "ref": {"key": ref.key, "bytes": ref.bytes,
                                                               "blake3": ref.blake3, "head": ref.head}}

    def finish(self, step: int, attempt: str, version: int, refs: list[dict[str, Any]]) -> dict[str, Any]:
        """Phase two: the committer commits ``version`` from ``refs`` (every rank's ``upload`` return, in rank
        order, as the driver gathered them); every rank then advances to the committed record. Returns the
        summary; a version already committed and reached returns it (a rerun after a restart)."""
        from ..shard.records import PartRef

        done = self._resumed(step)
        if done is not None:
            return done
        sp = self.publisher
        t0 = time.perf_counter()
        if sp.version + 1 != version:
            raise UsageError(f"rank {self.rank} is at version {sp.version}; cannot finish version {version}")
        if self.rank == sp.committer:
            parts = [PartRef(str(r["key"]), int(r["bytes"]), str(r["blake3"]), str(r.get("head", "")))
                     for r in refs]  # the head's BLAKE3 binds the descriptor's head (``PartRef``)
            rec = sp.commit_version(version, attempt, refs=parts, step=step)
        else:
            rec = sp.wait_commit(version)
        sp.advance(rec)
        return self._summary(rec, resumed=False, seconds=getattr(self, "_upload_s", 0.0) + time.perf_counter() - t0)

    def _summary(self, rec: Any, *, resumed: bool, seconds: float) -> dict[str, Any]:
        st = self.publisher.last_stats
        return {"rank": self.rank, "version": rec.version, "fingerprint": rec.fingerprint, "step": rec.step,
                "attempt": rec.attempt, "keyframe": rec.keyframe, "resumed": resumed, "restarted": self.restarted,
                "part_bytes": None if resumed or st is None else st.part_bytes, "seconds": seconds}

    def pid(self) -> int:
        import os

        return os.getpid()

    def ready(self) -> bool:
        return True


def start_trainer_ranks(actor_cls: type, world: int, *args: Any, resources: dict[str, float] | None = None,
                        num_cpus: float = 1, max_restarts: int = 3, name: str = "trainer",
                        runtime_env: dict[str, Any] | None = None, timeout: float = READY_TIMEOUT,
                        **kwargs: Any) -> list[Any]:
    """``world`` actors of ``actor_cls`` (a ``TrainerRank``), rank r built as ``actor_cls(*args, rank=r,
    world=world, **kwargs)``, in one placement group of ``world`` bundles (``num_cpus`` CPUs and
    ``resources`` each, ``PACK``: on the trainer's node where it has room), named ``<name>-rank-<r>``,
    restarted up to ``max_restarts`` times, in-flight calls not retried (the driver asks again).
    Returns the handles in rank order once every rank answers."""
    ray = require_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if world < 1:
        raise UsageError(f"world must be >= 1, got {world}")
    bundle = {"CPU": num_cpus, **(resources or {})}
    pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK", name=f"deltarefit-{name}-ranks")
    ray.get(pg.ready(), timeout=timeout)
    handles = []
    for r in range(world):
        opts = dict(num_cpus=num_cpus, resources=dict(resources or {}), max_restarts=max_restarts,
                    max_task_retries=0, name=f"{name}-rank-{r}", runtime_env=runtime_env,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r))
        handles.append(ray.remote(actor_cls).options(**opts).remote(*args, rank=r, world=world, **kwargs))
    ray.get([h.ready.remote() for h in handles], timeout=timeout)
    return handles


class _ShardTransfer:
    """The trainer engine's round trip for a sharded stream (what ``RefitTrainer`` drives): no publisher
    here, the trainer ranks publish. The engines get ``init_info`` once, then start, update to the head,
    finish and the version stamp, through vLLM's client."""

    def __init__(self, stream: str, init_info: dict[str, Any]) -> None:
        from ..storage.base import open_store

        self.store = open_store(stream)
        self.init_info = dict(init_info)
        self.client: Any = None
        self.engines_ready = False

    def _head(self) -> int:
        from ..stream.chain import head

        if not self.engines_ready:
            self.client.init_weight_transfer_engine(self.init_info)
            self.engines_ready = True
        return head(self.store)

    def prepare_weights(self) -> int:
        version = self._head()
        self.client.prepare_weights(version)
        return version

    def send_weights(self) -> int:
        version = self._head()
        self.client.start_weight_update()
        self.client.update_weights({"version": version})
        self.client.finish_weight_update(weight_version=str(version))
        return version


class ShardRefitTrainer(RefitTrainer):
    """The driver of a sharded trainer: publishes each step through the trainer-rank actors and brings
    every engine to it with ``RefitTrainer``'s rounds (the same acknowledgement rule).

    ``ranks``: the ``TrainerRank`` handles in rank order (``start_trainer_ranks``). ``engines``: handles
    or names of actors with vLLM's weight-sync calls and ``state`` (``EngineActor``, or any rollout
    actor that follows the sharded stream). ``engine_init``: what the engines' backend is initialized
    with (default ``{"stream": stream, "version": engine_version}``). ``state_dir``: where the
    driver's ``committed.json`` goes. ``publish_timeout``: the bound of one step's publish, restarts of
    killed ranks included.
    """

    def __init__(self, ranks: list[Any], engines: list[Any], stream: str, state_dir: str, *,
                 engine_version: int | None = None, engine_init: dict[str, Any] | None = None,
                 publish_timeout: float = PUBLISH_TIMEOUT, max_rounds: int = 3,
                 round_timeout: float = ROUND_TIMEOUT, ready_timeout: float = READY_TIMEOUT) -> None:
        if not ranks:
            raise UsageError("a sharded trainer needs at least one rank")
        self.ranks = list(ranks)
        self.publish_timeout = publish_timeout
        init = {"stream": stream, "version": engine_version} if engine_init is None else engine_init
        self._engine_init = {k: v for k, v in init.items() if v is not None}
        super().__init__(engines, stream, state_dir, max_rounds=max_rounds, round_timeout=round_timeout,
                         ready_timeout=ready_timeout)

    def _make_transfer(self, stream: str, **_: Any) -> _ShardTransfer:
        return _ShardTransfer(stream, self._engine_init)

    @property
    def store(self) -> Any:
        return self.transfer.store

    def fingerprint(self, version: int) -> str:
        from ..shard.stream import load_shard_commit

        return load_shard_commit(self.store, version).fingerprint

    def _ask(self, step: int, deadline: float, restarts: list[int], call) -> dict[int, dict[str, Any]]:
        """``call(handle)`` on every rank, each answer by rank; a rank whose process died in the middle is
        asked the same again once Ray restarted it (its rank appended to ``restarts``); a refusal
        (``RayTaskError``) or a rank Ray gave up on raises ``DeltaRefitError``, nothing committed by this
        call's phase where it was the upload."""
        ray = require_ray()
        pending = {call(h): r for r, h in enumerate(self.ranks)}
        done: dict[int, dict[str, Any]] = {}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeltaRefitError(f"step {step}: ranks {sorted(pending.values())} did not publish within "
                                      f"{self.publish_timeout:.0f} s")
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            for ref in ready:
                r = pending.pop(ref)
                try:
                    done[r] = ray.get(ref)
                except ray.exceptions.RayActorError:
                    # The rank's process died in the middle: once Ray restarted it, the same call, same
                    # attempt (its part is rebuilt from its checkpoint: the same bytes). A rank Ray gave
                    # up on (max_restarts spent) fails wait_ready at once.
                    log.warning("step %d: trainer rank %d died mid-publish; asking it again once it is back", step, r)
                    restarts.append(r)
                    self.wait_ready(timeout=max(1.0, deadline - time.monotonic()), handles=[self.ranks[r]])
                    pending[call(self.ranks[r])] = r
                except ray.exceptions.RayTaskError as e:
                    raise DeltaRefitError(f"step {step}: trainer rank {r}: {str(e).splitlines()[-1][:300]}") from None
        return done

    def publish(self, step: int) -> dict[str, Any]:  # type: ignore[override]
        """Every rank uploads its part of ``step`` under one fresh attempt, then finishes it with every rank's
        ref (the committer commits, every rank advances); returns the committed
        version's summary (``version``, ``fingerprint``, ``step``, per rank ``ranks``, and ``restarts``:
        the ranks asked again after their process died). A rank that died is asked again, same attempt,
        once Ray restarted it; a refusal (``PublishError`` on a rank) or a rank Ray gave up on raises."""
        from ..shard.stream import new_attempt

        attempt = new_attempt()
        deadline = time.monotonic() + self.publish_timeout
        restarts: list[int] = []
        up = self._ask(step, deadline, restarts, lambda h: h.upload.remote(step, attempt))
        if all("resumed" in u for u in up.values()):
            done = {r: u["resumed"] for r, u in up.items()}
        else:
            versions = {u.get("version", u.get("resumed", {}).get("version")) for u in up.values()}
            if len(versions) != 1 or any("resumed" in u for u in up.values()):
                raise DeltaRefitError(f"step {step}: the ranks are at different versions ({sorted(up.items())}); "
                                      "not committed")
            version = versions.pop()
            refs = [up[r]["ref"] for r in range(len(self.ranks))]
            done = self._ask(step, deadline, restarts, lambda h: h.finish.remote(step, attempt, version, refs))
        got = {(d["version"], d["fingerprint"], d["step"]) for d in done.values()}
        if len(got) != 1:
            raise DeltaRefitError(f"step {step}: the ranks report different versions {sorted(got)}")
        version, fp, _ = got.pop()
        return {"version": version, "fingerprint": fp, "step": step, "attempt": done[0]["attempt"],
                "keyframe": done[0]["keyframe"], "restarts": restarts, "ranks": [done[r] for r in sorted(done)]}
