"""Refit a running vLLM engine in place from a deltarefit delta, through vLLM's own weight loading.

The rollout node keeps the checkpoint its engine was loaded from on disk. A refit is two steps, run in
every worker by ``collective_rpc`` (driver side: :func:`refit_engine`):

1. ``deltarefit.apply.apply`` patches that checkpoint in place: the base is verified before any byte is
   written (a delta for another base is refused, nothing changed, engine untouched), the result is
   verified against the delta's target fingerprint.
2. The tensors the delta changed are read back one at a time from the updated safetensors (mmap) and fed
   to ``model_runner.reload_weights(weights_iterator=...)``, so vLLM's own loader does the name mapping,
   the fusing (qkv_proj, gate_up_proj), the tensor-parallel slicing and its post-load processing (CPU
   weight prepacking, quantization). Memory: one tensor, plus whatever vLLM buffers for one layer.

vLLM (0.32) reloads layer by layer: a layer is rebuilt once all of its elements have arrived, so feeding
``q_proj`` alone would leave the ``k``/``v`` rows of the fused ``qkv_proj`` uninitialized. The feed is
therefore widened to every checkpoint tensor of every layer a changed tensor touches (the model's
``packed_modules_mapping`` names the siblings), and, before vLLM finalizes, any layer still partly loaded
(a mapping this rule does not know, e.g. fused MoE experts) is completed from the checkpoint too.

Use it as ``LLM(model=ckpt_dir, worker_extension_cls=deltarefit.engines.vllm.EXTENSION, ...)`` and then
``refit_engine(llm, "step42.delta", ckpt_dir)``. Nothing here imports vLLM at module import time.

The methods that take a path (``apply_delta``, ``deltarefit_reload_all``, ``deltarefit_live_prepare``,
``deltarefit_live_apply``, ``deltarefit_verify``, ``deltarefit_live_describe``) keep to the trust the engine's
environment pins (``trust``): with ``DELTAREFIT_STREAMS``, a delta must lie under a pinned directory root and
a checkpoint directory there or be the engine's own; with ``DELTAREFIT_VERIFY_KEY``, a delta is taken only
when a version of the stream the backend follows, signed by that key, holds its target (it is copied first
to a private file, so that what was checked is what is applied), and a checkpoint to reload only when such
a version holds its fingerprint. A refusal comes back as ``{"ok": False, "error_type": "UntrustedError"}``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from ... import errors
from ...apply.files import apply as apply_delta_to_checkpoint
from ...checkpoint.read import open_checkpoint
from ...errors import DeltaRefitError, UntrustedError, UsageError
from ...format import DeltaReader
from ...io.fsutil import open_regular
from .. import kernels
from ..kernels import bits_digest, is_linear, kernel_digest, verify_layers
from .layers import _packed_mapping, layer_key, reload_set
from .trust import ENV_VERIFY_KEY, engine_trust

log = logging.getLogger(__name__)

EXTENSION = "deltarefit.engines.vllm.DeltaRefitWorkerExtension"
LOCK_NAME = ".deltarefit-engine.lock"  # serializes apply between workers sharing one checkpoint directory


def _delta_names(delta_path: str) -> tuple[str, str, list[str], list[str]]:
    """(base fp, target fp, tensors whose values change, tensors removed) of a delta, validated."""
    with DeltaReader(delta_path) as d:
        changed = [e.name for e in d.tensors if e.op in ("patch", "add", "replace")]
        removed = [e.name for e in d.tensors if e.op == "remove"]
        return d.base_fingerprint, d.target_fingerprint, changed, removed


def _private_copy(path: str, stack: contextlib.ExitStack) -> str:
    """A copy of the regular file ``path`` in a directory only this user can enter (``mkdtemp``: mode 0700),
    removed when ``stack`` closes: what is checked and then applied cannot be changed in between by a
    writer of the directory ``path`` lies in."""
    import shutil
    import tempfile

    try:
        d = tempfile.mkdtemp(prefix="deltarefit-checked-")
        stack.callback(shutil.rmtree, d, True)
        copy = os.path.join(d, "delta")
        with os.fdopen(open_regular(path, os.O_RDONLY, what="delta"), "rb") as src, open(copy, "xb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except OSError as e:  # a full or read-only temp directory: one line, as any file fault
        raise errors.FileSystemError.of(f"{path}: cannot copy the delta to check it", e) from None
    return copy


# ------------------------------------------------------------------------------------ engine access


def _partial_layers(model: Any) -> list[str] | None:
    """Layers vLLM's layerwise reload has started but not completed; None if this vLLM cannot tell."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # pragma: no cover - another vLLM layout
        return None
    out = []
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if 0 < info.load_numel < (info.load_numel_total or 0):
            out.append(name)
    return out


# ------------------------------------------------------------------------------------ worker extension


class DeltaRefitWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); called through ``llm.collective_rpc``.

    Method names are prefixed or specific enough not to collide with vLLM's Worker (vLLM asserts this).
    """

    # -- trust ----------------------------------------------------------------------------------------

    def _deltarefit_own_checkpoint(self) -> str | None:
        """The directory this engine was loaded from (a checkpoint to write to, whatever the pins)."""
        model = getattr(getattr(getattr(self, "vllm_config", None), "model_config", None), "model", None)
        return model if isinstance(model, str) and os.path.isdir(model) else None

    def _deltarefit_trusted_checkpoint(self, checkpoint_dir: str | None) -> None:
        """Refuse a checkpoint directory outside the pinned roots (the engine's own is always taken)."""
        if checkpoint_dir is not None:
            own = self._deltarefit_own_checkpoint()
            engine_trust().check_path(checkpoint_dir, "checkpoint directory", also=(own,) if own else ())

    def _deltarefit_signed_store(self, what: str) -> Any:
        """The stream the backend follows, where a version signed by the pinned key must name ``what``."""
        wte = getattr(self, "weight_transfer_engine", None)
        info = getattr(wte, "info", None)
        if info is None or getattr(wte, "follower", None) is not None:
            raise UntrustedError(f"deltarefit: {what}: this engine pins a verify key ({ENV_VERIFY_KEY}) and takes a "
                                 "delta or checkpoint by path only when a signed version of the (plain) stream its "
                                 "backend follows holds it; initialize the backend, or update with update_weights")
        from ...storage.base import open_store

        return open_store(info.stream, create=False)

    def _deltarefit_trusted_delta(self, delta_path: str, stack: contextlib.ExitStack) -> str:
        """The path to read ``delta_path`` from, as the pins allow: under a pinned root; with a pinned key, a
        private copy whose target a signed version holds (refused otherwise, ``UntrustedError``)."""
        trust = engine_trust()
        real = trust.check_path(delta_path, "delta")
        if trust.verify_key is None:
            return real if trust.roots or trust.urls else delta_path  # the path that was checked
        copy = _private_copy(real, stack)
        _, target, _, _ = _delta_names(copy)
        trust.signed_version(self._deltarefit_signed_store(delta_path), target, f"delta {delta_path}")
        return copy

    # -- main entry -----------------------------------------------------------------------------------

    def apply_delta(self, delta_path: str, checkpoint_dir: str, verify: bool = False) -> dict[str, Any]:
        """Apply the delta to the on-disk checkpoint (verified), then reload what changed into the engine.

        Returns a JSON-able report. A deltarefit error (wrong base, corrupt delta, ...) is returned as
        ``{"ok": False, "error_type": ..., "error": ...}``; :func:`refit_engine` raises it on the driver.
        Rerunning after any failure is safe: the apply is idempotent and the reload set comes from the
        delta, not from what this run wrote, so an engine left behind its files catches up.
        """
        t0 = time.perf_counter()
        rank = getattr(self, "rank", None)
        try:
            with contextlib.ExitStack() as stack:
                self._deltarefit_trusted_checkpoint(checkpoint_dir)
                delta_path = self._deltarefit_trusted_delta(delta_path, stack)
                return self._deltarefit_apply(delta_path, checkpoint_dir, verify, t0, rank)
        except DeltaRefitError as e:
            log.warning("deltarefit refit refused on rank %s: %s", rank, e)
            return {"ok": False, "rank": rank, "error_type": type(e).__name__, "error": str(e),
                    "seconds": time.perf_counter() - t0}

    def _deltarefit_apply(self, delta_path: str, ckpt: str, verify: bool, t0: float,
                          rank: Any) -> dict[str, Any]:
        if not os.path.isdir(ckpt):
            raise UsageError(f"{ckpt}: the engine's checkpoint must be a directory (what vLLM loaded)")
        base_fp, _, changed, removed = _delta_names(delta_path)
        if removed:
            # The engine has no way to drop a parameter; refusing here keeps files and engine in step.
            raise UsageError(f"{delta_path}: removes tensors {removed[:5]}; a running engine cannot drop "
                             "parameters, restart it from the target checkpoint instead")
        # Never through a planted symlink, never hung on a planted FIFO (``open_regular``).
        with os.fdopen(open_regular(os.path.join(ckpt, LOCK_NAME), os.O_RDWR | os.O_CREAT, what="engine lock"),
                       "r+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # one writer per directory; later workers re-verify
            # The driver holds the checkpoint's own lock for this refit (refit_engine); the workers
            # take turns on the engine lock above.
            rep = apply_delta_to_checkpoint(delta_path, ckpt, lock=False)
        t_apply = time.perf_counter()
        fed, nbytes, completed = self._deltarefit_reload(ckpt, changed)
        t_reload = time.perf_counter()
        report: dict[str, Any] = {
            "ok": True, "rank": rank, "base_fingerprint": base_fp, "target_fingerprint": rep.target_fingerprint,
            "chunks_applied": rep.chunks_applied, "chunks_skipped": rep.chunks_skipped,
            "chunks_recovered": rep.chunks_recovered, "written_bytes": rep.written_bytes,
            "tensors_changed": len(changed), "tensors_reloaded": len(fed), "bytes_reloaded": nbytes,
            "completed_layers": completed, "seconds_apply": t_apply - t0, "seconds_reload": t_reload - t_apply,
        }
        if verify:
            report["verify"] = self.deltarefit_verify(ckpt, fed)
            if report["verify"]["mismatched"]:
                raise errors.VerificationError(
                    f"engine weights differ from {ckpt} after reload: {report['verify']['mismatched'][:5]}")
        report["seconds"] = time.perf_counter() - t0
        log.info("deltarefit refit on rank %s: %d tensors, %d bytes, %.2f s", rank, len(fed), nbytes,
                 report["seconds"])
        return report

    def _deltarefit_model(self) -> Any:
        runner = getattr(self, "model_runner", None)
        if runner is None or not hasattr(runner, "get_model"):
            raise UsageError("this vLLM worker has no model_runner.get_model(); unsupported vLLM version")
        return runner.get_model()

    def _deltarefit_reload(self, ckpt: str, changed: list[str]) -> tuple[list[str], int, list[str]]:
        """Feed the layers ``changed`` touches to vLLM's reload; returns (fed names, bytes, completed)."""
        model = self._deltarefit_model()
        packed = _packed_mapping(model)
        fed: list[str] = []
        state = {"bytes": 0, "completed": []}
        if not changed:
            return fed, 0, []
        from safetensors import safe_open

        with contextlib.ExitStack() as stack:
            ck = stack.enter_context(open_checkpoint(ckpt))
            names = list(ck.tensors)
            handles: dict[str, Any] = {}

            def read(name: str) -> Any:
                file = ck.tensors[name].file
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
                t = handles[file].get_tensor(name)  # one tensor in memory at a time
                state["bytes"] += t.numel() * t.element_size()
                fed.append(name)
                return t

            def weights() -> Iterator[tuple[str, Any]]:
                first = reload_set(changed, names, packed)
                for n in first:
                    yield n, read(n)
                # Any layer still partly loaded now would be rebuilt with uninitialized elements: complete it.
                partial = _partial_layers(model)
                if not partial:
                    return
                done = set(fed)
                rest = [n for n in names if n not in done]
                extra = []
                for layer in partial:
                    under = [n for n in rest if layer_key(n, packed) == layer
                             or layer_key(n, packed).startswith(layer + ".")]
                    fed_under = any(layer_key(n, packed) == layer or layer_key(n, packed).startswith(layer + ".")
                                    for n in fed)
                    if under:
                        extra.extend(under)
                    elif not fed_under:
                        # Engine names do not line up with checkpoint names here: feed everything left.
                        extra = rest
                        break
                    # else: every tensor of the layer was fed; it is short only by padding (vocab rows).
                state["completed"] = partial
                seen = set()
                for n in rest:
                    if n in extra and n not in seen:
                        seen.add(n)
                        yield n, read(n)

            with kernels.Reloading(model) as reloading:
                if hasattr(self, "reload_weights"):
                    self.reload_weights(weights_iterator=weights())
                else:  # pragma: no cover - a worker without the wrapper
                    self.model_runner.reload_weights(weights_iterator=weights())
                reloading.keys = sorted({layer_key(n, packed) for n in fed})
        return fed, state["bytes"], state["completed"]

    def deltarefit_reload_all(self, checkpoint_dir: str) -> dict[str, Any]:
        """Reload every tensor of the checkpoint into the engine (after a keyframe replaced its files)."""
        t0 = time.perf_counter()
        rank = getattr(self, "rank", None)
        try:
            self._deltarefit_trusted_checkpoint(checkpoint_dir)
            with open_checkpoint(checkpoint_dir) as ck:
                names = list(ck.tensors)
                from ...checkpoint.read import fingerprint_checkpoint

                fp = fingerprint_checkpoint(ck)[0]
            if engine_trust().verify_key is not None:
                engine_trust().signed_version(self._deltarefit_signed_store(checkpoint_dir), fp,
                                              f"checkpoint {checkpoint_dir}")
            fed, nbytes, _ = self._deltarefit_reload(checkpoint_dir, names)
        except DeltaRefitError as e:
            return {"ok": False, "rank": rank, "error_type": type(e).__name__, "error": str(e)}
        return {"ok": True, "rank": rank, "target_fingerprint": fp, "tensors_reloaded": len(fed),
                "bytes_reloaded": nbytes, "seconds": time.perf_counter() - t0}

    # -- in place -------------------------------------------------------------------------------------

    def _deltarefit_live(self, checkpoint_dir: str | None) -> Any:
        """This worker's ``LiveEngine``: the weight-transfer backend's if it has one, else built once
        from ``checkpoint_dir`` (what the engine was loaded from)."""
        wte = getattr(self, "weight_transfer_engine", None)
        live = getattr(wte, "live", None) or getattr(self, "_deltarefit_live_engine", None)
        if live is None:
            from .worker import LiveEngine

            if not checkpoint_dir or not os.path.isdir(checkpoint_dir):
                raise UsageError(f"{checkpoint_dir}: the checkpoint the engine was loaded from is needed once, to "
                                 "capture and check its layout")
            self._deltarefit_trusted_checkpoint(checkpoint_dir)
            live = LiveEngine(self._deltarefit_model(), self.vllm_config, checkpoint_dir)
            self._deltarefit_live_engine = live
        return live

    def deltarefit_live_prepare(self, delta_path: str, checkpoint_dir: str | None = None) -> dict[str, Any]:
        """Start planning the delta in place (``LiveEngine.prepare``: read-only) on a thread of this worker,
        and return at once: the engine serves meanwhile. ``deltarefit_live_apply`` of the same delta waits
        for that plan and writes it; a plan that was refused, or went stale, is made again there (and
        refused there, with nothing written). Another delta's plan still pending is dropped."""
        import threading
        from concurrent.futures import Future

        rank = getattr(self, "rank", None)
        stack = contextlib.ExitStack()  # the checked copy of the delta, if any, until the plan is taken or dropped
        try:
            path = self._deltarefit_trusted_delta(delta_path, stack)
            live = self._deltarefit_live(checkpoint_dir)
        except DeltaRefitError as e:
            stack.close()
            log.warning("deltarefit live prepare refused on rank %s: %s", rank, e)
            return {"ok": False, "rank": rank, "error_type": type(e).__name__, "error": str(e)}
        self._deltarefit_drop_prepared()
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(live.prepare(path))
            except BaseException as e:  # delivered to the apply, which plans again
                fut.set_exception(e)

        threading.Thread(target=run, name="deltarefit-prepare", daemon=True).start()
        self._deltarefit_preparing = (delta_path, fut, path, stack)
        return {"ok": True, "rank": rank}

    def _deltarefit_drop_prepared(self) -> None:
        pending = getattr(self, "_deltarefit_preparing", None)
        self._deltarefit_preparing = None
        if pending is not None:
            if pending[1].exception() is None:
                pending[1].result().close()
            pending[3].close()

    def _deltarefit_take_prepared(self, delta_path: str) -> tuple[Any, str, contextlib.ExitStack] | None:
        """What ``deltarefit_live_prepare`` made of ``delta_path`` (waiting for it): (its plan, or None when
        it was refused; the path it read, already checked; what holds that path), or None."""
        pending = getattr(self, "_deltarefit_preparing", None)
        if pending is None or pending[0] != delta_path:
            self._deltarefit_drop_prepared()
            return None
        self._deltarefit_preparing = None
        if pending[1].exception() is not None:
            log.info("deltarefit: the prepared plan of %s was refused (%s); planning it again", delta_path,
                     pending[1].exception())
            return None, pending[2], pending[3]
        return pending[1].result(), pending[2], pending[3]

    def deltarefit_live_apply(self, delta_path: str, checkpoint_dir: str | None = None) -> dict[str, Any]:
        """Apply the delta in place into the engine's parameters (``LiveEngine.apply``; with the plan
        ``deltarefit_live_prepare`` made of it, if any); no file is written. Errors come back as
        ``{"ok": False, ...}`` as for ``apply_delta``."""
        rank = getattr(self, "rank", None)
        try:
            with contextlib.ExitStack() as stack:
                taken = self._deltarefit_take_prepared(delta_path)
                if taken is not None:
                    plan, path, held = taken
                    stack.enter_context(held)
                else:
                    plan, path = None, self._deltarefit_trusted_delta(delta_path, stack)
                live = self._deltarefit_live(checkpoint_dir)
                rep = live.apply(path, prepared=plan)
        except DeltaRefitError as e:
            log.warning("deltarefit live refit refused on rank %s: %s", rank, e)
            return {"ok": False, "rank": rank, "error_type": type(e).__name__, "error": str(e)}
        return {"ok": True, "rank": rank, **vars(rep)}

    def deltarefit_last_update(self) -> dict[str, Any]:
        """The weight-transfer backend's last update on this worker: version, fingerprint, route, versions
        applied, bytes fetched (empty before the first)."""
        last = getattr(getattr(self, "weight_transfer_engine", None), "last", None) or {}
        return {k: last[k] for k in ("version", "fingerprint", "route", "versions_applied", "bytes_fetched",
                                     "verified") if k in last}

    def deltarefit_live_describe(self, checkpoint_dir: str | None = None) -> dict[str, Any]:
        """What this worker writes in place and what it reloads (and why)."""
        return self._deltarefit_live(checkpoint_dir).describe()

    # -- checks ---------------------------------------------------------------------------------------

    def deltarefit_verify(self, checkpoint_dir: str, names: list[str] | None = None) -> dict[str, Any]:
        """Compare the engine's weights with the checkpoint tensors they were loaded from.

        Linear layers are read through their kernel (identity probe, so prepacked CPU weights and fused
        qkv/gate_up rows are covered) and compared by value (-0.0 equals +0.0); other parameters
        (embeddings, norms, lm_head) by bits, over the rows the checkpoint has (vocab padding excluded).
        Only unsharded engines (tensor parallel size 1) are compared; sharded layers are listed as
        unverified. ``names``: checkpoint tensors to check (default all).
        """
        from safetensors import safe_open

        self._deltarefit_trusted_checkpoint(checkpoint_dir)
        model = self._deltarefit_model()
        packed = _packed_mapping(model)
        tp = int(getattr(getattr(self, "parallel_config", None), "tensor_parallel_size", 1) or 1)
        out: dict[str, Any] = {"verified": [], "mismatched": [], "unverified": []}
        with contextlib.ExitStack() as stack:
            ck = stack.enter_context(open_checkpoint(checkpoint_dir))
            wanted = list(ck.tensors) if names is None else [n for n in ck.tensors if n in set(names)]
            handles: dict[str, Any] = {}

            def read(name: str) -> Any:
                file = ck.tensors[name].file
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
                return handles[file].get_tensor(name)

            verify_layers(model, wanted, packed, read, out, sharded=tp != 1)
        return out

    def deltarefit_digests(self) -> dict[str, str]:
        """sha256 of what the engine computes with: each linear layer's effective (kernel) weight, read
        through an identity probe, and the bits of every other non-empty parameter and buffer.

        Two engines of one model and parallel layout hold the same weights iff these are equal.
        """
        model = self._deltarefit_model()
        out: dict[str, str] = {}
        for name, module in model.named_modules():
            for pname, p in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
                if p.numel():
                    out[f"{name}.{pname}"] = bits_digest(p)
            if is_linear(module):
                out[f"{name}#kernel"] = kernel_digest(module)
        return out
