"""The delta container's writer: ``DeltaWriter`` streams chunk payloads to a temp file and renames it
into place only when complete. See FORMAT.md.

Crash safety is the writer's role: the file is written as ``PATH.tmp-PID`` and appears under its
name atomically, with fsyncs of the file and its directory (``durable=True``); temp files left by
killed writers are removed when the next writer of the same path starts. The manifest is checked
against the reader's limits (``format.layout``) before anything is renamed into place.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import zstandard

from ..errors import FileSystemError, LimitError
from ..integrity import seg_hash
from ..io.fsutil import fsync_dir
from ..io.jsonlimits import json_shape_problem
from .layout import (
    FLAG_MANIFEST_ZSTD,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MANIFEST_BYTES_PER_CONTAINER,
    MANIFEST_MAX_DEPTH,
    MANIFEST_VALUE_CHARS,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_TEXT,
    RECORD_SIZE,
    ZERO_HASH,
    ManifestBudget,
    _pack_record,
    check_encodings,
    check_version,
    manifest_limit,
)


class DeltaWriter:
    """Writes a delta file: ``add_chunk`` in table order, then ``finish``; the file appears atomically.
    ``durable=False`` skips the fsyncs: for a file that is staged to be copied elsewhere (the copy is
    made durable there) and read back by this process only; the rename stays atomic either way."""

    def __init__(self, path: str, *, durable: bool = True) -> None:
        self.path = path
        self.durable = durable
        self.tmp = f"{path}.tmp-{os.getpid()}"
        _remove_stale_temps(path)
        # Payloads average a few KiB: a 1 MiB buffer makes their writes a few large system calls.
        try:
            self._f = open(self.tmp, "wb", buffering=1 << 20)
            self._f.write(bytes(HEADER_SIZE))
        except OSError as e:
            raise FileSystemError.of(f"{self.tmp}: cannot write the delta", e) from None
        self._off = 0
        # Records go straight into the packed table: the encoder adds one per changed MiB, on the thread
        # that also feeds its workers, so a record costs one struct.pack and no object.
        self._table = bytearray()
        self.n_records = 0
        self._encodings: set[int] = set()  # the encodings used, checked against the format version at ``finish``

    def add_chunk(self, tensor_index: int, chunk_index: int, encoding: int, n_changed: int, payload: bytes,
                  decoded_len: int, pre_hash: bytes, post_hash: bytes) -> None:
        try:
            self._f.write(payload)
        except OSError as e:
            raise FileSystemError.of(f"{self.tmp}: cannot write the delta", e) from None
        self._table += _pack_record(tensor_index, chunk_index, encoding, n_changed, self._off, len(payload),
                                    decoded_len, seg_hash(payload), pre_hash, post_hash)
        self.n_records += 1
        self._off += len(payload)
        self._encodings.add(encoding)

    @property
    def payload_bytes(self) -> int:
        return self._off

    def finish(self, manifest: dict[str, Any]) -> int:
        """Write manifest, table and header, fsync and rename into place. Returns the file size.
        The header's format version is the manifest's ``version`` (1 or 2); a chunk of an encoding that
        version does not have (6 or 7 in version 1) is refused, nothing renamed into place."""
        version = check_version(manifest.get("version"), self.path, "manifest version")
        check_encodings(version, self._encodings, self.path)
        man = json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode("utf-8")
        if len(man) > MAX_MANIFEST_TEXT:
            raise LimitError(f"{self.path}: manifest of {len(man)} bytes exceeds {MAX_MANIFEST_TEXT}")
        problem = json_shape_problem(man, max_depth=MANIFEST_MAX_DEPTH,
                                     bytes_per_container=MANIFEST_BYTES_PER_CONTAINER)
        if problem:  # what readers would refuse is never written
            raise LimitError(f"{self.path}: manifest {problem}")
        raw_len = len(man)
        # Level 1: on real manifests it came out smaller than level 9, and 5x faster.
        man = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(man)
        if raw_len > manifest_limit(len(man)) or len(man) > MAX_MANIFEST_BYTES:
            raise LimitError(f"{self.path}: manifest of {raw_len} bytes compresses to {len(man)}, past the "
                             f"expansion readers accept ({manifest_limit(len(man))} bytes)")
        budget = ManifestBudget(len(man) + len(self._table), len(self._table) // RECORD_SIZE, self.path)
        _charge(manifest, budget)
        self.charged = budget.used  # what a reader of this file charges (``DeltaReader.charged``)
        table = bytes(self._table)
        payload_off = HEADER_SIZE
        man_off = payload_off + self._off
        head = HEADER.pack(MAGIC, version, FLAG_MANIFEST_ZSTD, HEADER_SIZE, payload_off, self._off, man_off, len(man),
                           man_off + len(man), len(table), seg_hash(man + table), ZERO_HASH)
        head = head[:-16] + seg_hash(head[:-16])
        size = man_off + len(man) + len(table)
        try:
            self._f.write(man)
            self._f.write(table)
            self._f.seek(0)
            self._f.write(head)
            self._f.flush()
            if self.durable:
                os.fsync(self._f.fileno())
            self._f.close()
        except OSError as e:
            raise FileSystemError.of(f"{self.tmp}: cannot write the delta", e) from None
        try:
            os.replace(self.tmp, self.path)
        except OSError as e:
            raise FileSystemError.of(f"{self.path}: cannot rename the delta into place from {self.tmp}", e) from None
        if self.durable:
            fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        return size

    def abort(self) -> None:
        # The close flushes bytes that are being thrown away: its failure (the disk that filled up and
        # made the encode abort) must not replace the error that aborted it.
        with contextlib.suppress(OSError):
            self._f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)


def _charge(manifest: dict[str, Any], budget: ManifestBudget) -> None:
    """Charge the manifest's tensor entries to ``budget`` as a reader does (``LimitError`` past it), and
    refuse an entry longer than a reader's window: what readers would refuse is never written."""
    for k, v in manifest.items():
        if k != "tensors" and len(json.dumps(v, separators=(",", ":"))) > MANIFEST_VALUE_CHARS:
            raise LimitError(f"{budget.where}: manifest value {k!r} is longer than {MANIFEST_VALUE_CHARS} characters")
    for t in manifest.get("tensors") or ():
        # An entry's text is at most 6 characters per character of its name (an escape) and 4 KiB besides.
        if (6 * len(t["name"]) + 4096 > MANIFEST_VALUE_CHARS
                and len(json.dumps(t, separators=(",", ":"))) > MANIFEST_VALUE_CHARS):
            raise LimitError(f"{budget.where}: tensor {t['name']!r}: its manifest entry is longer than "
                             f"{MANIFEST_VALUE_CHARS} characters")
        metas = tuple(None if m is None else (m["dtype"], tuple(m["shape"]), m["digest"], m.get("sum"))
                      for m in (t["base"], t["target"]))
        budget.charge(t["name"], metas)


def _remove_stale_temps(path: str) -> None:
    """Remove ``path.tmp-PID`` files left by writers that were killed (their PID no longer runs)."""
    import glob

    for tmp in glob.glob(glob.escape(path) + ".tmp-*"):
        pid = tmp.rsplit("-", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        except PermissionError:
            pass  # another user's live process
