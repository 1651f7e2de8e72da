"""Shard-to-checkpoint projection: round trips for every placement kind, intersections against brute
force, and DTensor's own shard offsets as the reference for placements."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltarefit.errors import UsageError
from deltarefit.geometry.projection import (
    AP,
    Axis,
    Piece,
    chunk_range,
    fused_pieces,
    intersect_ap,
    intersect_pieces,
    placement_box,
    shard_pieces,
    transposed_piece,
    whole_piece,
)

FAST = settings(max_examples=60, deadline=None)


def gather(pieces, local_shape, full: dict[str, np.ndarray]) -> np.ndarray:
    """What a rank holding these pieces holds, filled through the maps (box order -> local)."""
    out = np.full(local_shape, -1, np.int64)
    for p in pieces:
        box = p.box()
        f = box.flat(np.arange(box.count))
        loc = p.to_local(f)
        assert (loc >= 0).all()
        np.testing.assert_array_equal(p.to_ckpt(loc), f)  # round trip local <-> checkpoint
        out.reshape(-1)[loc] = full[p.name].reshape(-1)[f]
    return out


def check_partition(pieces_per_rank, full):
    """Owner pieces of all ranks cover every checkpoint element exactly once."""
    seen = {n: np.zeros(a.size, np.int64) for n, a in full.items()}
    for pieces in pieces_per_rank:
        for p in pieces:
            if p.owner:
                box = p.box()
                np.add.at(seen[p.name], box.flat(np.arange(box.count)), 1)
    for n, s in seen.items():
        assert (s == 1).all(), n


shapes = st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple)


@st.composite
def placed(draw):
    shape = draw(shapes)
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    spec = draw(st.sampled_from(["plain", "torch"]))
    pls = []
    for _ in mesh:
        if draw(st.booleans()):
            pls.append("R")
        else:
            pls.append(f"S{draw(st.integers(0, len(shape) - 1))}")
    if spec == "torch":
        from torch.distributed.tensor import Replicate, Shard

        pls = [Replicate() if p == "R" else Shard(int(p[1:])) for p in pls]
    return shape, mesh, pls


def torch_local(arr: np.ndarray, mesh, coords, pls) -> np.ndarray:
    """Reference: DTensor's Shard semantics (torch.chunk per mesh dim, in mesh-dim order)."""
    import torch

    t = torch.from_numpy(arr)
    for m, c, p in zip(mesh, coords, pls, strict=True):
        s = p if isinstance(p, str) else ("R" if type(p).__name__ == "Replicate" else f"S{p.dim}")
        if s == "R":
            continue
        chunks = torch.chunk(t, m, dim=int(s[1:]))
        if c < len(chunks):
            t = chunks[c]
        else:  # torch.chunk returns fewer chunks; DTensor gives an empty shard
            shp = list(t.shape)
            shp[int(s[1:])] = 0
            t = t.new_empty(shp)
    return t.numpy()


@FAST
@given(placed())
def test_placements_round_trip_and_partition(case):
    shape, mesh, pls = case
    full = {"w": np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)}
    per_rank = []
    for coords in itertools.product(*(range(m) for m in mesh)):
        off, local, owner = placement_box(shape, mesh, coords, pls)
        pieces = shard_pieces([whole_piece("w", shape)], off, local, owner)
        per_rank.append(pieces)
        ref = torch_local(full["w"], mesh, coords, pls)
        assert tuple(ref.shape) == local
        if ref.size:
            np.testing.assert_array_equal(gather(pieces, local, full), ref)
    check_partition(per_rank, full)


@FAST
@given(st.lists(st.integers(1, 7), min_size=2, max_size=4), st.integers(1, 6), st.integers(1, 4),
       st.integers(0, 1), st.integers(0, 1))
def test_fused_split_sharded(rows, cols, world, fuse_dim, shard_dim):
    # A trainer's fused parameter (e.g. qkv = rows of q, k, v) sharded by Shard(shard_dim).
    names = [f"p{i}" for i in range(len(rows))]
    shp = [(r, cols) if fuse_dim == 0 else (cols, r) for r in rows]
    full, base = {}, 0
    for n, s in zip(names, shp, strict=True):
        full[n] = np.arange(base, base + s[0] * s[1], dtype=np.int64).reshape(s)
        base += s[0] * s[1]
    fused = np.concatenate([full[n] for n in names], axis=fuse_dim)
    pieces = fused_pieces(list(zip(names, shp, strict=True)), fuse_dim)
    per_rank = []
    for r in range(world):
        off, local, owner = placement_box(fused.shape, [world], [r], [f"S{shard_dim}"])
        ps = shard_pieces(pieces, off, local, owner)
        per_rank.append(ps)
        ref = torch_local(fused, [world], [r], [f"S{shard_dim}"])
        if ref.size:
            np.testing.assert_array_equal(gather(ps, local, full), ref)
    check_partition(per_rank, full)


@FAST
@given(shapes.filter(lambda s: len(s) >= 2), st.data())
def test_transpose_sharded(shape, data):
    perm = data.draw(st.permutations(range(len(shape))))
    world = data.draw(st.integers(1, 3))
    d = data.draw(st.integers(0, len(shape) - 1))
    full = {"w": np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)}
    tp = transposed_piece("w", shape, perm)
    local_full = full["w"].transpose(perm)
    per_rank = []
    for r in range(world):
        off, local, owner = placement_box(local_full.shape, [world], [r], [f"S{d}"])
        ps = shard_pieces([tp], off, local, owner)
        per_rank.append(ps)
        ref = torch_local(np.ascontiguousarray(local_full), [world], [r], [f"S{d}"])
        if ref.size:
            np.testing.assert_array_equal(gather(ps, local, full), ref)
    check_partition(per_rank, full)


@FAST
@given(st.integers(0, 30), st.integers(1, 5), st.integers(0, 12), st.integers(0, 30), st.integers(1, 5),
       st.integers(0, 12))
def test_intersect_ap_brute_force(o1, s1, n1, o2, s2, n2):
    a, b = AP(o1, s1, n1), AP(o2, s2, n2)
    want = sorted({o1 + s1 * i for i in range(n1)} & {o2 + s2 * j for j in range(n2)})
    got = intersect_ap(a, b)
    assert (got is None and not want) or [got.off + got.stride * i for i in range(got.length)] == want


@st.composite
def random_piece(draw, shape):
    nd = len(shape)
    perm = draw(st.permutations(range(nd)))
    axes, local = [], []
    for d in range(nd):
        cd = perm[d]
        stride = draw(st.integers(1, 3))
        length = draw(st.integers(1, max(1, (shape[cd] - 1) // stride + 1)))
        off = draw(st.integers(0, shape[cd] - 1 - stride * (length - 1)))
        src_off = draw(st.integers(0, 2))
        src_stride = draw(st.integers(1, 2))
        axes.append(Axis(src_off, length, cd, off, stride, src_stride))
        local.append(src_off + src_stride * (length - 1) + 1 + draw(st.integers(0, 2)))
    return Piece("w", shape, tuple(local), tuple(axes))


@FAST
@given(st.lists(st.integers(1, 10), min_size=1, max_size=3).map(tuple).flatmap(
    lambda s: st.tuples(random_piece(s), random_piece(s))))
def test_intersect_pieces_brute_force(pq):
    p, q = pq

    def elems(x):
        b = x.box()
        return set(b.flat(np.arange(b.count)).tolist())

    want = elems(p) & elems(q)
    got = intersect_pieces(p, q)
    if not want:
        assert got is None
        return
    box, lp, lq = got
    flat = box.flat(np.arange(box.count))
    assert set(flat.tolist()) == want and len(flat) == len(want)
    assert (np.diff(flat) > 0).all()  # box order is checkpoint row-major order
    np.testing.assert_array_equal(p.to_ckpt(lp), flat)
    np.testing.assert_array_equal(q.to_ckpt(lq), flat)
    # restrict() gives the same elements as a piece
    r = p.restrict(box)
    assert r is not None and elems(r) == want


def test_bad_maps_refused():
    with pytest.raises(UsageError):
        Piece("w", (4, 4), (4, 4), (Axis(0, 4, 0, 0), Axis(0, 4, 0, 0)))  # not a permutation
    with pytest.raises(UsageError):
        Piece("w", (4, 4), (4, 4), (Axis(0, 5, 0, 0), Axis(0, 4, 1, 0)))  # leaves the tensor
    with pytest.raises(UsageError):
        placement_box((4,), [2], [0], ["partial"])
    assert chunk_range(5, 4, 3) == (5, 5)  # torch.chunk: 2,2,1 and an empty fourth


DTENSOR_SCRIPT = r"""
import json, sys, itertools
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from deltarefit.geometry.projection import placement_box
bad = []
for mesh in [(2,), (3,), (2, 2), (2, 3)]:
    world = 1
    for m in mesh: world *= m
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        dm = init_device_mesh("cpu", mesh)
        coords = dm.get_coordinate()
        for shape in [(7,), (10, 7), (5, 4, 3)]:
            opts = [Replicate()] + [Shard(d) for d in range(len(shape))]
            for pls in itertools.product(opts, repeat=len(mesh)):
                ls, go = compute_local_shape_and_global_offset(shape, dm, list(pls))
                off, local, _ = placement_box(shape, mesh, coords, list(pls))
                if tuple(ls) != local or (0 not in local and tuple(go) != off):
                    bad.append([mesh, rank, shape, [str(p) for p in pls], list(ls), list(go), list(local), list(off)])
        dist.destroy_process_group()
print(json.dumps(bad))
"""


def test_placements_match_dtensor():
    pytest.importorskip("torch.distributed.tensor", reason="needs torch>=2.5 with DTensor: pip install -e '.[test]' (make test installs it)")
    r = subprocess.run([sys.executable, "-c", DTENSOR_SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


@FAST
@given(st.lists(st.integers(1, 10), min_size=1, max_size=3).map(tuple).flatmap(
    lambda s: st.tuples(random_piece(s), st.data())))
def test_box_indices_match_generic_maps(pd):
    from deltarefit.geometry.projection import box_indices

    p, data = pd
    box = p.box()
    a = data.draw(st.integers(0, box.count - 1))
    b = data.draw(st.integers(a, box.count))
    flat, loc = box_indices(box, p, a, b)
    want = box.flat(np.arange(a, b))
    np.testing.assert_array_equal(flat, want)
    np.testing.assert_array_equal(loc, p.to_local(want))
