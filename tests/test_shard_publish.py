"""Sharded publish and tensor-parallel apply, ranks simulated in one process: bit for bit against the
full conversion, additive digests summed over two different partitions, wrong maps refused, an HF
model updated in place."""

from __future__ import annotations

import contextlib
import copy
import tracemalloc

import numpy as np
import pytest
import torch
from _shard_util import CFG, SHAPES, masters, step

from deltarefit.errors import BaseMismatchError, FormatError, IntegrityError, UsageError
from deltarefit.geometry.projection import Piece
from deltarefit.integrity import additive as D
from deltarefit.shard.convert import export_full, to_bf16_bits
from deltarefit.shard.names import (
    LocalTensor,
    cuts_from_layouts,
    identity_layout,
    llama_shapes,
    load_table,
    local_from_full,
    tp_layout,
    trainer_layout,
)
from deltarefit.shard.part import join, read_part, write_part
from deltarefit.shard.publish import ShardPublisher
from deltarefit.shard.rollout import apply_version, apply_version_to_module, group_check, slice_digests


class Sim:
    """Trainer ranks with their publishers; versions joined from all parts."""

    def __init__(self, tlayouts, cuts, served="BF16"):
        self.tl = tlayouts
        self.pubs = [ShardPublisher(lay, served, cuts=cuts, rank=r, world=len(tlayouts))
                     for r, lay in enumerate(tlayouts)]
        self.v = 0

    def publish(self, full):
        blobs = [pub.publish(local_from_full(lay, full, np.float32), self.v)[0] for pub, lay in zip(self.pubs, self.tl, strict=True)]
        man = join([read_part(b) for b in blobs], blobs)
        for pub, b in zip(self.pubs, blobs, strict=True):
            pub.commit(b)
        self.v += 1
        return man, blobs


def group_sum(states, layouts, man):
    total = {}
    for st, lay in zip(states, layouts, strict=True):
        for n, d in slice_digests(st, lay, man["tensors"]).items():
            total[n] = D.add(total.get(n, D.ZERO), d)
    return total


TRAINERS = {
    "fsdp2_fused": ([2], ["S0"], True),
    "shard1_plain": ([2], ["S1"], False),
    "uneven3_fused": ([3], ["S0"], True),
    "hsdp_replicate": ([2, 2], ["S0", "R"], True),
}


@pytest.mark.parametrize("kind", list(TRAINERS))
def test_sharded_versions_bit_exact(kind):
    mesh, pls, fuse = TRAINERS[kind]
    import itertools

    from deltarefit.shard.names import param_pieces

    # one placement list per parameter: 1-D parameters (norms) are sharded on dim 0
    per = {n: [p if p == "R" or len(ps[0].local_shape) > 1 else "S0" for p in pls]
           for n, ps in param_pieces(SHAPES, load_table(), fuse).items()}
    tl = [trainer_layout(SHAPES, mesh, list(c), per, fuse=fuse) for c in itertools.product(*map(range, mesh))]
    rollouts = {"tp2_fused": [tp_layout(SHAPES, 2, r) for r in range(2)],
                "tp4_unfused": [tp_layout(SHAPES, 4, r, fuse=False) for r in range(4)],
                "whole": [identity_layout(SHAPES)]}
    cuts = cuts_from_layouts([lay for lays in rollouts.values() for lay in lays])
    sim = Sim(tl, cuts)
    states = {k: [{n: np.zeros(lt.shape, np.uint16) for n, lt in lay.items()} for lay in lays]
              for k, lays in rollouts.items()}
    full = masters()
    rng = np.random.default_rng(1)
    for i in range(3):
        if i:
            step(full, rng)
        man, blobs = sim.publish(full)
        ref = {n: to_bf16_bits(a) for n, a in full.items()}
        assert man["keyframe"] == (i == 0)
        for k, lays in rollouts.items():
            if i:  # the group's base digests, summed over a partition unlike the trainers'
                assert group_check(group_sum(states[k], lays, man), man, "base") == []
            for st, lay in zip(states[k], lays, strict=True):
                apply_version(man, blobs, st, lay)
                want = local_from_full(lay, ref, np.uint16)
                for n in st:
                    np.testing.assert_array_equal(st[n], want[n], err_msg=f"{k} {n} step {i}")
            assert group_check(group_sum(states[k], lays, man), man, "target") == []
        # the additive digest of the full export equals the joined version's
        for n, ent in man["tensors"].items():
            assert D.to_hex(D.full_digest(n, "BF16", ref[n])) == ent["target"]
        if i:
            assert 0 < man["changed"] < man["elements"]
    # applying again is a no-op
    st = apply_version(man, blobs, states["whole"][0], rollouts["whole"][0])
    assert st.cells == 0 and st.written == 0


def fresh(lays):
    return [{n: np.zeros(lt.shape, np.uint16) for n, lt in lay.items()} for lay in lays]


@pytest.fixture(scope="module")
def two_versions():
    tl = [trainer_layout(SHAPES, [2], [r], ["S0"]) for r in range(2)]
    rl = [tp_layout(SHAPES, 2, r) for r in range(2)]
    sim = Sim(tl, cuts_from_layouts(rl))
    full = masters(5)
    v0 = sim.publish(full)
    step(full, np.random.default_rng(6))
    v1 = sim.publish(full)
    states = fresh(rl)
    for st, lay in zip(states, rl, strict=True):
        apply_version(*v0, st, lay)
    return tl, rl, v0, v1, states


def swap_kv(lay):
    """A deliberately wrong fused-qkv map: k and v rows swapped."""
    out = dict(lay)
    for n, lt in lay.items():
        if n.endswith("qkv_proj.weight"):
            q, k, v = lt.pieces
            out[n] = LocalTensor(lt.shape, (q, Piece(k.name, k.shape, k.local_shape, (v.axes[0], k.axes[1])),
                                            Piece(v.name, v.shape, v.local_shape, (k.axes[0], v.axes[1]))))
    return out


def test_wrong_rollout_map_refused_nothing_written(two_versions):
    _tl, rl, _v0, v1, states = two_versions
    st = copy.deepcopy(states[0])
    before = copy.deepcopy(st)
    with pytest.raises(BaseMismatchError):
        apply_version(*v1, st, swap_kv(rl[0]))
    for n in st:
        np.testing.assert_array_equal(st[n], before[n])
    # a TP rank that believes it is the other rank
    with pytest.raises(BaseMismatchError):
        apply_version(*v1, st, rl[1])
    for n in st:
        np.testing.assert_array_equal(st[n], before[n])
    # the group-level check sees it too, before anything is applied
    bad = group_sum([st, states[1]], [swap_kv(rl[0]), rl[1]], v1[0])
    assert group_check(bad, v1[0], "base")


def test_unaligned_slice_refused(two_versions):
    _tl, _rl, _v0, v1, _ = two_versions
    lay = tp_layout(SHAPES, 4, 1)  # not among the layouts the cells were cut for
    st = {n: np.zeros(lt.shape, np.uint16) for n, lt in lay.items()}
    with pytest.raises(UsageError, match="partly"):
        apply_version(*v1, st, lay)
    assert all(not a.any() for a in st.values())


def test_wrong_trainer_maps_caught(two_versions):
    tl, rl, _v0, _v1, _ = two_versions
    cuts = cuts_from_layouts(rl)
    full = masters(5)
    # rank 1 believes it holds rank 0's rows: overlap and a hole, refused by join
    bad = [ShardPublisher(tl[0], cuts=cuts, rank=r, world=2) for r in range(2)]
    blobs = [p.publish(local_from_full(tl[0], full, np.float32), 0)[0] for p in bad]
    with pytest.raises(FormatError, match=r"cover|overlap"):
        join([read_part(b) for b in blobs], blobs)
    # a consistently wrong fused split (k and v swapped on every trainer rank) is self-consistent, but
    # its version digest differs from the digest of an independent full export
    table = copy.deepcopy(load_table())
    table["fused"][0]["parts"] = ["{p}.q_proj.{k}", "{p}.v_proj.{k}", "{p}.k_proj.{k}"]
    wrong = [trainer_layout(SHAPES, [2], [r], ["S0"], table=table) for r in range(2)]
    sim = Sim(wrong, cuts)
    # the trainer's actual fused master is cat(q, k, v); the wrong map reads it as (q, v, k)
    true_lay = [trainer_layout(SHAPES, [2], [r], ["S0"]) for r in range(2)]
    blobs = [p.publish(local_from_full(t, full, np.float32), 0)[0] for p, t in zip(sim.pubs, true_lay, strict=True)]
    man = join([read_part(b) for b in blobs], blobs)
    export = export_full(full, "BF16")
    mism = [n for n, ent in man["tensors"].items() if D.to_hex(D.full_digest(n, "BF16", export[n][1])) != ent["target"]]
    assert mism and all(".k_proj." in n or ".v_proj." in n for n in mism)


def test_corrupt_or_missing_parts_refused(two_versions):
    _tl, rl, _v0, (man, blobs), states = two_versions
    st = copy.deepcopy(states[0])
    bad = bytearray(blobs[1])
    bad[-5] ^= 1
    with pytest.raises(IntegrityError):
        apply_version(man, [blobs[0], bytes(bad)], st, rl[0])
    with pytest.raises(IntegrityError):
        read_part(bytes(bad))
    with pytest.raises(FormatError):
        join([read_part(blobs[0])], [blobs[0]])
    # a part whose cell digests lie: decoded chunks do not reach the claimed target
    p = read_part(blobs[0])
    h = dict(p.header)
    h["tensors"] = copy.deepcopy(h["tensors"])
    cell = next(c for t in h["tensors"] for c in t["cells"] if c["chunks"])
    cell["target"] = D.to_hex(D.add(D.from_hex(cell["target"]), np.array([1, 0], np.uint64)))
    forged = write_part(h, bytes(p.payload))
    man2 = join([read_part(forged), read_part(blobs[1])], [forged, blobs[1]])
    with pytest.raises(Exception, match="target"):
        for s, lay in zip(copy.deepcopy(states), rl, strict=True):
            apply_version(man2, [forged, blobs[1]], s, lay)


def test_residual_shows_up_in_a_later_delta():
    shapes = {"w": (64, 64)}
    tl = [trainer_layout(shapes, [2], [r], ["S0"]) for r in range(2)]
    sim = Sim(tl, None)
    full = {"w": (np.random.default_rng(0).standard_normal((64, 64)) * 0.02).astype(np.float32)}
    whole = identity_layout(shapes)
    st = {"w": np.zeros((64, 64), np.uint16)}
    apply_version(*sim.publish(full), st, whole)
    changed = []
    for _ in range(40):
        full["w"] += np.float32(2e-7)  # about 1/300 of a bf16 ulp at 0.02
        man, blobs = sim.publish(full)
        apply_version(man, blobs, st, whole)
        changed.append(man["changed"])
        np.testing.assert_array_equal(st["w"], to_bf16_bits(full["w"]))
    assert changed[0] < 64 * 64 * 0.05 and sum(changed) > 64 * 64 * 0.2


def test_hf_model_updated_in_place():
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra: pip install -e '.[test]' (make test installs it)")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CFG)
    trainer = transformers.LlamaForCausalLM(cfg).float()
    served = copy.deepcopy(trainer).to(torch.bfloat16)
    with torch.no_grad():
        for p in served.parameters():
            p.zero_()
    full = {n: p.detach().numpy().copy() for n, p in trainer.named_parameters()}
    shapes = {n: a.shape for n, a in full.items()}
    assert shapes == {n: tuple(s) for n, s in llama_shapes(CFG).items()}
    tl = [trainer_layout(shapes, [2], [r], ["S0"]) for r in range(2)]
    sim = Sim(tl, None)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    ids = torch.randint(0, CFG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    ptrs = {n: p.data_ptr() for n, p in served.named_parameters()}
    for i in range(3):
        if i:
            loss = trainer(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        full = {n: p.detach().numpy() for n, p in trainer.named_parameters()}
        man, blobs = sim.publish(full)
        apply_version_to_module(man, blobs, served)
        want = export_full(full, "BF16")
        for n, p in served.named_parameters():
            np.testing.assert_array_equal(p.detach().view(torch.int16).numpy().view(np.uint16), want[n][1])
        assert {n: p.data_ptr() for n, p in served.named_parameters()} == ptrs  # in place
    assert torch.isfinite(served(input_ids=ids).logits).all()


def test_publish_and_apply_memory_is_o_chunk():
    # One 1024 x 2048 fp32 shard (8 MiB): publish allocates the part and O(chunk) work arrays beyond
    # the baseline slice; apply allocates O(chunk) beyond the parts it was given.
    shapes = {"w": (1024, 2048)}
    lay = trainer_layout(shapes, [1], [0], ["S0"])
    pub = ShardPublisher(lay, "BF16", rank=0, world=1)
    m = {"w": (np.random.default_rng(0).standard_normal((1024, 2048)) * 0.02).astype(np.float32)}
    roll = {"w": np.zeros((1024, 2048), np.uint16)}
    whole = identity_layout(shapes)
    for v in range(2):  # warm: the codec's first calls load numba code (Python objects)
        blob = pub.publish(m, v)[0]
        pub.commit(blob)
        apply_version(join([read_part(blob)], [blob]), [blob], roll, whole)
        m["w"] += np.float32(1e-6)
    tracemalloc.start()
    blob, _ = pub.publish(m, 2)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert pub.baseline_bytes() == 1024 * 2048 * 2
    chunk_elems = (1 << 20) // 2
    print(f"publish peak beyond model and baseline: {peak / 2**20:.1f} MiB for a {m['w'].nbytes / 2**20:.0f} MiB "
          f"shard ({peak / chunk_elems:.0f} B per chunk element, part {len(blob)} B)")
    assert peak < 40 * chunk_elems + 4 * len(blob)  # ~23 B per chunk element measured
    man = join([read_part(blob)], [blob])
    tracemalloc.start()
    apply_version(man, [blob], roll, whole)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"apply peak: {peak / 2**20:.1f} MiB into a {roll['w'].nbytes / 2**20:.0f} MiB slice")
    assert peak < 40 * chunk_elems + 4 * len(blob)
    np.testing.assert_array_equal(roll["w"], to_bf16_bits(m["w"]))


FP8_CFG = {"hidden_size": 256, "head_dim": 128, "intermediate_size": 512, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "tie_word_embeddings": False}


def test_fp8_block_scaled_sharded():
    # Linear weights served as e4m3 with 128x128 block scales (<name>_scale_inv), the rest bf16; trainer
    # shards and TP slices lie on block boundaries. Equal bit for bit to the full export.
    from deltarefit.shard.names import with_fp8_scales

    shapes = llama_shapes(FP8_CFG)
    served = {n: "F8_E4M3" if n.endswith("proj.weight") else "BF16" for n in shapes}
    ck = with_fp8_scales(shapes, served)
    tl = [trainer_layout(shapes, [2], [r], ["S0"]) for r in range(2)]
    rl = [tp_layout(ck, 2, r) for r in range(2)] + [identity_layout(ck)]
    assert rl[0]["model.layers.0.self_attn.qkv_proj.weight_scale_inv"].shape == (4, 2)
    sim = Sim(tl, cuts_from_layouts(rl), served)
    rng = np.random.default_rng(9)
    full = {n: (rng.standard_normal(s) * 0.02).astype(np.float32) for n, s in shapes.items()}
    full["model.layers.0.mlp.up_proj.weight"][:128, :128] = 0  # an all-zero block: scale 1.0
    dts = {"F8_E4M3": np.uint8, "F32": np.uint32, "BF16": np.uint16}
    exp = export_full(full, served)
    states = [{n: np.zeros(lt.shape, dts[exp[lt.pieces[0].name][0]]) for n, lt in lay.items()} for lay in rl]
    for i in range(3):
        if i:
            step(full, rng, 2e-4)
        man, blobs = sim.publish(full)
        exp = export_full(full, served)
        assert set(man["tensors"]) == set(ck)
        for st, lay in zip(states, rl, strict=True):
            apply_version(man, blobs, st, lay)
            want = local_from_full(lay, {n: b for n, (_, b) in exp.items()}, np.uint64)
            for n in st:
                np.testing.assert_array_equal(st[n], want[n].astype(st[n].dtype), err_msg=f"{n} step {i}")
        for n, ent in man["tensors"].items():
            assert D.to_hex(D.full_digest(n, exp[n][0], exp[n][1])) == ent["target"]
    assert 0 < man["changed"] < man["elements"]
    # a shard that splits fp8 blocks is refused up front
    with pytest.raises(UsageError, match="aligned"):
        ShardPublisher(trainer_layout(shapes, [3], [1], ["S0"]), served)


def test_hostile_part_headers_only_raise_format_errors(two_versions):
    # Any edit of a part's JSON header is either still a valid part or refused with a FormatError
    # (never another exception, never an out-of-bounds read).
    import json
    import struct

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    _tl, _rl, _v0, (_man, blobs), _ = two_versions
    blob = blobs[0]
    hlen = struct.unpack_from("<I", blob, 12)[0]
    header = json.loads(blob[16:16 + hlen])
    payload = blob[16 + hlen:]
    leaves = []

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, (*path, k))
        elif isinstance(x, list):
            for i, v in enumerate(x[:3]):
                walk(v, (*path, i))
        else:
            leaves.append(path)

    walk(header, ())
    values = st.one_of(st.integers(-3, 1 << 40), st.none(), st.text(max_size=4), st.booleans(),
                       st.lists(st.integers(-2, 70), max_size=3))

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(leaves), values)
    def run(path, value):
        h = copy.deepcopy(header)
        x = h
        for k in path[:-1]:
            x = x[k]
        x[path[-1]] = value
        hb = json.dumps(h).encode()
        with contextlib.suppress(FormatError):
            read_part(struct.pack("<8sHHI", b"DRSHPART", 1, 0, len(hb)) + hb + payload)

    run()
    for cut in (0, 10, 16, 16 + hlen // 2, len(blob) - 1):
        with pytest.raises(FormatError):
            read_part(blob[:cut])


def test_rollout_fetches_only_the_parts_it_needs():
    # 4 trainer ranks shard row-parallel down_proj by rows (Shard(0)); TP rollouts slice it by columns
    # (every rank needs every part), but column-parallel gate/up rows: TP rank 0 needs trainer ranks 0-1.
    from deltarefit.shard.rollout import needed_ranks

    shapes = {"model.layers.0.mlp.up_proj.weight": (128, 32)}
    tl = [trainer_layout(shapes, [4], [r], ["S0"]) for r in range(4)]
    rl = [tp_layout(shapes, 2, r) for r in range(2)]
    sim = Sim(tl, cuts_from_layouts(rl))
    full = {n: (np.random.default_rng(0).standard_normal(s) * 0.02).astype(np.float32) for n, s in shapes.items()}
    man, blobs = sim.publish(full)
    assert needed_ranks(man, rl[0]) == [0, 1] and needed_ranks(man, rl[1]) == [2, 3]
    st = {n: np.zeros(lt.shape, np.uint16) for n, lt in rl[1].items()}
    with pytest.raises(UsageError, match=r"ranks \[3\]"):
        apply_version(man, {2: blobs[2]}, st, rl[1])
    assert not st["model.layers.0.mlp.up_proj.weight"].any()
    apply_version(man, {2: blobs[2], 3: blobs[3]}, st, rl[1])
    want = local_from_full(rl[1], {n: to_bf16_bits(a) for n, a in full.items()}, np.uint16)
    np.testing.assert_array_equal(st["model.layers.0.mlp.up_proj.weight"], want["model.layers.0.mlp.up_proj.weight"])


def test_manifest_signature(two_versions, tmp_path):
    from deltarefit.shard.part import sign_manifest, verify_manifest
    from deltarefit.signing import SignatureError, Signer, Verifier, keygen

    _tl, _rl, _v0, (man, _blobs), _ = two_versions
    pub = keygen(str(tmp_path / "k"))
    signed = sign_manifest(man, Signer(str(tmp_path / "k")))
    verify_manifest(signed, Verifier(pub))
    with pytest.raises(SignatureError):
        verify_manifest(man, Verifier(pub))  # unsigned
    forged = copy.deepcopy(signed)
    name = next(iter(forged["tensors"]))
    forged["tensors"][name]["target"] = "0" * 32
    with pytest.raises(SignatureError):
        verify_manifest(forged, Verifier(pub))
