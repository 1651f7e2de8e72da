"""Parts planned while they download: ranged reads into a staging file, in an order that lets the
applier begin before the last byte has arrived.

A delta's header (96 bytes at offset 0) says where its manifest and chunk table lie: at the end of
the file (FORMAT.md). ``ArrivingPart`` reads the header, then that tail, then the payload section in
order (a few ranged reads in flight), writing each range at its offset into a staging file pre-sized
to the part's size; it hashes the bytes in file order as they come (the tail, read back from the
file, last), so the check against the commit record costs no second pass. ``ArrivingReader`` is a
``DeltaReader`` over that file whose ``read_payload`` waits until the chunk's bytes have arrived (a
watermark under a condition variable): ``Applier.plan`` decodes chunks as they come in, since chunks
are planned in table order, which is payload order.

Trust: until the whole part has arrived and its size and BLAKE3 match its commit record, nothing in
it is authenticated, not the header, the manifest or the table. Planning on it is safe because the
plan only reads (its decoders treat payloads as hostile: bounded, never out of bounds), and the
caller passes ``PartDownloads.wait_all`` (every part whole and matching its record) before the
applier's first write (``apply(before_write=)``). A part that fails the check is removed; one that
passes is renamed to its staged name by ``ArrivingPart.verified``, where a rerun finds it again.
``apply_arriving`` applies a route of deltas that way.

Overlap (a subscriber's sync): a route of deltas (no keyframe) from a store with ranged reads (``get_range``), applied by
plain apply (no ``apply_hook``), is not staged whole first. Its parts stream into the staging
directory in route order on a background thread (``stream.arriving``: each part's header, then its
manifest and chunk table from the end of the file, then its payloads in order, hashed as they come),
and the first delta's plan runs on its part as it arrives, each chunk decoded once its bytes are
there; so a single-delta sync takes about max(download, plan) + write instead of download + plan +
write. The guarantees are the staged path's: the first write waits (``apply(before_write=)``) until
every part of the route has arrived whole with the size and BLAKE3 of its record (which is what
authenticates a part's header, manifest and table) and says what its record says, and until the
whole plan passed; a refusal before that point names a part that does not match its record if there
is one, else the plan's reason. Later deltas of a chain are planned once the one before is applied
(they apply to it), on parts already checked. A part that fails its check is removed from staging; a
checked one stays there until the sync ends, for a rerun. Keyframe routes, engine hooks and stores
without ranged reads stage every part whole first (``records.fetch_part``), as does ``prepare``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import blake3

from ..apply.files import ApplyReport
from ..errors import FileSystemError
from ..format import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_MANIFEST_BYTES,
    MAX_RECORDS,
    RECORD_SIZE,
    ChunkRecord,
    DeltaReader,
)
from ..history_book import HistoryBook
from ..storage.base import Store
from .records import Part, StreamError, file_hash

T = TypeVar("T")

# One ranged read covers a sixteenth of the part, within these bounds: small parts still arrive in
# steps the plan can follow, large ones in reads long enough for an object store's latency.
MIN_READ_BYTES = 256 << 10
MAX_READ_BYTES = 8 << 20
READS_IN_FLIGHT = 8  # ranged reads ahead of the one being written (bounded memory: 64 MiB)


def read_bytes(size: int) -> int:
    """The length of one ranged read of a part of ``size`` bytes."""
    return min(MAX_READ_BYTES, max(MIN_READ_BYTES, -(-size // 16)))


def index_offset(head: bytes, size: int) -> int | None:
    """Where the manifest + table tail of a delta of ``size`` bytes begins, from its (unauthenticated)
    header; None when the header does not describe a layout ``DeltaReader`` would accept (the part
    is then read in order, and refused or read once it is whole)."""
    if len(head) < HEADER_SIZE or head[:8] != MAGIC:
        return None
    (_, _, _, hsize, pay_off, pay_len, man_off, man_len, tab_off, tab_len, _, _) = HEADER.unpack(head[:HEADER_SIZE])
    if not (hsize == pay_off == HEADER_SIZE and man_off == pay_off + pay_len and tab_off == man_off + man_len
            and tab_off + tab_len == size and man_len <= MAX_MANIFEST_BYTES and tab_len % RECORD_SIZE == 0
            and tab_len // RECORD_SIZE <= MAX_RECORDS):
        return None
    return man_off


def holds(path: str, part: Part) -> bool:
    """Whether ``path`` already holds ``part`` whole (a staged download of an interrupted run)."""
    return os.path.exists(path) and os.path.getsize(path) == part.bytes and file_hash(path) == part.blake3


class ArrivingPart:
    """One part downloading into ``path`` (``dest`` + ``.arriving``), then, once checked, ``dest``.

    The download runs on the downloader's thread (``download``); readers wait on the watermark
    (``wait_index``, ``wait_bytes``); the sync's thread takes the verdict (``verified``)."""

    def __init__(self, store: Store, part: Part, dest: str) -> None:
        self.store, self.part, self.dest = store, part, dest
        self.path = dest + ".arriving"  # staging only: never the checkpoint
        self.where = f"{store.url}/{part.key}"
        self.fetched = 0
        self.early_reads = 0  # payload reads served before the part had wholly arrived (the overlap)
        self._cv = threading.Condition()
        self._mark = 0  # bytes [0, mark) have arrived (and the tail, once ``_index``)
        self._index = False
        self._done = False
        self._error: BaseException | None = None

    # -- the downloader's side ------------------------------------------------------------------

    def download(self, pool: ThreadPoolExecutor, cancel: threading.Event) -> bool:
        """Fetch and check the part; never raises (the error is kept for the waiters). Returns
        whether it matched its record."""
        error: BaseException | None = None
        try:
            if holds(self.dest, self.part):
                self.path = self.dest
            else:
                self._stream(pool, cancel)
                self.fetched = self.part.bytes
        except BaseException as e:  # kept for the waiters, raised on the sync's thread
            error = e
            if isinstance(e, OSError) and e.filename is None:  # a write into staging: name the file
                error = OSError(e.errno, e.strerror, self.path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        with self._cv:
            self._error, self._done = error, True
            if error is None:
                self._mark, self._index = self.part.bytes, True
            self._cv.notify_all()
        return error is None

    def _stream(self, pool: ThreadPoolExecutor, cancel: threading.Event) -> None:
        size = self.part.bytes
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            raise FileSystemError.of(f"{self.path}: cannot stage the part {self.part.key}", e) from None
        try:
            os.ftruncate(fd, size)
            h = blake3.blake3()
            head = self._fetch(pool, cancel, fd, 0, min(HEADER_SIZE, size), h)
            tail = index_offset(head, size)
            if tail is not None:  # the index first, so the plan can begin; hashed at the end, in file order
                self._fetch(pool, cancel, fd, tail, size, None)
                with self._cv:
                    self._mark, self._index = len(head), True
                    self._cv.notify_all()
            self._fetch(pool, cancel, fd, len(head), size if tail is None else tail, h, advance=True)
            if tail is not None:
                for off in range(tail, size, MAX_READ_BYTES):
                    h.update(os.pread(fd, min(MAX_READ_BYTES, size - off), off))
        finally:
            os.close(fd)
        if h.hexdigest() != self.part.blake3:
            raise StreamError(f"{self.where}: part does not match its commit record")

    def _fetch(self, pool: ThreadPoolExecutor, cancel: threading.Event, fd: int, start: int, end: int,
               h, *, advance: bool = False) -> bytes:
        """Ranged reads of [start, end) written at their offsets, in order; hashed into ``h`` and, with
        ``advance``, moving the watermark. The read ending at the part's end asks for one byte more:
        an object longer than its record is refused too. Returns the bytes of the first read."""
        size = self.part.bytes
        step = read_bytes(size)
        first = b""
        pending: deque = deque()
        nxt = start
        try:
            while nxt < end or pending:
                while len(pending) < READS_IN_FLIGHT and nxt < end:
                    n = min(step, end - nxt)
                    ask = n + 1 if nxt + n == size else n
                    pending.append((nxt, n, pool.submit(self.store.get_range, self.part.key, nxt, ask)))
                    nxt += n
                off, n, fut = pending.popleft()
                if cancel.is_set():
                    raise StreamError(f"{self.where}: download abandoned (the sync that started it gave up)")
                try:
                    data = fut.result()
                except KeyError:
                    raise StreamError(f"{self.where}: part is missing (pruned?)") from None
                if len(data) != n:
                    raise StreamError(f"{self.where}: part does not match its commit record (the object is "
                                      f"{'longer' if len(data) > n else 'shorter'} than its {size} bytes)")
                _pwrite_all(fd, data, off, self.path)
                if h is not None:
                    h.update(data)
                if off == start:
                    first = data
                if advance:
                    with self._cv:
                        self._mark = off + n
                        self._cv.notify_all()
        finally:
            for _, _, fut in pending:
                fut.cancel()
        return first

    # -- the readers' side ----------------------------------------------------------------------

    def wait_index(self) -> None:
        """Until the header and the manifest + table have arrived (or the whole part, when its header
        does not say where they are); raises the download's error if it failed before."""
        with self._cv:
            self._cv.wait_for(lambda: self._index or self._done)
            if not self._index:
                raise self._error

    def wait_bytes(self, end: int) -> None:
        """Until bytes [0, end) have arrived; raises the download's error if it failed before."""
        with self._cv:
            self._cv.wait_for(lambda: self._mark >= end or self._done)
            if self._mark < end:
                raise self._error if self._error is not None else StreamError(f"{self.where}: ended early")
            if not self._done:  # served while the rest of the part is still on its way
                self.early_reads += 1

    def verified(self) -> str:
        """Wait for the download; raise its error, or return the staged path of the checked part."""
        with self._cv:
            self._cv.wait_for(lambda: self._done)
            if self._error is not None:
                raise self._error
        if self.path != self.dest:
            os.replace(self.path, self.dest)
            self.path = self.dest
        return self.dest


class ArrivingReader(DeltaReader):
    """A ``DeltaReader`` of a part as it arrives: opened once its index has arrived, and each payload
    read waits for the chunk's bytes. Everything it returns is unauthenticated until the part's
    ``verified``."""

    def __init__(self, part: ArrivingPart) -> None:
        part.wait_index()
        self._arriving = part
        super().__init__(part.path)
        self.path = part.dest  # what errors name: the staged part

    def read_payload(self, r: ChunkRecord, where: str) -> bytes:
        self._arriving.wait_bytes(self.payload_off + r.payload_offset + r.payload_len)
        return super().read_payload(r, where)


class PartDownloads:
    """Parts downloaded one after another, in order, on one background thread (a few ranged reads in
    flight each). The first failure stops it: later parts are not fetched."""

    def __init__(self, store: Store, parts: list[tuple[Part, str]]) -> None:
        self.parts = [ArrivingPart(store, p, dest) for p, dest in parts]
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sync-download", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with ThreadPoolExecutor(READS_IN_FLIGHT, thread_name_prefix="sync-read") as pool:
            for i, p in enumerate(self.parts):
                if not p.download(pool, self._cancel):
                    for q in self.parts[i + 1:]:  # never fetched: their waiters get the first failure
                        with q._cv:
                            q._error, q._done = StreamError(f"{q.where}: not fetched"), True
                            q._cv.notify_all()
                    return

    def wait_all(self) -> list[str]:
        """Every part whole and matching its record (their staged paths), or the first failure raised."""
        return [p.verified() for p in self.parts]

    @property
    def fetched(self) -> int:
        return sum(p.fetched for p in self.parts)

    @property
    def early_reads(self) -> int:
        return sum(p.early_reads for p in self.parts)

    def abandon(self) -> None:
        """Stop at the next read (the sync is unwinding) and wait for the thread."""
        self._cancel.set()
        self._thread.join()


def apply_arriving(downloads: PartDownloads, first: str, checkpoint: str, threads: int | None, *,
                   apply: Callable[..., ApplyReport], check_staged: Callable[[], None],
                   apply_steps: Callable[[Callable[[HistoryBook | None], ApplyReport]], T]) -> T:
    """A route of deltas applied with its first delta (staged at ``first``) planned while ``downloads``
    brings the parts (``Subscriber``'s module docstring, "Overlap"): ``apply_steps(first_apply)``
    applies the route, its first step by ``first_apply(history)``, an apply to ``checkpoint`` (by
    ``apply``: ``apply.files.apply``, as the caller names it) that plans on the part as it arrives. Before that apply's first write, every part must be whole and
    match its record, and every delta must say what its record says (``check_staged``), as on the
    staged path. Interrupted (not an ``Exception``), the download stops where it is."""
    gate: list[bool] = []  # [True] once passed, [False] once refused

    def authenticated() -> None:
        """The first write waits here, after the whole plan passed: every part of the route whole,
        with its record's size and BLAKE3, and saying what its record says."""
        try:
            downloads.wait_all()
            check_staged()
        except BaseException:
            gate.append(False)
            raise
        gate.append(True)

    def apply_first(history: HistoryBook | None) -> ApplyReport:
        try:
            reader = ArrivingReader(downloads.parts[0])
            try:
                return apply(first, checkpoint, threads=threads, reader=reader, before_write=authenticated,
                             history=history)
            finally:
                reader.close()
        except Exception:
            if not gate:
                # Refused before the gate, on bytes not yet authenticated: a part that does not
                # match its record is the refusal to report (as the staged path reports it);
                # otherwise the parts are what their records say, and the plan's refusal stands.
                try:
                    authenticated()
                except Exception as e:
                    raise e from None
            raise

    try:
        return apply_steps(apply_first)
    except BaseException as e:
        if not isinstance(e, Exception):  # interrupted: stop the download where it is
            downloads.abandon()
        raise


def _pwrite_all(fd: int, data: bytes, off: int, path: str) -> None:
    """All of ``data`` at ``off``: a full disk may take part of a write and report no error (a short
    write), and the bytes not written would read back as zeros."""
    view = memoryview(data)
    try:
        while view:
            n = os.pwrite(fd, view, off)
            if n == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view, off = view[n:], off + n
    except OSError as e:
        raise FileSystemError.of(f"{path}: cannot write the staged part", e) from None
