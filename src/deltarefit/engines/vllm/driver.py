"""The driver side of a vLLM refit: what the process holding the ``LLM`` calls (``refit_engine``,
``refit_engine_in_place``, ``reload_engine``, ``sync_engine``, ``engine_digests``); each runs the worker
extension's methods on every worker through ``collective_rpc`` and raises a worker's error as its own class."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

from ... import errors

log = logging.getLogger(__name__)

EXTENSION = "deltarefit.engines.vllm.DeltaRefitWorkerExtension"
LOCK_NAME = ".deltarefit-engine.lock"  # serializes apply between workers sharing one checkpoint directory
PROBE_ROWS = 1024  # identity rows per probe GEMM when reading a linear layer's effective weight


def _raise(report: dict[str, Any]) -> None:
    """Raise a worker's refusal (``error_type``, ``error``) on the driver as its own class: a name
    looked up in the closed set of ``errors`` (never unpickled); an unknown name is a DeltaRefitError."""
    raise errors.error_from_name(report.get("error_type"), f"rank {report.get('rank')}: {report.get('error')}")


def _on_every_worker(llm: Any, method: str, args: tuple, timeout: float | None) -> list[dict[str, Any]]:
    """The workers' reports of extension ``method``; the first refusal raised (``_raise``)."""
    reports = llm.collective_rpc(method, timeout=timeout, args=args)
    failed = [r for r in reports if not r.get("ok")]
    if failed:
        _raise(failed[0])
    return reports


def _paths(delta_path: str, checkpoint_dir: str | None) -> tuple[str, str | None]:
    return os.path.abspath(delta_path), os.path.abspath(checkpoint_dir) if checkpoint_dir else None


def refit_engine(llm: Any, delta_path: str, checkpoint_dir: str, *, verify: bool = False,
                 timeout: float | None = None) -> dict[str, Any]:
    """Refit a running ``vllm.LLM`` (started with ``worker_extension_cls=EXTENSION`` from
    ``checkpoint_dir``) to the delta's target; returns a JSON-able report, raises deltarefit errors.

    Call it between ``generate`` calls (the offline LLM is idle then). The prefix cache is reset
    afterwards: its blocks were computed with the old weights.
    """
    t0 = time.perf_counter()
    from ...apply.files import checkpoint_lock

    # The checkpoint's lock, held here for the workers' applies (they run in other processes): another
    # sync or apply of this checkpoint is refused meanwhile. Re-entered inside sync_engine's sync.
    with checkpoint_lock(os.path.abspath(checkpoint_dir)):
        reports = llm.collective_rpc("apply_delta", timeout=timeout,
                                     args=(os.path.abspath(delta_path), os.path.abspath(checkpoint_dir)),
                                     kwargs={"verify": verify})
    failed = [r for r in reports if not r.get("ok")]
    if failed:
        if len(failed) < len(reports):
            log.error("refit failed on %d of %d workers; rerun refit_engine (safe) before serving",
                      len(failed), len(reports))
        _raise(failed[0])
    fps = {r["target_fingerprint"] for r in reports}
    if len(fps) != 1:
        raise errors.VerificationError(f"workers disagree on the target fingerprint: {sorted(fps)}")
    reset = None
    with contextlib.suppress(AttributeError):
        reset = bool(llm.reset_prefix_cache())
    if reset is False:
        log.warning("refit done but vLLM did not reset its prefix cache (requests running?): cached blocks "
                    "were computed with the old weights; call llm.reset_prefix_cache() once idle")
    return {
        "ok": True, "prefix_cache_reset": reset, "target_fingerprint": fps.pop(), "base_fingerprint": reports[0]["base_fingerprint"],
        "tensors_reloaded": max(r["tensors_reloaded"] for r in reports),
        "bytes_reloaded": sum(r["bytes_reloaded"] for r in reports),
        "seconds": time.perf_counter() - t0, "workers": reports,
    }


def refit_engine_in_place(llm: Any, delta_path: str, checkpoint_dir: str | None = None, *,
                          timeout: float | None = None) -> dict[str, Any]:
    """Refit a running ``vllm.LLM`` in place (``deltarefit.engines.vllm.worker``): only changed elements are
    written into its parameters, tensors whose kernel keeps its own copy are reloaded through vLLM's loader
    from host copies, and nothing is written to disk. ``checkpoint_dir``: what the engine was loaded from,
    read once per worker to capture and check the layout (not needed with the weight-transfer backend
    initialized). A refused delta leaves the engine exactly at its version; after any failure, calling
    again with the same delta completes it. The prefix cache is reset afterwards."""
    reports = _on_every_worker(llm, "deltarefit_live_apply", _paths(delta_path, checkpoint_dir), timeout)
    fps = {r["target_fingerprint"] for r in reports}
    if len(fps) != 1:
        raise errors.VerificationError(f"workers disagree on the target fingerprint: {sorted(fps)}")
    with contextlib.suppress(AttributeError):
        llm.reset_prefix_cache()
    return {"ok": True, "target_fingerprint": fps.pop(), "workers": reports}


def prepare_refit_in_place(llm: Any, delta_path: str, checkpoint_dir: str | None = None, *,
                           timeout: float | None = None) -> None:
    """Start planning ``delta_path`` in every worker (``LiveEngine.prepare``: decoded and checked against
    the live weights, nothing written) and return at once; the engine keeps serving while the workers
    plan. ``refit_engine_in_place`` of the same delta then writes those plans: the engine's update then
    costs the writes and their checks (O(changed elements)) and any reload, not the decode. Meant for
    in-flight updates (asynchronous RL), where the pause is what generation waits for."""
    _on_every_worker(llm, "deltarefit_live_prepare", _paths(delta_path, checkpoint_dir), timeout)


def reload_engine(llm: Any, checkpoint_dir: str, *, timeout: float | None = None) -> dict[str, Any]:
    """Reload a running engine's weights from every tensor of ``checkpoint_dir`` (a full refit, as after
    a keyframe); resets the prefix cache."""
    t0 = time.perf_counter()
    reports = _on_every_worker(llm, "deltarefit_reload_all", (os.path.abspath(checkpoint_dir),), timeout)
    with contextlib.suppress(AttributeError):
        llm.reset_prefix_cache()
    return {"ok": True, "target_fingerprint": reports[0]["target_fingerprint"],
            "tensors_reloaded": max(r["tensors_reloaded"] for r in reports), "seconds": time.perf_counter() - t0}


def sync_engine(llm: Any, store: Any, checkpoint_dir: str, *, to_version: int | None = None,
                subscriber_id: str | None = None, public_key: str | None = None, verify: bool = False,
                timeout: float | None = None) -> Any:
    """Bring a running engine (loaded from ``checkpoint_dir``) to the newest version of a stream.

    The stream subscriber does what ``deltarefit sync`` does (records checked, cheapest route, parts
    staged and checked before any write, the version recorded only once verified), with each delta
    applied through :func:`refit_engine` (files, then the touched layers) and, when the route installs a
    keyframe into the directory (config and tokenizer files stay), every weight reloaded through
    :func:`reload_engine`. Returns the subscriber's ``SyncReport``; ``current()`` of a
    ``Subscriber(store, checkpoint_dir)`` gives the version to stamp rollouts with. Safe to rerun after
    any failure: a version is recorded only after the engine took it.
    """
    from ...stream.subscriber import Subscriber

    ck = os.path.abspath(checkpoint_dir)
    sub = Subscriber(store, ck, subscriber_id=subscriber_id, public_key=public_key,
                     apply_hook=lambda delta: refit_engine(llm, delta, ck, verify=verify,
                                                           timeout=timeout)["target_fingerprint"],
                     keyframe_hook=lambda: reload_engine(llm, ck, timeout=timeout))
    return sub.sync(to_version=to_version)


def engine_digests(llm: Any, timeout: float | None = None) -> list[dict[str, str]]:
    """Per worker: ``deltarefit_digests`` (see there)."""
    return llm.collective_rpc("deltarefit_digests", timeout=timeout)
