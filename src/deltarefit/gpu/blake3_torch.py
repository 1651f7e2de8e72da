"""BLAKE3 segment hashes in pure torch: the vectorized reference for the Triton kernels.

Contract: ``segment_hashes_torch(raw)`` takes a 1-D ``torch.uint8`` tensor on any device and returns a
``[n_segments, 16]`` uint8 tensor on the same device whose row ``i`` is
``blake3(raw[i * 2**20 : (i + 1) * 2**20]).digest(16)``, the ``seg_hash`` of
``deltarefit.integrity``. An empty input has no segments (a ``[0, 16]`` result), as in
``integrity.segment_hashes``. ``blake3_torch(raw, out_len)`` is plain BLAKE3 of the whole input
(``out_len <= 32``; the empty input included).

The algorithm, shared with ``blake3_triton`` (spec: github.com/BLAKE3-team/BLAKE3-specs):

1. Every 1 KiB chunk of every segment is compressed independently (16 blocks of 64 bytes, the last
   block of the input's last chunk zero-padded but carrying its real ``block_len``) into an 8-word
   chaining value. The chunk counter restarts at 0 in every segment: each segment is its own message.
   Segments are multiples of 1 KiB, so chunk ``g`` of the whole buffer starts at byte ``1024 * g`` and
   only the buffer's last chunk can be short.
2. Chaining values are merged pairwise level by level within each segment; an odd last node is carried
   up unchanged. That is exactly BLAKE3's left-balanced tree (the left subtree holds the largest power
   of two of chunks that is less than the total). The merge that leaves one node per segment gets the
   ROOT flag; a segment of one chunk gets ROOT on that chunk's last block instead.
3. The root's first 8 output words are its chaining-value formula (``v[i] ^ v[i + 8]``); their
   little-endian bytes are the first 32 bytes of the digest.

Hazards: all words are u32. Here they live in int64 tensors, so every addition is masked back to 32
bits and rotations mask the left shift; xor of two masked values needs no mask. Message words are
little-endian (byte ``4k`` is the low byte of word ``k``), whatever the host's byte order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SEGMENT_BYTES = 1 << 20  # deltarefit.integrity.SEGMENT_BYTES (not imported: keep this module torch-only)
CHUNK_BYTES = 1024
BLOCK_BYTES = 64
SEG_HASH_BYTES = 16

CHUNK_START = 1
CHUNK_END = 2
PARENT = 4
ROOT = 8

IV: tuple[int, ...] = (
    0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19,
)  # fmt: skip
MSG_PERMUTATION: tuple[int, ...] = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)

# (a, b, c, d) state indices of the 8 G calls of one round: 4 columns, then 4 diagonals.
_G_LANES = ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),
            (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14))  # fmt: skip


def _schedule() -> tuple[tuple[int, ...], ...]:
    """Message word order of each of the 7 rounds (round r+1 = round r permuted)."""
    s = list(range(16))
    out = []
    for _ in range(7):
        out.append(tuple(s))
        s = [s[p] for p in MSG_PERMUTATION]
    return tuple(out)


MSG_SCHEDULE = _schedule()
_M32 = 0xFFFFFFFF


# ------------------------------------------------------------------------------------------ tree plan


@dataclass(frozen=True)
class TreePlan:
    """How a buffer of ``n_bytes`` splits into segments of ``seg_bytes`` and their chunk trees.

    Chunks of the ``n_full`` full segments come first (``chunks_per_seg`` each), then the ``last_chunks``
    chunks of the short last segment (0 when there is none). Chunk ``g`` covers bytes
    ``[1024 g, min(1024 (g + 1), n_bytes))``.
    """

    n_bytes: int
    seg_bytes: int
    n_full: int
    last_chunks: int

    @property
    def chunks_per_seg(self) -> int:
        return self.seg_bytes // CHUNK_BYTES

    @property
    def n_segments(self) -> int:
        return self.n_full + (1 if self.last_chunks else 0)

    @property
    def n_chunks(self) -> int:
        return self.n_full * self.chunks_per_seg + self.last_chunks

    @property
    def n_whole_chunks(self) -> int:
        """Chunks holding a full 1024 bytes (all but possibly the buffer's last one)."""
        return self.n_bytes // CHUNK_BYTES

    def levels(self) -> list[tuple[int, int]]:
        """``(nodes per full segment, nodes in the last segment)`` entering each merge level."""
        full = self.chunks_per_seg if self.n_full else 0
        last = self.last_chunks
        out = []
        while max(full, last) > 1:
            out.append((full, last))
            full, last = (full + 1) // 2, (last + 1) // 2
        return out


def segment_plan(n_bytes: int, seg_bytes: int = SEGMENT_BYTES) -> TreePlan:
    """Plan for ``integrity``'s segments: none for an empty buffer."""
    if seg_bytes <= 0 or seg_bytes % CHUNK_BYTES:
        raise ValueError(f"segment size must be a positive multiple of {CHUNK_BYTES}, got {seg_bytes}")
    n_full, rem = divmod(n_bytes, seg_bytes)
    return TreePlan(n_bytes, seg_bytes, n_full, -(-rem // CHUNK_BYTES))


def message_plan(n_bytes: int) -> TreePlan:
    """Plan for one BLAKE3 message: one segment, one (possibly empty) chunk at least."""
    n_chunks = max(1, -(-n_bytes // CHUNK_BYTES))
    return TreePlan(n_bytes, n_chunks * CHUNK_BYTES, 0, n_chunks)


def check_input(raw: torch.Tensor) -> None:
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.dim() != 1:
        raise TypeError("expected a 1-D torch.uint8 tensor (a tensor's raw bytes: t.reshape(-1).view(torch.uint8))")
    if raw.numel() and raw.stride(0) != 1:
        raise ValueError("raw bytes must be contiguous")
    if raw.numel() >= (1 << 42):
        # Chunk counters are written as a 32-bit low word with a zero high word.
        raise ValueError("inputs of 4 TiB or more are not supported")


# ---------------------------------------------------------------------------------------- compression


def _rotr(x: torch.Tensor, n: int) -> torch.Tensor:
    # x < 2**32, so x << (32 - n) < 2**63: no int64 overflow; the mask drops the wrapped-out bits.
    return ((x >> n) | (x << (32 - n))) & _M32


def compress(cv: list[torch.Tensor], m: list[torch.Tensor], counter: torch.Tensor | int,
             block_len: torch.Tensor | int, flags: torch.Tensor | int) -> list[torch.Tensor]:
    """The 8 output words ``v[i] ^ v[i + 8]`` of one compression (chaining value / first 32 root bytes).

    All arguments are int64 values in ``[0, 2**32)``, broadcastable to ``cv[0]``'s shape; ``counter`` is
    the low counter word (the high word is 0).
    """
    like = cv[0]
    v = [*cv, *(torch.full_like(like, w) for w in IV[:4]),
         torch.zeros_like(like) + counter, torch.zeros_like(like),
         torch.zeros_like(like) + block_len, torch.zeros_like(like) + flags]
    for s in MSG_SCHEDULE:
        for k, (a, b, c, d) in enumerate(_G_LANES):
            va, vb, vc, vd = v[a], v[b], v[c], v[d]
            va = (va + vb + m[s[2 * k]]) & _M32
            vd = _rotr(vd ^ va, 16)
            vc = (vc + vd) & _M32
            vb = _rotr(vb ^ vc, 12)
            va = (va + vb + m[s[2 * k + 1]]) & _M32
            vd = _rotr(vd ^ va, 8)
            vc = (vc + vd) & _M32
            vb = _rotr(vb ^ vc, 7)
            v[a], v[b], v[c], v[d] = va, vb, vc, vd
    return [v[i] ^ v[i + 8] for i in range(8)]


def _le_words(b: torch.Tensor) -> list[torch.Tensor]:
    """``[n, 64]`` uint8 -> 16 int64 ``[n]`` little-endian words."""
    w = b.reshape(-1, 16, 4).to(torch.int64)
    words = w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)
    return list(words.unbind(1))


def _words_to_bytes(cv: torch.Tensor) -> torch.Tensor:
    """``[n, 8]`` int64 words -> ``[n, 32]`` uint8, little-endian."""
    shifts = torch.tensor([0, 8, 16, 24], device=cv.device, dtype=torch.int64)
    return ((cv[..., None] >> shifts) & 0xFF).to(torch.uint8).reshape(cv.shape[0], 32)


# ---------------------------------------------------------------------------------------- the hashes


def _chunk_cvs(raw: torch.Tensor, plan: TreePlan, g0: int, g1: int) -> torch.Tensor:
    """Chaining values ``[g1 - g0, 8]`` (int64) of chunks ``g0 .. g1 - 1``."""
    n = g1 - g0
    dev = raw.device
    lo, hi = g0 * CHUNK_BYTES, min(g1 * CHUNK_BYTES, plan.n_bytes)
    data = raw[lo:hi]
    if data.numel() != n * CHUNK_BYTES:  # the buffer's last chunk is short (or empty): zero-pad a copy
        data = torch.cat([data, data.new_zeros(n * CHUNK_BYTES - data.numel())])
    data = data.view(n, CHUNK_BYTES)
    g = torch.arange(g0, g1, device=dev, dtype=torch.int64)
    chunk_len = (plan.n_bytes - g * CHUNK_BYTES).clamp(0, CHUNK_BYTES)
    n_blocks = ((chunk_len + BLOCK_BYTES - 1) // BLOCK_BYTES).clamp_min(1)
    cps = plan.chunks_per_seg
    counter = g % cps
    seg_len = (plan.n_bytes - (g // cps) * plan.seg_bytes).clamp(max=plan.seg_bytes)
    end_flags = CHUNK_END | torch.where(seg_len <= CHUNK_BYTES, ROOT, 0)
    cv = [torch.full((n,), w, device=dev, dtype=torch.int64) for w in IV]
    for b in range(CHUNK_BYTES // BLOCK_BYTES):
        active = b < n_blocks
        if not bool(active.any()):
            break
        m = _le_words(data[:, b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES])
        block_len = (chunk_len - b * BLOCK_BYTES).clamp(0, BLOCK_BYTES)
        flags = (CHUNK_START if b == 0 else 0) | torch.where(n_blocks - 1 == b, end_flags, 0)
        new = compress(cv, m, counter, block_len, flags)
        cv = [torch.where(active, x, y) for x, y in zip(new, cv, strict=True)]
    return torch.stack(cv, 1)


def _merge(nodes: torch.Tensor, groups: int, count: int) -> torch.Tensor:
    """One level for ``groups`` segments of ``count`` nodes each (``[groups * count, 8]``)."""
    x = nodes.view(groups, count, 8)
    pairs = x[:, : count // 2 * 2].reshape(groups, count // 2, 2, 8)
    left, right = pairs[:, :, 0], pairs[:, :, 1]
    flags = PARENT | (ROOT if count == 2 else 0)
    iv = [torch.full_like(left[..., 0], w) for w in IV]
    m = [*left.unbind(-1), *right.unbind(-1)]
    out = torch.stack(compress(iv, m, 0, BLOCK_BYTES, flags), -1)
    if count % 2:
        out = torch.cat([out, x[:, count - 1:]], 1)  # odd last node carried up unchanged
    return out.reshape(-1, 8)


def _roots(raw: torch.Tensor, plan: TreePlan, batch_chunks: int) -> torch.Tensor:
    """Root words ``[n_segments, 8]`` (int64)."""
    cps = plan.chunks_per_seg
    step = max(1, batch_chunks // cps) * cps  # batches of whole segments
    parts = []
    for g0 in range(0, plan.n_chunks, step):
        g1 = min(g0 + step, plan.n_chunks)
        nodes = _chunk_cvs(raw, plan, g0, g1)
        full = min(g1 // cps, plan.n_full) - g0 // cps  # full segments in this batch
        last = plan.last_chunks if g1 > plan.n_full * cps else 0
        f, lc = (cps if full else 0), last
        while max(f, lc) > 1:
            a = _merge(nodes[: full * f], full, f) if full and f > 1 else nodes[: full * f]
            b = _merge(nodes[full * f:], 1, lc) if lc > 1 else nodes[full * f:]
            nodes = torch.cat([a, b])
            f, lc = (f + 1) // 2, (lc + 1) // 2
        parts.append(nodes)
    return torch.cat(parts) if parts else torch.zeros(0, 8, dtype=torch.int64, device=raw.device)


def segment_hashes_torch(raw: torch.Tensor, *, batch_chunks: int = 1 << 18) -> torch.Tensor:
    """``[n_segments, 16]`` uint8 segment hashes, on ``raw``'s device; see the module docstring.

    ``batch_chunks`` bounds the work per pass (about 1.5 KiB of temporaries per chunk in flight).
    """
    check_input(raw)
    plan = segment_plan(raw.numel())
    return _words_to_bytes(_roots(raw, plan, batch_chunks))[:, :SEG_HASH_BYTES].contiguous()


def blake3_torch(raw: torch.Tensor, out_len: int = 32) -> bytes:
    """Plain BLAKE3 of the whole input (first ``out_len <= 32`` bytes)."""
    check_input(raw)
    if not 0 < out_len <= 32:
        raise ValueError("out_len must be in 1..32 (longer outputs need the XOF, not implemented)")
    plan = message_plan(raw.numel())
    return bytes(_words_to_bytes(_roots(raw, plan, 1 << 62)).cpu().numpy()[0, :out_len])
