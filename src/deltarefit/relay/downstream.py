"""A relay's children: placement of a joiner, and one feeder per child streaming the mirror to it.

A feeder reads the mirror's files up to the bytes on disk (``PartState.have``) and sends them at the
child's pace (its socket and token bucket): the disk is the buffer, memory is one frame per child, and
a slow or stalled child holds back only its own feeder (a send stuck for 60 s drops the child)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

from . import plan
from .protocol import (
    NET_ERRORS,
    AuthError,
    Channel,
    ProtocolError,
    accept,
    describe,
    refuse_auth,
    refuse_busy,
)

log = logging.getLogger("deltarefit.relay")

PING_EVERY = 1.0  # a feeder with nothing to send pings, so the child can tell a quiet parent from a dead one
# Connections that have not authenticated yet (handshake and first frame, within AUTH_TIMEOUT): at most
# this many at once, each a few KiB (see protocol); more are answered BUSY and closed at once.
MAX_PENDING = 32
AUTH_TIMEOUT = 10.0
BUSY_LOG_EVERY = 10.0  # seconds between log lines about refused connections (a flood logs little)


@dataclass
class Child:
    id: str
    addr: str
    ch: Channel
    size: int = 1
    settled: bool = False
    hosts_new: bool = True


class DownstreamMixin:
    """Part of ``Relay`` (``node.py``): serving children."""

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._pending >= self.max_pending:
            self._busy_refused += 1
            now = time.monotonic()
            if now - self._busy_logged >= BUSY_LOG_EVERY:
                self._busy_logged = now
                log.warning("relay %s: %d connection(s) refused as busy so far: %d are awaiting "
                            "authentication (limit %d)", self.id, self._busy_refused, self._pending,
                            self.max_pending)
            await refuse_busy(reader, writer)
            return
        ch: Channel | None = None
        child: Child | None = None
        peer = writer.get_extra_info("peername")
        peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"
        try:
            self._pending += 1
            try:
                ch, hdr = await asyncio.wait_for(self._authenticate(reader, writer), AUTH_TIMEOUT)
            finally:
                self._pending -= 1
            if hdr["t"] != "HELLO":
                raise ProtocolError(f"{ch.peer} sent {hdr['t']!r} before HELLO")
            jid, addr, held = str(hdr["id"]), str(hdr["listen"]), int(hdr["held"])
            offsets = {str(k): int(v) for k, v in dict(hdr["offsets"]).items()}
            avoid = {str(a) for a in hdr.get("avoid", [])}
            where = plan.place(jid, self.id, self.path, self._kids(), self.fanout, new=held == 0, avoid=avoid)
            m = self.mirror
            if (self.origin is not None and where.kind == "accept" and held > 0 and m.versions
                    and held + 1 < min(m.versions)):
                await self._backfill(held + 1, min(m.versions))  # the root can serve any chain
            start = plan.start_version(held, m.known())
            if self._exiting or where.kind == "refuse" or start == -2:
                why = "finishing" if self._exiting else where.why or "no keyframe here for a new node"
                await ch.send({"t": "REFUSE", "why": why})
                return
            if where.kind == "redirect":
                await ch.send({"t": "REDIRECT", "to": where.to})
                return
            stale = self.children.pop(jid, None)
            if stale is not None:
                stale.ch.writer.close()
            child = self.children[jid] = Child(jid, addr, ch)
            self._status_changed()
            await ch.send({"t": "WELCOME", "start": start, "path": [*self.path, self.id]})
            log.info("relay %s: child %s (%s) attached, held %d, start %d", self.id, jid, addr, held, start)
            tasks = [asyncio.create_task(self._feed(ch, held, start, offsets)),
                     asyncio.create_task(self._listen(child))]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()
            finally:
                for t in tasks:
                    t.cancel()
        except NET_ERRORS as e:
            if not (child and child.settled):
                log.warning("relay %s: connection %s closed: %s", self.id, peer, describe(e))
        finally:
            if child is not None and self.children.get(child.id) is child:
                del self.children[child.id]
                self._status_changed()
            if ch is not None:
                await ch.close()
            else:
                writer.close()

    async def _authenticate(self, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> tuple[Channel, dict]:
        """The handshake and the peer's first frame (whose MAC proves it holds the key). A peer whose
        frame fails its MAC is told so before the connection closes."""
        ch = await accept(reader, writer, self.key, rate=self.rate)
        try:
            hdr, _ = await ch.recv()
        except AuthError:
            await refuse_auth(ch)
            await ch.close()
            raise
        except BaseException:
            ch.writer.close()  # no await: this may be the timeout's cancellation
            raise
        return ch, hdr

    async def _listen(self, child: Child) -> None:
        while True:
            hdr, _ = await child.ch.recv(self.timeout)
            if hdr["t"] == "STATUS":
                child.size, child.settled = max(1, int(hdr["size"])), bool(hdr["settled"])
                child.hosts_new = bool(hdr.get("hosts_new", True))
                self._status_changed()
            else:
                raise ProtocolError(f"unexpected {hdr['t']!r} from child {child.id}")

    async def _feed(self, ch: Channel, held: int, start: int, offsets: dict[str, int]) -> None:
        """Push every version from ``start`` on: its record, then its parts from the child's offsets,
        each byte once it is on this relay's disk."""
        m = self.mirror
        while start == plan.WAIT:
            if not await m.wait(lambda: plan.start_version(held, m.known()) != plan.WAIT, PING_EVERY):
                await ch.send({"t": "PING"})
            start = plan.start_version(held, m.known())
        if start < 1:
            raise ProtocolError("no keyframe here to start a new node from; the child must join elsewhere")
        v = start
        while True:
            if not await m.wait(lambda v=v: v in m.versions or (m.versions and min(m.versions) > v), PING_EVERY):
                await ch.send({"t": "PING"})
                continue
            if v not in m.versions:
                raise ProtocolError(f"version {v} is no longer held here; the child must join again")
            vs = m.versions[v]
            new_start = v == start and (held == 0 or held + 1 != start)  # the child starts over here
            keys = plan.parts_to_send(vs.keys, vs.rec.delta.key if vs.rec.delta else None,
                                      [p.key for _, p in vs.rec.keyframe], as_keyframe=new_start)
            await ch.send({"t": "RECORD", "v": v, "keys": keys}, vs.raw)
            for k in keys:
                await self._feed_part(ch, k, offsets.get(k, 0))
            v += 1

    async def _feed_part(self, ch: Channel, key: str, off: int) -> None:
        m = self.mirror
        ps = m.parts[key]
        off, epoch, fd = min(max(off, 0), ps.part.bytes), ps.epoch, None
        try:
            while off < ps.part.bytes:
                if not await m.wait(lambda off=off: ps.have > off or ps.epoch != epoch or m.parts.get(key) is not ps,
                                    PING_EVERY):
                    await ch.send({"t": "PING"})
                    continue
                if ps.epoch != epoch or m.parts.get(key) is not ps:
                    raise ProtocolError(f"{key} was discarded upstream; the child must join again")
                if fd is None:  # the open file stays valid across the .partial -> key rename
                    fd = os.open(ps.path(), os.O_RDONLY)
                data = os.pread(fd, min(self.frame, ps.have - off), off)
                await ch.send({"t": "DATA", "k": key, "o": off}, data)
                off += len(data)
        finally:
            if fd is not None:
                os.close(fd)
