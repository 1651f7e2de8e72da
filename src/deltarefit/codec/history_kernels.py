"""Numba kernel of ``history.History.from_moves``: the states of a chunk's elements from its last
three versions' moves, by one merge of the (sorted) change sets, O(changes).

Imported on first use (``history`` stays free of numba for processes that never build a history).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def merge_states(p0, d0, p1, d1, p2, d2, table, out_pos, out_state):
    """Merge three ascending position arrays (newest first), each ending in one sentinel larger than
    every position, with their down flags (``d``: one per position, at least one entry), into the
    positions whose state (``table[(s0 + 1) * 9 + (s1 + 1) * 3 + (s2 + 1)] & 127``) is not 0, and
    their history bytes. Returns how many were written.

    Branch-free steps: which sets hold the smallest position is data (the sets interleave at
    random), and as branches that cost about 8 ns per change in mispredictions."""
    i0 = i1 = i2 = 0
    m0, m1, m2 = p0.size - 1, p1.size - 1, p2.size - 1
    k = 0
    for _ in range(m0 + m1 + m2):
        a, b, c = p0[i0], p1[i1], p2[i2]
        p = min(a, b, c)
        e0, e1, e2 = np.int64(a == p), np.int64(b == p), np.int64(c == p)
        s0 = 9 - 18 * np.int64(d0[min(i0, m0 - 1)]) if m0 else 0
        s1 = 3 - 6 * np.int64(d1[min(i1, m1 - 1)]) if m1 else 0
        s2 = 1 - 2 * np.int64(d2[min(i2, m2 - 1)]) if m2 else 0
        s = table[13 + e0 * s0 + e1 * s1 + e2 * s2]
        out_pos[k] = p
        out_state[k] = s
        k += np.int64((s & 127) != 0)
        i0 += e0
        i1 += e1
        i2 += e2
        if i0 == m0 and i1 == m1 and i2 == m2:
            break
    return k
