"""Name tables, as plain data (no code): how parameters map to checkpoint tensors for a model family.

* ``fused``: parameters that concatenate checkpoint tensors along ``dim``. ``param`` is a regex of the
  fused parameter's name; ``parts`` are checkpoint names with its groups (``{p}``, ``{k}``) filled in.
  Row splits come from the checkpoint shapes, i.e. from the config's head counts (``llama_shapes``).
  fp8 checkpoints' ``<weight>_scale_inv`` tensors are fused and sliced like their weights.
* ``tp``: how a tensor-parallel rollout slices each checkpoint tensor: ``column`` = dim-0 slice,
  ``row`` = dim-1 slice, ``vocab`` = dim-0 slice; a tensor matching none is replicated.
"""

LLAMA = {
    "fused": [
        {"param": r"^(?P<p>.+\.self_attn)\.qkv_proj\.(?P<k>weight|bias|weight_scale_inv)$", "dim": 0,
         "parts": ["{p}.q_proj.{k}", "{p}.k_proj.{k}", "{p}.v_proj.{k}"]},
        {"param": r"^(?P<p>.+\.mlp)\.gate_up_proj\.(?P<k>weight|weight_scale_inv)$", "dim": 0,
         "parts": ["{p}.gate_proj.{k}", "{p}.up_proj.{k}"]},
    ],
    "tp": {
        "column": [r"\.self_attn\.[qkv]_proj\.(weight|bias|weight_scale_inv)$",
                   r"\.mlp\.(gate|up)_proj\.(weight|weight_scale_inv)$"],
        "row": [r"\.self_attn\.o_proj\.(weight|weight_scale_inv)$", r"\.mlp\.down_proj\.(weight|weight_scale_inv)$"],
        "vocab": [r"^model\.embed_tokens\.weight$", r"^lm_head\.weight$"],
    },
}

# Qwen2 / Qwen2.5 / Mistral use the same names (Qwen2 adds q/k/v biases, which the rules cover).
TABLES = {"llama": LLAMA, "qwen2": LLAMA, "mistral": LLAMA}
