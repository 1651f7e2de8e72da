"""Relay tree: forward a version stream from one store through a tree of authenticated relays.

``protocol`` (handshake, MAC'd frames), ``plan`` (pure placement and start decisions), ``mirror`` (the
local copy of the stream, filled part by part), ``node`` (the asyncio relay). The command line:
``deltarefit relay root|node|keygen``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os

from ..errors import UsageError
from ..storage.base import open_store
from ..transport.ratelimit import parse_rate
from .node import Relay
from .plan import parse_addrs
from .protocol import ProtocolError, load_key

__all__ = ["ProtocolError", "Relay", "run_node", "run_root"]


def _check_id(node_id: str | None) -> None:
    if node_id is not None and not node_id.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise UsageError(f"relay id {node_id!r}: use letters, digits, '-', '_' and '.' only")


def run_root(store: str, *, listen: str, key_file: str, fanout: int = 2, rate: str | None = None,
             mirror: str | None = None, node_id: str | None = None, poll: float = 1.0) -> int:
    """``deltarefit relay root``: serve STORE to the tree until interrupted."""
    _check_id(node_id)
    key = load_key(key_file)
    origin = open_store(store)
    if mirror is None:
        h = hashlib.sha256(os.fsencode(f"{origin.url}|{listen}")).hexdigest()[:12]
        mirror = os.path.join(os.path.expanduser("~"), ".cache", "deltarefit", f"relay-root-{h}")
    relay = Relay(key=key, listen=listen, mirror=mirror, node_id=node_id, fanout=fanout, rate=parse_rate(rate),
                  origin=origin, poll=poll)
    return asyncio.run(relay.run())


def run_node(checkpoint: str, *, join: str, listen: str, key_file: str, fanout: int = 2, rate: str | None = None,
             mirror: str | None = None, node_id: str | None = None, until: int | None = None) -> int:
    """``deltarefit relay node``: keep CHECKPOINT in sync from the tree and serve children."""
    _check_id(node_id)
    key = load_key(key_file)
    addrs = parse_addrs(join)
    if not addrs:
        raise UsageError("--join needs at least one HOST:PORT")
    relay = Relay(key=key, listen=listen, mirror=mirror or os.path.abspath(checkpoint) + ".relay-mirror",
                  node_id=node_id, fanout=fanout, rate=parse_rate(rate), join=addrs, checkpoint=checkpoint,
                  until=until)
    return asyncio.run(relay.run())
