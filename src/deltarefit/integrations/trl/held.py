"""The tensors of a TRL sync as the publisher can take them (``held``). Imports torch and numpy only when called."""

from __future__ import annotations

from typing import Any

__all__ = ["held"]


def held(named_params: Any, served: str) -> Any:
    """``(name, tensor)`` as TRL yields them, each copied to the host in the served dtype before the next is
    asked for: TRL's iterator unmerges a PEFT adapter after its last tensor and releases each ZeRO-3/FSDP
    gathered tensor after yielding it, while ``publish_tensors`` reads the tensors it is given after it has
    taken them all. The copy is the served model's size on the host (no checkpoint is written); floating
    tensors are converted by the one conversion function (``shard.convert.to_served_bits``), others
    copied as they are."""
    import numpy as np
    import torch

    from ...shard.convert import to_served_bits

    want = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[served]
    bits = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32}[served]
    for name, tensor in named_params:
        t = tensor.detach()
        if t.dtype == want or t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            yield name, t.to(device="cpu", copy=True)
        else:  # bf16/fp16 -> fp32 is exact: every conversion goes through the fp32 one
            f32 = t.to(device="cpu", dtype=torch.float32).contiguous().reshape(-1).numpy()
            yield name, torch.from_numpy(to_served_bits(f32, served).view(bits)).view(want).reshape(t.shape)
