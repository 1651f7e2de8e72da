"""Link emulation: rate parsing, the token bucket, and stores paced to a rate.

Timing checks here are lower bounds only (an emulated link must not be faster than its rate); a slow
machine only makes them pass more easily, so they cannot flake on a loaded CI runner.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from deltarefit.errors import UsageError
from deltarefit.storage.base import open_store
from deltarefit.storage.local import LocalStore
from deltarefit.transport import TokenBucket, parse_rate


@pytest.mark.parametrize(("text", "want"), [
    ("1Gbit", 125e6), ("1gbit/s", 125e6), ("10gbps", 1.25e9), ("125MB", 125e6), ("100M", 100e6),
    ("2.5e8", 2.5e8), ("800kbit", 1e5), ("0", None), (None, None), (5e6, 5e6),
])
def test_parse_rate(text, want):
    assert parse_rate(text) == want


@pytest.mark.parametrize("text", ["fast", "1 Gbit per hour", "-5MB", "1Xbit"])
def test_parse_rate_refuses_nonsense_with_a_usage_error(text):
    with pytest.raises(UsageError, match="bad rate"):
        parse_rate(text)


def test_bucket_paces_threads_and_coroutines_to_the_rate():
    rate = 4e6  # 4 MB/s; burst 200 kB
    b = TokenBucket(rate)
    t = time.monotonic()
    for _ in range(10):
        b.take(100_000)  # 1 MB in all
    assert time.monotonic() - t >= (1e6 - b.burst) / rate * 0.95

    async def go():
        a = TokenBucket(rate)
        t = time.monotonic()
        for _ in range(10):
            await a.atake(100_000)
        return time.monotonic() - t, a.burst

    took, burst = asyncio.run(go())
    assert took >= (1e6 - burst) / rate * 0.95
    unlimited = TokenBucket(None)
    t = time.monotonic()
    unlimited.take(10**12)
    assert time.monotonic() - t < 1.0


def test_local_store_paced_to_its_rate_keeps_bytes_exact(tmp_path):
    data = os.urandom(3 << 20)
    src = tmp_path / "src"
    src.write_bytes(data)
    st = LocalStore(str(tmp_path / "store"), rate=parse_rate("80Mbit"))  # 10 MB/s
    t = time.monotonic()
    st.put_file("v/a", str(src))
    st.get_to("v/a", str(tmp_path / "back"))
    took = time.monotonic() - t
    assert (tmp_path / "back").read_bytes() == data
    assert took >= (2 * len(data) - st._bucket.burst) / 10e6 * 0.95
    assert isinstance(open_store(str(tmp_path / "s2"), rate=1e6), LocalStore)
    with pytest.raises(UsageError, match="memory"):
        open_store("memory://x", rate=1e6)
