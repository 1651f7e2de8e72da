"""The storage seam: a handful of operations on keys (``/``-separated strings, never ``Path``).

Contract every store keeps:
* ``put`` makes an object visible whole or not at all (never a partial object under its key).
* ``create`` is a conditional create: it writes only if the key does not exist and reports whether it
  did; of two racing creators exactly one wins. Commit records rely on it.
* ``get``/``get_to`` return exactly what was put; missing keys raise ``KeyError``.
* ``list(prefix)`` returns the keys under a prefix, sorted.
* Optional: ``get_range(key, start, length)``, a slice of an object (all three stores have it); the
  relay root streams parts from the origin with it, so its children get bytes while it downloads.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..errors import StoreError as StoreError  # defined there, re-exported
from ..errors import UsageError


@runtime_checkable
class Store(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> None: ...

    def put_file(self, key: str, path: str) -> None: ...

    def create(self, key: str, data: bytes) -> bool: ...

    def get(self, key: str) -> bytes: ...

    def get_to(self, key: str, path: str) -> None: ...

    def exists(self, key: str) -> bool: ...

    def size(self, key: str) -> int: ...

    def list(self, prefix: str = "") -> list[str]: ...

    def delete(self, key: str) -> None: ...


def check_key(key: str) -> str:
    """Keys are relative, ``/``-separated, without empty, ``.`` or ``..`` parts."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise UsageError(f"bad storage key {key!r}")
    return key


def open_store(url: str, *, rate: float | None = None, create: bool = True) -> Store:
    """A store from a URL: a local directory path (or ``file://``), ``memory://name``, or
    ``s3://bucket/prefix`` (endpoint and credentials from the standard AWS environment).

    ``rate`` (bytes/s) emulates a link: transfers of parts in and out of the store are paced to it.
    ``create=False``: a local directory must exist (``StoreError`` otherwise), for commands that only
    read or follow a stream, where a mistyped path must not become a new empty store."""
    if url.startswith("memory://"):
        from .memory import MemoryStore

        if rate:
            raise UsageError("memory:// stores have no link to emulate (rate=)")
        return MemoryStore.named(url[len("memory://"):])
    if url.startswith("s3://"):
        from .s3 import S3Store

        return S3Store(url, rate=rate)
    from .local import LocalStore

    return LocalStore(url[len("file://"):] if url.startswith("file://") else url, rate=rate, create=create)
