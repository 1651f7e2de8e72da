"""Where version streams live: a small storage interface and its implementations."""

from .base import Store, StoreError, open_store
from .local import LocalStore
from .memory import MemoryStore

__all__ = ["LocalStore", "MemoryStore", "Store", "StoreError", "open_store"]
