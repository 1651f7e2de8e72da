"""Momentum-like version chains for the history tests (``test_history``, ``test_stream_history``):
an element that moved in the last version moves again far more often than others, mostly the same
way (as AdamW's steps do), written as real safetensors checkpoints."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import safetensors.torch
import torch


def _key(u: np.ndarray, bits: int) -> np.ndarray:
    u = u.astype(np.int64)
    sign, mask = 1 << (bits - 1), (1 << bits) - 1
    return np.where(u & sign, u ^ mask, u ^ sign)


def _unkey(k: np.ndarray, bits: int) -> np.ndarray:
    sign, mask = 1 << (bits - 1), (1 << bits) - 1
    return np.where(k & sign, k ^ sign, mask - k)


def momentum_chain(n: int, steps: int, *, bits: int = 16, rate: float = 0.03, seed: int = 0,
                   udt=np.uint16) -> list[np.ndarray]:
    """``steps + 1`` versions of ``n`` float bit patterns (bf16 / f16 by ``bits``): each version moves
    a few percent of the elements by a few ulps, an element that just moved again with probability
    0.3 and mostly the same way."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 0.02).astype(np.float32)
    if bits == 16 and udt == np.uint16:
        v = (x.view(np.uint32) >> 16).astype(np.uint16)
    else:
        v = x.astype(np.float16).view(np.uint16)
    out = [v]
    last = np.zeros(n, np.int64)
    for _ in range(steps):
        again = (last != 0) & (rng.random(n) < 0.3)
        fresh = (last == 0) & (rng.random(n) < rate)
        d = np.where(rng.random(n) < 0.85, 1, rng.integers(2, 6, n))
        d = np.where(again, np.sign(last) * np.where(rng.random(n) < 0.95, 1, -1) * d,
                     np.where(fresh, np.where(rng.random(n) < 0.5, 1, -1) * d, 0))
        k = _key(out[-1], bits)
        nk = np.clip(k + d, 1, (1 << bits) - 2)
        new = _unkey(nk, bits).astype(udt)
        last = np.where(new != out[-1], d, 0)
        out.append(new)
    return out


def write_chain(d, steps: int, *, n: int, seed: int, rate: float = 0.03, prefix: str = "v") -> list[str]:
    """``steps + 1`` checkpoints ``{prefix}{i}.safetensors`` in ``d``: a bf16 vector of ``n`` elements
    and a 100 x 200 bf16 matrix along momentum chains, and a counter (so every version differs)."""
    a = momentum_chain(n, steps, seed=seed, rate=rate)
    b = momentum_chain(20_000, steps, seed=seed + 1, rate=rate)
    os.makedirs(d, exist_ok=True)
    paths = []
    for i in range(steps + 1):
        p = os.path.join(d, f"{prefix}{i}.safetensors")
        safetensors.torch.save_file({
            "w": torch.from_numpy(a[i].view(np.int16).copy()).view(torch.bfloat16),
            "small": torch.from_numpy(b[i].view(np.int16).copy()).view(torch.bfloat16).reshape(100, 200),
            "count": torch.tensor([i], dtype=torch.int64),
        }, p)
        paths.append(p)
    return paths


def encodings(delta_path: str) -> dict[int, int]:
    """A delta file's chunk count per encoding id."""
    from deltarefit.format import DeltaReader

    out: dict[int, int] = {}
    with DeltaReader(delta_path) as r:
        for e in r.tensors:
            for c in r.chunks(e):
                out[c.encoding] = out.get(c.encoding, 0) + 1
    return out


def hist_chunks(encs: dict[int, int]) -> int:
    """The chunks coded against a history in ``encodings``' count: ``ulp_hist`` (5) and ``ulp2_hist`` (7)."""
    return encs.get(5, 0) + encs.get(7, 0)


def deltas_with_history(paths: list[str], d) -> Iterator[tuple[str, Any, int]]:
    """Each step of the chain ``paths`` encoded as a trainer does with a history book (kept in ``d``,
    advanced by each step's moves): (the delta's path, its ``EncodeReport``, its chunks coded with history)."""
    from deltarefit.encode import encode
    from deltarefit.history_book import HistoryBook

    trainer = HistoryBook(os.path.join(d, "trainer.history"))
    for i in range(1, len(paths)):
        out = os.path.join(d, f"h{i}.delta")
        rep = encode(paths[i - 1], paths[i], out, history=trainer, sums=True)
        trainer.commit(rep.target_fingerprint, rep.moves, parent=rep.base_fingerprint)
        yield out, rep, hist_chunks(encodings(out))


def checkpoint_bits(path: str) -> dict[str, bytes]:
    """Every tensor of a safetensors file as its raw bytes."""
    return {n: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for n, t in safetensors.torch.load_file(path).items()}


def follow_with_book(paths: list[str], d: str, apply: Callable[[str, Any], Any],
                     held_bits: Callable[[], dict[str, bytes]]) -> None:
    """A target follows the chain ``paths`` (it holds ``paths[0]``) delta by delta with a history book
    (``deltas_with_history``, the trainer's book in ``d``): a delta with ``ulp_hist`` chunks is first
    refused by name, nothing written, given an empty book; each is then applied with the target's own
    book (``apply(delta, book)``), which must end at the delta's target, and the target must hold the
    next checkpoint bit for bit (``held_bits()``: its tensors' bytes). Some delta must use history."""
    import pytest

    from deltarefit.errors import DecodeError
    from deltarefit.history_book import HistoryBook

    book = HistoryBook(os.path.join(d, "book"))
    hist_chunks = 0
    for i, (out, rep, n5) in enumerate(deltas_with_history(paths, d), 1):
        hist_chunks += n5
        if n5:
            before = held_bits()
            with pytest.raises(DecodeError, match="history"):
                apply(out, HistoryBook(os.path.join(d, f"empty{i}")))
            assert held_bits() == before
        got = apply(out, book)
        assert got.target_fingerprint == rep.target_fingerprint == book.tip
        assert held_bits() == checkpoint_bits(paths[i])
    assert hist_chunks > 0
