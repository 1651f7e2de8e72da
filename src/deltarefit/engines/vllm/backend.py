"""deltarefit as a native vLLM weight-transfer backend (``vllm/distributed/weight_transfer``).

Selected with one config line, as RL frameworks switch backends::

    vllm serve CKPT --weight-transfer-config '{"backend": "deltarefit"}'
    LLM(model=CKPT, weight_transfer_config={"backend": "deltarefit"})

The backend is registered by the ``vllm.general_plugins`` entry point ``deltarefit``
(``deltarefit_vllm_plugin:register``, which vLLM runs in every process; this module is imported only
when vLLM creates the engine).

Worker side (``DeltaRefitWeightTransferEngine``):

* ``init_weight_transfer_engine({"stream": DIR_OR_S3_URL, "verify_key": ..., "version": ...})`` (within the
  engine's pinned trust, below) builds the
  worker's ``LiveEngine`` (layout captured from the model's own loader, checked against the checkpoint the
  engine was loaded from) and finds the version it holds (``version``, or the newest one whose
  fingerprint it has). Hazard: its kernel check changes one element of each linear weight for a moment
  (restored at once), so it runs while no request does: before serving, between ``generate`` calls, or
  drained (``HTTPClient`` pauses the server around it).
* ``update_weights({"version": N})`` (between ``start_weight_update`` and ``finish_weight_update``) makes
  the worker sync from the stream itself: records read and checked (parent links, signatures with
  ``verify_key``), the cheapest route staged and checked before any write (a route of deltas in memory,
  ``/dev/shm``, where it fits: a refit writes nothing to disk), each delta applied in place (O(changed
  elements) written), a keyframe (staged on disk) through the reload path. The held version moves only after
  each apply verified. A failure leaves the worker at a verified version or completable by sending
  the same update again; nothing needs a restart.
* ``update_weights({"version": N, "prepare": true})``, sent while the engine serves (no pause around it),
  returns at once and has a thread of the worker sync to N up to its first write: the route's records
  checked, its parts staged, the first delta planned against the live weights (``LiveEngine.prepare``:
  decoded and checked, nothing written; a tensor-parallel group, whose workers plan together, only
  stages). The next ``update_weights({"version": N})``, in the pause,
  waits for that plan and writes it: the changed elements are read again first and must hold the bits
  the plan read. The engine's pause is then the writes and their checks, not the decode. A plan that
  was refused or went stale is dropped and the update plans again (and refuses there, with nothing
  written). Hazard: the planning thread takes CPU (and the GIL, for its Python parts) from the
  engine's own work while it runs.

A **sharded stream** (a trainer sharded over ranks, ``shard.ShardStreamPublisher``: every rank uploads its
part of a version, one commits) is detected from its records at init, with the same init and update
info: the worker follows it with ``sharded.ShardFollower`` (``shard.sync.sync_sharded`` into the engine's
captured layout, then the engine's own steps after an apply; a TP group's workers together). A prepare
update fetches and checks the route ahead there; the cells are decoded and written in the update. ``deltarefit_live_describe``'s "fingerprint" is then the sharded record's
(``sharded.version_fingerprint`` reads either kind for the trainer's acknowledgement).

Trust is the engine's, not the caller's (``trust``): with ``DELTAREFIT_VERIFY_KEY`` and ``DELTAREFIT_STREAMS``
in the workers' environment, an init naming another key or none, or a stream outside those, is refused before
anything is read or built, and every record followed must be signed by the pinned key. The stream is never
created at init. Each message's fields are checked when it is built (``trust.InitFields``,
``trust.UpdateFields``): a wrong type or range is refused in one line.

Trainer side (``DeltaRefitTrainerWeightTransferEngine``): a ``Publisher`` on the trainer's stream;
``send_weights(checkpoint)`` publishes the checkpoint as the next version and drives the round trip
(start, update with that version, finish with ``weight_version=str(version)``) through any
``VLLMWeightSyncClient`` (vLLM's HTTP or Ray clients, or ``LLMClient`` below for an in-process ``LLM``).
``prepare_weights(checkpoint)`` publishes it and has the engines plan it while they serve; the
``send_weights()`` after it then costs the engines' pause only the writes.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ...errors import UsageError
from ...storage.base import open_store
from ...stream.records import StreamError, head, load_commit, newest_with_fingerprint
from ...stream.subscriber import Subscriber
from .holder import EngineHolder, engine_subscriber
from .sharded import ShardFollower, stream_kind
from .trust import InitFields, UpdateFields, engine_trust, parse_message

log = logging.getLogger(__name__)

BACKEND = "deltarefit"

__all__ = ["BACKEND", "DeltaRefitInitInfo", "DeltaRefitTrainerInitInfo", "DeltaRefitTrainerWeightTransferEngine",
           "DeltaRefitUpdateInfo", "DeltaRefitWeightTransferEngine", "HTTPClient", "LLMClient"]


@dataclass
class DeltaRefitInitInfo(InitFields, WeightTransferInitInfo):
    """The backend's init message (fields: ``trust.InitFields``, each checked when built)."""


@dataclass
class DeltaRefitUpdateInfo(UpdateFields, WeightTransferUpdateInfo):
    """The backend's update message (fields: ``trust.UpdateFields``, each checked when built)."""


def held_version(store: Any, fingerprint: str, version: int | None,
                 public_key: str | None = None) -> tuple[int, str]:
    """The version an engine holding ``fingerprint`` is at: ``version`` if its record says that
    fingerprint, else the newest version that does; refuses an engine that holds no version. With
    ``public_key``, it must be signed by it: each record is checked over its stored bytes before it is
    parsed; one that does not verify is passed over, its refusal reported when no signed one holds it."""
    from ...signing import Verifier

    verifier = Verifier(public_key) if public_key else None
    if version is not None:
        rec = load_commit(store, version, verifier)
        if rec.fingerprint != fingerprint:
            raise StreamError(f"{store.url} version {version} is {rec.fingerprint[:16]}…; the engine holds "
                              f"{fingerprint[:16]}…")
        return version, fingerprint
    found, refused = newest_with_fingerprint(store, fingerprint, verifier)
    if found is not None:
        return found, fingerprint
    if refused is not None:
        raise refused
    raise StreamError(f"the engine's weights ({fingerprint[:16]}…) are no version of {store.url}; start it "
                      "from a version's checkpoint")


def head_signed(store: Any, public_key: str) -> int:
    """The head version of a plain stream, whose record must be signed by ``public_key``
    (``SignatureError`` otherwise, ``StreamError`` for an empty stream)."""
    from ...signing import Verifier

    v = head(store)
    if v == 0:
        raise StreamError(f"{store.url}: no version in this stream")
    verifier = Verifier(public_key)
    load_commit(store, v, verifier)  # the signature checked over the bytes read, before parsing
    return v


def seed_book(sub: Subscriber, checkpoint: str) -> bool:
    """Start the engine's history book from the one a rollout keeps beside the checkpoint the engine
    loaded (``deltarefit sync`` of a stream published with ``--history``), so that the engine goes on by
    the chain from its first update instead of taking a keyframe route. A copy only: whether it follows
    the stream at the held version is checked before every route, a malformed one is started over,
    and one that holds other moves is refused by name (the route falls back). Whether it was copied."""
    import shutil

    from ...stream.subscriber import history_path

    src = history_path(checkpoint)
    if not sub.hook_keeps_book or not os.path.isdir(src):
        return False
    shutil.copytree(src, sub.book_path, dirs_exist_ok=True)
    return True


class DeltaRefitWeightTransferEngine(WeightTransferEngine[DeltaRefitInitInfo, DeltaRefitUpdateInfo]):
    """vLLM worker side of the deltarefit backend (see the module docstring)."""

    init_info_cls = DeltaRefitInitInfo
    update_info_cls = DeltaRefitUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        engine_trust()  # the worker's pins, read (and a pin that cannot hold refused) as the engine starts
        self.live = None
        self.holder: EngineHolder | None = None  # the worker's engine as what holds the stream's version
        self.sub: Subscriber | None = None
        self.follower: ShardFollower | None = None  # instead of ``holder`` and ``sub``, for a sharded stream
        self.info: DeltaRefitInitInfo | None = None
        self.last: dict[str, Any] = {}
        self.preparing: threading.Thread | None = None  # the thread of a prepare update, while it runs
        self.prepare_error: BaseException | None = None
        self.verify_key: str | None = None  # the key records are checked with: the pinned one, if pinned

    def parse_init_info(self, init_dict: dict[str, Any]) -> DeltaRefitInitInfo:
        return parse_message(DeltaRefitInitInfo, init_dict, "init_info")  # one line, not a bare TypeError

    def parse_update_info(self, update_dict: dict[str, Any]) -> DeltaRefitUpdateInfo:
        return parse_message(DeltaRefitUpdateInfo, update_dict, "update_info")

    def init_transfer_engine(self, init_info: DeltaRefitInitInfo) -> None:
        from .worker import LiveEngine

        # The engine's own pins decide before anything is read or built: a stream outside them, another
        # key or none is refused here, and the stream must exist (never created at init).
        key = engine_trust().check_init(init_info.stream, init_info.verify_key)
        store = open_store(init_info.stream, create=False)
        kind = stream_kind(store)
        if key is not None and kind != "sharded":
            head_signed(store, key)  # an unsigned stream is refused before the engine it replaces is shut down
        self.shutdown()  # a second init replaces the first
        ckpt = init_info.checkpoint or self.model_config.model
        if not os.path.isdir(ckpt):
            raise UsageError(f"{ckpt}: the engine's checkpoint directory (what it was loaded from) is needed once, "
                             "to capture and check its layout")
        self.live = LiveEngine(self.model, self.vllm_config, ckpt, cpus=init_info.apply_cpus)
        self.info, self.verify_key = init_info, key
        if kind == "sharded":  # parts of trainer ranks (shard/): followed by sync_sharded
            self.follower = ShardFollower(self.live, store, version=init_info.version, public_key=key)
            log.info("deltarefit: engine at version %d of the sharded stream %s", self.follower.held()[0], store.url)
            return
        held = held_version(store, self.live.fingerprint, init_info.version, key)
        self.holder = EngineHolder(self.live, held)
        self.sub = engine_subscriber(store, self.holder, public_key=key, subscriber_id=init_info.subscriber_id)
        seed_book(self.sub, ckpt)
        log.info("deltarefit: engine at version %d of %s; %s", held[0], store.url,
                 {k: v for k, v in self.live.describe().items() if k in ("host_bytes", "seconds_init")})

    def start_weight_update(self) -> None:
        if self.sub is None and self.follower is None:
            raise UsageError("deltarefit: call init_weight_transfer_engine with the stream first")

    def receive_weights(self, update_info: DeltaRefitUpdateInfo) -> None:
        if self.info is None or (self.follower is None and (self.sub is None or self.holder is None)):
            raise UsageError("deltarefit: call init_weight_transfer_engine with the stream first")
        if update_info.stream is not None and update_info.stream != self.info.stream:
            raise UsageError(f"deltarefit: this engine follows {self.info.stream}, not {update_info.stream}")
        if self.follower is not None:
            self._receive_sharded(update_info)
            return
        self.wait_prepared()
        if update_info.prepare:
            self._start_prepare(update_info.version)
            return
        self.holder.reports = []
        try:
            rep = self.sub.sync(to_version=update_info.version, verify=update_info.verify)
        finally:
            self.holder.drop_prepared()  # a plan this update did not write (stale, or of another route)
        if update_info.verify and rep.route != "none":
            self.live.verify()
        self.last = {"version": rep.version, "fingerprint": rep.fingerprint, "route": rep.route,
                     "verified": bool(rep.verified or update_info.verify),
                     "bytes_fetched": rep.bytes_fetched, "versions_applied": rep.versions_applied,
                     "refits": [vars(r) for r in self.holder.reports]}
        log.info("deltarefit: version %d -> %d via %s, %d bytes", rep.from_version, rep.version, rep.route,
                 rep.bytes_fetched)

    def _receive_sharded(self, update_info: DeltaRefitUpdateInfo) -> None:
        """``receive_weights`` from a sharded stream (``sharded.ShardFollower``). A prepare update has a
        thread fetch and check the route ahead (``ShardFollower.prepare``: records, manifests, parts;
        nothing written, no collective call), which the next update uses; the cells are checked, decoded
        and written in the update."""
        follower = self.follower
        assert follower is not None and self.live is not None
        self.wait_prepared()
        if update_info.prepare:
            self.prepare_error, self.last = None, {"prepare": update_info.version}

            def run() -> None:
                try:
                    follower.prepare(update_info.version)
                except BaseException as e:  # reported by the update, which stages (and refuses) again itself
                    self.prepare_error = e

            self.preparing = threading.Thread(target=run, name="deltarefit-prepare", daemon=True)
            self.preparing.start()
            return
        rep = follower.sync(to_version=update_info.version)
        if update_info.verify:
            self.live.verify()
        self.last = {"version": rep.version, "fingerprint": rep.fingerprint, "route": rep.route,
                     "verified": rep.route != "none" or update_info.verify, "bytes_fetched": rep.bytes_fetched,
                     "versions_applied": rep.versions_applied, "sharded": True, "staged": rep.staged,
                     "refits": [vars(a) for a in rep.applied], "layers_reloaded": self.follower.reloaded}
        log.info("deltarefit: version %d -> %d of a sharded stream via %s, %d bytes", rep.from_version, rep.version,
                 rep.route, rep.bytes_fetched)

    def _start_prepare(self, version: int | None) -> None:
        """Sync to ``version`` on a thread up to its first write (module docstring); returns at once."""
        sub, holder = self.sub, self.holder
        assert sub is not None and holder is not None
        self.prepare_error = None
        self.last = {"prepare": version}

        def run() -> None:
            try:
                sub.plan(to_version=version)  # Planned, or the report of an engine already there
            except BaseException as e:  # reported by the update, which syncs (and refuses) again itself
                self.prepare_error = e
                holder.drop_prepared()

        self.preparing = threading.Thread(target=run, name="deltarefit-prepare", daemon=True)
        self.preparing.start()

    def wait_prepared(self) -> None:
        """Wait for a prepare update's thread to end (one sync at a time on the subscriber)."""
        if self.preparing is not None:
            self.preparing.join()
            self.preparing = None
            if self.prepare_error is not None:
                log.info("deltarefit: planning ahead failed (%s: %s); the update syncs without it",
                         type(self.prepare_error).__name__, self.prepare_error)

    def finish_weight_update(self) -> None:
        pass  # applied in place and verified in receive_weights; nothing is deferred

    def shutdown(self) -> None:
        self.wait_prepared()
        if self.holder is not None:
            self.holder.close()
        if self.follower is not None:
            self.follower.close()
        self.sub = self.holder = self.follower = None


class LLMClient:
    """``VLLMWeightSyncClient`` over an in-process ``vllm.LLM``; resets its prefix cache after a finish
    (cached blocks were computed with the old weights)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
        self.llm.reset_prefix_cache()

    def prepare_weights(self, version: int) -> None:
        """Have the workers plan ``version`` while the engine serves (``update_weights`` with ``prepare``);
        nothing is written, so no cache is reset."""
        self.llm.start_weight_update()
        try:
            self.llm.update_weights({"update_info": {"version": version, "prepare": True}})
        finally:
            self.llm.finish_weight_update(None)


class HTTPClient:
    """``VLLMWeightSyncClient`` for ``vllm serve`` over its RL routes, draining around the update: ``/pause``
    (``mode=wait``: running requests finish, then the caches, whose blocks would be stale, are cleared)
    before ``/start_weight_update`` and ``/resume`` after ``/finish_weight_update``."""

    def __init__(self, base_url: str, timeout: float = 300.0) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.rl = HTTPVLLMWeightSyncClient(base_url, timeout)

    def _post(self, path: str) -> None:
        import requests

        requests.post(f"{self.base_url}/{path}", timeout=self.timeout).raise_for_status()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        # Drained too: the kernel check at init changes one element of each linear weight for a moment.
        self._post("pause?mode=wait&clear_cache=true")
        try:
            self.rl.init_weight_transfer_engine(init_info)
        finally:
            self._post("resume")

    def start_weight_update(self) -> None:
        self._post("pause?mode=wait&clear_cache=true")
        self.rl.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.rl.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.rl.finish_weight_update(weight_version)
        self._post("resume")

    def prepare_weights(self, version: int) -> None:
        """Have the workers plan ``version`` while the server serves: no pause around it (nothing is
        written; the workers return at once and plan on a thread)."""
        self.rl.start_weight_update()
        try:
            self.rl.update_weights({"version": version, "prepare": True})
        finally:
            self.rl.finish_weight_update(None)


@dataclass
class DeltaRefitTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND

    stream: str  # a directory or an s3:// URL the engines can read
    state_dir: str  # the publisher's state (its baseline)
    signing_key: str | None = None  # Ed25519 private key file: records are signed
    verify_key: str | None = None  # the matching public key, handed to the engines
    keyframe_every: int = 20
    engine_version: int | None = None  # the version the engines were started from
    format_version: int | None = None  # of the deltas, 1 or 2; None: the stream's (``Publisher``)


class DeltaRefitTrainerWeightTransferEngine(TrainerWeightTransferEngine[DeltaRefitTrainerInitInfo]):
    """vLLM trainer side of the deltarefit backend: a Publisher and the update round trip."""

    init_info_cls = DeltaRefitTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: DeltaRefitTrainerInitInfo, *, client: Any, source: Any = None):
        from ...stream.publisher import Publisher

        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        self.init_info = init_info
        self.publisher = Publisher(init_info.stream, init_info.state_dir, keyframe_every=init_info.keyframe_every,
                                   signing_key=init_info.signing_key, format_version=init_info.format_version)
        self.engines_ready = False
        return self

    def _init_engines(self) -> None:
        info = {"stream": self.init_info.stream, "verify_key": self.init_info.verify_key,
                "version": self.init_info.engine_version}
        self.client.init_weight_transfer_engine({k: v for k, v in info.items() if v is not None})
        self.engines_ready = True

    def _publish(self, checkpoint: str | None, step: int | None) -> int:
        version = head(self.publisher.store)
        if checkpoint is not None and self.is_sender:
            version = self.publisher.publish(checkpoint, step=step).version
        if self.is_sender and not self.engines_ready:
            self._init_engines()
        return version

    def prepare_weights(self, checkpoint: str | None = None, *, step: int | None = None) -> int:
        """Publish ``checkpoint`` as the next version (as ``send_weights`` does) and have the engines plan
        it while they go on serving (the client's ``prepare_weights``); returns the version. The
        ``send_weights()`` that follows writes those plans."""
        version = self._publish(checkpoint, step)
        if self.is_sender:
            self.client.prepare_weights(version)
        return version

    def send_weights(self, checkpoint: str | None = None, *, step: int | None = None) -> int:
        """Publish ``checkpoint`` (the trainer's new weights in the served dtype) as the next version and
        bring the engines to it; returns the version. With no checkpoint, brings them to the head."""
        version = self._publish(checkpoint, step)
        if not self.is_sender:
            return version
        self.client.start_weight_update()
        self.client.update_weights({"version": version})
        self.client.finish_weight_update(weight_version=str(version))
        return version
