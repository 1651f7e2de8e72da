"""Format 2 (encodings 6 ``ulp2`` and 7 ``ulp2_hist``) on the device: decode and encode chunks with
the Triton kernels of ``_ulp2_kernels`` (one program per chunk, the W rANS lanes as its vector).

* ``decode_chunks(dt, base, items, states)``: the changes (positions, target bits) of a batch of
  chunks, each ``(element offset in base, n, n_changed, payload)``; the host parses each payload's
  header into dense tables (``ulp2_tables.parse``: O(contexts) numbers, every header refusal), the
  device runs every lane of every chunk and returns a status per chunk (the lane refusals: a read
  past the stream, a count other than the record's, a lane not ending at L, unread bytes). Results
  are staged in fresh device arrays; nothing is written to ``base``.
* ``decode_chunk(dt, seg, payload, m, states)``: one chunk; raises ``DecodeError`` on any refusal.
* ``encode_chunk(dt, base, target, history)``: the ``ulp2`` family coding of one chunk from device
  tensors: counts per context from torch ops on the device (a few hundred numbers cross to the
  host), tables built on the host (``ulp2_tables.build``), the rANS lanes run backwards on the
  device into an output area of the bound's size, and only the stream's tail, the final lane states
  and the header make the payload. Both variants (and ``ulp2_hist`` with a history) are coded; the
  smallest payload is kept (ties: variant 0, then ``ulp2``), as the host encoder does.

Widths up to 32 bits (``supported``); 8-byte dtypes stay on the host decoder. Kernels run compiled on
CUDA, or through Triton's interpreter on CPU tensors under ``TRITON_INTERPRET=1`` (``gpu.scan``'s
rule: ``available(device)``).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..codec.encodings import ULP2, ULP2_HIST, EncodedChunk, _ctx, _kind, max_payload_len
from ..codec.history import HIST_ID_BYTES
from ..dtypes import DType
from ..errors import DecodeError
from . import ulp2_tables as T

_STATE: dict = {"kernels": None, "error": None}


def _kernels():
    if _STATE["kernels"] is None and _STATE["error"] is None:
        try:
            from . import _ulp2_kernels
        except ImportError as e:  # no triton: the host decoder does the work
            _STATE["error"] = f"{type(e).__name__}: {e}"
        else:
            _STATE["kernels"] = _ulp2_kernels
    return _STATE["kernels"]


def _interpreted(k) -> bool:
    return type(k.decode_kernel).__name__ == "InterpretedFunction"


def available(device: torch.device) -> bool:
    """Whether the kernels run on tensors of ``device``: compiled on CUDA, interpreted on CPU."""
    k = _kernels()
    if k is None:
        return False
    if device.type == "cuda":
        return not _interpreted(k)
    return device.type == "cpu" and _interpreted(k) and os.environ.get("TRITON_INTERPRET") == "1"


def supported(dt: DType) -> bool:
    return dt.bits <= 32


def _consts(dt: DType, hist: bool, variant: int) -> dict:
    shift, mask, nexp = _ctx(dt)
    M, R, W, LB = T.VARIANTS[variant]
    return {"SHIFT": shift, "MASK": mask, "NEXP": nexp, "NCT": nexp * (T.N_STATES if hist else 1),
            "HIST": hist, "KIND": _kind(dt), "BITS": dt.bits, "M": M, "R": R, "W": W, "LB": LB,
            "NR": (dt.bits - 2) // M + 1}


def _nct(dt: DType, hist: bool) -> int:
    return _ctx(dt)[2] * (T.N_STATES if hist else 1)


def decode_chunks(dt: DType, base: torch.Tensor, items: list[tuple[int, int, int, bytes]],
                  states: torch.Tensor | None = None):
    """Decode a batch (see the module docstring). ``base``: 1-D same-width integer view on the device;
    ``states``: ``ulp2_hist``'s uint8 history bytes aligned with ``base`` (None: ``ulp2``). Returns
    ``(pos, val, offsets, status)``: int64 positions within each chunk and target bits (``base``'s
    dtype) of all chunks, chunk ``c``'s at ``offsets[c]:offsets[c+1]``, and a numpy status per chunk
    (0, or a negative code of ``ulp2_tables.STATUS2``); a chunk with a bad status holds garbage."""
    if not supported(dt):
        raise ValueError(f"{dt.name}: the device decoder handles widths up to 32 bits")
    k = _kernels()
    hist = states is not None
    dev = base.device
    nct = _nct(dt, hist)
    status = np.zeros(len(items), np.int64)
    for c, (boff, n, m, _) in enumerate(items):
        if boff < 0 or n < 0 or boff + n > base.numel():
            raise ValueError(f"chunk {c}: elements {boff}..{boff + n} outside the base's {base.numel()}")
        if not 0 <= m <= n:  # a count no chunk can hold: refused before staging is sized by it
            status[c] = -4
    offs = np.zeros(len(items) + 1, np.int64)
    offs[1:] = np.cumsum([0 if status[c] else it[2] for c, it in enumerate(items)])
    total = int(offs[-1])
    pos = torch.zeros(max(total, 1), dtype=torch.int64, device=dev)
    ctx = torch.zeros(max(total, 1), dtype=torch.int32, device=dev)
    val = torch.zeros(max(total, 1), dtype=base.dtype, device=dev)
    groups: dict[int, list] = {0: [], 1: []}
    for c, (boff, n, m, payload) in enumerate(items):
        if status[c]:
            continue
        try:
            tb = T.parse(payload, dt.bits, nct, hist)
        except T.TableError as err:
            status[c] = err.status
            continue
        groups[tb.variant].append((c, boff, n, m, payload, tb))
    st_dev = []
    for variant, g in groups.items():
        if not g:
            continue
        stream = np.frombuffer(b"".join(pl[tb.stream:] for _, _, _, _, pl, tb in g) or b"\0", np.uint8)
        soffs = np.concatenate([[0], np.cumsum([len(pl) - tb.stream for _, _, _, _, pl, tb in g])])
        chunk = np.array([[boff, n, m, soffs[i], len(pl) - tb.stream, offs[c]]
                          for i, (c, boff, n, m, pl, tb) in enumerate(g)], np.int64)

        def up(a, dtype=None):
            return torch.from_numpy(np.array(a, dtype, copy=True)).to(dev)

        st = torch.zeros(len(g), dtype=torch.int32, device=dev)
        k.decode_kernel[(len(g),)](
            base, states if hist else base, up(stream), up(chunk), up(np.stack([x[5].lanes for x in g])),
            up(np.stack([x[5].p for x in g])), up(np.stack([x[5].cum for x in g])),
            up(np.stack([x[5].sp for x in g])), pos, ctx, val, st, SIGNED=dt.itemsize > 1,
            num_warps=1, **_consts(dt, hist, variant))  # one warp: the W lanes
        st_dev.append(([x[0] for x in g], st))
    for idx, st in st_dev:
        status[idx] = st.cpu().numpy()
    return pos[:total], val[:total], offs, status


def decode_chunk(dt: DType, seg: torch.Tensor, payload: bytes, m: int, where: str,
                 states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, target bits) of one chunk on the device; ``DecodeError`` naming ``where`` and the
    reason on any refusal (nothing is written anywhere but fresh staging arrays)."""
    pos, val, _, status = decode_chunks(dt, seg, [(0, seg.numel(), m, payload)], states)
    if status[0]:
        raise DecodeError(f"{where}: {T.STATUS2.get(int(status[0]), f'status {status[0]}')}")
    return pos, val


def _u(x: torch.Tensor, bits: int) -> torch.Tensor:
    return x.to(torch.int64) & ((1 << bits) - 1)


def _key(u: torch.Tensor, dt: DType) -> torch.Tensor:
    top, all_ = 1 << (dt.bits - 1), (1 << dt.bits) - 1
    kind = _kind(dt)
    if kind == 0:
        return torch.where((u & top) != 0, all_ - u, u | top)
    return u ^ top if kind == 1 else u


def counts(dt: DType, base: torch.Tensor, target: torch.Tensor, per: int, states: torch.Tensor | None):
    """The counts of a batch of chunks of ``per`` elements (the last may be short), from torch ops on
    the device: ``(chg, m, [ulp2_tables.Counts per chunk])`` with ``chg`` every change's position
    within its chunk (device, ascending per chunk) and ``m`` the changes per chunk (numpy). About
    ``NCT * (BITS + 2) + 16`` numbers per chunk cross to the host."""
    shift, mask, nexp = _ctx(dt)
    hist = states is not None
    nct = _nct(dt, hist)
    nb = dt.bits + 1
    count = -(-base.numel() // per)
    b, t = _u(base, dt.bits), _u(target, dt.bits)
    cid = torch.arange(b.numel(), device=b.device) // per
    e = (b >> shift) & mask
    if hist:
        sb = states.to(torch.int64)
        e = (sb & 127).clamp(max=T.N_STATES - 1) * nexp + e
    chg = torch.nonzero(b != t).reshape(-1)
    cc = cid[chg]
    d = (_key(t[chg], dt) - _key(b[chg], dt)) & ((1 << dt.bits) - 1)
    neg = (d >> (dt.bits - 1)) != 0
    mag = torch.where(neg, (1 << dt.bits) - d, d)
    k = torch.zeros_like(mag)
    for i in range(dt.bits):
        k += (mag >> i) > 0
    ec = cc * nct + e[chg]
    c_t = c1_t = torch.zeros(count * 8, dtype=torch.int64, device=b.device)
    if hist:
        st = sb[chg]
        c_t = torch.bincount(cc * 8 + (st & 127), minlength=count * 8)
        c1_t = torch.bincount(cc * 8 + (st & 127), weights=(neg ^ ((st >> 7) != 0)).to(torch.float64),
                              minlength=count * 8)
    host = [x.cpu().numpy().astype(np.int64) for x in (
        torch.bincount(cid * nct + e, minlength=count * nct), torch.bincount(ec, minlength=count * nct),
        torch.bincount(ec * nb + k, minlength=count * nct * nb), c_t, c1_t, torch.bincount(cc, minlength=count))]
    n_e, c_e, c_ek, ct, c1 = host[0].reshape(count, nct), host[1].reshape(count, nct), \
        host[2].reshape(count, nct, nb), host[3].reshape(count, 8), host[4].reshape(count, 8)
    return chg - cc * per, host[5], [T.Counts(n_e[c], c_e[c], c_ek[c], ct[c], c1[c]) for c in range(count)]


def code_batch(dt: DType, base: torch.Tensor, target: torch.Tensor, per: int, states: torch.Tensor | None,
               chg: torch.Tensor, m: np.ndarray, cns: list[T.Counts], variant: int) -> list[bytes | None]:
    """The ``variant`` payload (without a history id) of every chunk of the batch (``counts``'s
    results), or None for a chunk it cannot code (or without changes). One launch: each program codes
    its chunk backwards into its own area (bound: one unit per symbol); only the areas' used tails
    and the lane states cross to the host."""
    k = _kernels()
    cs = _consts(dt, states is not None, variant)
    ub, W = cs["R"] // 8, cs["W"]
    dev = base.device
    nel = base.numel()
    goffs = np.concatenate([[0], np.cumsum(m)])
    rows, heads, tabs = [], [], []
    area = 0
    for c, cn in enumerate(cns):
        built = T.build(cn, dt.bits, variant, states is not None) if m[c] else None
        if built is None:
            continue
        n = min(per, nel - c * per)
        cap = n + int(m[c]) * (2 + cs["NR"])  # units
        rows.append((c, [c * per, n, int(m[c]), goffs[c], area, cap]))
        heads.append(built[1])
        tabs.append(built[0])
        area += cap * ub
    out: list[bytes | None] = [None] * len(cns)
    if not rows:
        return out

    def up(a):
        return torch.from_numpy(np.array(a, copy=True)).to(dev)

    buf = torch.empty(area, dtype=torch.uint8, device=dev)
    g = len(rows)
    lanes = torch.zeros(g, W, dtype=torch.int64, device=dev)
    top = torch.zeros(g, dtype=torch.int64, device=dev)
    st = torch.zeros(g, dtype=torch.int32, device=dev)
    chunk = up(np.array([r for _, r in rows], np.int64))
    k.encode_kernel[(g,)](base, target, states if states is not None else base, chg, chunk,
                          up(np.stack([x.p for x in tabs])), up(np.stack([x.cum for x in tabs])),
                          up(np.stack([x.sp for x in tabs])), buf, lanes, top, st, num_warps=1, **cs)
    status = st.cpu().numpy()
    if status.any():  # the tables came from the same counts: a failure here is a defect, not input
        c = int(np.flatnonzero(status)[0])
        raise RuntimeError(f"ulp2 device encoder: chunk {rows[c][0]}: status {status[c]}")
    # The used tails, packed on the device and copied once.
    start = chunk[:, 4] + top * ub
    length = (chunk[:, 5] - top) * ub
    seg = torch.repeat_interleave(torch.arange(g, device=dev), length)
    within = torch.arange(seg.numel(), device=dev) - (torch.cumsum(length, 0) - length)[seg]
    packed = buf[start[seg] + within].cpu().numpy().tobytes()
    lens = length.cpu().numpy()
    lane_h = lanes.cpu().numpy().astype(f"<u{2 if variant == 0 else 4}")
    o = 0
    for i, (c, _) in enumerate(rows):
        pl = heads[i] + lane_h[i].tobytes() + packed[o:o + int(lens[i])]
        o += int(lens[i])
        # The host encoder's bound (codec.ulp2.encode_variant): the record's payload limit, and its
        # worst-case header within it; a coding past either is no candidate.
        limit = max_payload_len(dt, rows[i][1][1]) - (HIST_ID_BYTES if states is not None else 0)
        g = int(np.count_nonzero(cns[c].c_e))
        ps, sb = (1, 2) if variant == 0 else (2, 4)
        need = 1 + 5 + g * (5 + ps) + g * (1 + ps * (dt.bits - 1)) + 6 * ps + W * sb
        out[c] = pl if need <= limit and len(pl) <= limit else None
    return out


def encode_chunks(dt: DType, base: torch.Tensor, target: torch.Tensor, per: int,
                  histories: list | None = None) -> list[EncodedChunk | None]:
    """The smallest ``ulp2`` / ``ulp2_hist`` coding of every chunk of a batch (same-width integer
    views on the device; chunks of ``per`` elements), None where nothing changed. ``histories``: each
    chunk's ``codec.history.History`` or None (then ``ulp2_hist`` is a candidate for those that have
    one; its payload starts with the id). Ties: variant 0, then ``ulp2``."""
    if not supported(dt):
        raise ValueError(f"{dt.name}: the device encoder handles widths up to 32 bits")
    count = -(-base.numel() // per)
    best: list[EncodedChunk | None] = [None] * count
    tries: list[tuple[int, torch.Tensor | None]] = [(ULP2, None)]
    if histories is not None and any(h is not None and h.m for h in histories):
        st = np.zeros(base.numel(), np.uint8)
        for c, h in enumerate(histories):
            if h is not None and h.m:
                n = min(per, base.numel() - c * per)
                if h.n != n:
                    raise ValueError(f"history of a {h.n}-element chunk given for chunk {c} of {n}")
                st[c * per:c * per + n] = h.states()
        tries.append((ULP2_HIST, torch.from_numpy(st).to(base.device)))
    for enc, states in tries:
        chg, m, cns = counts(dt, base, target, per, states)
        for variant in (0, 1):
            for c, coded in enumerate(code_batch(dt, base, target, per, states, chg, m, cns, variant)):
                if coded is None:
                    continue
                pl = coded
                if enc == ULP2_HIST:
                    h = histories[c]
                    if h is None or not h.m:
                        continue
                    pl = h.id + coded
                if best[c] is None or len(pl) < len(best[c].payload):
                    best[c] = EncodedChunk(enc, pl, int(m[c]), 0)
    return best


def encode_chunk(dt: DType, base: torch.Tensor, target: torch.Tensor, history=None) -> EncodedChunk | None:
    """``encode_chunks`` of one chunk (``history``: its ``History`` or None)."""
    return encode_chunks(dt, base, target, max(base.numel(), 1), [history])[0]
