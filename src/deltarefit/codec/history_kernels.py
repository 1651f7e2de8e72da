"""Numba kernel of ``history.History.from_moves``: the states of a chunk's elements from its last
three versions' moves, by one merge of the (sorted) change sets, O(changes).

Imported on first use (``history`` stays free of numba for processes that never build a history).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def merge_states(p0, d0, p1, d1, p2, d2, table, out_pos, out_state):
    """Merge three ascending position arrays (newest first) with their down flags into the positions
    whose state (``table[(s0 + 1) * 9 + (s1 + 1) * 3 + (s2 + 1)] & 127``) is not 0, and their history
    bytes. Returns how many were written."""
    i0 = i1 = i2 = 0
    n0, n1, n2 = p0.size, p1.size, p2.size
    big = np.int64(1) << 62
    k = 0
    while i0 < n0 or i1 < n1 or i2 < n2:
        a = p0[i0] if i0 < n0 else big
        b = p1[i1] if i1 < n1 else big
        c = p2[i2] if i2 < n2 else big
        p = min(a, b, c)
        idx = 13
        if a == p:
            idx += -9 if d0[i0] else 9
            i0 += 1
        if b == p:
            idx += -3 if d1[i1] else 3
            i1 += 1
        if c == p:
            idx += -1 if d2[i2] else 1
            i2 += 1
        s = table[idx]
        if s & 127:
            out_pos[k] = p
            out_state[k] = s
            k += 1
    return k
