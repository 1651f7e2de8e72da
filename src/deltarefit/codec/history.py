"""A chunk's history: what the previous version of the stream changed in it, which encoding 5
(``ULP_HIST``, FORMAT.md "Encoding 5: ulp_hist") takes as context.

Contract:

* A ``History`` is the previous delta's change set over one chunk: the changed element indices in
  ascending order and, for each, whether it moved down (its key, ``primitives._key``, decreased).
  Its per-element state is 0 (unchanged), 1 (moved up) or 2 (moved down).
* Its ``id`` is a BLAKE3 digest of exactly that content (domain-separated, with the chunk's element
  count), so an encoder and a decoder that derived their histories independently (one from the scan
  of its pair, the other from the patch it applied) agree on the id exactly when they agree on every
  state. A ``ULP_HIST`` payload starts with the id it was coded against; a decoder holding another
  refuses the chunk.
* Holding it costs the change set, not the chunk: positions and one bit each.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import blake3
import numpy as np

from ..dtypes import DType
from . import native

HIST_ID_BYTES = 16
QDEPTH = 8  # gap-quotient decisions through the range coder, per state (encoding 1 takes 2)
DEPTH = 3  # versions of change sets a history summarises
_DOMAIN = b"deltarefit.history.v1\0"
_tls = threading.local()


def _state_table() -> np.ndarray:
    """History byte of an element from its last three moves (s1 newest; each -1, 0, +1), indexed by
    ``(s1 + 1) * 9 + (s2 + 1) * 3 + (s3 + 1)`` (FORMAT.md, "Encoding 5: ulp_hist").

    The moves are taken up to their direction: negated when the first nonzero of (s1, s2, s3) is -1,
    which sets bit 7 (the sign's coding undoes it). The state (low 7 bits) is the pattern (s1, s2 + s3)
    so obtained, with the two rarest merged into neighbours: (1, -2) into (1, -1), and (0, 0) (moves
    that cancelled) into state 0, "no net move in three versions". Chosen by measurement on real AdamW
    chains: the pattern with s2 and s3 apart, or a fourth version, gained under 1% more and costs more
    groups and more history to hold."""
    t = np.zeros(27, np.uint8)
    codes: dict[tuple[int, int], int] = {(0, 0): 0}
    for s1 in (-1, 0, 1):
        for s2 in (-1, 0, 1):
            for s3 in (-1, 0, 1):
                sig = (s1, s2, s3)
                flip = next((x for x in sig if x), 0) < 0
                c1, c2, c3 = (-x for x in sig) if flip else sig
                c = {(1, -2): (1, -1)}.get((c1, c2 + c3), (c1, c2 + c3))
                if c not in codes:
                    codes[c] = len(codes)
                t[(s1 + 1) * 9 + (s2 + 1) * 3 + (s3 + 1)] = codes[c] | (128 if flip and codes[c] else 0)
    return t


STATE_TABLE = _state_table()
N_STATES = int((STATE_TABLE & 127).max()) + 1


def context_map(n_exp: int) -> tuple[np.ndarray, np.ndarray]:
    """(cmap, cstate) of encoding 5 for a dtype with ``n_exp`` exponent contexts: element context
    ``cmap[state * n_exp + exponent]``, and each context's state (``cstate[c]``). Every state keeps
    the exponent contexts; the context ids run state by state."""
    got = _CMAPS.get(n_exp)
    if got is None:
        cmap = np.arange(N_STATES * n_exp, dtype=np.int32)
        cstate = (np.arange(N_STATES * n_exp) // n_exp).astype(np.int32)
        got = _CMAPS[n_exp] = (cmap, cstate)
    return got


_CMAPS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


# A set with no move, read-only like the sets taken from records: numba compiles a kernel per mix of
# read-only and writable arguments (a fresh mix cost about half a second in the middle of a chain).
_NO_MOVE = (np.frombuffer(b"", np.uint32), np.frombuffer(b"\0", np.uint8))


def _record_counts(r: bytes | memoryview) -> tuple[int, int] | None:
    """(elements, changes) of a change set's record (``Moves.to_bytes``), or None where its header
    and its length do not agree."""
    if len(r) < 16:
        return None
    n, m = int.from_bytes(r[:8], "little"), int.from_bytes(r[8:16], "little")
    return (n, m) if m <= n and len(r) == 16 + 4 * m + (m + 7) // 8 else None


def _record_size(r: bytes | None, n: int) -> int:
    """The number of changes of a change set's record of a chunk of ``n`` elements (0 for None), or
    -1 where it is not one (``_record_counts``)."""
    if r is None:
        return 0
    got = _record_counts(r)
    return got[1] if got is not None and got[0] == n else -1


def _merge_kernel():
    """``merge_records``: the native kernel where the extension was built (and is in use: ``native.USE_NATIVE``),
    else numba's, the same outputs. The native one keeps numba out of a process that decodes or encodes
    with history (its import and compilation cost about half a second in every ``deltarefit apply
    --history``)."""
    kern = native.kernel("merge_records")
    if kern is None:
        from .history_kernels import merge_records as kern
    return kern


def _history_id(n: int, pos32: np.ndarray, state: np.ndarray) -> bytes:
    """FORMAT.md's history id of a chunk of ``n`` elements: its positions (little-endian u32) and
    their history bytes."""
    h = blake3.blake3(_DOMAIN + int(n).to_bytes(8, "little") + int(pos32.size).to_bytes(8, "little"))
    h.update(np.ascontiguousarray(pos32, "<u4").view(np.uint8))
    h.update(np.ascontiguousarray(state, np.uint8))
    return h.digest(HIST_ID_BYTES)


@dataclass(frozen=True)
class History:
    n: int  # elements in the chunk
    pos: np.ndarray  # ascending int64 element indices with a state other than 0
    state: np.ndarray  # uint8 per position, 1 .. N_STATES - 1
    id: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        pos = np.ascontiguousarray(self.pos, np.int64)
        state = np.ascontiguousarray(self.state, np.uint8)
        if pos.ndim != 1 or state.shape != pos.shape:
            raise ValueError("history positions and states must be 1-D and of one length")
        if pos.size and (pos[0] < 0 or pos[-1] >= self.n or np.any(np.diff(pos) <= 0)):
            raise ValueError(f"history positions must ascend strictly within the chunk's {self.n} elements")
        if state.size and ((state & 127).min() < 1 or (state & 127).max() >= N_STATES):
            raise ValueError(f"history states must lie in 1..{N_STATES - 1}")
        object.__setattr__(self, "pos", pos)
        object.__setattr__(self, "state", state)
        object.__setattr__(self, "id", _history_id(self.n, pos.astype("<u4"), state))

    @property
    def m(self) -> int:
        return int(self.pos.size)

    def states(self) -> np.ndarray:
        """The per-element states (uint8) in this thread's scratch array. Hazard: valid until the
        thread's next ``states()`` call."""
        a = getattr(_tls, "states", None)
        if a is None or a.size < self.n:
            a = _tls.states = np.empty(max(self.n, 1), np.uint8)
        a = a[: self.n]
        a.fill(0)
        a[self.pos] = self.state
        return a

    @classmethod
    def from_records(cls, n: int, records: list[bytes | None], where: list[str]) -> History:
        """``from_moves`` of change sets given as their records (``Moves.to_bytes``; None: no move),
        newest first, each checked as ``Moves.from_bytes`` does (``DecodeError`` naming ``where[d]``
        for a malformed record ``d``): one kernel call, where ``from_moves`` takes numpy's steps on
        every change set."""
        from ..errors import DecodeError

        merge_records = _merge_kernel()
        sets: list[np.ndarray] = []
        for d, r in enumerate(list(records[:DEPTH])):
            m = _record_size(r, n)
            if m < 0:
                raise DecodeError(f"{where[d]}: change set of {len(r or b'')} bytes is not one of a chunk of {n} elements")
            sets += ([np.frombuffer(r, "<u4", m, 16), np.frombuffer(r, np.uint8, (m + 7) // 8, 16 + 4 * m)] if m
                     else list(_NO_MOVE))
        sets += list(_NO_MOVE) * (DEPTH - len(sets) // 2)
        total = sum(p.size for p in sets[::2]) + 1
        pos, pos32, st = np.empty(total, np.int64), np.empty(total, np.uint32), np.empty(total, np.uint8)
        k = merge_records(*sets, n, STATE_TABLE, pos, pos32, st)
        if k < 0:
            raise DecodeError(f"{where[-1 - k]}: change set positions do not ascend within {n} elements")
        return cls._trusted(n, pos[:k], st[:k], pos32[:k])

    @classmethod
    def _trusted(cls, n: int, pos: np.ndarray, state: np.ndarray, pos32: np.ndarray) -> History:
        """A history from a merge's output (valid by construction: not checked again)."""
        h = object.__new__(cls)
        object.__setattr__(h, "n", n)
        object.__setattr__(h, "pos", pos)
        object.__setattr__(h, "state", state)
        object.__setattr__(h, "id", _history_id(n, pos32, state))
        return h

    @classmethod
    def from_moves(cls, n: int, moves: list[Moves]) -> History:
        """The history of a chunk of ``n`` elements from its last moves, newest first (at most
        ``DEPTH`` are used; fewer count as no move): ``from_records`` of their records."""
        moves = list(moves[:DEPTH])
        for mv in moves:
            if mv.n != n:
                raise ValueError(f"moves of a {mv.n}-element chunk given for a chunk of {n}")
        return cls.from_records(n, [mv.to_bytes() for mv in moves], [f"moves {d}" for d in range(len(moves))])


@dataclass(frozen=True)
class Moves:
    """One version's change set over a chunk: the changed element indices (ascending) and whether
    each moved down (its key, ``primitives._key``, decreased)."""

    n: int
    pos: np.ndarray
    down: np.ndarray

    def to_bytes(self) -> bytes:
        """n, m, the positions as little-endian u32, the directions packed (for a history file)."""
        return (int(self.n).to_bytes(8, "little") + int(self.pos.size).to_bytes(8, "little")
                + np.asarray(self.pos, "<u4").tobytes() + np.packbits(self.down, bitorder="little").tobytes())

    @classmethod
    def from_bytes(cls, raw: bytes | memoryview, where: str = "history") -> Moves:
        from ..errors import DecodeError

        mv = memoryview(raw)
        if len(mv) < 16:
            raise DecodeError(f"{where}: truncated change set")
        counts = _record_counts(mv)
        if counts is None:
            n, m = int.from_bytes(mv[:8], "little"), int.from_bytes(mv[8:16], "little")
            raise DecodeError(f"{where}: change set of {len(mv)} bytes does not hold {m} of {n} changes")
        n, m = counts
        pos = np.frombuffer(mv, "<u4", m, 16).astype(np.int64)
        if m and (pos[-1] >= n or np.any(np.diff(pos) <= 0)):
            raise DecodeError(f"{where}: change set positions do not ascend within {n} elements")
        down = np.unpackbits(np.frombuffer(mv, np.uint8, (m + 7) // 8, 16 + 4 * m), count=m,
                             bitorder="little").astype(np.bool_)
        return cls(n, pos, down)


def directions(dt: DType, bvals: np.ndarray, tvals: np.ndarray) -> np.ndarray:
    """For each changed element, whether it moved down: its key (FORMAT.md, "Keys") decreased. The keys
    are taken in the bits' own unsigned width (``_key`` widened to 64 bits took ten times as long)."""
    u, v = np.asarray(bvals), np.asarray(tvals)
    if u.dtype.kind != "u":
        u, v = u.view(f"u{u.dtype.itemsize}"), v.view(f"u{v.dtype.itemsize}")
    if dt.kind == "float":
        t = u.dtype.type
        sign, top = t(1 << (dt.bits - 1)), t(dt.bits - 1)
        # key = bits ^ (all ones if the sign is set, else the sign): every float dtype fills its
        # container, so 0 - (bits >> top) is all ones or zero there (np.where took nine times as long)
        return (v ^ ((t(0) - (v >> top)) | sign)) < (u ^ ((t(0) - (u >> top)) | sign))
    if dt.kind == "int":
        sign = u.dtype.type(1 << (dt.bits - 1))
        return (v ^ sign) < (u ^ sign)
    return v < u


def _key(dt: DType, v: np.ndarray) -> np.ndarray:
    """FORMAT.md's key of bits ``v``, as uint64 (the reference ``directions`` is checked against)."""
    u = v.astype(np.uint64)
    sign = np.uint64(1 << (dt.bits - 1))
    mask = np.uint64((1 << dt.bits) - 1)
    if dt.kind == "float":
        return np.where(u & sign, u ^ mask, u ^ sign)
    if dt.kind == "int":
        return u ^ sign
    return u


def moves_of_changes(dt: DType, n: int, pos: np.ndarray, bvals: np.ndarray, tvals: np.ndarray) -> Moves:
    """A version's moves in a chunk of ``n`` elements: its changed positions (ascending) and their base
    and target bits."""
    return Moves(n, np.array(pos, np.int64), directions(dt, bvals, tvals))  # a copy: pos may be scratch


def moves_of_images(dt: DType, base: np.ndarray, target: np.ndarray) -> Moves:
    """A version's moves in a chunk from its two images (uint views of one length)."""
    pos = np.flatnonzero(base != target)
    return Moves(base.size, pos, directions(dt, base[pos], target[pos]))
