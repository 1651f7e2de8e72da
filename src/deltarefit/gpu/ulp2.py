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

from ..codec.encodings import EncodedChunk, _ctx, _kind
from ..dtypes import DType
from ..errors import DecodeError
from . import ulp2_tables as T

ULP2, ULP2_HIST = 6, 7

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
    offs = np.zeros(len(items) + 1, np.int64)
    offs[1:] = np.cumsum([it[2] for it in items])
    total = int(offs[-1])
    pos = torch.zeros(max(total, 1), dtype=torch.int64, device=dev)
    ctx = torch.zeros(max(total, 1), dtype=torch.int32, device=dev)
    val = torch.zeros(max(total, 1), dtype=base.dtype, device=dev)
    groups: dict[int, list] = {0: [], 1: []}
    for c, (boff, n, m, payload) in enumerate(items):
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
            **_consts(dt, hist, variant))
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


def counts(dt: DType, base: torch.Tensor, target: torch.Tensor, states: torch.Tensor | None):
    """(changed positions on the device, ``ulp2_tables.Counts``) of one chunk: torch ops on the device,
    ``NCT * (BITS + 2) + 16`` numbers to the host."""
    shift, mask, nexp = _ctx(dt)
    hist = states is not None
    nct = _nct(dt, hist)
    b, t = _u(base, dt.bits), _u(target, dt.bits)
    e = (b >> shift) & mask
    if hist:
        sb = states.to(torch.int64)
        e = (sb & 127).clamp(max=T.N_STATES - 1) * nexp + e
    chg = torch.nonzero(b != t).reshape(-1)
    d = (_key(t[chg], dt) - _key(b[chg], dt)) & ((1 << dt.bits) - 1)
    neg = (d >> (dt.bits - 1)) != 0
    mag = torch.where(neg, (1 << dt.bits) - d, d)
    k = torch.zeros_like(mag)
    for i in range(dt.bits):
        k += (mag >> i) > 0
    ec = e[chg]
    c_t = c1_t = torch.zeros(8, dtype=torch.int64, device=b.device)
    if hist:
        st = sb[chg]
        c_t = torch.bincount(st & 127, minlength=8)
        c1_t = torch.bincount(st & 127, weights=(neg ^ ((st >> 7) != 0)).to(torch.float64), minlength=8)
    host = [x.cpu().numpy().astype(np.int64) for x in (
        torch.bincount(e, minlength=nct), torch.bincount(ec, minlength=nct),
        torch.bincount(ec * (dt.bits + 1) + k, minlength=nct * (dt.bits + 1)), c_t, c1_t)]
    return chg, T.Counts(host[0], host[1], host[2].reshape(nct, dt.bits + 1), host[3], host[4])


def _encode_variant(dt: DType, base, target, states, chg, cn: T.Counts, variant: int) -> bytes | None:
    built = T.build(cn, dt.bits, variant, states is not None)
    if built is None:
        return None
    tb, head = built
    k = _kernels()
    cs = _consts(dt, states is not None, variant)
    n, m = base.numel(), chg.numel()
    ub = cs["R"] // 8
    cap = n + m * (2 + cs["NR"])  # units: at most one per symbol
    dev = base.device
    out = torch.zeros(cap * ub, dtype=torch.uint8, device=dev)
    lanes = torch.zeros(cs["W"], dtype=torch.int64, device=dev)
    top = torch.zeros(1, dtype=torch.int64, device=dev)
    st = torch.zeros(1, dtype=torch.int32, device=dev)

    def up(a):
        return torch.from_numpy(np.array(a, copy=True)).to(dev)

    k.encode_kernel[(1,)](base, target, states if states is not None else base, chg,
                          up(np.array([0, n, m, 0, 0, cap], np.int64)), up(tb.p), up(tb.cum), up(tb.sp),
                          out, lanes, top, st, **cs)
    status = int(st.cpu()[0])
    if status:
        raise RuntimeError(f"ulp2 device encoder: status {status} ({T.STATUS2.get(status)})")
    sb = 2 if variant == 0 else 4
    t0 = int(top.cpu()[0])
    return head + lanes.cpu().numpy().astype(f"<u{sb}").tobytes() + out[t0 * ub:].cpu().numpy().tobytes()


def encode_chunk(dt: DType, base: torch.Tensor, target: torch.Tensor, history=None) -> EncodedChunk | None:
    """The smallest ``ulp2`` / ``ulp2_hist`` coding of one chunk (same-width integer views on the
    device), or None when nothing changed or no variant can code it. ``history``: the chunk's
    ``codec.history.History`` (then ``ulp2_hist`` is a candidate too; its payload starts with the id)."""
    if not supported(dt):
        raise ValueError(f"{dt.name}: the device encoder handles widths up to 32 bits")
    best: EncodedChunk | None = None
    tries: list[tuple[int, torch.Tensor | None, bytes]] = [(ULP2, None, b"")]
    if history is not None and history.m:
        if history.n != base.numel():
            raise ValueError(f"history of a {history.n}-element chunk given for a chunk of {base.numel()}")
        tries.append((ULP2_HIST, torch.from_numpy(history.states().copy()).to(base.device), history.id))
    for enc, states, prefix in tries:
        chg, cn = counts(dt, base, target, states)
        if chg.numel() == 0:
            return None
        for variant in (0, 1):
            pl = _encode_variant(dt, base, target, states, chg, cn, variant)
            if pl is not None and (best is None or len(prefix) + len(pl) < len(best.payload)):
                best = EncodedChunk(enc, prefix + pl, int(chg.numel()), 0)
    return best
