"""An in-memory store for fast unit tests (same contract as the others, one process only).

Optional operations: ``get_range`` only. It has no clock for its objects (no ``mtime``), nothing half
written to sweep (a put is one assignment under the lock), no files and no transfers to report."""

from __future__ import annotations

import threading

from ..io.fsutil import write_atomic
from .base import GET_RANGE, StoreBase, StoreError, check_key, check_range, local_write_error

_NAMED: dict[str, MemoryStore] = {}


class MemoryStore(StoreBase):
    capabilities = frozenset({GET_RANGE})

    def __init__(self, name: str = "") -> None:
        self.url = f"memory://{name}"
        self._d: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @classmethod
    def named(cls, name: str) -> MemoryStore:
        if name not in _NAMED:
            _NAMED[name] = cls(name)
        return _NAMED[name]

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            self._d[check_key(key)] = bytes(data)

    def put_file(self, key: str, path: str) -> None:
        check_key(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise StoreError(f"{self.url}/{key}: put_file: cannot read {path} ({e.strerror})") from None
        self.put(key, data)

    def create(self, key: str, data: bytes) -> bool:
        with self._lock:
            if check_key(key) in self._d:
                return False
            self._d[key] = bytes(data)
            return True

    def get(self, key: str) -> bytes:
        check_key(key)
        with self._lock:
            return self._d[key]

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)
        return self.get(key)[start:start + length]

    def get_to(self, key: str, path: str) -> None:
        data = self.get(key)
        try:  # a rename over the destination, never a truncation of a file a reader may hold
            write_atomic(path, data, durable=False)
        except OSError as e:
            local = local_write_error(e, path)
            if local is not None:
                raise local from None
            raise StoreError(f"{self.url}/{key}: copy to {path} failed ({e.strerror})") from None

    def exists(self, key: str) -> bool:
        return check_key(key) in self._d

    def size(self, key: str) -> int:
        return len(self.get(key))

    def list(self, prefix: str = "") -> list[str]:
        with self._lock:
            return sorted(k for k in self._d if k.startswith(prefix))

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self._d.pop(key, None)
