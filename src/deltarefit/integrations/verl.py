"""deltarefit as a verl checkpoint engine: the trainer publishes each weight sync to a version stream,
every rollout worker follows the stream to that version, verified, and hands verl its tensors.

Selected by configuration alone (verl 0.9.1; docs/FRAMEWORKS.md, "verl")::

    actor_rollout_ref.rollout.checkpoint_engine.backend=deltarefit
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=deltarefit.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltarefit.stream=s3://bucket/run7

verl imports ``custom_backend_module`` in every trainer and rollout worker before it asks
``CheckpointEngineRegistry`` for the backend; importing this module registers ``DeltaRefitCheckpointEngine``
there under ``deltarefit`` (where verl imports; without verl the module imports and registers nothing).

The round, in the order verl's ``CheckpointEngineManager.update_weights`` drives it:

* ``prepare()`` on every worker: actor rank 0 (the one verl builds with ``is_master=True``) names the
  round with a fresh token; the others return nothing.
* ``build_topology``: the token goes to every worker (``init_process_group(token=...)``). No process
  group is built: the payload travels through the stream's store.
* Trainer, ``send_weights(weights, global_steps)``: actor rank 0 publishes the tensors it is handed from
  memory (``Publisher.publish_tensors``; a delta against the previous version, a keyframe every
  ``keyframe_every``), then writes the round's *handoff* (``verl/<token>.json`` in the store: the version
  and its fingerprint, or the publish's error). The other ranks walk the generator (producing each
  tensor is collective over the actor group) and drop what it yields.
* Rollout, ``receive_weights(global_steps)``: waits for the handoff (``timeout_s``), syncs its local
  copy (``checkpoint``, one per rollout worker, in ``/dev/shm`` by default) to that version with a
  ``Subscriber`` (records, signatures with ``verify_key``, stream identity, parent links and every apply
  checked; the cheapest route: the chain of deltas or a keyframe), checks that it holds the handoff's
  fingerprint, and only then yields every tensor of the copy. Nothing is yielded from a sync that was
  refused, so verl's loader never sees an unverified tensor.
* ``finalize()``: actor rank 0 removes the handoff.

The tensors yielded are the trainer's served bits: those it was handed, converted to ``served``
(``"BF16"``, ``"F16"``, ``"F32"``, or None to keep each tensor's dtype) by the one conversion
``publish_tensors`` uses. verl loads them into vLLM through its own IPC loader (``update_weights_from_ipc``),
a full load: the stream saves the trainer-to-rollout bytes, not the load.

In place (``in_place: true``): the rollout keeps no copy and yields one item instead of tensors, the update
request of deltarefit's vLLM weight-transfer backend (``("deltarefit", {"init_info": ..., "update_info":
{"version": V}})``, wire format ``deltarefit``), for a vLLM engine started with
``weight_transfer_config={"backend": "deltarefit"}`` whose workers sync from the stream themselves and
write only the changed elements (docs/VLLM.md). verl 0.9.1's vLLM adapter knows no such wire format: it
needs the small change in docs/FRAMEWORKS.md ("verl"), and refuses the round in one line without it.

The handoff is not trusted beyond the version it names: that version's record is read and checked like
any other (signature, stream identity), and the copy must hash to the record's fingerprint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import blake3

from ..errors import DeltaRefitError, StoreError, StreamError, UsageError

log = logging.getLogger(__name__)

BACKEND = "deltarefit"
HANDOFF_PREFIX = "verl/"
# The wire format of an in-place round: one ("deltarefit", update_request) item instead of tensors.
WIRE_FORMAT = "deltarefit"
SERVED = (None, "BF16", "F16", "F32")
KEYS = ("stream", "state_dir", "signing_key", "verify_key", "served", "keyframe_every", "local_dir", "checkpoint",
        "subscriber_id", "timeout_s", "in_place", "format_version")  # engine_kwargs.deltarefit
POLL_S = 0.1

__all__ = ["BACKEND", "DeltaRefitEngine", "register"]


def _handoff_key(token: str) -> str:
    if not token.isalnum():
        raise UsageError(f"deltarefit verl round token {token!r}: letters and digits only")
    return f"{HANDOFF_PREFIX}{token}.json"


def default_local_dir() -> str:
    root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(root, "deltarefit-verl")


def local_copy(local_dir: str, stream: str, subscriber_id: str) -> str:
    """A rollout worker's copy: one per worker and stream in ``local_dir`` (workers of a host share the dir)."""
    tag = blake3.blake3(stream.encode()).hexdigest(6)
    return os.path.join(os.path.abspath(local_dir), f"{tag}-{subscriber_id}.safetensors")


def _default_id() -> str:
    rank = os.environ.get("RANK")
    return f"verl-{os.uname().nodename}-" + (f"rank{rank}" if rank and rank.isdigit() else f"pid{os.getpid()}")


def checkpoint_tensors(path: str) -> Iterator[tuple[str, Any]]:
    """Every tensor of a safetensors checkpoint (a file, or a directory of ``*.safetensors``), one at a
    time, each a CPU tensor of its own: ``safe_open``'s tensors share the file's mapping, which the next
    sync writes in place, so each is copied out (one tensor's bytes at a time)."""
    from safetensors import safe_open

    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, st.get_tensor(name).clone()


class DeltaRefitEngine:
    """verl's ``CheckpointEngine`` contract over a deltarefit stream, without verl (the registered class,
    ``DeltaRefitCheckpointEngine``, is this with verl's base class; see the module docstring).

    verl builds it with ``bucket_size`` (unused: nothing is bucketed), ``is_master`` on the trainer side
    only (rank 0 True), and the keys of ``engine_kwargs.deltarefit``:

    * ``stream``: a directory or ``s3://`` URL both sides reach (required);
    * trainer: ``state_dir`` (the publisher's baseline; default as ``deltarefit publish``'s),
      ``signing_key`` (Ed25519 private key: records are signed), ``served`` (dtype of what is published),
      ``keyframe_every``, ``format_version`` (of the deltas, 1 or 2; default the stream's);
    * rollout: ``verify_key`` (records must verify with it), ``local_dir`` (where each rollout worker keeps
      its copy, ``<stream hash>-<subscriber_id>.safetensors``; default ``/dev/shm/deltarefit-verl``),
      ``checkpoint`` (this one worker's copy, exactly: not for a config shared by several), ``subscriber_id``
      (default from the host and verl's ``RANK``), ``timeout_s`` (how long a rollout waits for the
      trainer's handoff, default 1800), ``in_place`` (hand the vLLM engine the backend's update request
      instead of tensors; module docstring).
    """

    def __init__(self, bucket_size: int | None = None, is_master: bool | None = None, *, stream: str | None = None,
                 state_dir: str | None = None, signing_key: str | None = None, verify_key: str | None = None,
                 served: str | None = None, keyframe_every: int = 20, local_dir: str | None = None,
                 checkpoint: str | None = None, subscriber_id: str | None = None, timeout_s: float = 1800.0,
                 in_place: bool = False, format_version: int | None = None, **unknown: Any) -> None:
        if unknown:
            raise UsageError(f"engine_kwargs.deltarefit: unknown key(s) {', '.join(sorted(unknown))}; known: "
                             f"{', '.join(KEYS)}")
        if not stream:
            raise UsageError("engine_kwargs.deltarefit.stream is required: the directory or s3:// URL of the "
                             "version stream (+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltarefit"
                             ".stream=...)")
        if served not in SERVED:
            raise UsageError(f"engine_kwargs.deltarefit.served: {served!r}; use BF16, F16, F32 or null")
        if format_version not in (None, 1, 2):
            raise UsageError(f"engine_kwargs.deltarefit.format_version: {format_version!r}; use 1, 2 or null")
        if timeout_s <= 0:
            raise UsageError(f"engine_kwargs.deltarefit.timeout_s must be > 0, got {timeout_s}")
        self.bucket_size = bucket_size
        self.stream = str(stream)
        # verl passes is_master on the trainer side only (engine_workers), never on the rollout side.
        self.trainer = is_master is not None
        self.is_master = bool(is_master)
        self.state_dir = state_dir
        self.signing_key = signing_key
        self.verify_key = verify_key
        self.served = served
        self.keyframe_every = int(keyframe_every)
        self.format_version = format_version
        self.subscriber_id = subscriber_id or _default_id()
        self.checkpoint = os.path.abspath(checkpoint) if checkpoint else local_copy(
            local_dir or default_local_dir(), self.stream, self.subscriber_id)
        self.timeout_s = float(timeout_s)
        self.in_place = bool(in_place)
        if self.in_place:
            # verl's CheckpointEngineWorker hands the adapter this wire format; only a verl patched as in
            # docs/FRAMEWORKS.md ("verl", in-place refit) knows it (its stock adapters refuse it in one line).
            self.wire_format = WIRE_FORMAT
        self.token: str | None = None
        self._publisher = None
        self._subscriber = None
        self._store = None

    # -- verl's round ---------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """Actor rank 0 names the round (a fresh token); everyone else returns an empty dict."""
        if self.trainer and self.is_master:
            self.token = uuid.uuid4().hex
            return {"deltarefit_token": self.token}
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """The round's token for every worker (``metadata[0]`` is actor rank 0's ``prepare``)."""
        token = (metadata[0] or {}).get("deltarefit_token") if metadata else None
        if not token:
            raise UsageError("deltarefit: actor rank 0 named no round (its engine was not built with "
                             "is_master=True, or the metadata is not verl's actors-then-rollouts list)")
        return {"token": [token] * actor_wg_world_size}, {"token": [token] * rollout_world_size}

    def init_process_group(self, token: str, **_: Any) -> None:
        """Takes the round's token; no process group: the weights travel through the stream."""
        _handoff_key(token)
        self.token = token

    def finalize(self) -> None:
        """Actor rank 0 removes the round's handoff (every rollout has read it: verl finalizes after
        both sides' updates returned)."""
        if self.trainer and self.is_master and self.token:
            try:
                self.store.delete(_handoff_key(self.token))
            except DeltaRefitError as e:
                log.warning("deltarefit: could not remove the handoff of round %s (%s)", self.token, e)
        self.token = None

    # -- trainer ----------------------------------------------------------------------------------

    @property
    def store(self) -> Any:
        """The stream's store; a directory is created by the trainer, and must exist for a rollout."""
        if self._store is None:
            from ..storage.base import open_store

            self._store = open_store(self.stream, create=self.trainer)
        return self._store

    @property
    def publisher(self) -> Any:
        if self._publisher is None:
            from ..stream.publisher import Publisher, default_state_dir

            self._publisher = Publisher(self.store, self.state_dir or default_state_dir(self.stream),
                                        keyframe_every=self.keyframe_every, signing_key=self.signing_key,
                                        format_version=self.format_version)
        return self._publisher

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Trainer: actor rank 0 publishes ``weights`` (an iterable or async iterable of ``(name, tensor)``)
        from memory as the next version and hands its version to the round; the other ranks walk them.
        Returns verl's per-sync metrics (rank 0; the others an empty dict)."""
        if not self.trainer:
            raise UsageError("deltarefit: send_weights on a rollout worker (built without is_master)")
        if not self.is_master:
            await _drain(weights)
            return {}
        key = _handoff_key(self._need_token())
        t0 = time.perf_counter()
        try:
            if hasattr(weights, "__aiter__"):
                rec = await _publish_async(self.publisher, _on_host_async(weights), self.served, global_steps)
            else:
                rec = self.publisher.publish_tensors(_on_host(weights), served=self.served, step=global_steps)
        except BaseException as e:
            # Rollouts fail at once with the trainer's reason instead of waiting out their timeout.
            self._put_handoff(key, {"error": f"{type(e).__name__}: {e}"})
            raise
        seconds = time.perf_counter() - t0
        self._put_handoff(key, {"version": rec.version, "fingerprint": rec.fingerprint, "step": global_steps})
        log.info("deltarefit: step %s published as version %d (%s, %d of %d bytes) in %.2f s", global_steps,
                 rec.version, rec.kind, rec.part_bytes, rec.full_bytes, seconds)
        return {"deltarefit/version": float(rec.version), "deltarefit/bytes": float(rec.part_bytes),
                "deltarefit/full_bytes": float(rec.full_bytes), "deltarefit/keyframe": float(rec.kind == "keyframe"),
                "deltarefit/publish_s": seconds}

    def _put_handoff(self, key: str, body: dict[str, Any]) -> None:
        self.store.put(key, json.dumps(body, sort_keys=True).encode())

    def _need_token(self) -> str:
        if not self.token:
            raise UsageError("deltarefit: no round token; verl calls prepare, build_topology and "
                             "init_process_group before send_weights and receive_weights")
        return self.token

    # -- rollout ----------------------------------------------------------------------------------

    @property
    def subscriber(self) -> Any:
        if self._subscriber is None:
            from ..stream.subscriber import Subscriber

            os.makedirs(os.path.dirname(self.checkpoint), exist_ok=True)
            self._subscriber = Subscriber(self.store, self.checkpoint, subscriber_id=self.subscriber_id,
                                          public_key=self.verify_key)
        return self._subscriber

    async def wait_handoff(self) -> dict[str, Any]:
        """The round's handoff from the trainer, once it is in the store (``timeout_s``)."""
        key = _handoff_key(self._need_token())
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                body = json.loads(self.store.get(key))
            except (KeyError, StoreError) as e:
                # Not yet there: no handoff, or (a directory store) the trainer has not created the store.
                if isinstance(e, StoreError) and self._store is not None:
                    raise
                if time.monotonic() > deadline:
                    raise StreamError(f"{self.stream}: no handoff from the trainer for round {self.token} within "
                                      f"{self.timeout_s:g} s (engine_kwargs.deltarefit.timeout_s)") from None
                await asyncio.sleep(POLL_S)
                continue
            except ValueError as e:
                raise StreamError(f"{self.stream}/{key}: malformed handoff ({e})") from None
            if not isinstance(body, dict):
                raise StreamError(f"{self.stream}/{key}: malformed handoff")
            if "error" in body:
                raise StreamError(f"{self.stream}: the trainer's publish for round {self.token} failed: "
                                  f"{body['error']}")
            if not isinstance(body.get("version"), int) or not isinstance(body.get("fingerprint"), str):
                raise StreamError(f"{self.stream}/{key}: malformed handoff (no version or fingerprint)")
            return body

    def sync_to(self, version: int, fingerprint: str) -> Any:
        """Bring the local copy to ``version`` (verified by the subscriber) and check it holds
        ``fingerprint``; returns the ``SyncReport``."""
        sub = self.subscriber
        held = sub.current()
        if held is not None and held[0] > version:
            raise StreamError(f"{self.stream}: the trainer handed over version {version}, but {self.checkpoint} "
                              f"already holds version {held[0]}; a stream does not go back")
        rep = sub.sync(to_version=version)
        if (rep.version, rep.fingerprint) != (version, fingerprint):
            raise StreamError(f"{self.checkpoint}: synced to version {rep.version} ({rep.fingerprint[:16]}…), "
                              f"not the trainer's version {version} ({fingerprint[:16]}…)")
        return rep

    def update_request(self, version: int) -> dict[str, dict[str, Any]]:
        """What an in-place round hands verl's (patched) vLLM adapter: the deltarefit weight-transfer
        backend's init info (sent once per engine) and update info. The engine's workers sync from the
        stream themselves and verify every apply (docs/VLLM.md)."""
        init = {"stream": self.stream, "verify_key": self.verify_key}
        return {"init_info": {k: v for k, v in init.items() if v is not None}, "update_info": {"version": version}}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, Any]]:
        """Rollout: waits for the trainer's version, syncs the local copy to it, verified, then yields
        every tensor of the copy. Raises before the first yield when the sync is refused."""
        if self.trainer:
            raise UsageError("deltarefit: receive_weights on a trainer worker (built with is_master)")
        body = await self.wait_handoff()
        version, fingerprint = body["version"], body["fingerprint"]
        if self.in_place:
            yield WIRE_FORMAT, self.update_request(version)
            return
        t0 = time.perf_counter()
        rep = await asyncio.to_thread(self.sync_to, version, fingerprint)
        log.info("deltarefit: step %s, %s at version %d (%s, %d bytes fetched) in %.2f s", global_steps,
                 self.checkpoint, version, rep.route, rep.bytes_fetched, time.perf_counter() - t0)
        self.last_sync = rep
        for item in checkpoint_tensors(self.checkpoint):
            yield item


def _host(t: Any) -> Any:
    return t if getattr(t, "device", None) is None or t.device.type == "cpu" else t.detach().to("cpu")


def _on_host(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Each tensor moved to the host as it comes (a trainer's gather yields one full tensor at a time on
    its device; the publish holds every tensor until it returns, so on the host, not on the device)."""
    for name, t in weights:
        yield name, _host(t)


async def _on_host_async(weights: Any) -> AsyncIterator[tuple[str, Any]]:
    async for name, t in weights:
        yield name, _host(t)


async def _drain(weights: Any) -> None:
    if hasattr(weights, "__aiter__"):
        async for _ in weights:
            pass
    else:
        for _ in weights:
            pass


_END = object()


class _Abort:
    def __init__(self, error: BaseException) -> None:
        self.error = error


async def _publish_async(publisher: Any, weights: Any, served: str | None, step: int | None) -> Any:
    """``publish_tensors`` over an async iterable: the iterable is walked on the event loop (its tensors may
    come from collectives bound to this thread), the publish runs on a thread fed one tensor at a time. An
    iterable that fails mid-walk fails the publish (nothing is committed from part of the weights)."""
    q: queue.Queue = queue.Queue(maxsize=2)
    failed = threading.Event()
    ended = threading.Event()  # the consumer took the last item (_END or _Abort)

    def items() -> Iterator[tuple[str, Any]]:
        while True:
            it = q.get()
            if it is _END or isinstance(it, _Abort):
                ended.set()
                if it is _END:
                    return
                raise UsageError(f"the weights' iterator failed before its end: {it.error!r}") from it.error
            yield it

    def run() -> Any:
        try:
            return publisher.publish_tensors(items(), served=served, step=step)
        except BaseException:
            failed.set()
            while not ended.is_set():  # let the producer finish its walk
                it = q.get()
                if it is _END or isinstance(it, _Abort):
                    break
            raise

    async def put(it: Any) -> None:
        while True:
            try:
                q.put(it, timeout=POLL_S)
                return
            except queue.Full:
                await asyncio.sleep(0)

    fut = asyncio.get_running_loop().run_in_executor(None, run)
    try:
        async for item in weights:
            if not failed.is_set():
                await put(item)
    except BaseException as e:
        await put(_Abort(e))
        try:
            await fut
        finally:
            raise e
    await put(_END)
    return await fut


def register() -> type | None:
    """Register ``DeltaRefitCheckpointEngine`` (this engine on verl's ``CheckpointEngine``) in verl's
    ``CheckpointEngineRegistry`` under ``deltarefit``; returns the class, or None where verl does not import."""
    try:
        from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
    except ImportError:
        return None
    cls = CheckpointEngineRegistry._registry.get(BACKEND)
    if cls is None or not issubclass(cls, DeltaRefitEngine):
        cls = type("DeltaRefitCheckpointEngine", (DeltaRefitEngine, CheckpointEngine),
                   {"__module__": __name__, "__doc__": DeltaRefitEngine.__doc__})
        CheckpointEngineRegistry.register(BACKEND)(cls)
    return cls


DeltaRefitCheckpointEngine = register()
