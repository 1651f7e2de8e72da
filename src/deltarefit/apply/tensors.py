"""Apply deltas straight into live torch tensors and modules, and fingerprint them, without a file.

* ``apply_to_tensors(delta, {name: tensor})`` patches CPU tensors in place through uint8 numpy views
  sharing their memory (no second copy of the model). Tensors the delta adds, removes or re-types are
  inserted into, deleted from or replaced in the dict (``ApplyReport.structural`` names them).
* ``apply_to_module(delta, module)`` patches ``module.state_dict(keep_vars=True)`` (parameters and
  persistent buffers) in place under ``torch.no_grad()``. Structural changes are refused: a module's
  parameters cannot appear or change type without the module's code.
* ``state_dict_fingerprint(tensors)`` is ``deltarefit.fingerprint`` of a safetensors file holding them.

The full apply protocol runs unchanged (``apply.protocol.run_apply``): every tensor is checked against the delta's
base before any byte is written, every written chunk is re-hashed, and the result must hash to the
delta's target fingerprint. There is no journal: a crash mid-apply loses the process's memory anyway.

Shared storage (tied weights: one storage under two names, e.g. input and output embeddings) is
written once. Every name the delta lists for a storage must say the same thing about it (same base and
same target digest); one of them is applied and the others are re-hashed at the end against their
target digests, so the fingerprint is still verified over every name. Names the delta does not list
but that share storage with a listed one (a file saved with ``safetensors.torch.save_model``, which
keeps one name per storage) are covered by that one. Tensors overlapping only in part, or sharing
memory under another dtype or shape, are refused.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..dtypes import DTYPES
from ..encode import default_threads
from ..errors import DeltaRefitError, UsageError, VerificationError
from ..format import ChunkRecord, DeltaReader, TensorEntry
from ..history_book import HistoryBook, MovesRecorder, advance_or_start_over
from ..integrity import (
    SEGMENT_BYTES,
    fingerprint_from_digests,
    segment_hashes,
    tensor_digest_from_segments,
)
from .files import _new_tensor_chunks
from .protocol import ApplyReport, _TensorPlan, run_apply

__all__ = ["TORCH_DTYPES", "apply_to_module", "apply_to_tensors", "safetensors_dtype", "state_dict_fingerprint",
           "torch_dtype"]

_NAMES = [
    ("BF16", "bfloat16"), ("F16", "float16"), ("F32", "float32"), ("F64", "float64"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ("I8", "int8"), ("I16", "int16"), ("I32", "int32"), ("I64", "int64"),
    ("U8", "uint8"), ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("BOOL", "bool"),
]  # fmt: skip
# safetensors dtype name -> torch dtype (only those this torch build has)
TORCH_DTYPES: dict[str, torch.dtype] = {st: getattr(torch, tn) for st, tn in _NAMES if hasattr(torch, tn)}
_ST_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}
assert all(k in DTYPES for k in TORCH_DTYPES)


def safetensors_dtype(dt: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``); UsageError if unsupported."""
    try:
        return _ST_NAMES[dt]
    except KeyError:
        raise UsageError(f"torch dtype {dt} has no safetensors equivalent deltarefit supports; "
                         f"supported: {', '.join(str(d) for d in _ST_NAMES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (``"F8_E4M3"`` -> ``torch.float8_e4m3fn``)."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise UsageError(f"dtype {name} has no torch equivalent in torch {torch.__version__}") from None


# ------------------------------------------------------------------------------------------ targets


@dataclass(frozen=True)
class _Info:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def _raw_view(t: torch.Tensor) -> np.ndarray:
    """A writable 1-D uint8 numpy array over the tensor's bytes (shares memory; ``t`` must be contiguous)."""
    flat = t.detach().reshape(-1)  # a view for a contiguous tensor, also 1-D for a 0-d one
    if flat.numel() == 0:
        return np.zeros(0, np.uint8)
    return flat.view(torch.uint8).numpy()


def _check_tensor(name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise UsageError(f"tensor {name!r}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise UsageError(f"tensor {name!r}: layout {t.layout} is not supported (only dense strided tensors)")
    if t.device.type != "cpu":
        raise UsageError(f"tensor {name!r} is on {t.device}; apply into CPU tensors (or move it with .cpu() "
                         "and copy it back)")
    if not t.is_contiguous():
        raise UsageError(f"tensor {name!r} is not contiguous (strides {tuple(t.stride())}); apply needs its "
                         "bytes in safetensors order: pass t.contiguous() and keep that tensor")
    if t.is_conj() or t.is_neg():
        raise UsageError(f"tensor {name!r} has a lazy conj/neg bit; resolve it first")
    try:
        safetensors_dtype(t.dtype)
    except UsageError as e:
        raise UsageError(f"tensor {name!r}: {e}") from None


class _TorchTarget:
    """A ``TensorTarget`` over torch tensors: info per name and cached uint8 views sharing memory."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.torch = dict(tensors)
        self.tensors: dict[str, _Info] = {
            n: _Info(_ST_NAMES[t.dtype], tuple(int(d) for d in t.shape), t.numel() * t.element_size())
            for n, t in self.torch.items()
        }
        self._raw: dict[str, np.ndarray] = {}

    def raw(self, name: str) -> np.ndarray:
        v = self._raw.get(name)
        if v is None:
            v = self._raw[name] = _raw_view(self.torch[name])
        return v


# ------------------------------------------------------------------------------------ shared storage


def _span(t: torch.Tensor) -> tuple[int, int]:
    n = t.numel() * t.element_size()
    return (t.data_ptr(), t.data_ptr() + n)


def _alias_groups(tensors: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Groups (2+ names) of tensors over exactly the same bytes; refuses partial or re-typed overlap."""
    spans = sorted((_span(t), n) for n, t in tensors.items() if t.numel())
    groups: list[list[str]] = []
    i = 0
    while i < len(spans):
        (lo, hi), name = spans[i]
        j = i + 1
        group = [name]
        while j < len(spans) and spans[j][0][0] < hi:  # starts before this span ends: overlap
            (lo2, hi2), other = spans[j]
            a, b = tensors[name], tensors[other]
            if (lo2, hi2) != (lo, hi) or a.dtype != b.dtype or a.shape != b.shape:
                raise UsageError(f"tensors {name!r} and {other!r} share memory without being the same tensor "
                                 f"({a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}); "
                                 "apply into such views is not supported")
            group.append(other)
            j += 1
        if len(group) > 1:
            groups.append(sorted(group))
        i = j
    return groups


class _DeltaView:
    """A ``DeltaReader`` seen without some tensor entries (aliases applied through another name)."""

    def __init__(self, d: DeltaReader, drop: set[str]) -> None:
        self._d = d
        self.path = d.path
        self.base_fingerprint = d.base_fingerprint
        self.manifest = d.manifest
        self.tensors: list[TensorEntry] = [e for e in d.tensors if e.name not in drop]
        # run_apply checks its digests against this; the full fingerprint is checked by our caller.
        self.target_fingerprint = fingerprint_from_digests(
            {e.name: e.target.digest for e in self.tensors if e.target is not None})

    def chunks(self, e: TensorEntry) -> list[ChunkRecord]:
        return self._d.chunks(e)

    def read_payload(self, r: ChunkRecord, where: str) -> bytes:
        return self._d.read_payload(r, where)


def _dedupe(d: DeltaReader, tensors: Mapping[str, torch.Tensor]) -> tuple[set[str], set[str]]:
    """Names to hide from the applier: (delta entries applied through another name, extra target names).

    Only in-place entries (op ``same``/``patch``) write to existing storage, so only they are merged;
    ``remove``/``replace`` entries read a storage before any write and never write into it.
    """
    entries = {e.name: e for e in d.tensors}
    drop_entries: set[str] = set()
    drop_targets: set[str] = set()
    for group in _alias_groups(tensors):
        listed = [n for n in group if n in entries]
        inplace = [n for n in listed if entries[n].op in ("same", "patch")]
        if not listed:
            continue  # the applier reports the names as unknown to the delta
        if inplace:
            first = entries[inplace[0]]
            for n in inplace[1:]:
                e = entries[n]
                if (e.base, e.target) != (first.base, first.target):
                    what = "base" if e.base != first.base else "target"
                    raise UsageError(
                        f"tensors {inplace[0]!r} and {n!r} share one storage (tied weights) but the delta gives "
                        f"them different {what} contents; it cannot be applied to tied tensors (untie them, "
                        "or encode from checkpoints where they are equal)")
                drop_entries.add(n)
                drop_targets.add(n)
        # Names the delta does not list ride along with a listed one of the same storage.
        drop_targets.update(n for n in group if n not in entries)
    return drop_entries, drop_targets


# -------------------------------------------------------------------------------------------- apply


def _structural_for(tensors: dict[str, torch.Tensor]):
    def structural(delta, plans: list[_TensorPlan]) -> list[str]:
        # Decode (hash-checked) every new tensor first, then change the dict: all or nothing.
        new: dict[str, torch.Tensor] = {}
        removed: list[str] = []
        for tp in plans:
            e = tp.entry
            if tp.state in ("add", "replace"):
                t = torch.empty(e.target.shape, dtype=torch_dtype(e.target.dtype))
                raw = _raw_view(t)
                off = 0
                for data in _new_tensor_chunks(delta, e):
                    raw[off:off + len(data)] = np.frombuffer(data, np.uint8)
                    off += len(data)
                if off != e.target.nbytes:
                    raise VerificationError(f"tensor {e.name!r}: decoded {off} bytes, expected {e.target.nbytes}")
                new[e.name] = t
            elif tp.state == "remove":
                removed.append(e.name)
        for n in removed:
            tensors.pop(n, None)
        tensors.update(new)
        return [tp.entry.name for tp in plans if tp.state in ("add", "remove", "replace")]

    return structural


def _check_tensors(tensors: Mapping[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise UsageError(f"tensor names must be strings, got {name!r}")
        _check_tensor(name, t)


def _apply(delta_path: str, tensors: dict[str, torch.Tensor], *, threads: int | None,
           allow_structural: bool, history: HistoryBook | None = None) -> ApplyReport:
    _check_tensors(tensors)
    moves = MovesRecorder() if history is not None else None
    with DeltaReader(delta_path) as d:
        if not allow_structural:
            _refuse_structural(d, tensors)
        drop_entries, drop_targets = _dedupe(d, tensors)
        target = _TorchTarget({n: t for n, t in tensors.items() if n not in drop_targets})
        view = _DeltaView(d, drop_entries) if drop_entries or drop_targets else d
        structural = _structural_for(tensors) if allow_structural else None
        rep = run_apply(view, target, journal=None, threads=threads, structural=structural, history=history,
                        moves=moves)
        if view is not d:
            # Every name the delta lists must hash to its target digest; the merged ones are re-hashed.
            digests = {e.name: e.target.digest for e in d.tensors if e.target is not None}
            for n in drop_entries:
                e = next(x for x in d.tensors if x.name == n)
                got = _digest(e.target.dtype, e.target.shape, _raw_view(tensors[n]))
                if got != e.target.digest:
                    raise VerificationError(f"tensor {n!r} (tied) does not hash to the delta's target after apply")
            fp = fingerprint_from_digests(digests)
            if fp != d.target_fingerprint:
                raise VerificationError(f"fingerprint after apply {fp[:16]}… is not the delta's target "
                                        f"{d.target_fingerprint[:16]}…")
            rep = dataclasses.replace(rep, target_fingerprint=fp)
        if history is not None and moves is not None:
            # The tensors are verified at the target: a book that cannot be written (a full disk,
            # something planted at its path) is started over instead of failing the apply.
            advance_or_start_over(history, d, moves, tolerate=(OSError, DeltaRefitError))
    return rep


def _refuse_structural(d: DeltaReader, tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse (before any write) a delta that would add, remove or re-type a tensor of a module."""
    for e in d.tensors:
        t = tensors.get(e.name)
        if e.op == "add" and t is None:
            need = f"adds tensor {e.name!r} ({e.target.dtype}{list(e.target.shape)})"
        elif e.op == "remove" and t is not None:
            need = f"removes tensor {e.name!r}"
        elif e.op == "replace" and t is not None and (_ST_NAMES[t.dtype], tuple(t.shape)) == (
                e.base.dtype, e.base.shape):
            need = (f"changes tensor {e.name!r} from {e.base.dtype}{list(e.base.shape)} to "
                    f"{e.target.dtype}{list(e.target.shape)}")
        else:
            continue
        raise UsageError(f"{d.path}: the delta {need}, which cannot be done in place in a module; "
                         "apply it to a checkpoint file or a dict of tensors, then load that")


def apply_to_tensors(delta_path: str, tensors: dict[str, torch.Tensor], *,
                     threads: int | None = None, history: HistoryBook | None = None) -> ApplyReport:
    """Apply the delta in place into CPU torch tensors; ``tensors`` must be the delta's base.

    Existing tensors are written through views of their memory. Added and re-typed tensors are put into
    ``tensors`` as new tensors, removed ones are deleted from it. Wrong base, non-contiguous or non-CPU
    tensors are refused before any byte is written. Idempotent: applying again changes nothing.
    ``history``: the tensors' history book (as ``deltarefit.apply``'s): ``ulp_hist`` chunks decode
    against it (refused by name, nothing written, where it is not theirs), and it advances once the
    apply is verified (one that cannot be written is started over: the verified apply stands).
    """
    if not isinstance(tensors, dict):
        raise UsageError(f"tensors must be a dict of name -> torch.Tensor, got {type(tensors).__name__}")
    return _apply(delta_path, tensors, threads=threads, allow_structural=True, history=history)


def apply_to_module(delta_path: str, module: torch.nn.Module, *, threads: int | None = None,
                    history: HistoryBook | None = None) -> ApplyReport:
    """Apply the delta in place into a module's parameters and persistent buffers (``state_dict`` names).

    Tied weights are written once and verified under every name. Deltas that add, remove or re-type
    tensors are refused before any write, as are wrong bases and non-CPU or non-contiguous tensors.
    Non-tensor ``state_dict`` entries (``_extra_state``) are ignored. ``history``: as ``apply_to_tensors``.
    """
    if not isinstance(module, torch.nn.Module):
        raise UsageError(f"expected a torch.nn.Module, got {type(module).__name__}")
    with torch.no_grad():
        sd = module.state_dict(keep_vars=True)
        tensors = {n: v.detach() for n, v in sd.items() if isinstance(v, torch.Tensor)}
        return _apply(delta_path, tensors, threads=threads, allow_structural=False, history=history)


# -------------------------------------------------------------------------------------- fingerprint


def _digest(dt: str, shape: tuple[int, ...], raw: np.ndarray) -> bytes:
    return tensor_digest_from_segments(dt, shape, raw.size, segment_hashes(raw))


def state_dict_fingerprint(tensors: Mapping[str, torch.Tensor], *, threads: int | None = None) -> str:
    """``deltarefit.fingerprint`` of a safetensors file holding these tensors, computed from memory.

    Tensors on other devices and non-contiguous ones are hashed from a contiguous CPU copy.
    """
    threads = threads or default_threads()
    prepared: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = {}
    for name, t0 in tensors.items():
        if not isinstance(t0, torch.Tensor) or t0.layout != torch.strided:
            raise UsageError(f"tensor {name!r}: expected a dense torch.Tensor")
        t = t0.detach()
        dt = safetensors_dtype(t.dtype)
        if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg().to("cpu").contiguous()
        prepared[name] = (dt, tuple(int(d) for d in t.shape), _raw_view(t))

    step = 16 * SEGMENT_BYTES
    with ThreadPoolExecutor(threads, thread_name_prefix="deltarefit-hash") as pool:
        futs = {n: [pool.submit(segment_hashes, raw[o:o + step]) for o in range(0, raw.size, step)]
                for n, (_, _, raw) in prepared.items()}
        digests = {}
        for n, (dt, shape, raw) in prepared.items():
            segs = [h for f in futs[n] for h in f.result()]
            assert raw.size == math.prod(shape) * DTYPES[dt].itemsize
            digests[n] = tensor_digest_from_segments(dt, shape, raw.size, segs)
    return fingerprint_from_digests(digests)
