"""Numba kernel of ``history.History.from_records``: the states of a chunk's elements from its last
three versions' moves, by one merge of the (sorted) change sets, O(changes).

Imported on first use (``history`` stays free of numba for processes that never build a history).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def _ascending(p, n):
    """Whether the uint32 positions ``p`` ascend strictly below ``n``."""
    prev = np.int64(-1)
    for i in range(p.size):
        x = np.int64(p[i])
        if x <= prev or x >= n:
            return False
        prev = x
    return True


@njit(nogil=True, cache=True)
def merge_records(p0, d0, p1, d1, p2, d2, n, table, out_pos, out_pos32, out_state):
    """Merge three change sets (newest first) into the positions whose state is not 0
    (``table[(s0 + 1) * 9 + (s1 + 1) * 3 + (s2 + 1)] & 127``; ``s`` +1 up, -1 down, 0 no move), with
    their history bytes. Each set as its record holds it: positions as uint32 (``p``, empty for no
    move) and down flags as packed bits, least significant first (``d``, at least one byte); each
    set's positions are checked first. Returns how many positions were written (to ``out_pos`` as
    int64, ``out_pos32`` as uint32, their history bytes to ``out_state``), or ``-(1 + d)`` when set
    ``d``'s positions do not ascend strictly below ``n``.

    One call in place of three ``Moves.from_bytes`` and a merge of their arrays: numpy's steps on
    each change set (conversions, checks, unpacking the bits, sentinels) cost more than the merge.
    Branch-free steps: which sets hold the smallest position is data (the sets interleave at
    random), and as branches that cost about 8 ns per change in mispredictions."""
    if not _ascending(p0, n):
        return -1
    if not _ascending(p1, n):
        return -2
    if not _ascending(p2, n):
        return -3
    m0, m1, m2 = p0.size, p1.size, p2.size
    big = np.int64(n)  # past every position
    i0 = i1 = i2 = 0
    k = 0
    for _ in range(m0 + m1 + m2):
        a = np.int64(p0[i0]) if i0 < m0 else big
        b = np.int64(p1[i1]) if i1 < m1 else big
        c = np.int64(p2[i2]) if i2 < m2 else big
        p = min(a, b, c)
        e0, e1, e2 = np.int64(a == p), np.int64(b == p), np.int64(c == p)
        s0 = 9 - 18 * np.int64((d0[i0 >> 3] >> (i0 & 7)) & 1) if i0 < m0 else 0
        s1 = 3 - 6 * np.int64((d1[i1 >> 3] >> (i1 & 7)) & 1) if i1 < m1 else 0
        s2 = 1 - 2 * np.int64((d2[i2 >> 3] >> (i2 & 7)) & 1) if i2 < m2 else 0
        s = table[13 + e0 * s0 + e1 * s1 + e2 * s2]
        out_pos[k] = p
        out_pos32[k] = p
        out_state[k] = s
        k += np.int64((s & 127) != 0)
        i0 += e0
        i1 += e1
        i2 += e2
        if i0 == m0 and i1 == m1 and i2 == m2:
            break
    return k
