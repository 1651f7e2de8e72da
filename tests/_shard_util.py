"""The tiny Llama the sharded tests share: its config, its checkpoint's tensor shapes, fp32 masters
and an optimizer-like step on them."""

from __future__ import annotations

import numpy as np

from deltarefit.shard.names import llama_shapes

CFG = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 32, "tie_word_embeddings": False}
SHAPES = llama_shapes(CFG)


def masters(seed=0):
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s) * 0.02).astype(np.float32) for n, s in SHAPES.items()}


def step(full, rng, scale=2e-5):
    for n in full:
        full[n] += (rng.standard_normal(full[n].shape) * scale).astype(np.float32)
