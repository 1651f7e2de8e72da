"""``DeltaRefitVLLMClient``: TRL's ``VLLMClient`` with its weight sync going through a deltarefit stream.

Imports TRL (and, through it, vLLM's client helpers). ``deltarefit.integrations.trl.enable`` installs it.

Generation, logprobs and the server checks stay TRL's own code. What changes:

* ``init_communicator(device)``: no NCCL group. The server must run the ``deltarefit`` weight-transfer
  backend (``GET /server_info``); the served dtype is its model dtype unless ``enable(served=...)`` says
  otherwise. A ``Publisher`` on the stream and a ``deltarefit.engines.vllm.backend.HTTPClient`` on the
  server are made; the trainer's device does not matter (tensors are published from where they are).
* ``update_named_params(metadata, named_params)`` (what ``VLLMGeneration.sync_weights`` calls with every
  tensor of the model, under the names vLLM loads, PEFT adapters merged, FSDP/ZeRO gathered one tensor
  at a time): the tensors are published from memory as the next version
  (``Publisher.publish_tensors``; each copied to the host in the served dtype as it is yielded, by the
  one conversion function, since TRL's iterator unmerges or releases it afterwards: see ``held``; no
  checkpoint is written; the same weights again are the version already published). Then the server:
  on its first sync (vLLM's weight-version label still ``"default"``, as after a restart),
  ``/init_weight_transfer_engine`` with the stream and the verify key, drained; the engine finds the
  version it holds by its fingerprint (it must have been started from the trainer's initial weights:
  TRL's first sync, before the first step, publishes those). Then ``/pause``, ``/start_weight_update``,
  ``/update_weights`` with the version (every worker syncs from the stream itself, verified before it
  moves), a read-back of every worker's verified version and fingerprint (``POST /collective_rpc``
  ``deltarefit_last_update``), ``/finish_weight_update`` with the version as vLLM's label, ``/resume``.
* A sync that fails raises one line (``SyncError``) and leaves the server paused: a worker whose write
  failed holds weights that no version verified, and a paused server serves none of them. The next
  sync (TRL's next step, or the same ``sync_weights`` again) completes it: the same route brought to the
  new head, or, where the server was restarted, an init and a catch-up from the version it loaded.
* ``update_named_param`` (one tensor) and ``weight_update()`` are refused: a version is the whole model.

``prepare`` (the workers planning the next version while the server serves) is not used: TRL calls
``update_named_params`` between its optimizer step and its next ``generate``, with no request in flight,
so planning ahead would only move the same work inside the same wait.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from trl.generation.vllm_client import VLLMClient

from ...errors import DeltaRefitError, UsageError, VerificationError
from .held import held
from .settings import RolloutVersion, _state, settings

log = logging.getLogger(__name__)

BACKEND = "deltarefit"
SERVED = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
FRESH_LABEL = "default"  # vLLM's weight-version label of an engine nobody has labelled yet
INIT_LABEL = "deltarefit-init"  # ours between a server's init and its first finished update

__all__ = ["DeltaRefitVLLMClient", "SyncError", "SyncReport"]


class SyncError(DeltaRefitError):
    """A sync did not bring the server to the published version (one line: what, where, the cause); the
    server is left paused, and the next sync completes it."""


@dataclass
class SyncReport:
    """One sync: what was published, what the server fetched, how long each half took."""

    version: int
    fingerprint: str
    kind: str  # the record's kind: "keyframe" or "delta"
    route: str  # how the server got there: "chain", "keyframe", "none" (already there) ...
    bytes_fetched: int  # what the server's worker fetched from the stream for this sync
    part_bytes: int  # what the version's record stores (delta, plus the keyframe files on keyframes)
    full_bytes: int  # the whole model in the served dtype
    publish_s: float  # publish_tensors (convert, encode, upload, commit)
    refit_s: float  # the server's round: init where needed, pause, update, read-back, finish, resume
    init: bool  # this sync initialized the server's backend (first sync, or after a restart)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class DeltaRefitVLLMClient(VLLMClient):
    """TRL's server client with the weight sync through deltarefit (module docstring). Built by TRL's
    ``VLLMGeneration`` with TRL's own arguments; the sync settings come from ``enable``."""

    def __init__(self, base_url: str | None = None, host: str = "0.0.0.0", server_port: int = 8000,
                 group_port: int = 51216, connection_timeout: float = 0.0) -> None:
        self.sync = settings()
        super().__init__(base_url=base_url, host=host, server_port=server_port, group_port=group_port,
                         connection_timeout=connection_timeout)
        self.publisher: Any = None
        self.http: Any = None
        self.served: str | None = None
        self.last_sync: SyncReport | None = None
        self.reports: list[SyncReport] = []
        _state.clients.append(self)

    # -- set-up ----------------------------------------------------------------------------------------

    def init_communicator(self, device: Any = 0) -> None:
        """Check that the server runs the deltarefit backend; make the publisher and the route client."""
        from ...engines.vllm.backend import HTTPClient
        from ...stream.publisher import Publisher

        info = self.get_server_info()
        backend = (info.get("weight_transfer_config") or {}).get("backend")
        if backend != BACKEND:
            raise UsageError(f"the vLLM server at {self.base_url} runs weight-transfer backend {backend!r}, not "
                             f"{BACKEND!r}: start it with python -m deltarefit.integrations.trl.serve MODEL")
        dtype = str((info.get("model_config") or {}).get("dtype", "")).removeprefix("torch.")
        self.served = self.sync.served or SERVED.get(dtype)
        if self.served is None:
            raise UsageError(f"the vLLM server at {self.base_url} computes in {dtype!r}; pass enable(served=...) "
                             "with one of BF16, F16, F32")
        self.publisher = Publisher(self.sync.stream, self.sync.state_dir, keyframe_every=self.sync.keyframe_every,
                                   signing_key=self.sync.signing_key, format_version=self.sync.format_version)
        self.http = HTTPClient(self.base_url, timeout=self.sync.timeout)

    def close_communicator(self) -> None:
        pass  # no group to close: the stream and the routes hold no connection between syncs

    # -- the sync --------------------------------------------------------------------------------------

    def update_named_params(self, metadata: Any, named_params: Any) -> None:
        """Publish every tensor of the model as the next version and bring the server to it, checked
        (module docstring). ``metadata`` (TRL's names, dtypes and shapes) is not needed: the version
        carries them."""
        if self.publisher is None:
            raise UsageError("init_communicator() first: the client has no publisher yet")
        t0 = time.perf_counter()
        rec = self.publisher.publish_tensors(held(named_params, self.served), served=self.served)
        t1 = time.perf_counter()
        try:
            init, state = self._bring_server_to(rec.version, rec.fingerprint)
        except SyncError:
            raise
        except Exception as e:  # requests' errors, an HTTP 500 from a worker's refusal, a deltarefit error
            raise SyncError(f"deltarefit: the vLLM server at {self.base_url} did not take version {rec.version} "
                            f"({_one_line(e)}); it is left paused, the next sync completes it") from e
        self.last_sync = SyncReport(rec.version, rec.fingerprint, rec.kind, state.get("route", "?"),
                                    int(state.get("bytes_fetched", 0)), rec.part_bytes, rec.full_bytes, t1 - t0,
                                    time.perf_counter() - t1, init)
        self.reports.append(self.last_sync)
        log.info("deltarefit: server at version %d (%s, %d bytes fetched of %d) in %.2f s + %.2f s", rec.version,
                 self.last_sync.route, self.last_sync.bytes_fetched, rec.full_bytes, t1 - t0,
                 self.last_sync.refit_s)

    def _bring_server_to(self, version: int, fingerprint: str) -> tuple[bool, dict[str, Any]]:
        """The server's round to ``version``; (whether it initialized the backend, the workers' state)."""
        init = self._label() == FRESH_LABEL
        if init:  # a new server process (or one that never took a deltarefit update from this stream)
            info = {"stream": self.sync.stream, "verify_key": self.sync.verify_key}
            self.http.init_weight_transfer_engine({k: v for k, v in info.items() if v is not None})
            self._post(f"{self.base_url}/update_weight_version", json={"new_version": INIT_LABEL})
        self.http.start_weight_update()
        self.http.update_weights({"version": version})
        states = self._rpc("deltarefit_last_update")
        wrong = [s for s in states if s.get("version") != version or s.get("fingerprint") != fingerprint]
        if not states or wrong:
            raise SyncError(f"deltarefit: the vLLM server at {self.base_url} reports "
                            f"{[(s.get('version'), str(s.get('fingerprint'))[:16]) for s in states]} after an update "
                            f"to version {version} ({fingerprint[:16]}…); it is left paused")
        self.http.finish_weight_update(str(version))
        label = self._label()
        if label != str(version):
            raise SyncError(f"deltarefit: the vLLM server at {self.base_url} is labelled {label!r} after finishing "
                            f"version {version}")
        return init, states[0]

    def _label(self) -> str:
        return str(self._get(f"{self.base_url}/weight_info", timeout=self.sync.timeout)["weight_version"])

    def _rpc(self, method: str) -> list[dict[str, Any]]:
        """``method`` of the deltarefit worker extension on every worker (vLLM's dev route)."""
        out = self._post(f"{self.base_url}/collective_rpc", json={"method": method}, timeout=self.sync.timeout)
        return list(out["results"])

    def rollout_version(self) -> RolloutVersion:
        """What the server's workers hold now, read back from them; they must agree (``rollout_version``)."""
        states = self._rpc("deltarefit_last_update")
        held = {(s.get("version"), s.get("fingerprint")) for s in states}
        if len(held) != 1 or None in next(iter(held)):
            raise VerificationError(f"deltarefit: the vLLM server at {self.base_url} holds no single synced "
                                    f"version (its workers report {sorted(map(str, held))})")
        version, fp = next(iter(held))
        return RolloutVersion(int(version), str(fp), self._label())

    # -- what a version cannot be made of ---------------------------------------------------------------

    def update_named_param(self, name: str, weights: Any) -> None:
        raise UsageError(f"deltarefit publishes whole models as versions; {name} alone is not one: call "
                         "update_named_params with every tensor (as VLLMGeneration.sync_weights does)")

    @contextlib.contextmanager
    def weight_update(self):
        raise UsageError("deltarefit publishes whole models as versions: call update_named_params with every "
                         "tensor (as VLLMGeneration.sync_weights does)")
        yield  # pragma: no cover
