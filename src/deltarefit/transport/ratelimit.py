"""Link emulation: a token bucket that paces bytes to a rate, per connection.

A benchmark on loopback emulates a cross-cluster link by giving every connection (a relay socket, an
object-store transfer) its own bucket. ``take`` blocks a thread, ``atake`` suspends a coroutine; both
charge the bytes first and then sleep off any debt, so large writes are paced as a whole and the
long-run rate never exceeds ``rate`` by more than one ``burst``.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

from ..errors import UsageError

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str | float | int | None) -> float | None:
    """Bytes per second from ``"1Gbit"``, ``"125MB"``, ``"10gbps"``, ``"2.5e8"`` (bytes); None or 0: unlimited.

    Units: ``bit``/``bps`` count bits (``1Gbit`` = 125e6 bytes/s); ``B`` or no suffix count bytes.
    """
    if text is None:
        return None
    if isinstance(text, (int, float)):
        return float(text) or None
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(bit|bps|b)?(?:/s)?\s*", text, re.IGNORECASE)
    if not m:
        raise UsageError(f"bad rate {text!r}: expected a number with a unit such as 1Gbit, 125MB or 10gbps")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if (m.group(3) or "").lower() in ("bit", "bps"):
        value /= 8
    return value or None


class TokenBucket:
    """Pace a byte stream to ``rate`` bytes/s with bursts up to ``burst`` bytes (default: 50 ms of rate)."""

    def __init__(self, rate: float | None, burst: float | None = None) -> None:
        self.rate = rate
        self.burst = burst if burst is not None else (max(rate * 0.05, 64 << 10) if rate else 0.0)
        self._tokens = self.burst
        self._t = time.monotonic()
        self._lock = threading.Lock()

    def _charge(self, n: int) -> float:
        """Take ``n`` tokens now (possibly going into debt); return the seconds to wait."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
            self._t = now
            self._tokens -= n
            return -self._tokens / self.rate if self._tokens < 0 else 0.0

    def take(self, n: int) -> None:
        if self.rate and n > 0:
            wait = self._charge(n)
            if wait > 0:
                time.sleep(wait)

    async def atake(self, n: int) -> None:
        if self.rate and n > 0:
            wait = self._charge(n)
            if wait > 0:
                await asyncio.sleep(wait)
