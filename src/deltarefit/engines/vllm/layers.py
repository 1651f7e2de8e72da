"""The engine layers a checkpoint tensor loads into: names grouped by layer, fused siblings (``qkv_proj``,
``gate_up_proj``) by the model's ``packed_modules_mapping``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def layer_key(name: str, packed: dict[str, list[str]]) -> str:
    """The engine layer a checkpoint tensor loads into: its module path, fused siblings renamed.

    ``model.layers.0.self_attn.k_proj.weight`` -> ``model.layers.0.self_attn.qkv_proj`` when ``packed`` (the
    model's ``packed_modules_mapping``) has ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``.
    """
    module = name.rpartition(".")[0]
    parent, _, last = module.rpartition(".")
    for fused, parts in packed.items():
        if last in parts:
            return f"{parent}.{fused}" if parent else fused
    return module


def reload_set(changed: Iterable[str], names: Iterable[str], packed: dict[str, list[str]]) -> list[str]:
    """Checkpoint tensors (in ``names`` order) to feed so every layer ``changed`` touches loads whole."""
    touched = {layer_key(n, packed) for n in changed}
    return [n for n in names if layer_key(n, packed) in touched]


def _packed_mapping(model: Any) -> dict[str, list[str]]:
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    return {str(k): [str(p) for p in v] for k, v in dict(mapping).items()}
