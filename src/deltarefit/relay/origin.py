"""The root's upstream: the origin store. Polls the stream's head and fetches each new version's parts
into the mirror (the newest keyframe first, then every version: its delta and, on keyframe versions,
its files too); fetches older versions on demand for a child continuing an older chain."""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque

from ..errors import DeltaRefitError
from ..storage.base import GET_RANGE
from ..stream.chain import newest_keyframe
from ..stream.records import StreamError, commit_key, fetch_part, head, load_commit
from . import plan
from .mirror import VersionState

log = logging.getLogger("deltarefit.relay")

ORIGIN_READ_BYTES = 4 << 20  # one ranged read from the origin
ORIGIN_READS_IN_FLIGHT = 4  # reads ahead of the one being written (bounded memory: 16 MiB)


class OriginMixin:
    """Part of ``Relay`` (``node.py``): the methods a root uses to read the origin store."""

    async def _poll_origin(self) -> None:
        nxt = self.mirror.committed_top() + 1 if self.mirror.versions else None
        while True:
            try:
                nxt = await self._pull(nxt)
            except (DeltaRefitError, OSError) as e:  # the store may come back: keep polling
                log.warning("relay %s: origin %s: %s", self.id, self.origin.url, e)
            await asyncio.sleep(self.poll)

    async def _pull(self, nxt: int | None) -> int | None:
        h = await asyncio.to_thread(head, self.origin)
        if h == 0:
            return nxt
        if nxt is None:  # a new root starts at the newest keyframe
            nxt = await asyncio.to_thread(newest_keyframe, lambda v: load_commit(self.origin, v), h)
        for v in range(nxt, h + 1):
            vs = await self._origin_version(v)
            await self._fetch_parts([vs])
            log.info("relay %s: version %d from the origin (%s)", self.id, v, ",".join(vs.keys))
        return h + 1

    async def _origin_version(self, v: int) -> VersionState:
        """Register version ``v`` of the origin in the mirror (its record; the parts come after)."""
        rec = await asyncio.to_thread(load_commit, self.origin, v)
        raw = await asyncio.to_thread(self.origin.get, commit_key(v))
        keys = plan.root_parts(rec.delta.key if rec.delta else None, [p.key for _, p in rec.keyframe])
        return self.mirror.add_version(v, raw, keys)

    async def _fetch_parts(self, versions: list[VersionState]) -> None:
        """Fetch parts from the origin into the mirror. With ranged reads (``get_range``) a part is
        streamed into the mirror in order, a few reads in flight, so children's feeders forward its
        bytes while the root is still downloading (cut-through from the store on); the mirror checks
        the whole part's BLAKE3 at its end, as for bytes from a parent. Otherwise whole parts are
        fetched (checked by ``fetch_part``). One fetch at a time: two fetches of one part would
        share its temp file."""
        get_range = self.origin.get_range if GET_RANGE in self.origin.capabilities else None
        async with self._fetch_lock:
            for vs in versions:
                for k in vs.keys:
                    ps = self.mirror.parts.get(k)
                    if ps is None or ps.done:
                        continue
                    if get_range is not None:
                        await self._stream_part(k, ps.part.bytes, get_range)
                    else:
                        await asyncio.to_thread(fetch_part, self.origin, ps.part, ps.partial)
                        os.replace(ps.partial, ps.final)
                        ps.have, ps.done = ps.part.bytes, True
                        self.mirror.changed()
                self.mirror.commit_ready()

    async def _stream_part(self, key: str, size: int, get_range) -> None:
        """Ranged reads of ``key`` from what the mirror holds to its end, written in order."""
        ps = self.mirror.parts[key]
        nxt = ps.have
        pending: deque = deque()
        try:
            while not ps.done:
                while len(pending) < ORIGIN_READS_IN_FLIGHT and nxt < size:
                    n = min(ORIGIN_READ_BYTES, size - nxt)
                    pending.append((nxt, n, asyncio.ensure_future(asyncio.to_thread(get_range, key, nxt, n))))
                    nxt += n
                if not pending:
                    raise StreamError(f"{self.origin.url}/{key}: ended at {ps.have} of {size} bytes")
                off, n, fut = pending.popleft()
                try:
                    data = await fut
                except KeyError:
                    raise StreamError(f"{self.origin.url}/{key}: part is missing (pruned?)") from None
                if len(data) != n:
                    raise StreamError(f"{self.origin.url}/{key}: read {len(data)} bytes at {off}, expected {n} "
                                      "(shorter than its commit record)")
                await self.mirror.write(key, off, data)
        finally:
            for _, _, fut in pending:
                fut.cancel()

    async def _backfill(self, lo: int, hi: int) -> None:
        """Root only: a child holding version ``lo - 1`` joined, and the mirror begins at ``hi``: add the
        records of ``lo .. hi-1`` from the origin now, and fetch their parts in the background."""
        try:
            added = [await self._origin_version(v) for v in range(lo, hi)]
        except DeltaRefitError as e:
            log.warning("relay %s: cannot serve versions %d-%d from the origin: %s", self.id, lo, hi - 1, e)
            self.mirror.drop_uncommitted(only=range(lo, hi))
            return

        async def fetch() -> None:
            try:
                await self._fetch_parts(added)
            except (DeltaRefitError, OSError) as e:  # children waiting for these parts are restarted
                log.warning("relay %s: fetching versions %d-%d failed: %s", self.id, lo, hi - 1, e)
                self.mirror.drop_uncommitted(only=range(lo, hi))

        self._spawn(fetch())

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._bg.add(t)  # the loop keeps only weak references to tasks
        t.add_done_callback(self._bg.discard)
