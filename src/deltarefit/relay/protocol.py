"""Relay wire protocol: an authenticated handshake and MAC'd frames over asyncio streams.

Handshake (both sides know the same shared key, at least 32 bytes)::

    client -> server   MAGIC (8 bytes) | client nonce (32 random bytes)
    server -> client   MAGIC (8 bytes) | server nonce (32 random bytes)

Each direction then has its own session key, ``HMAC-SHA256(shared key, "c2s"|"s2c" | nc | ns)``:
fresh per connection (a frame recorded on one connection never verifies on another) and per direction
(a frame can't be reflected back to its sender).

Frame::

    seq u64 | header_len u32 | payload_len u32 | header (JSON object, UTF-8) | payload | mac (32 bytes)

``mac`` is keyed BLAKE3 (a MAC by design, with the session key as its key) over everything before it.
It is used instead of HMAC-SHA256 for the per-frame MAC because every relay authenticates every byte
twice (receiving and forwarding) and keyed BLAKE3 runs ~7x faster here (6 GB/s against 0.8 GB/s).
``seq`` counts frames per direction from 0; a frame with a bad MAC, an unexpected ``seq``, lengths over
the limits or a header that is not a JSON object raises ``ProtocolError``, and the caller closes the
connection. Headers are JSON, never pickle: nothing a peer sends is executed.

Before authentication (until the first frame from the peer has verified) a connection costs a few
KiB: frames are at most ``PREAUTH_MAX_FRAME`` bytes, the socket is read in small pieces and its buffer
is paused at a few KiB (``PREAUTH_STREAM_LIMIT``); the full limits apply once the MAC checked out.
A server whose first frame from a client fails its MAC answers with one ``AUTH_FAILED`` frame (MAC'd
with its own key: a client with another key fails to verify it, which is the same news) and closes;
the client raises ``AuthError``. A server with too many connections awaiting authentication answers
the handshake with ``BUSY`` (8 bytes, then 32 zero bytes) and closes; the client raises
``ProtocolError`` saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import struct
from typing import Any

import blake3

from ..errors import AuthError, DeltaRefitError, ProtocolError, UsageError
from ..errors import BadPartError as BadPartError  # defined there, re-exported
from ..io.fsutil import read_small, write_new
from ..transport.ratelimit import TokenBucket

MAGIC = b"DRRELAY1"
NONCE_BYTES = 32
MAC_BYTES = 32
MIN_KEY_BYTES = 32
MAX_HEADER = 64 << 10
MAX_PAYLOAD = 17 << 20  # a commit record is at most 4 MiB; data frames are much smaller
_PREFIX = struct.Struct(">QII")
# StreamReader pauses the socket whenever its buffer exceeds twice its limit (64 KiB by default), and
# resumes it for each read: with 1 MiB frames that is a pause and a resume per socket read. Relays use
# a limit of a few frames instead (pass it to ``asyncio.start_server`` too).
STREAM_LIMIT = 4 << 20
# Until the peer's first frame verified: frames of at most 16 KiB (a HELLO with the resume offsets of
# ~200 unfinished parts), a StreamReader that pauses the socket past 8 KiB buffered, reads of 4 KiB.
PREAUTH_MAX_FRAME = 16 << 10
PREAUTH_STREAM_LIMIT = 4 << 10
PREAUTH_READ_BYTES = 4 << 10
BUSY = b"DRRBUSY\x00"  # in place of MAGIC: the server refuses the connection for now


def load_key(path: str) -> bytes:
    """The shared key: the raw bytes of ``path`` (at least 32; ``deltarefit relay keygen`` writes 64 hex
    digits). Every relay of a tree must read the same file contents."""
    key = read_small(path, 1 << 16, what="relay key")  # a regular file of at most 64 KiB: never hung on a FIFO
    if len(key) < MIN_KEY_BYTES:
        raise UsageError(f"{path}: a relay key needs at least {MIN_KEY_BYTES} bytes, this one has {len(key)}")
    return key


def write_key(path: str) -> None:
    """Write a new random key (64 hex digits) to ``path``, readable by its owner only."""
    write_new(path, os.urandom(32).hex().encode())


def _session_keys(key: bytes, nc: bytes, ns: bytes) -> tuple[bytes, bytes]:
    c2s = hmac.new(key, b"c2s" + nc + ns, hashlib.sha256).digest()
    s2c = hmac.new(key, b"s2c" + nc + ns, hashlib.sha256).digest()
    return c2s, s2c


class Channel:
    """One authenticated connection. ``send`` paces its bytes through the connection's own token
    bucket (link emulation) and waits for the socket buffer to drain (backpressure); ``recv`` returns
    ``(header, payload)`` of the next frame once its MAC and sequence number check out."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, send_key: bytes,
                 recv_key: bytes, *, rate: float | None = None, peer: str = "") -> None:
        self.reader, self.writer = reader, writer
        self._send_key, self._recv_key = send_key, recv_key
        self._send_seq = self._recv_seq = 0
        self.bucket = TokenBucket(rate)
        self.peer = peer or _peername(writer)
        self._lock = asyncio.Lock()  # frames from several tasks must not interleave on the socket
        self.authenticated = False  # a frame from the peer has verified: the full limits apply
        _read_bounds(reader, writer, small=True)

    async def send(self, header: dict[str, Any], payload: bytes = b"", *, drain_timeout: float = 60.0) -> None:
        hb = json.dumps(header, separators=(",", ":")).encode()
        if len(hb) > MAX_HEADER or len(payload) > MAX_PAYLOAD:
            raise ProtocolError(f"frame to {self.peer} of {len(hb)}+{len(payload)} bytes, over the size limits "
                                f"({MAX_HEADER}+{MAX_PAYLOAD})")
        async with self._lock:
            if self.writer.is_closing() or self.reader.at_eof():
                raise ConnectionResetError(f"connection to {self.peer} is closed")
            prefix = _PREFIX.pack(self._send_seq, len(hb), len(payload))
            mac = blake3.blake3(prefix, key=self._send_key)
            mac.update(hb)
            mac.update(payload)
            self._send_seq += 1
            await self.bucket.atake(len(prefix) + len(hb) + len(payload) + MAC_BYTES)
            self.writer.writelines((prefix, hb, payload, mac.digest()))
            # A stalled peer must not hold this task (or memory) forever: drop it after a while.
            await asyncio.wait_for(self.writer.drain(), drain_timeout)

    async def recv(self, timeout: float | None = None) -> tuple[dict[str, Any], bytes]:
        return await asyncio.wait_for(self._recv(), timeout)

    async def _recv(self) -> tuple[dict[str, Any], bytes]:
        prefix = await self.reader.readexactly(_PREFIX.size)
        seq, hlen, plen = _PREFIX.unpack(prefix)
        if hlen > MAX_HEADER or plen > MAX_PAYLOAD:
            raise ProtocolError(f"frame from {self.peer} declares {hlen}+{plen} bytes, over the limits")
        if not self.authenticated and hlen + plen > PREAUTH_MAX_FRAME:
            # Nothing is read, let alone buffered, for a peer that has proven nothing yet.
            raise ProtocolError(f"frame from {self.peer} declares {hlen}+{plen} bytes before authenticating, "
                                f"limit {PREAUTH_MAX_FRAME}")
        body = await self.reader.readexactly(hlen + plen + MAC_BYTES)
        hb, payload, mac = body[:hlen], body[hlen:hlen + plen], body[hlen + plen:]
        want = blake3.blake3(prefix, key=self._recv_key)
        want.update(hb)
        want.update(payload)
        # The MAC first: nothing of an unauthenticated frame (not even its seq) is believed.
        if not hmac.compare_digest(want.digest(), mac):
            raise AuthError(f"frame {self._recv_seq} from {self.peer} failed authentication "
                            f"(wrong key or tampered)")
        if seq != self._recv_seq:
            raise ProtocolError(f"frame from {self.peer} has sequence {seq}, expected {self._recv_seq} "
                                f"(replayed, dropped or reordered)")
        self._recv_seq += 1
        if not self.authenticated:
            self.authenticated = True
            _read_bounds(self.reader, self.writer, small=False)
        try:
            header = json.loads(hb.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise ProtocolError(f"frame {seq} from {self.peer}: header is not JSON") from None
        if not isinstance(header, dict) or not isinstance(header.get("t"), str):
            raise ProtocolError(f"frame {seq} from {self.peer}: header is not a message")
        return header, bytes(payload)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(self.writer.wait_closed(), 2.0)


def _read_bounds(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, small: bool) -> None:
    """Bound what the event loop buffers for this connection: small before authentication, the
    relay's stream limit after. Hazard: these are CPython asyncio internals (``StreamReader._limit``,
    the socket transport's ``max_size`` read size), set only where they exist; elsewhere the frame
    limits above still hold, with the stream's own buffering."""
    if hasattr(reader, "_limit"):
        reader._limit = PREAUTH_STREAM_LIMIT if small else STREAM_LIMIT
    transport = writer.transport
    if small and hasattr(transport, "max_size"):
        transport.max_size = PREAUTH_READ_BYTES  # an instance attribute over the class's 256 KiB
    elif not small and "max_size" in getattr(transport, "__dict__", {}):
        del transport.max_size


def _peername(writer: asyncio.StreamWriter) -> str:
    p = writer.get_extra_info("peername")
    return f"{p[0]}:{p[1]}" if isinstance(p, tuple) and len(p) >= 2 else "peer"


async def _read_hello(reader: asyncio.StreamReader, peer: str) -> bytes:
    data = await reader.readexactly(len(MAGIC) + NONCE_BYTES)
    if data[:len(BUSY)] == BUSY:
        raise ProtocolError(f"{peer} is busy: too many connections are waiting to authenticate there; "
                            "try again later")
    if data[:len(MAGIC)] != MAGIC:
        raise ProtocolError(f"{peer} is not a deltarefit relay (bad handshake)")
    return data[len(MAGIC):]


async def connect(host: str, port: int, key: bytes, *, rate: float | None = None,
                  timeout: float = 10.0) -> Channel:
    """Open a connection to a relay and run the client side of the handshake."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=STREAM_LIMIT), timeout)
    try:
        nc = os.urandom(NONCE_BYTES)
        writer.write(MAGIC + nc)
        await writer.drain()
        ns = await asyncio.wait_for(_read_hello(reader, f"{host}:{port}"), timeout)
    except BaseException:
        writer.close()
        raise
    c2s, s2c = _session_keys(key, nc, ns)
    return Channel(reader, writer, c2s, s2c, rate=rate, peer=f"{host}:{port}")


async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes, *,
                 rate: float | None = None, timeout: float = 10.0) -> Channel:
    """Run the server side of the handshake on an accepted connection. The peer has proven nothing
    yet: its first frame's MAC is the proof that it holds the key (``Channel.recv`` keeps the
    pre-authentication limits until then)."""
    peer = _peername(writer)
    _read_bounds(reader, writer, small=True)
    nc = await asyncio.wait_for(_read_hello(reader, peer), timeout)
    ns = os.urandom(NONCE_BYTES)
    writer.write(MAGIC + ns)
    await writer.drain()
    c2s, s2c = _session_keys(key, nc, ns)
    return Channel(reader, writer, s2c, c2s, rate=rate, peer=peer)


async def refuse_busy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer a connection's handshake with ``BUSY`` and close it. The client's hello is read first
    (briefly, at most 64 bytes): closing over unread bytes would reset the connection, and the client
    might lose the answer."""
    _read_bounds(reader, writer, small=True)
    with contextlib.suppress(OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
        writer.write(BUSY + bytes(len(MAGIC) + NONCE_BYTES - len(BUSY)))
        await asyncio.wait_for(writer.drain(), 1.0)
        await asyncio.wait_for(reader.read(64), 1.0)
    writer.close()


async def refuse_auth(ch: Channel) -> None:
    """Tell a peer whose first frame failed its MAC that it did (one frame, MAC'd with our key)."""
    with contextlib.suppress(*NET_ERRORS):
        await ch.send({"t": "AUTH_FAILED", "why": "your frame failed authentication: the relays' keys differ"},
                      drain_timeout=2.0)


# What a broken, closed or misbehaving connection raises (malformed messages included: a missing field,
# a wrong type, a record that does not parse): each ends that connection only.
NET_ERRORS = (DeltaRefitError, ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError, OSError,
              KeyError, TypeError, ValueError, AttributeError)


async def quiet_send(ch: Channel, header: dict) -> None:
    """Send, ignoring a broken connection (its reader notices and reports)."""
    with contextlib.suppress(*NET_ERRORS):
        await ch.send(header)


def describe(e: BaseException) -> str:
    """One line for a connection's end."""
    if isinstance(e, asyncio.IncompleteReadError):
        return "connection closed"
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return str(e) or type(e).__name__


def split_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) to a (host, port) pair."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise UsageError(f"bad address {addr!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)
