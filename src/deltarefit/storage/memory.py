"""An in-memory store for fast unit tests (same contract as the others, one process only)."""

from __future__ import annotations

import threading

from .base import check_key

_NAMED: dict[str, MemoryStore] = {}


class MemoryStore:
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
        with open(path, "rb") as f:
            self.put(key, f.read())

    def create(self, key: str, data: bytes) -> bool:
        with self._lock:
            if check_key(key) in self._d:
                return False
            self._d[key] = bytes(data)
            return True

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._d[key]

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self.get(key)[start:start + length]

    def get_to(self, key: str, path: str) -> None:
        data = self.get(key)
        with open(path, "wb") as f:
            f.write(data)

    def exists(self, key: str) -> bool:
        return key in self._d

    def size(self, key: str) -> int:
        return len(self.get(key))

    def list(self, prefix: str = "") -> list[str]:
        with self._lock:
            return sorted(k for k in self._d if k.startswith(prefix))

    def delete(self, key: str) -> None:
        with self._lock:
            self._d.pop(key, None)
