"""The tiny Llama the sharded tests share: its config and its checkpoint's tensor shapes."""

from __future__ import annotations

from deltarefit.shard.names import llama_shapes

CFG = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 32, "tie_word_embeddings": False}
SHAPES = llama_shapes(CFG)
