"""The delta container: fixed header, payload, JSON manifest, binary chunk table. See FORMAT.md.

The import path of the container (``from deltarefit.format import DeltaReader, DeltaWriter, ...``);
its parts live in modules by role: ``layout`` (the structs, limits and typed records every part
shares, no I/O), ``manifest`` (the manifest read from untrusted bytes in bounded memory), ``writer`` (``DeltaWriter``: payloads to a temp file, renamed into place only when
complete) and ``reader`` (``DeltaReader``: validates everything it can before returning, checks
payload hashes as chunks are read). Nothing here decodes chunks or touches checkpoints.
"""

from __future__ import annotations

from .layout import (
    FLAG_MANIFEST_ZSTD,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MANIFEST_BYTES_PER_CONTAINER,
    MANIFEST_EXPANSION,
    MANIFEST_FLOOR,
    MANIFEST_MAX_DEPTH,
    MANIFEST_VALUE_CHARS,
    MANIFEST_WINDOW,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_TEXT,
    MAX_NDIM,
    MAX_RECORDS,
    MEMORY_FLOOR,
    MEMORY_PER_INDEX_BYTE,
    OPS,
    RECORD,
    RECORD_SIZE,
    RELEASE,
    SUM_BYTES,
    VERSION,
    VERSION_ENCODINGS,
    VERSIONS,
    ZERO_HASH,
    ChunkRecord,
    ManifestBudget,
    TensorEntry,
    TensorMeta,
    check_version,
    manifest_limit,
    memory_budget,
)

# Private helpers too, for the tests and tools that reach them through this path.
from .layout import _pack_record as _pack_record
from .manifest import _hex as _hex
from .manifest import _meta as _meta
from .manifest import _tensor_entry as _tensor_entry
from .reader import DeltaReader
from .reader import _unpack_record as _unpack_record
from .writer import DeltaWriter
from .writer import _remove_stale_temps as _remove_stale_temps

__all__ = [
    "FLAG_MANIFEST_ZSTD", "HEADER", "HEADER_SIZE", "MAGIC", "MANIFEST_BYTES_PER_CONTAINER", "MANIFEST_EXPANSION",
    "MANIFEST_FLOOR", "MANIFEST_MAX_DEPTH", "MANIFEST_VALUE_CHARS", "MANIFEST_WINDOW", "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_TEXT", "MAX_NDIM", "MAX_RECORDS", "MEMORY_FLOOR", "MEMORY_PER_INDEX_BYTE", "OPS", "RECORD",
    "RECORD_SIZE", "RELEASE", "SUM_BYTES", "VERSION", "VERSIONS",
    "VERSION_ENCODINGS", "ZERO_HASH", "ChunkRecord", "DeltaReader", "DeltaWriter",
    "ManifestBudget", "TensorEntry", "TensorMeta", "check_version", "manifest_limit", "memory_budget",
]
