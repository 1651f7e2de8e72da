"""Capture where an engine's own weight loader puts each checkpoint element, without writing a byte.

``capture_layout(load, params, specs)`` runs the engine's loader (``load``: a callable taking an iterable
of ``(checkpoint name, tensor)``, e.g. a vLLM model's ``load_weights``) once per checkpoint tensor on a
probe tensor of the right dtype and shape, under a torch dispatch mode that sees every aten operation the
loader runs. Each ``copy_`` into a parameter's storage is recorded, not executed: its destination is a
strided view of the parameter and its source a strided view of the probe, and the pair is one affine
``Piece`` (TP slices, fused qkv/gate_up rows, transposes). Fills of parameter storage (padding rows) are
skipped too. Nothing the loader does reaches the parameters.

A checkpoint tensor whose load is anything else is not placed but listed in ``CapturedLayout.reload``
with the reason: the loader raised (a parameter replaced by post-load processing, a quantized layout),
it converted the dtype, copied from a computed tensor (a repack, a concatenation of a cloned source),
or wrote parameter storage by another in-place operation. Such tensors go through the engine's reload
path. Maps are never trusted on capture alone: ``LiveTarget`` checks coverage, and the caller checks
that the placed bits hash to the checkpoint's digests before first use (see ``deltarefit.engines.vllm``).

Hazard: a loader that swaps ``param.data`` for a new tensor bypasses the dispatcher; the capture then
sees a copy into a storage it does not know and reports the tensor for reload, but the swap itself has
happened. The parameters' storages are compared before and after each probe, and such a loader is
refused with ``UsageError`` naming the parameter.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import UsageError
from ..geometry.projection import Axis, Piece
from .placement import Placement

log = logging.getLogger(__name__)

__all__ = ["CapturedLayout", "capture_layout", "piece_from_views", "placed_params", "sub_param"]


@dataclass
class CapturedLayout:
    placements: dict[str, list[Placement]] = field(default_factory=dict)  # checkpoint name -> placements
    reload: dict[str, str] = field(default_factory=dict)  # checkpoint name -> why it is not placed


@dataclass(frozen=True)
class _View:
    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]


def _decompose(view: _View, shape: Sequence[int]) -> tuple[list[int], dict[int, tuple[int, int]]] | None:
    """Start coordinates of a strided view into a contiguous tensor of ``shape``, and per view dim of size
    > 1 the tensor dim it steps along and its step there; None when the view is not such a box."""
    if not shape or view.offset < 0 or view.offset >= max(1, math.prod(shape)):
        return None
    start = [int(x) for x in np.unravel_index(view.offset, shape)]
    cstr = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    out: dict[int, tuple[int, int]] = {}
    used: set[int] = set()
    for d, (n, s) in enumerate(zip(view.sizes, view.strides, strict=True)):
        if n <= 1:
            continue
        if s <= 0:
            return None
        for j in range(len(shape) - 1, -1, -1):  # innermost first: a stride of 1 is the last dim's
            if j in used or s % cstr[j] or start[j] + (s // cstr[j]) * (n - 1) >= shape[j]:
                continue
            out[d] = (j, s // cstr[j])
            used.add(j)
            break
        else:
            return None
    return start, out


def piece_from_views(name: str, ckpt_shape: Sequence[int], src: _View, param_shape: Sequence[int],
                     dst: _View) -> Piece | None:
    """The piece of a ``dst.copy_(src)`` with ``src`` a view of checkpoint tensor ``name`` and ``dst`` a
    view of a parameter (both contiguous underneath); None when it is not one affine box."""
    ckpt_shape, param_shape = tuple(int(d) for d in ckpt_shape), tuple(int(d) for d in param_shape)
    if len(ckpt_shape) != len(param_shape) or src.sizes != dst.sizes:
        return None
    c = _decompose(src, ckpt_shape)
    loc = _decompose(dst, param_shape)
    if c is None or loc is None:
        return None
    (c_start, c_dims), (l_start, l_dims) = c, loc
    if set(c_dims) != set(l_dims):
        return None
    axes: dict[int, Axis] = {}
    for d, (j, q) in l_dims.items():
        cd, cq = c_dims[d]
        axes[j] = Axis(l_start[j], dst.sizes[d], cd, c_start[cd], cq, q)
    free_l = [j for j in range(len(param_shape)) if j not in axes]
    free_c = [cd for cd in range(len(ckpt_shape)) if cd not in {a.dst_dim for a in axes.values()}]
    for j, cd in zip(free_l, free_c, strict=True):
        axes[j] = Axis(l_start[j], 1, cd, c_start[cd])
    try:
        piece = Piece(name, ckpt_shape, param_shape, tuple(axes[j] for j in range(len(param_shape))))
    except UsageError:
        return None
    if piece.count != math.prod(src.sizes):
        return None
    # Check the map on the view's corners and a sample: local flat -> checkpoint flat, as the strides say.
    nd = len(src.sizes)
    rng = np.random.default_rng(0)
    sample = np.stack([rng.integers(0, n, 64) for n in src.sizes], -1)
    corners = np.array([[n - 1 if (k >> d) & 1 else 0 for d, n in enumerate(src.sizes)]
                        for k in range(1 << min(nd, 6))], np.int64)
    idx = np.concatenate([sample, corners]).astype(np.int64)
    want = src.offset + idx @ np.array(src.strides, np.int64)
    local = dst.offset + idx @ np.array(dst.strides, np.int64)
    if not np.array_equal(piece.to_ckpt(local), want):
        return None
    return piece


def _sub_piece(name: str, ckpt_shape: Sequence[int], src: _View, param_shape: Sequence[int],
               dst: _View) -> tuple[tuple[int, ...], Piece] | None:
    """(leading indices, piece) of a copy into a parameter of higher rank than the checkpoint tensor: the
    box lies in one slice ``param[i, j, ...]`` (a stacked expert's rows of a fused MoE ``w13_weight``),
    and the piece is of that slice. None when the copy is not one affine box of one slice."""
    k = len(param_shape) - len(ckpt_shape)
    if k <= 0 or len(src.sizes) != len(ckpt_shape):
        return None
    inner = math.prod(param_shape[k:])
    if not inner or dst.offset < 0:
        return None
    lead, rel = divmod(dst.offset, inner)
    if lead >= math.prod(param_shape[:k]):
        return None
    reach = rel + sum((n - 1) * s for n, s in zip(dst.sizes, dst.strides, strict=True) if n > 1)
    if any(s < 0 for s in dst.strides) or reach >= inner:
        return None
    piece = piece_from_views(name, ckpt_shape, src, param_shape[k:], _View(rel, dst.sizes, dst.strides))
    if piece is None:
        return None
    return tuple(int(i) for i in np.unravel_index(lead, tuple(param_shape[:k]))), piece


def sub_param(name: str) -> tuple[str, tuple[int, ...]]:
    """(parameter name, leading indices) of a placement's parameter: ``experts.w13_weight[3]`` is slice 3
    of ``experts.w13_weight``; a plain name has no indices."""
    if not name.endswith("]") or "[" not in name:
        return name, ()
    base, _, idx = name[:-1].rpartition("[")
    return base, tuple(int(i) for i in idx.split(","))


def placed_params(params: Mapping[str, Any], placements: Mapping[str, Sequence[Placement]]) -> dict[str, Any]:
    """``params`` with a view for each sliced parameter the placements name (``sub_param``): the live
    target writes the slice, which shares the parameter's storage."""
    out = dict(params)
    for places in placements.values():
        for pl in places:
            if pl.param not in out:
                base, idx = sub_param(pl.param)
                out[pl.param] = params[base][idx]
    return out


def _storage_key(t: Any) -> int:
    return t.untyped_storage().data_ptr()


def _view_of(t: Any, base_offset: int) -> _View:
    return _View(t.storage_offset() - base_offset, tuple(int(x) for x in t.shape), tuple(int(x) for x in t.stride()))


def _written_args(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """Tensors an aten op writes (its mutable arguments, ``out=`` included)."""
    import torch

    out = []
    schema = func._schema
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def _recorder(by_storage: Mapping[int, tuple[str, Any]]) -> type:
    """A torch dispatch mode recording where a loader's copies of one probe land in the parameters
    (``by_storage``: storage key -> (parameter name, parameter)); those copies are not executed."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    fills = {aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default}

    class Recorder(TorchDispatchMode):
        def __init__(self, name: str, probe: Any) -> None:
            super().__init__()
            self.name, self.probe, self.probe_key = name, probe, _storage_key(probe)
            self.copies: list[tuple[str, _View, _View]] = []
            self.problem: str | None = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            written = _written_args(func, args, kwargs)
            hit = [w for w in written if w.numel() and _storage_key(w) in by_storage]
            if not hit:
                return func(*args, **kwargs)
            dst = hit[0]
            pname, p = by_storage[_storage_key(dst)]
            if not p.is_contiguous():  # a transposed or strided view (an fp8 weight kept as qweight.t())
                self.problem = self.problem or f"{pname} is a strided view, not a contiguous parameter"
                return dst  # refused, and not executed either: the probe's bytes never reach the engine
            if func is aten.copy_.default:
                src = args[1]
                if not isinstance(src, torch.Tensor) or _storage_key(src) != self.probe_key:
                    self.problem = self.problem or f"{pname} is written from a computed tensor, not the checkpoint's"
                elif src.dtype != dst.dtype:
                    self.problem = self.problem or f"{pname} is {dst.dtype}, loaded from {src.dtype} by conversion"
                elif tuple(src.shape) != tuple(dst.shape):
                    self.problem = self.problem or f"{pname} is written by a broadcasting copy"
                elif src.numel():
                    self.copies.append((pname, _view_of(src, self.probe.storage_offset()),
                                        _view_of(dst, p.storage_offset())))
                return dst  # recorded, not executed
            if func in fills:
                return dst  # padding or a reset of the parameter: not checkpoint elements, not executed
            self.problem = self.problem or f"{pname} is written by {func.__name__}, not by a copy"
            return dst

    return Recorder


def capture_layout(load: Callable[[Iterable[tuple[str, Any]]], Any], params: Mapping[str, Any],
                   specs: Mapping[str, tuple[Any, Sequence[int]]]) -> CapturedLayout:
    """Run ``load`` on a probe of every checkpoint tensor in ``specs`` (name -> (torch dtype, shape)) and
    return where each lands in ``params`` (name -> parameter), or why it does not land affinely."""
    import torch

    # Every parameter's storage, strided ones too: a write into any of them is recorded or refused, never
    # executed (the probe holds no weights).
    by_storage: dict[int, tuple[str, Any]] = {}
    for pname, p in sorted(params.items(), key=lambda kv: not kv[1].is_contiguous()):
        if p.numel():
            by_storage.setdefault(_storage_key(p), (pname, p))
    recorder = _recorder(by_storage)
    out = CapturedLayout()
    before = {n: (p.untyped_storage().data_ptr(), p.storage_offset()) for n, p in params.items()}
    for name, (dt, shape) in specs.items():
        probe = torch.empty(tuple(shape), dtype=dt)
        rec = recorder(name, probe)
        try:
            with torch.no_grad(), rec:
                load([(name, probe)])
        except Exception as e:  # the loader refused the probe: the engine's storage is not the checkpoint's
            out.reload[name] = f"the loader raised {type(e).__name__}: {str(e)[:160]}"
            continue
        finally:
            del probe
        moved = [n for n, p in params.items() if (p.untyped_storage().data_ptr(), p.storage_offset()) != before[n]]
        if moved:
            raise UsageError(f"loading {name!r} replaced the storage of parameter {moved[0]!r}; this loader cannot "
                             "be captured without changing the engine")
        places, why = _placements(name, shape, rec, params)
        if places is None:
            out.reload[name] = why
        else:
            out.placements[name] = places
    return out


def _placements(name: str, shape: Sequence[int], rec: Any, params: Mapping[str, Any]
                ) -> tuple[list[Placement] | None, str]:
    """(the placements of checkpoint tensor ``name`` from a recorder's copies, or None and why it is a
    reload target instead)."""
    if rec.problem:
        return None, rec.problem
    if not rec.copies:
        return None, "the loader did not copy it into any parameter"
    places = []
    for pname, src, dst in rec.copies:
        pshape = tuple(params[pname].shape)
        piece, where = piece_from_views(name, shape, src, pshape, dst), pname
        if piece is None:  # a slice of a stacked parameter (fused MoE experts)?
            sub = _sub_piece(name, shape, src, pshape, dst)
            if sub is None:
                return None, f"its copy into {pname} is not one affine box"
            where, piece = f"{pname}[{','.join(map(str, sub[0]))}]", sub[1]
        places.append(Placement(where, piece))
    # The same checkpoint elements copied into several parameters: the first copy owns them.
    seen: list[Piece] = []
    final = []
    for pl in places:
        dup = any(_same_box(pl.piece, q) for q in seen)
        final.append(Placement(pl.param, Piece(pl.piece.name, pl.piece.shape, pl.piece.local_shape,
                                               pl.piece.axes, owner=not dup)))
        seen.append(pl.piece)
    return final, ""


def _same_box(a: Piece, b: Piece) -> bool:
    return a.box() == b.box()
