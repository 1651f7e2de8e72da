"""Parameter names -> checkpoint names, as data (``tables.py``), and the layouts built from them.

A **layout** is ``{local parameter name: LocalTensor}``: for each tensor a rank holds, its local shape
and the pieces (``geometry.projection.Piece``) saying where it lives in checkpoint tensors. Layouts are built
from the checkpoint's shapes (``{name: shape}``, e.g. from a safetensors header or ``llama_shapes``)
plus the name table:

* ``trainer_layout``: a trainer's parameters (plain or fused, e.g. ``qkv_proj`` = rows of q, k, v),
  each sharded by DTensor placements (``Shard(d)``, ``Replicate``) or an explicit spec.
* ``tp_layout``: a tensor-parallel rollout rank in its own fused layout (vLLM style): column-parallel
  = dim-0 slice, row-parallel = dim-1 slice, vocab-parallel = dim-0 slice, the rest replicated; fused
  ``qkv_proj`` holds this rank's q rows, then its k rows, then its v rows.
* ``identity_layout``: a rank holding whole checkpoint tensors under their own names (an HF module).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from ..geometry.projection import (
    Axis,
    Piece,
    chunk_range,
    fused_pieces,
    placement_box,
    shard_pieces,
    whole_piece,
)
from .tables import TABLES

__all__ = ["LocalTensor", "cuts_from_layouts", "fused_params", "identity_layout", "llama_shapes", "load_table",
           "tp_layout", "trainer_layout", "with_fp8_scales"]


@dataclass(frozen=True)
class LocalTensor:
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


Layout = dict[str, LocalTensor]


def load_table(name: str = "llama") -> dict:
    """A shipped name table (``tables.TABLES``: llama, qwen2, mistral) or, given a .json path, that file
    (same structure as ``tables.LLAMA``)."""
    if name.endswith(".json"):
        with open(name, encoding="utf-8") as f:
            return json.load(f)
    try:
        return TABLES[name]
    except KeyError:
        raise UsageError(f"no name table {name!r}; shipped: {', '.join(TABLES)}") from None


def llama_shapes(config) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor shapes of an HF Llama/Qwen2-style config (head counts give the q/k/v rows)."""
    c = config if isinstance(config, Mapping) else config.to_dict()
    h, nl, v, inter = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    nq = c["num_attention_heads"]
    nkv = c.get("num_key_value_heads") or nq
    hd = c.get("head_dim") or h // nq
    bias = bool(c.get("attention_bias", False)) or c.get("model_type") == "qwen2"
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(nl):
        p = f"model.layers.{i}"
        out |= {f"{p}.self_attn.q_proj.weight": (nq * hd, h), f"{p}.self_attn.k_proj.weight": (nkv * hd, h),
                f"{p}.self_attn.v_proj.weight": (nkv * hd, h), f"{p}.self_attn.o_proj.weight": (h, nq * hd),
                f"{p}.mlp.gate_proj.weight": (inter, h), f"{p}.mlp.up_proj.weight": (inter, h),
                f"{p}.mlp.down_proj.weight": (h, inter), f"{p}.input_layernorm.weight": (h,),
                f"{p}.post_attention_layernorm.weight": (h,)}
        if bias:
            out |= {f"{p}.self_attn.q_proj.bias": (nq * hd,), f"{p}.self_attn.k_proj.bias": (nkv * hd,),
                    f"{p}.self_attn.v_proj.bias": (nkv * hd,)}
    if not c.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (v, h)
    return out


def with_fp8_scales(shapes: Mapping[str, Sequence[int]], served: Mapping[str, str]) -> dict[str, tuple[int, ...]]:
    """Checkpoint shapes plus a ``<name>_scale_inv`` tensor for every tensor served as ``F8_E4M3``
    (what a rollout holds; trainers publish the scales from their weights' pieces)."""
    from .convert import SCALE_SUFFIX, fp8_block_shape

    out = {n: tuple(int(d) for d in s) for n, s in shapes.items()}
    for n, s in shapes.items():
        if served.get(n) == "F8_E4M3":
            out[n + SCALE_SUFFIX] = fp8_block_shape(tuple(s))
    return out


def fused_params(shapes: Mapping[str, Sequence[int]], table: dict) -> dict[str, tuple[list[str], int]]:
    """``{fused parameter name: (checkpoint parts, dim)}`` for every fused rule all of whose parts exist."""
    out: dict[str, tuple[list[str], int]] = {}
    for rule in table.get("fused", []):
        # Derive candidates from the checkpoint names of the first part.
        part0 = rule["parts"][0]
        pat = re.escape(part0)
        for g, sub in _groups(rule["param"]).items():
            pat = pat.replace(re.escape("{" + g + "}"), f"(?P<{g}>{sub})", 1)
        pat = "^" + pat + "$"
        for n in shapes:
            m = re.match(pat, n)
            if not m:
                continue
            g = m.groupdict()
            parts = [p.format(**g) for p in rule["parts"]]
            if not all(p in shapes for p in parts):
                continue
            fused = _param_name(rule["param"], g)
            out[fused] = (parts, int(rule["dim"]))
    return out


def _groups(pattern: str) -> dict[str, str]:
    """``{group name: sub-pattern}`` of the named groups of a regex (balanced parentheses)."""
    out = {}
    for m in re.finditer(r"\(\?P<(\w+)>", pattern):
        depth, i = 1, m.end()
        while depth:
            if pattern[i] == "\\":
                i += 2
                continue
            depth += {"(": 1, ")": -1}.get(pattern[i], 0)
            i += 1
        out[m.group(1)] = pattern[m.end():i - 1]
    return out


def _param_name(pattern: str, groups: dict[str, str]) -> str:
    """Instantiate a fused-parameter regex like ``^(?P<p>.+\\.mlp)\\.gate_up_proj\\.weight$``."""
    s = pattern.strip("^$")
    s = re.sub(r"\(\?P<(\w+)>[^()]*(?:\([^()]*\)[^()]*)*\)", lambda m: "\0" + m.group(1) + "\0", s)
    s = s.replace("\\.", ".")
    return re.sub("\0(\\w+)\0", lambda m: groups[m.group(1)], s)


def param_pieces(shapes: Mapping[str, Sequence[int]], table: dict, fuse: bool = True) -> dict[str, list[Piece]]:
    """Whole-parameter pieces: fused parameters (if ``fuse``) and every other checkpoint tensor as itself."""
    out: dict[str, list[Piece]] = {}
    covered: set[str] = set()
    if fuse:
        for fused, (parts, dim) in fused_params(shapes, table).items():
            out[fused] = fused_pieces([(p, shapes[p]) for p in parts], dim)
            covered.update(parts)
    for n, s in shapes.items():
        if n not in covered:
            out[n] = [whole_piece(n, s)]
    return out


def trainer_layout(shapes: Mapping[str, Sequence[int]], mesh_shape: Sequence[int], coords: Sequence[int],
                   placements: Mapping[str, Sequence] | Sequence, *, table: dict | None = None,
                   fuse: bool = True) -> Layout:
    """Layout of one trainer rank: each parameter (fused per the table if ``fuse``) sharded by DTensor
    placements (torch ``Shard``/``Replicate`` objects or plain specs ``"S0"``, ``"R"``), one per mesh
    dimension; ``placements`` is one list for all or ``{param: list}``."""
    table = load_table() if table is None else table
    out: Layout = {}
    for name, pieces in param_pieces(shapes, table, fuse).items():
        gshape = pieces[0].local_shape
        pl = placements[name] if isinstance(placements, Mapping) else placements
        off, local, owner = placement_box(gshape, mesh_shape, coords, pl)
        out[name] = LocalTensor(local, tuple(shard_pieces(pieces, off, local, owner)))
    return out


def identity_layout(shapes: Mapping[str, Sequence[int]]) -> Layout:
    return {n: LocalTensor(tuple(int(d) for d in s), (whole_piece(n, s),)) for n, s in shapes.items()}


def _tp_style(name: str, table: dict) -> str:
    for style, pats in table.get("tp", {}).items():
        if any(re.search(p, name) for p in pats):
            return style
    return "replicate"


def tp_layout(shapes: Mapping[str, Sequence[int]], tp_size: int, tp_rank: int, *, table: dict | None = None,
              fuse: bool = True) -> Layout:
    """Layout of one tensor-parallel rollout rank (fused ``qkv_proj``/``gate_up_proj`` if ``fuse``).

    Slices use ``torch.chunk`` semantics per checkpoint tensor; engines that pad the vocabulary or
    replicate kv heads when ``tp_size > num_key_value_heads`` need their own layout (refused here).
    """
    table = load_table() if table is None else table
    out: Layout = {}
    groups = fused_params(shapes, table) if fuse else {}
    covered = {p for parts, _ in groups.values() for p in parts}
    singles = {n: ([n], None) for n in shapes if n not in covered}
    for name, (parts, _dim) in {**groups, **singles}.items():
        styles = {_tp_style(p, table) for p in parts}
        if len(styles) != 1:
            raise UsageError(f"fused parameter {name!r} mixes tensor-parallel styles {sorted(styles)}")
        style = styles.pop()
        if style == "replicate":
            s = tuple(int(d) for d in shapes[parts[0]])
            out[name] = LocalTensor(s, (whole_piece(parts[0], s, owner=tp_rank == 0),))
            continue
        dim = 1 if style == "row" else 0
        pieces, off = [], 0
        local: list[int] | None = None
        for p in parts:
            s = tuple(int(d) for d in shapes[p])
            if s[dim] % tp_size:
                raise UsageError(f"{p}: dim {dim} of size {s[dim]} does not split evenly over tp={tp_size}")
            lo, hi = chunk_range(s[dim], tp_size, tp_rank)
            pieces.append((p, s, lo, hi, off))
            off += hi - lo
            local = list(s)
        assert local is not None
        local[dim] = off
        ps = []
        for p, s, lo, hi, o in pieces:
            axes = tuple(Axis(o if d == dim else 0, (hi - lo) if d == dim else n, d, lo if d == dim else 0)
                         for d, n in enumerate(s))
            ps.append(Piece(p, s, tuple(local), axes))
        out[name] = LocalTensor(tuple(local), tuple(ps))
    return out


def cuts_from_layouts(layouts: Sequence[Layout]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Per checkpoint tensor and dimension, the sorted boundaries of every piece of these layouts.

    A publisher cuts its regions at these points, so each rank of these layouts can decode exactly the
    cells it holds with the base it holds. Strided pieces have no interval boundaries and are refused.
    """
    cuts: dict[str, list[set[int]]] = {}
    for lay in layouts:
        for lt in lay.values():
            for p in lt.pieces:
                c = cuts.setdefault(p.name, [{0, n} for n in p.shape])
                for a in p.axes:
                    if a.dst_stride != 1 and a.length > 1:
                        raise UsageError(f"{p.name}: strided pieces cannot define cell boundaries")
                    c[a.dst_dim].update((a.dst_off, a.dst_off + a.length))
    return {n: tuple(tuple(sorted(s)) for s in c) for n, c in cuts.items()}


def local_from_full(layout: Layout, full: Mapping[str, np.ndarray], dtype) -> dict[str, np.ndarray]:
    """The local tensors of ``layout`` filled from checkpoint-named full arrays (``full`` may be mmaps of
    an export): what a rank loads when it starts from a full checkpoint, and what tests compare with.
    Memory: the local tensors; each full array is read only where the layout's pieces lie."""
    out = {}
    for ln, lt in layout.items():
        a = np.zeros(lt.shape, dtype)
        for p in lt.pieces:
            box = p.box()
            f = box.flat(np.arange(box.count, dtype=np.int64))
            a.reshape(-1)[p.to_local(f)] = full[p.name].reshape(-1)[f]
        out[ln] = a
    return out
