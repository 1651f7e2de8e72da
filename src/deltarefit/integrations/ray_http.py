"""``vllm serve`` engines in Ray actors, refitted over vLLM's HTTP routes (``HTTPVLLMWeightSyncClient``).

* ``ServerActor``: a Ray actor that runs vLLM's OpenAI server (what ``vllm serve`` runs) as its child
  process, with ``--weight-transfer-config '{"backend": "deltarefit"}'`` and vLLM's RL routes on
  (``VLLM_SERVER_DEV_MODE=1``), on a fixed port of its node, bound to loopback (``127.0.0.1``) unless
  ``host`` says otherwise. Dev mode opens ``/collective_rpc``, which calls any worker method by name (the
  extension's ``apply_delta``, ``deltarefit_reload_all``, ``deltarefit_live_apply`` among them), and the RL
  routes (``/init_weight_transfer_engine``, ``/update_weights``, ``/pause``); vLLM 0.32's ``--api-key``
  guards only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``, none of those. So the server listens where
  only its own host reaches it, and a wider ``host`` is the operator's choice to make behind a firewall
  or tunnel; the engine's own pins (``DELTAREFIT_VERIFY_KEY``, ``DELTAREFIT_STREAMS`` in the actor's
  ``runtime_env``, passed on to the server) still decide what it follows (docs/RAY.md). The server dies with the actor (the
  kernel sends it SIGKILL when the actor's process ends), so a restarted actor starts a new server on
  the same port, initializes the backend and catches up through the stream, as ``EngineActor`` does.
* ``HTTPFanOut``: the trainer's client over several servers: for each, vLLM's
  ``HTTPVLLMWeightSyncClient`` inside ``deltarefit.engines.vllm.backend.HTTPClient`` (``/pause`` before
  the update, ``/resume`` after). A round that fails on one server finishes and resumes the others at
  once, so they go on serving while the trainer waits to drive it again.

``RefitTrainer(..., transport="http")`` drives ``ServerActor``s through it; the acknowledgement is the
same (``state``: the weight version from ``GET /weight_info``, each worker's fingerprint from the dev
route ``POST /collective_rpc``).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from ..errors import DeltaRefitError
from .placement import BACKEND, READY_TIMEOUT, placed, require_ray

log = logging.getLogger(__name__)

__all__ = ["LOOPBACK", "HTTPFanOut", "ServerActor", "start_servers"]

LOOPBACK = "127.0.0.1"  # where a ServerActor's server listens by default (its dev routes are open)


def _die_with_parent() -> Any:
    """A ``preexec_fn`` for the server: SIGKILL when the actor's process ends (``PR_SET_PDEATHSIG``). libc is
    loaded here, before the fork: the child makes one system call and takes no lock."""
    import ctypes
    import signal

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    return lambda: libc.prctl(1, signal.SIGKILL)


class ServerActor:
    """``vllm serve MODEL`` with the deltarefit backend, as a Ray actor's child process (module docstring).

    ``serve_args``: more arguments for the server (``--dtype bfloat16`` ...). ``init_info``: the backend's
    init; given, the actor initializes it and syncs to the stream's head at every start. ``extension``: the
    workers' extension class (``--worker-extension-cls``); deltarefit's by default, a subclass of it to add
    worker methods that ``collective_rpc`` calls. ``host``: the address the server binds to and is
    called at (loopback by default: its routes take no credentials; module docstring)."""

    def __init__(self, model: str, *, port: int, init_info: dict[str, Any] | None = None,
                 serve_args: list[str] | None = None, name: str = "server", timeout: float = READY_TIMEOUT,
                 extension: str | None = None, host: str = LOOPBACK) -> None:
        ray = require_ray()
        from ..engines.vllm import EXTENSION
        from ..engines.vllm.backend import HTTPClient

        self.name = name
        ctx = ray.get_runtime_context()
        self.restarted = bool(ctx.was_current_actor_reconstructed)
        self.node_id = ctx.get_node_id()
        if host != LOOPBACK:
            log.warning("[%s] vllm serve with dev mode on %s: its /collective_rpc and RL routes take no "
                        "credentials; only the engine's own pins (DELTAREFIT_VERIFY_KEY, DELTAREFIT_STREAMS) "
                        "limit what a caller can make it load", name, host)
        self.url = f"http://{host}:{port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
               "--port", str(port), "--weight-transfer-config", json.dumps({"backend": BACKEND}),
               "--worker-extension-cls", extension or EXTENSION, *(serve_args or [])]  # the extension: state() and digests()
        fd, self.log_path = tempfile.mkstemp(prefix=f"deltarefit-{name}-", suffix=".log")
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent(),  # noqa: PLW1509 (one prctl)
                                         env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
        self._wait_healthy(timeout)
        self.seconds_start = time.perf_counter() - t0
        self.client = HTTPClient(self.url)
        self.init_info: dict[str, Any] | None = None
        self.caught_up: dict[str, Any] | None = None
        if init_info is not None:
            self.client.init_weight_transfer_engine(init_info)
            self.init_info = dict(init_info)
            self.caught_up = self._catch_up()

    def _wait_healthy(self, timeout: float) -> None:
        from .serving import wait_healthy

        wait_healthy(self.proc, self.url, self.log_path, timeout, f"[{self.name}] vllm serve")

    def _catch_up(self) -> dict[str, Any]:
        from ..storage.base import open_store
        from ..stream.records import head

        assert self.init_info is not None
        version = head(open_store(self.init_info["stream"], create=False))
        t0 = time.perf_counter()
        self.client.start_weight_update()
        self.client.update_weights({"version": version})
        self.client.finish_weight_update(str(version))
        return {"version": version, "seconds": time.perf_counter() - t0}

    def _rpc(self, method: str, args: tuple[str, ...] = ()) -> list[Any]:
        import requests

        r = requests.post(f"{self.url}/collective_rpc", json={"method": method, "args": list(args)}, timeout=300)
        r.raise_for_status()
        return r.json()["results"]

    def collective_rpc(self, method: str, args: tuple[str, ...] = ()) -> list[Any]:
        """A worker method by name on every worker of the server (vLLM's dev route ``POST /collective_rpc``:
        string arguments only); each worker's result."""
        return self._rpc(method, args)

    def get_url(self) -> str:
        return self.url

    def state(self) -> dict[str, Any]:
        import requests

        r = requests.get(f"{self.url}/weight_info", timeout=60)
        r.raise_for_status()
        fps = [d["fingerprint"] for d in self._rpc("deltarefit_live_describe")]
        return {"name": self.name, "pid": os.getpid(), "server_pid": self.proc.pid, "node_id": self.node_id,
                "restarted": self.restarted, "weight_version": r.json()["weight_version"], "fingerprints": fps,
                "seconds_start": self.seconds_start, "caught_up": self.caught_up}

    def digests(self) -> list[dict[str, str]]:
        return self._rpc("deltarefit_digests")

    def generate(self, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
        """Greedy token ids per prompt (``/v1/completions`` with ``return_token_ids``), as ``EngineActor``'s."""
        import requests

        r = requests.post(f"{self.url}/v1/completions", timeout=300, json={
            "model": self._model(), "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True})
        r.raise_for_status()
        return [list(c["token_ids"]) for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    def _model(self) -> str:
        import requests

        return requests.get(f"{self.url}/v1/models", timeout=60).json()["data"][0]["id"]

    def pids(self) -> list[int]:
        import psutil

        me = psutil.Process()
        return [me.pid, *(p.pid for p in me.children(recursive=True))]

    def ready(self) -> bool:
        return True


class HTTPFanOut:
    """The client protocol vLLM's trainer engines drive, over several servers (module docstring)."""

    def __init__(self, urls: list[str], timeout: float = 300.0) -> None:
        from ..engines.vllm.backend import HTTPClient

        self.clients = [HTTPClient(u, timeout) for u in urls]
        self.open = [False] * len(urls)

    def _each(self, call: str, *args: Any) -> None:
        failures = []
        for i, c in enumerate(self.clients):
            try:
                getattr(c, call)(*args)
                if call == "start_weight_update":
                    self.open[i] = True
                elif call == "finish_weight_update":
                    self.open[i] = False
            except Exception as e:  # every server is called; the round fails with the first failure
                failures.append((c.base_url, e))
        if failures:
            if call in ("start_weight_update", "update_weights"):
                self._close_open()
            url, e = failures[0]
            raise DeltaRefitError(f"{call} failed on {len(failures)} of {len(self.clients)} servers; "
                                  f"{url}: {type(e).__name__}: {e}") from e

    def _close_open(self) -> None:
        """Finish (and resume) the servers a failed round left paused: they go on serving meanwhile."""
        for i, c in enumerate(self.clients):
            if self.open[i]:
                try:
                    c.finish_weight_update(None)
                except Exception as e:  # a server that died since: its restart starts clean
                    log.warning("%s: could not finish the update a failed round left open: %s", c.base_url, e)
                self.open[i] = False

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._each("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._each("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._each("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each("finish_weight_update", weight_version)

    def prepare_weights(self, version: int) -> None:
        self._each("prepare_weights", version)


def start_servers(model: str, resources: list[dict[str, float]], ports: list[int], *,
                  init_info: dict[str, Any] | None = None, serve_args: list[str] | None = None,
                  names: list[str] | None = None, max_restarts: int = 3, num_cpus: float = 1,
                  runtime_env: dict[str, Any] | None = None, timeout: float = READY_TIMEOUT,
                  extension: str | None = None, host: str = LOOPBACK) -> list[Any]:
    """One ``ServerActor`` per entry of ``resources``, each on ``ports[i]`` of its node (bound to ``host``:
    loopback by default, so the trainer reaches them from the same host), placed and restarted as
    ``start_engines`` does; the handles once every server answers."""
    ray = require_ray()
    names = names or [f"server-{i}" for i in range(len(resources))]
    handles = []
    for name, res, port in zip(names, resources, ports, strict=True):
        actor = ray.remote(ServerActor).options(**placed(res, name, num_cpus=num_cpus, max_restarts=max_restarts,
                                                         runtime_env=runtime_env, timeout=timeout))
        handles.append(actor.remote(model, port=port, init_info=init_info, serve_args=serve_args, name=name,
                                    extension=extension, host=host))
    ray.get([h.ready.remote() for h in handles], timeout=timeout)
    return handles
