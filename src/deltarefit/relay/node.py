"""A relay: one asyncio process that mirrors the version stream and forwards it down a tree.

* The root's upstream is the origin store (a directory or ``s3://``): it polls the stream's head and
  fetches each new version's parts into its mirror (the newest keyframe first, then the deltas).
* A node's upstream is its parent relay: one authenticated connection receiving records and part bytes,
  written into the node's mirror (``mirror.py``). A node that holds a checkpoint keeps it in sync from
  its mirror with the stream ``Subscriber``, in a worker thread, while it goes on receiving.
* Every child has its own feeder task that reads the mirror's files at the child's pace, from the bytes
  already on disk (cut-through: a chunk goes on as soon as it arrived and its frame's MAC checked out;
  each relay checks every part's BLAKE3 itself before using it). The disk is the buffer: memory is one
  frame per child plus the socket buffer, and a slow child only slows its own feeder.
* Joining: HELLO(id, listen address, version held, bytes held of unfinished parts); the parent accepts
  (capacity left), redirects into its smallest child subtree, or refuses (see ``plan.py``). A node
  whose parent dies (EOF, or no frame for ``timeout`` seconds) joins again from its join list and
  resumes every part at the bytes it holds: nothing is applied twice, nothing is skipped.
* A parent that sends ``BAD_PARTS_LIMIT`` parts whose bytes do not match their records is avoided
  for ``AVOID_SECONDS``: the node joins again elsewhere (its HELLO lists the parents it avoids, and
  relays place it outside those subtrees, over their fan-out if they must). A node whose frames fail
  authentication ``MAX_AUTH_FAILURES`` times in a row (its key is not the tree's) stops with an error.

``Relay`` is split by concern: this module (lifecycle, the parent connection, the local checkpoint),
``origin.py`` (the root's store), ``downstream.py`` (children).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import time

from ..checkpoint.read import carry_non_weights
from ..errors import DeltaRefitError
from ..storage.base import Store
from . import plan
from .downstream import BUSY_LOG_EVERY, MAX_PENDING, Child, DownstreamMixin
from .mirror import Mirror, wait_event
from .origin import OriginMixin
from .protocol import (
    NET_ERRORS,
    PREAUTH_STREAM_LIMIT,
    AuthError,
    BadPartError,
    Channel,
    ProtocolError,
    connect,
    describe,
    quiet_send,
    split_addr,
)

log = logging.getLogger("deltarefit.relay")

STATUS_EVERY = 2.0  # a child reports its subtree this often (and on every change); it is its heartbeat too
BAD_PARTS_LIMIT = 3  # parts from one parent that fail their BLAKE3 before it is avoided
AVOID_SECONDS = 300.0  # how long an avoided parent stays avoided
MAX_AUTH_FAILURES = 3  # joins in a row whose authentication failed before the node gives up


def default_id(listen: str) -> str:
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return f"{host}-{split_addr(listen)[1]}"


class Relay(OriginMixin, DownstreamMixin):
    """One relay of the tree. Give ``origin`` for the root, ``join`` (addresses, root first) for a node;
    ``checkpoint`` to keep a checkpoint in sync; ``until`` to return 0 once the checkpoint is verified at
    that version and every child has finished too (otherwise ``run`` serves until cancelled)."""

    def __init__(self, *, key: bytes, listen: str, mirror: str, node_id: str | None = None, fanout: int = 2,
                 rate: float | None = None, origin: Store | None = None, join: list[str] | None = None,
                 checkpoint: str | None = None, until: int | None = None, poll: float = 1.0,
                 frame: int = 1 << 20, timeout: float = 15.0, max_pending: int = MAX_PENDING) -> None:
        self.key, self.listen, self.fanout, self.rate = key, listen, fanout, rate
        self.id = node_id or ("root" if origin is not None else "")  # default: host-port, once bound
        self.mirror = Mirror(mirror)
        self.origin, self.join = origin, list(join or [])
        self.checkpoint, self.until, self.poll, self.frame, self.timeout = checkpoint, until, poll, frame, timeout
        self.children: dict[str, Child] = {}
        self.path: list[str] = []  # ancestors, root first
        self.synced = 0
        self._sync_event = asyncio.Event()
        self._status_event = asyncio.Event()
        self._done = asyncio.Event()
        self._exiting = False
        self._parent: Channel | None = None
        self._bg: set[asyncio.Task] = set()
        self._fetch_lock = asyncio.Lock()
        self._cleanup_old = ""
        self._fresh = False  # joined holding nothing: it will hold a keyframe version
        self.max_pending = max_pending
        self._pending = 0  # connections accepted that have not authenticated yet
        self._busy_refused, self._busy_logged = 0, -BUSY_LOG_EVERY
        self._auth_failures = 0  # joins in a row whose authentication failed
        self._bad_parts: dict[str, int] = {}  # parent address -> parts from it that failed their BLAKE3
        self._avoid: dict[str, float] = {}  # parent address -> monotonic time until which it is avoided

    # -- lifecycle -------------------------------------------------------------------------------

    async def run(self) -> int:
        host, port = split_addr(self.listen)
        try:
            # Small until a connection authenticates (Channel raises it to STREAM_LIMIT then): bytes
            # that arrive before the handler runs are buffered under this limit too.
            server = await asyncio.start_server(self._on_connect, host, port, limit=PREAUTH_STREAM_LIMIT)
        except OSError as e:
            raise ProtocolError(f"cannot listen on {self.listen}: {e.strerror or e}") from None
        port = server.sockets[0].getsockname()[1]
        self.listen = f"{host}:{port}"
        self.id = self.id or default_id(self.listen)
        print(f"relay {self.id} listening on {self.listen}", flush=True)
        tasks = [asyncio.create_task(self._poll_origin() if self.origin is not None else self._upstream())]
        if self.checkpoint:
            tasks.append(asyncio.create_task(self._local_sync()))
            self._sync_event.set()
        try:
            waiter = asyncio.create_task(self._done.wait())
            done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not waiter:
                    t.result()  # a task that ended by itself failed: raise its error
            if self._parent is not None:  # tell the parent we are finished, so it may finish too
                with contextlib.suppress(*NET_ERRORS):
                    await asyncio.wait_for(self._parent.send(self._status(True)), 2)
            return 0
        finally:
            for t in tasks:
                t.cancel()
            server.close()
            for c in list(self.children.values()):
                await c.ch.close()
            self.mirror.close()

    def _size(self) -> int:
        return plan.subtree_size(self._kids())

    def _kids(self) -> list[plan.Child]:
        return [plan.Child(c.id, c.addr, c.size, c.hosts_new) for c in self.children.values()]

    def _hosts_new(self) -> bool:
        known = self.mirror.known()
        return (any(known.values()) or (not known and self._fresh)
                or any(c.hosts_new for c in self.children.values()))

    def _status(self, settled: bool) -> dict:
        return {"t": "STATUS", "size": self._size(), "settled": settled, "hosts_new": self._hosts_new()}

    def _status_changed(self) -> None:
        self._status_event.set()
        self._check_exit()

    def _check_exit(self) -> None:
        if (self.until is not None and self.synced >= self.until
                and all(c.settled for c in self.children.values())):
            self._exiting = True
            self._done.set()

    # -- upstream: a parent relay (node) ---------------------------------------------------------

    async def _upstream(self) -> None:
        backoff = 0.1
        while True:
            ch = await self._attach()
            if ch is None:
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
                continue
            backoff = 0.1
            self._parent = ch
            sender = asyncio.create_task(self._status_sender(ch))
            try:
                await self._session(ch)
            except BadPartError as e:
                log.warning("relay %s: lost parent %s: %s", self.id, ch.peer, describe(e))
                self._bad_part_from(ch.peer)
            except NET_ERRORS as e:
                log.warning("relay %s: lost parent %s: %s", self.id, ch.peer, describe(e))
            finally:
                self._parent = None
                sender.cancel()
                await ch.close()

    def _bad_part_from(self, parent: str) -> None:
        n = self._bad_parts[parent] = self._bad_parts.get(parent, 0) + 1
        if n >= BAD_PARTS_LIMIT:
            del self._bad_parts[parent]
            self._avoid[parent] = time.monotonic() + AVOID_SECONDS
            log.warning("relay %s: parent %s sent %d parts whose bytes do not match their records; rejoining "
                        "elsewhere, avoiding %s for %.0f s", self.id, parent, n, parent, AVOID_SECONDS)

    def _avoided(self) -> list[str]:
        now = time.monotonic()
        for a in [a for a, until in self._avoid.items() if until <= now]:
            del self._avoid[a]
        return sorted(self._avoid)

    def _held(self) -> int:
        top = self.mirror.committed_top()
        if top or not self.checkpoint:
            return top
        from ..stream.subscriber import Subscriber

        cur = Subscriber(self.mirror.store, self.checkpoint, subscriber_id=self.id).current()
        return cur[0] if cur else 0

    async def _attach(self) -> Channel | None:
        """Join the tree: try each join address, following redirects, skipping avoided parents. The
        channel on WELCOME, or None. Raises ``AuthError`` once authentication failed
        ``MAX_AUTH_FAILURES`` times in a row."""
        avoid = self._avoided()
        for first in self.join:
            addr, hops = first, 0
            while addr and hops < 32 and addr != self.listen:
                if addr in avoid:
                    log.info("relay %s: not joining %s: avoided (it sent bad parts)", self.id, addr)
                    break
                hops += 1
                host, port = split_addr(addr)
                try:
                    ch = await connect(host, port, self.key, rate=self.rate, timeout=5)
                except (TimeoutError, OSError, ProtocolError) as e:
                    log.info("relay %s: cannot join %s (%s)", self.id, addr, describe(e))
                    break
                try:
                    held, offsets = self._held(), self.mirror.offsets()
                    self._fresh = held == 0
                    await ch.send({"t": "HELLO", "id": self.id, "listen": self.listen, "held": held,
                                   "offsets": offsets, "avoid": avoid})
                    hdr, _ = await ch.recv(self.timeout)
                    if hdr["t"] == "AUTH_FAILED":  # our key verified its frame: our frame was tampered with
                        raise AuthError(f"{addr} says our frame failed authentication")
                    self._auth_failures = 0
                    if hdr["t"] == "WELCOME":
                        self._welcome(int(hdr["start"]), [str(p) for p in hdr["path"]])
                        log.info("relay %s: attached to %s, from version %d, holding %d bytes of unfinished "
                                 "parts", self.id, addr, int(hdr["start"]), sum(offsets.values()))
                        return ch
                    if hdr["t"] == "REDIRECT":
                        addr = str(hdr["to"])
                    else:
                        log.warning("relay %s: %s refused: %s", self.id, addr, hdr.get("why", hdr["t"]))
                        addr = ""
                except AuthError:
                    self._auth_failures += 1
                    log.warning("relay %s: joining %s failed: authentication failed, the relays' keys differ "
                                "(or a frame was tampered with); try %d of %d", self.id, addr, self._auth_failures,
                                MAX_AUTH_FAILURES)
                    await ch.close()
                    if self._auth_failures >= MAX_AUTH_FAILURES:
                        raise AuthError(f"relay {self.id}: authentication failed {self._auth_failures} times in "
                                        f"a row (last at {addr}): this relay's key is not the tree's; check "
                                        "--key") from None
                    addr = ""
                    continue
                except NET_ERRORS as e:
                    log.warning("relay %s: joining %s failed: %s", self.id, addr, describe(e))
                    addr = ""
                await ch.close()
        return None

    def _welcome(self, start: int, path: list[str]) -> None:
        self.path = path
        if start > 0 and self.mirror.drop_uncommitted(below=start):
            self._reset_children("the stream restarts at a keyframe")
        for c in list(self.children.values()):
            self._spawn(quiet_send(c.ch, {"t": "PATH", "path": [*self.path, self.id]}))

    def _reset_children(self, why: str) -> None:
        """Children were sent versions this relay no longer holds: make them join again."""
        for c in list(self.children.values()):
            log.warning("relay %s: restarting child %s: %s", self.id, c.id, why)
            c.ch.writer.close()

    async def _session(self, ch: Channel) -> None:
        while True:
            hdr, payload = await ch.recv(self.timeout)
            t = hdr["t"]
            if t == "DATA":
                ps = await self.mirror.write(str(hdr["k"]), int(hdr["o"]), payload)
                if ps.done:
                    self._commit()
            elif t == "RECORD":
                v, keys = int(hdr["v"]), [str(k) for k in hdr["keys"]]
                old = self.mirror.versions.get(v)
                if old is not None and (old.committed or (old.keys == keys and old.raw == payload)):
                    continue
                if old is not None:  # the same version with other parts: start it over
                    self.mirror.drop_uncommitted()
                    self._reset_children(f"version {v} changed its parts")
                self.mirror.add_version(v, payload, keys)
                self._status_event.set()
                self._commit()
            elif t == "PATH":
                self._welcome(0, [str(p) for p in hdr["path"]])
            elif t != "PING":
                raise ProtocolError(f"unexpected {t!r} from parent {ch.peer}")

    def _commit(self) -> None:
        done = self.mirror.commit_ready()
        if done:
            log.info("relay %s: received version %s", self.id, ",".join(map(str, done)))
            self._sync_event.set()

    async def _status_sender(self, ch: Channel) -> None:
        while True:
            self._status_event.clear()
            await quiet_send(ch, self._status(self._exiting))
            await wait_event(self._status_event, STATUS_EVERY)

    # -- the local checkpoint --------------------------------------------------------------------

    async def _local_sync(self) -> None:
        from ..stream.subscriber import Subscriber

        sub = Subscriber(self.mirror.store, self.checkpoint, subscriber_id=self.id)
        while True:
            await self._sync_event.wait()
            self._sync_event.clear()
            cur = await asyncio.to_thread(sub.current)
            top = self.mirror.committed_top()
            if top and (cur is None or cur[0] < top):
                try:
                    rep = await asyncio.to_thread(sub.sync)
                    log.info("relay %s: checkpoint %d -> %d via %s, verified", self.id, rep.from_version,
                             rep.version, rep.route)
                    if self._cleanup_old:  # the copy set aside by _restart_from_keyframe
                        _drop_old_copy(self._cleanup_old, self.checkpoint)
                        self._cleanup_old = ""
                    cur = (rep.version, rep.fingerprint)
                except (DeltaRefitError, OSError) as e:
                    if await asyncio.to_thread(self._restart_from_keyframe, sub, cur):
                        log.warning("relay %s: the chain from version %d is not in the mirror (%s); installing "
                                    "the mirror's keyframe instead", self.id, cur[0] if cur else 0, e)
                    else:
                        log.warning("relay %s: sync of %s failed: %s", self.id, self.checkpoint, e)
                        await asyncio.sleep(1.0)
                    self._sync_event.set()
                    continue
            if cur is not None:
                self.synced = cur[0]
                self._check_exit()

    def _restart_from_keyframe(self, sub, cur: tuple[int, str] | None) -> bool:
        """The parent started this relay at a keyframe past its checkpoint's chain (its old parent, or
        the versions after its version, are gone; or the checkpoint has no version record and is none
        of the mirror's versions), so the mirror can't bring the checkpoint forward.
        Set the checkpoint aside and forget its version: the next sync installs the keyframe. The old
        copy is removed only after that sync. Returns False when this is not the situation."""
        from ..stream.holder import other_state_paths, state_path

        versions, held = self.mirror.versions, cur[0] if cur else 0
        if (cur is None and not os.path.exists(self.checkpoint)) or (cur is not None and held + 1 in versions) \
                or not any(s.committed and s.has_keyframe and v > held for v, s in versions.items()):
            return False
        old = self.checkpoint + ".relay-old"
        records = [state_path(self.checkpoint), *other_state_paths(self.checkpoint)]  # before the rename
        if os.path.exists(self.checkpoint):
            shutil.rmtree(old, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old)
            os.replace(self.checkpoint, old)
        # Hazard: a kill between the rename and this unlink leaves a version record without its
        # checkpoint; the subscriber then refuses to sync, and this function runs again and ends it.
        for p in records:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        self._cleanup_old = old
        return True


def _drop_old_copy(old: str, checkpoint: str) -> None:
    """Remove a checkpoint set aside for a keyframe reinstall. A Hugging Face directory's entries that are
    not weights (config, tokenizer, subdirectories, links) are moved back first, and its mode restored
    (``carry_non_weights``): the keyframe has only the weights."""
    if os.path.isdir(old) and os.path.isdir(checkpoint):
        carry_non_weights(old, checkpoint)
    shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(old)
