"""The storage seam: a handful of operations on keys (``/``-separated strings, never ``Path``).

Contract every store keeps (``tests/test_store_contract.py`` runs the same assertions against each):

* Keys are relative, ``/``-separated, without empty, ``.`` or ``..`` parts; any operation given
  another key raises ``UsageError`` before any I/O.
* ``put``/``put_file`` make an object visible whole or not at all: a reader sees the old object or the
  new one, never a partial one, and a failed put (``StoreError``) leaves the old object (or none).
* ``create`` is a conditional create: it writes only if the key does not exist and reports whether it
  did; of two racing creators exactly one wins. Commit records rely on it.
* ``get``/``get_to`` return exactly what was put. ``get_to`` replaces its destination by a rename
  (it never truncates a file a reader may hold); a failed ``get_to`` leaves no file behind.
* A missing key raises ``KeyError`` (from ``get``, ``get_to``, ``size`` and, where the store has them,
  ``get_range`` and ``mtime``); ``exists`` answers False and ``delete`` of a missing key does nothing.
  Every other failure (I/O, permissions, a lost connection) raises ``StoreError`` in one line, but
  for a ``get_to`` whose local destination cannot be written (a full disk, a read-only filesystem,
  its directory missing or not writable: ``local_write_error``), which raises ``FileSystemError``
  naming the destination.
* ``list(prefix)`` returns the keys that start with the string ``prefix``, sorted; unfinished writes
  are never listed.

Optional operations. A store names those it has in ``capabilities`` (a frozenset of the names
below); callers ask ``NAME in store.capabilities`` and never probe for methods. Every store has every
method (subclass :class:`StoreBase`): one it does not declare raises ``StoreError`` saying so.

* ``get_range(key, start, length)`` (:data:`GET_RANGE`): ``length`` bytes of an object from
  ``start``, fewer at its end, ``b""`` at or past its end; a negative ``start`` or ``length`` is a
  ``UsageError``. The relay root and the overlapped sync stream parts with it.
* ``mtime(key)`` (:data:`MTIME`): when the object was last written, in seconds since the epoch (the
  store's clock, a second's resolution or better). Retention ages orphan parts by it; a store without
  it has no age for an object (the stream and sharded retentions each say what they then do).
* ``sweep_temps(older_than, *, prefix="", dry_run=False)`` (:data:`SWEEP_TEMPS`): removes unfinished
  writes (temp files, incomplete multipart uploads) of killed writers older than ``older_than``
  seconds under ``prefix``, and returns their names relative to the store (each starts with the key
  being written); ``dry_run``: returns them and removes nothing.
* ``path_of(key)`` (:data:`PATH_OF`): the local file that holds (or would hold) ``key``, for readers
  on the same host that open it instead of copying it.
* ``set_progress(progress)`` (:data:`SET_PROGRESS`): ``progress(n)`` is called as each ``n`` bytes of
  a ``put_file`` or ``get_to`` move (summing to the object's size); ``None`` stops it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from ..errors import DeltaRefitError, FileSystemError, UsageError
from ..errors import StoreError as StoreError  # defined there, re-exported

GET_RANGE = "get_range"
MTIME = "mtime"
SWEEP_TEMPS = "sweep_temps"
PATH_OF = "path_of"
SET_PROGRESS = "set_progress"
OPTIONAL = frozenset({GET_RANGE, MTIME, SWEEP_TEMPS, PATH_OF, SET_PROGRESS})
"""Every optional operation a store may declare in its ``capabilities``."""


@runtime_checkable
class Store(Protocol):
    url: str
    capabilities: frozenset[str]

    def put(self, key: str, data: bytes) -> None: ...

    def put_file(self, key: str, path: str) -> None: ...

    def create(self, key: str, data: bytes) -> bool: ...

    def get(self, key: str) -> bytes: ...

    def get_to(self, key: str, path: str) -> None: ...

    def exists(self, key: str) -> bool: ...

    def size(self, key: str) -> int: ...

    def list(self, prefix: str = "") -> list[str]: ...

    def delete(self, key: str) -> None: ...

    # Optional: each works only where its name is in ``capabilities`` (StoreError otherwise).

    def get_range(self, key: str, start: int, length: int) -> bytes: ...

    def mtime(self, key: str) -> float: ...

    def sweep_temps(self, older_than: float, *, prefix: str = "", dry_run: bool = False) -> list[str]: ...

    def path_of(self, key: str) -> str: ...

    def set_progress(self, progress: Callable[[int], None] | None) -> None: ...


class StoreBase:
    """What every store inherits: the optional operations, each refusing with ``StoreError`` unless
    the store declares it in ``capabilities`` (and overrides it)."""

    url: str
    capabilities: frozenset[str] = frozenset()

    def _absent(self, name: str) -> StoreError:
        have = ", ".join(sorted(self.capabilities)) or "none"
        return StoreError(f"{self.url}: this store has no {name} (its optional operations: {have})")

    def get_range(self, key: str, start: int, length: int) -> bytes:
        raise self._absent(GET_RANGE)

    def mtime(self, key: str) -> float:
        raise self._absent(MTIME)

    def sweep_temps(self, older_than: float, *, prefix: str = "", dry_run: bool = False) -> list[str]:
        raise self._absent(SWEEP_TEMPS)

    def path_of(self, key: str) -> str:
        raise self._absent(PATH_OF)

    def set_progress(self, progress: Callable[[int], None] | None) -> None:
        raise self._absent(SET_PROGRESS)


def check_key(key: str) -> str:
    """Keys are relative, ``/``-separated, without empty, ``.`` or ``..`` parts."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise UsageError(f"bad storage key {key!r}")
    return key


def check_range(key: str, start: int, length: int) -> None:
    """A ranged read starts at a byte offset ``>= 0`` and asks for ``>= 0`` bytes."""
    if start < 0 or length < 0:
        raise UsageError(f"{key}: bad byte range (start {start}, length {length}): both must be >= 0")


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


# errno values only the writing side of a copy can meet: the local filesystem, never the store
_LOCAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})


def local_write_error(e: BaseException, dest: str) -> FileSystemError | None:
    """A ``get_to`` failure that is its local destination's, not the store's, as the one-line
    ``FileSystemError`` naming ``dest`` (the CLI's exit 12): a full disk, a quota, a read-only
    filesystem, or an error naming only ``dest`` or a temp beside it (its directory missing or not
    writable). None for any other failure (the store's own: ``StoreError``)."""
    if isinstance(e, FileSystemError):
        return e
    if not isinstance(e, OSError) or isinstance(e, DeltaRefitError):
        return None
    names = [os.fsdecode(n) for n in (e.filename, e.filename2) if n is not None]
    if e.errno in _LOCAL_ERRNOS or (names and all(str(n).startswith(dest) for n in names)):
        return FileSystemError.of(f"{dest}: cannot write the download", e)
    return None
