"""Bytes over torch.distributed collectives, without pickle.

torch's ``*_object`` collectives pickle what they send, and unpickling runs code a peer chose; these
send raw bytes in uint8 tensors (lengths first), so callers exchange JSON or other plain data only.
``device`` is where the buffers live: ``"cpu"`` for gloo, ``"cuda"`` for NCCL.
"""

from __future__ import annotations


def broadcast_bytes(data: bytes | None, src: int, group=None, device: str = "cpu") -> bytes:
    """``data`` from global rank ``src`` (None on the other ranks), on every rank of ``group``."""
    import torch
    import torch.distributed as dist

    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(n, src, group=group)
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    if data is not None and len(data):
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if buf.numel():
        dist.broadcast(buf, src, group=group)
    return buf.cpu().numpy().tobytes()


def all_gather_bytes(data: bytes, group=None, device: str = "cpu") -> list[bytes]:
    """Every rank's ``data``, in group rank order, on every rank."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    top = max(int(s.item()) for s in sizes)
    buf = torch.zeros(max(top, 1), dtype=torch.uint8, device=device)
    if len(data):
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf, group=group)
    return [o[:int(s.item())].cpu().numpy().tobytes() for o, s in zip(out, sizes, strict=True)]
