"""Sharded refit on one machine: 2 trainer ranks (dim-0 sharded fp32 masters, fused qkv/gate_up) and
2 tensor-parallel rollout ranks (fused qkv/gate_up, column/row-parallel slices), 4 processes over
torch.distributed gloo on loopback; versions travel through a version stream in a local directory
(``OUT/stream``: per-rank parts, the joined manifest, the commit record created last).

Each step the trainers take a real AdamW step on a toy causal-LM loss (each rank updates only its own
master shard; the shards are all-gathered into the compute copy, as FSDP does) and publish the version
with ``ShardStreamPublisher`` (each rank uploads its part, no rank gathers tensors; rank 0 joins the
parts and commits; each rank's baseline advances once the commit exists); the rollouts follow the
stream with ``sync_sharded`` (records and parts checked before any write, the TP group's base digests
before and target digests after apply), and finally compare their slices bit for bit with the full
conversion of the gathered masters (a test-only gather, written beside the stream). One line per step;
exit status 1 on any mismatch.

    python examples/sharded_refit.py [--steps 5] [--out DIR] [--lr 1e-6] [--wrong-map]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import tracemalloc

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deltarefit.errors import BaseMismatchError
from deltarefit.integrity import additive as D
from deltarefit.shard.convert import export_full
from deltarefit.shard.names import cuts_from_layouts, llama_shapes, local_from_full, tp_layout, trainer_layout
from deltarefit.shard.rollout import group_check, slice_digests
from deltarefit.shard.stream import ShardStreamPublisher, load_manifest, load_shard_commit, sync_sharded
from deltarefit.storage.local import LocalStore

CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64, "tie_word_embeddings": False}
TRAINERS, ROLLOUTS = 2, 2


def engine_slices(full: dict[str, np.ndarray], tp: int, r: int) -> dict[str, np.ndarray]:
    """What a vLLM-style TP engine's own weight loader holds, written with plain torch.chunk/cat and
    independent of deltarefit's maps: the check that the maps are right, not only self-consistent."""
    t = {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in full.items()}
    out = {}
    for n, w in t.items():
        if ".self_attn.q_proj." in n:
            p = n.replace(".q_proj.", ".{}.")
            out[n.replace(".q_proj.", ".qkv_proj.")] = torch.cat(
                [t[p.format(x)].chunk(tp, 0)[r] for x in ("q_proj", "k_proj", "v_proj")])
        elif ".mlp.gate_proj." in n:
            out[n.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat(
                [w.chunk(tp, 0)[r], t[n.replace(".gate_proj.", ".up_proj.")].chunk(tp, 0)[r]])
        elif any(k in n for k in (".k_proj.", ".v_proj.", ".up_proj.")):
            continue
        elif n.endswith(("o_proj.weight", "down_proj.weight")):
            out[n] = w.chunk(tp, 1)[r]
        elif n in ("model.embed_tokens.weight", "lm_head.weight"):
            out[n] = w.chunk(tp, 0)[r]
        else:
            out[n] = w
    return {n: v.contiguous().numpy() for n, v in out.items()}


def wrong_map(layout):
    """A deliberately wrong fused-qkv map (k and v rows swapped), for --wrong-map."""
    from deltarefit.geometry.projection import Piece
    from deltarefit.shard.names import LocalTensor

    out = dict(layout)
    for n, lt in layout.items():
        if n.endswith("qkv_proj.weight"):
            q, k, v = lt.pieces
            out[n] = LocalTensor(lt.shape, (q, Piece(k.name, k.shape, k.local_shape, (v.axes[0], k.axes[1])),
                                            Piece(v.name, v.shape, v.local_shape, (k.axes[0], v.axes[1]))))
    return out


def allreduce_digests(names: list[str], digests: dict, group) -> dict[str, np.ndarray]:
    """Sum per-tensor additive digests over ``group``: 64 bytes per tensor, exact (limbs in int64)."""
    limbs = torch.from_numpy(np.stack([D.to_limbs(digests.get(n, D.ZERO)) for n in names]))
    dist.all_reduce(limbs, group=group)
    return {n: D.from_limbs(limbs[i].numpy()) for i, n in enumerate(names)}


def trainer(rank: int, a, shapes, tlay, cuts, group) -> bool:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).float()
    sd = {n: p.detach().numpy() for n, p in model.named_parameters()}
    masters = {n: torch.from_numpy(v) for n, v in local_from_full(tlay, sd, np.float32).items()}
    for m in masters.values():
        m.requires_grad_(True)
    opt = torch.optim.AdamW(list(masters.values()), lr=a.lr, weight_decay=0.0)
    store = LocalStore(os.path.join(a.out, "stream"))
    sp = ShardStreamPublisher(store, tlay, "BF16", cuts=cuts, rank=rank, world=TRAINERS, group=group,
                              state_dir=os.path.join(a.out, "trainer-state"), timeout=120)
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, CONFIG["vocab_size"], (4, 32), generator=gen)
    names = sorted(shapes)
    ok = True
    for step in range(a.steps + 1):
        if step:  # a real AdamW step on this rank's master shard
            loss = model(input_ids=tokens, labels=tokens).loss
            model.zero_grad()
            loss.backward()
            grads = {n: p.grad.detach().numpy() for n, p in model.named_parameters()}
            local_g = local_from_full(tlay, grads, np.float32)
            for n, m in masters.items():
                g = torch.from_numpy(local_g[n])
                dist.all_reduce(g, group=group)  # data-parallel gradient average (shard only)
                m.grad = g / TRAINERS
            opt.step()
            # FSDP-style unshard for the next forward (compute only; the publish below uses no gather)
            full = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
            for ln, lt in tlay.items():
                lf = masters[ln].detach().numpy().reshape(-1)
                for p in lt.pieces:
                    if p.owner:
                        box = p.box()
                        f = box.flat(np.arange(box.count, dtype=np.int64))
                        full[p.name].reshape(-1)[f] = lf[p.to_local(f)]
            with torch.no_grad():
                for n, p in model.named_parameters():
                    t = torch.from_numpy(full[n])
                    dist.all_reduce(t, group=group)
                    p.copy_(t)
        vdir = os.path.join(a.out, f"v{step:06d}")  # test-only side files (reference, stats)
        os.makedirs(vdir, exist_ok=True)
        local = {n: m.detach() for n, m in masters.items()}
        if rank == 0 and step == a.steps:
            tracemalloc.start()
        rec = sp.publish(local, step=step)  # upload; rank 0 joins and commits; every baseline advances
        blob, st = sp.last_part, sp.last_stats
        if rank == 0 and step == a.steps:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            print(f"trainer rank 0 publish memory beyond the model: baseline slice {sp.pub.baseline_bytes()} B "
                  f"(masters {sum(m.numel() * 4 for m in masters.values())} B) + peak {peak} B during publish "
                  f"(part {len(blob)} B)", flush=True)
        summed = allreduce_digests(names, sp.pub.partial_digests(blob), group)
        stats = torch.tensor([st.changed, st.elements, st.part_bytes, st.served_bytes], dtype=torch.int64)
        dist.all_reduce(stats, group=group, op=dist.ReduceOp.SUM)
        secs = torch.tensor([int(st.seconds * 1e6)], dtype=torch.int64)
        dist.all_reduce(secs, group=group, op=dist.ReduceOp.MAX)
        if rank == 0:
            if group_check(summed, load_manifest(store, rec)):
                ok = False
                print(f"step {step}: trainer digests do not sum to the committed version", flush=True)
            # test-only reference: the full conversion of the (gathered) masters
            ref = export_full({n: p.detach().numpy() for n, p in model.named_parameters()}, "BF16")
            np.savez(os.path.join(vdir, "ref.npz"), **{n: b for n, (_, b) in ref.items()})
            with open(os.path.join(vdir, "stats.json"), "w") as f:
                json.dump({"version": rec.version, "keyframe": rec.keyframe, "changed": int(stats[0]),
                           "elements": int(stats[1]), "part_bytes": int(stats[2]), "served_bytes": int(stats[3]),
                           "publish_us": int(secs[0])}, f)
        dist.barrier()  # version committed: rollouts may sync
        dist.barrier()  # rollouts done with this step
    return ok


def rollout(rank: int, a, shapes, rlay, group) -> bool:
    tensors = {n: torch.zeros(lt.shape, dtype=torch.bfloat16) for n, lt in rlay.items()}
    store = LocalStore(os.path.join(a.out, "stream"))
    names = sorted(shapes)
    ok = True
    good_map = rlay
    for step in range(a.steps + 1):
        # --wrong-map: the keyframe goes in through the right map (as an engine's own loader would
        # load it), later versions through a wrong one, which the base digests must refuse.
        rlay = wrong_map(good_map) if a.wrong_map and step and rank == TRAINERS + 1 else good_map
        dist.barrier()
        vdir = os.path.join(a.out, f"v{step:06d}")
        with open(os.path.join(vdir, "stats.json")) as f:
            s = json.load(f)
        t0 = time.perf_counter()
        base_ok = applied = False
        try:  # fetches only the parts that meet this rank's slices; checks the group's digests
            sync_sharded(store, tensors, rlay, state_path=os.path.join(a.out, f"rollout-{rank}.json"), group=group)
            base_ok = applied = True
        except BaseMismatchError as e:
            if rank == TRAINERS:
                print(f"step {step}: {e}", flush=True)  # "...: refusing the version, nothing written"
        except Exception as e:  # a refusal: report it as a mismatch
            base_ok = True
            print(f"rollout {rank}: step {step}: {type(e).__name__}: {e}", flush=True)
        man = load_manifest(store, load_shard_commit(store, s["version"]))
        post = allreduce_digests(names, slice_digests(tensors, rlay, man["tensors"]), group)
        dig_ok = not group_check(post, man, "target")
        secs = time.perf_counter() - t0
        ref = np.load(os.path.join(vdir, "ref.npz"))
        want = engine_slices({n: ref[n].view(np.int16) for n in ref.files}, ROLLOUTS, rank - TRAINERS)
        want = {n: w.view(np.uint16) for n, w in want.items()}
        bits_ok = set(want) == set(tensors) and all(
            np.array_equal(tensors[n].view(torch.int16).numpy().view(np.uint16), want[n]) for n in tensors)
        good = torch.tensor([int(base_ok and applied and dig_ok and bits_ok)], dtype=torch.int64)
        dist.all_reduce(good, group=group, op=dist.ReduceOp.MIN)
        t = torch.tensor([secs])
        dist.all_reduce(t, group=group, op=dist.ReduceOp.MAX)
        if rank == TRAINERS:
            print(f"step {step:3d}  {'keyframe' if s['keyframe'] else 'delta   '}  changed "
                  f"{100 * s['changed'] / max(s['elements'], 1):6.2f}%  parts {s['part_bytes']:8d} B  ratio "
                  f"{s['served_bytes'] / max(s['part_bytes'], 1):6.1f}x  publish {s['publish_us'] / 1e6:.3f}s  "
                  f"sync {float(t[0]):.3f}s  verified {'yes' if int(good[0]) else 'NO'}", flush=True)
        ok &= bool(int(good[0]))
        dist.barrier()
    return ok


def warm_codec() -> None:
    """Load the codec's compiled kernels once, outside the timed steps and the memory trace."""
    from deltarefit.codec.chunk import decode_chunk, encode_chunk
    from deltarefit.dtypes import dtype

    base = np.zeros(64, np.uint16)
    enc = encode_chunk(dtype("BF16"), base, base + np.uint16(1))
    decode_chunk(dtype("BF16"), base, enc.encoding, enc.payload, enc.n_changed, enc.decoded_len, "warm-up")


def worker(rank: int, a) -> None:
    torch.set_num_threads(1)
    warm_codec()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank,
                            world_size=TRAINERS + ROLLOUTS, timeout=datetime.timedelta(seconds=120))
    tgroup = dist.new_group(list(range(TRAINERS)))
    rgroup = dist.new_group(list(range(TRAINERS, TRAINERS + ROLLOUTS)))
    from torch.distributed.tensor import Shard

    shapes = llama_shapes(CONFIG)
    tlays = [trainer_layout(shapes, [TRAINERS], [r], [Shard(0)]) for r in range(TRAINERS)]
    rlays = [tp_layout(shapes, ROLLOUTS, r) for r in range(ROLLOUTS)]
    cuts = cuts_from_layouts(rlays)
    try:
        if rank < TRAINERS:
            ok = trainer(rank, a, shapes, tlays[rank], cuts, tgroup)
        else:
            ok = rollout(rank, a, shapes, rlays[rank - TRAINERS], rgroup)
    finally:
        dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--out", default=None)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--wrong-map", action="store_true", help="inject a wrong fused-qkv map on one rollout rank")
    a = ap.parse_args(argv)
    if not a.port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            a.port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        a.out = a.out or tmp
        # a fresh stream each run (an old one under --out would be followed, not restarted)
        for name in ("stream", "trainer-state", *(f"rollout-{r}.json" for r in range(TRAINERS, TRAINERS + ROLLOUTS))):
            path = os.path.join(a.out, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.unlink(path)
        t0 = time.perf_counter()
        try:
            mp.spawn(worker, args=(a,), nprocs=TRAINERS + ROLLOUTS, join=True)
        except mp.ProcessExitedException as e:
            print(f"sharded refit FAILED: {e}", flush=True)
            return 1
        except mp.ProcessRaisedException as e:
            print(f"sharded refit FAILED: {e}", flush=True)
            return 1
        print(f"sharded refit: {a.steps} steps verified bit for bit in {time.perf_counter() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
