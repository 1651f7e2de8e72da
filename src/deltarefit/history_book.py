"""A history book: the last versions' moves of a checkpoint, kept beside it, which encoding 5
(``ulp_hist``) codes against (FORMAT.md, "Encoding 5: ulp_hist").

Contract:

* A book is a directory. Each version it knows has one *moves file*, ``<fingerprint>.moves``: the
  chunks that version changed, each with its moves (``codec.history.Moves``, zstd-compressed), and
  the tensors it reset (added, replaced or removed: older moves do not apply to them). ``HEAD.json``
  names the newest ``DEPTH`` versions, newest first; the first is the book's *tip*, the fingerprint
  of the checkpoint whose history it holds.
* Holding a book costs each version's changes, not the checkpoint: about 3 bytes per change (u32
  positions and a direction bit, zstd; 83 KB for the 26,196 changes of a MiB of the real AdamW
  chain's bf16). Gap-coding the positions would bring that near one byte.
  Advancing it (``commit``) writes one moves file of the new version's changes and rewrites HEAD;
  the oldest moves file goes. Nothing is rewritten per refit in proportion to the model.
* Crash safety: the moves file is written to a temporary name and renamed, then HEAD the same way.
  A process killed at any point leaves the old HEAD (and at worst an orphan moves file, removed by
  the next commit) or the new one, never a mixture.
* Trust: a book is local state, but it is read as untrusted input: a malformed file raises
  ``DecodeError`` naming it. Every moves file ends in the BLAKE3 digest of the bytes before it, and
  HEAD carries the digest of the versions it names; both are checked when the book is opened (a
  stream's ``open_book`` starts a book that fails over, and never codes against it): a bit-rotted
  book is refused whole, not trusted until a chunk's coded history happens to disagree. A wrong book cannot make a decoder accept wrong bytes: every
  ``ulp_hist`` chunk names the id of the history it was coded against, and a decoder whose book
  gives another refuses the chunk before anything is written.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import re
import shutil
import stat
import threading

import blake3
import zstandard

from .codec.history import DEPTH, History, Moves
from .errors import CheckpointError, DecodeError
from .io.fsutil import fsync_dir, open_regular, write_atomic
from .io.jsonlimits import json_shape_problem
from .io.locks import remove_dead_temps, temp_pattern

MAGIC = b"DRMOVES2"  # DRMOVES1 files had no digest: refused, so such a book starts over
DIGEST = 32  # the trailing BLAKE3 digest of a moves file
HEAD = "HEAD.json"
_TEMPS = temp_pattern(r".+\.moves", re.escape(HEAD))  # what write_atomic leaves when killed
MAX_INDEX_BYTES = 64 << 20

log = logging.getLogger(__name__)


def _open_file(path: str) -> int:
    """A book's file, opened to read: a regular file only, never through a symlink, and a FIFO
    planted there cannot hang the open (``open_regular``); anything else is a malformed book."""
    try:
        return open_regular(path, os.O_RDONLY, what="history book file")
    except CheckpointError as e:
        raise DecodeError(str(e)) from None


class MovesRecorder:
    """Collects one version's moves, chunk by chunk, from any thread. Each chunk's record is also
    compressed as it is added, on the thread that decoded or encoded the chunk (zstd releases the
    GIL), so that the book's ``commit`` after the apply or encode only writes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.moves: dict[tuple[str, int], Moves] = {}
        self.blobs: dict[tuple[str, int], bytes] = {}  # the moves file's compressed record of each
        self.resets: set[str] = set()
        # Set where a chunk's moves could not be taken (applied by an earlier, killed run): the
        # version's history is then unknown, and ``HistoryBook.commit`` starts the book over.
        self.incomplete = False

    def add(self, name: str, ci: int, moves: Moves) -> None:
        if moves.pos.size:
            blob = _compress(moves)
            with self._lock:
                self.moves[(name, ci)] = moves
                self.blobs[(name, ci)] = blob

    def reset(self, name: str) -> None:
        """Start ``name``'s history over at this version (added, removed or re-typed)."""
        with self._lock:
            self.resets.add(name)


def _compress(moves: Moves) -> bytes:
    """A chunk's record as a moves file stores it (one compressor per thread)."""
    zc = getattr(_tls, "zc", None)
    if zc is None:
        zc = _tls.zc = zstandard.ZstdCompressor(level=3)
    return zc.compress(moves.to_bytes())


_tls = threading.local()


def _head_digest(fps: list[str]) -> str:
    return blake3.blake3("\n".join(fps).encode()).hexdigest()


class _MovesFile:
    def __init__(self, path: str) -> None:
        self.path = path
        with open(_open_file(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(16)
            if len(head) != 16 or head[:8] != MAGIC or size < 16 + DIGEST:
                raise DecodeError(f"{path}: not a moves file")
            n = int.from_bytes(head[8:], "little")
            if n > MAX_INDEX_BYTES or 16 + n > size - DIGEST:
                raise DecodeError(f"{path}: index of {n} bytes exceeds {min(MAX_INDEX_BYTES, size - DIGEST - 16)}")
            # The whole file against its digest first (streamed), so that no byte of it is trusted
            # before it is known to be the bytes the commit wrote.
            h, left = blake3.blake3(head), size - DIGEST - 16
            f.seek(16)
            while left > 0:
                b = f.read(min(left, 1 << 20))
                if not b:
                    raise DecodeError(f"{path}: truncated")
                h.update(b)
                left -= len(b)
            if f.read(DIGEST) != h.digest():
                raise DecodeError(f"{path}: digest mismatch (the moves file is damaged)")
            f.seek(16)
            raw = f.read(n)
        # Digest or not, whoever can write the book can write any index: its shape is checked before
        # it is built (an entry ``["name",chunk,n,offset,length]`` takes at least 13 bytes of text).
        why = json_shape_problem(raw, max_depth=3, bytes_per_container=12)
        if why is not None:
            raise DecodeError(f"{path}: malformed index ({why})")
        try:
            idx = json.loads(raw)
            self.fingerprint = str(idx["fingerprint"])
            self.resets = {str(x) for x in idx["reset"]}
            self.entries = {(str(name), int(ci)): (int(n_el), int(off), int(ln))
                            for name, ci, n_el, off, ln in idx["entries"]}
        except (ValueError, KeyError, TypeError) as e:
            raise DecodeError(f"{path}: malformed index ({e})") from None
        self.base = 16 + n
        self.size = size - DIGEST  # where the blobs end
        self._map: mmap.mmap | None = None  # opened on first lookup; the file is replaced, never truncated

    def _blob(self, off: int, ln: int) -> bytes:
        if self._map is None:
            with open(_open_file(self.path), "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._map[self.base + off:self.base + off + ln]

    def where(self, name: str, ci: int) -> str:
        return f"{self.path}: entry {name!r} chunk {ci}"

    def record(self, name: str, ci: int, n: int) -> bytes | None:
        """The change set of chunk ``ci`` of ``name`` as stored (``Moves.to_bytes``, not yet checked),
        or None when this version has no move of it."""
        got = self.entries.get((name, ci))
        if got is None:
            return None
        n_el, off, ln = got
        if n_el != n or off < 0 or ln < 0 or self.base + off + ln > self.size:
            raise DecodeError(f"{self.where(name, ci)} does not fit ({n_el} elements, chunk of {n})")
        blob = self._blob(off, ln)
        dctx = getattr(_tls, "dctx", None)
        if dctx is None:  # one per thread (a context per call cost a third of the decompression)
            dctx = _tls.dctx = zstandard.ZstdDecompressor()
        cap = 16 + 5 * n + 8
        try:
            # A frame that declares its content size is decompressed into that many bytes whatever
            # max_output_size says: the declaration is checked first (memory before trust).
            declared = zstandard.frame_content_size(blob)
            if declared > cap:
                raise DecodeError(f"{self.where(name, ci)} declares {declared} bytes, more than its chunk's "
                                  f"moves can take ({cap})")
            return dctx.decompress(blob, max_output_size=cap)
        except zstandard.ZstdError as e:
            raise DecodeError(f"{self.where(name, ci)} does not decompress ({e})") from None

    def moves(self, name: str, ci: int, n: int) -> Moves | None:
        raw = self.record(name, ci, n)
        if raw is None:
            return None
        mv = Moves.from_bytes(raw, self.where(name, ci))
        if mv.n != n:
            raise DecodeError(f"{self.where(name, ci)} is of {mv.n} elements, chunk of {n}")
        return mv


class HistoryBook:
    """The book in directory ``path`` (created on first commit)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._files: list[_MovesFile] = []
        head = os.path.join(self.path, HEAD)
        if planted(self.path):  # by another user, or left by one: never read (or written) through
            raise DecodeError(f"{self.path}: not a directory (a symbolic link, or another file)")
        if os.path.lexists(head):
            try:
                with open(_open_file(head), "rb") as f:
                    d = json.loads(f.read(1 << 16))
                fps = d["versions"]
                if not isinstance(fps, list) or len(fps) > DEPTH or not all(isinstance(x, str) for x in fps):
                    raise ValueError("versions must be a list of at most 3 fingerprints")
                if d.get("blake3") != _head_digest(fps):
                    raise ValueError("digest mismatch")
            except (ValueError, KeyError, TypeError) as e:
                raise DecodeError(f"{head}: malformed ({e})") from None
            for fp in fps:
                mf = _MovesFile(self._moves_path(fp))
                if mf.fingerprint != fp:
                    raise DecodeError(f"{mf.path}: holds the moves of {mf.fingerprint}, HEAD names {fp}")
                self._files.append(mf)

    @classmethod
    def empty(cls, path: str | os.PathLike[str]) -> HistoryBook:
        """The empty book at ``path``, whatever lies there (not read): one that could not be started
        over is used as this, and never decoded against."""
        book = cls.__new__(cls)
        book.path, book._files = os.fspath(path), []
        return book

    def _moves_path(self, fp: str) -> str:
        if not fp or any(c not in "0123456789abcdef" for c in fp):
            raise DecodeError(f"{self.path}: bad fingerprint {fp!r} in the book")
        return os.path.join(self.path, f"{fp}.moves")

    @property
    def tip(self) -> str | None:
        """The fingerprint of the checkpoint whose history this is (None: an empty book)."""
        return self._files[0].fingerprint if self._files else None

    def versions(self) -> list[str]:
        return [f.fingerprint for f in self._files]

    def tip_moves(self) -> MovesRecorder:
        """The moves of the tip version, as recorded (an empty recorder for an empty book): what a
        ``commit`` of that version into another book takes."""
        rec = MovesRecorder()
        if self._files:
            f = self._files[0]
            for (name, ci), (n_el, _, _) in f.entries.items():
                rec.add(name, ci, f.moves(name, ci, n_el))
            for name in f.resets:
                rec.reset(name)
        return rec

    def history(self, name: str, ci: int, n: int) -> History | None:
        """The history of chunk ``ci`` (``n`` elements) of tensor ``name`` at the tip, or None when
        the book has no move of it (the chunk is then coded and decoded without history)."""
        records: list[bytes | None] = []
        for f in self._files:
            records.append(f.record(name, ci, n))
            if name in f.resets:
                break
        if all(r is None for r in records):
            return None
        got = History.from_records(n, records, [f.where(name, ci) for f in self._files[:len(records)]])
        # (checked by from_records: bytes 8..16 of a record are its number of changes)
        return got if any(r is not None and int.from_bytes(r[8:16], "little") for r in records) else None

    def advance(self, delta, rec: MovesRecorder, *, durable: bool = True) -> None:
        """``commit`` after a verified apply of ``delta`` (a ``DeltaReader``) whose decodes ``rec``
        recorded: the tensors it adds, removes or replaces start their history over."""
        for e in delta.tensors:
            if e.op in ("add", "remove", "replace"):
                rec.reset(e.name)
        self.commit(delta.target_fingerprint, rec, parent=delta.base_fingerprint, durable=durable)

    def commit(self, fingerprint: str, rec: MovesRecorder, *, parent: str | None, durable: bool = True) -> None:
        """Advance the book to the version ``fingerprint`` with that version's moves. ``parent``: the
        fingerprint the version was applied to; a book whose tip is another starts over from this
        version (its older moves describe another checkpoint). Raises ``OSError`` where the book
        cannot be written (``advance_or_start_over`` is the caller that must not fail)."""
        if os.path.islink(self.path):  # never written through a link another user may have planted
            raise OSError(errno.ELOOP, "a symbolic link, not a history book's directory", self.path)
        os.makedirs(self.path, exist_ok=True)
        if rec.incomplete:
            rec = MovesRecorder()
            # An empty moves file and no older ones: no chunk has a history at this version, so its
            # next delta's ulp_hist chunks are refused by name and the rollout catches up.
            parent = None
        keep = self._files[: DEPTH - 1] if parent is not None and self.tip == parent else []
        keep = [f for f in keep if f.fingerprint != fingerprint]
        blobs, entries, off = [], [], 0
        for (name, ci), mv in sorted(rec.moves.items(), key=lambda kv: (kv[0][0].encode("utf-8"), kv[0][1])):
            b = rec.blobs.get((name, ci)) or _compress(mv)
            entries.append([name, ci, mv.n, off, len(b)])
            blobs.append(b)
            off += len(b)
        idx = json.dumps({"fingerprint": fingerprint, "reset": sorted(rec.resets), "entries": entries},
                         separators=(",", ":")).encode()
        body = MAGIC + len(idx).to_bytes(8, "little") + idx + b"".join(blobs)
        write_atomic(self._moves_path(fingerprint), body + blake3.blake3(body).digest(), durable=durable)
        fps = [fingerprint] + [f.fingerprint for f in keep]
        write_atomic(os.path.join(self.path, HEAD), json.dumps({"versions": fps, "blake3": _head_digest(fps)}).encode(),
                     durable=durable)
        for fn in os.listdir(self.path):  # older versions' files, and orphans of killed commits
            if fn.endswith(".moves") and fn[:-6] not in fps:
                os.unlink(os.path.join(self.path, fn))
        remove_dead_temps(self.path, _TEMPS)  # the temps of commits killed mid-write
        if durable:
            fsync_dir(self.path)
        self.__init__(self.path)


def start_over(path: str) -> None:
    """Empty the book at ``path``: HEAD goes first (from then on the book is empty), then its files.
    Whatever else lies at ``path`` (a symlink, dangling or not, a FIFO, a file) is unlinked, never
    followed. Raises ``OSError`` where the book cannot be emptied (its directory not writable)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, HEAD))
    shutil.rmtree(path, ignore_errors=True)


def planted(path: str) -> bool:
    """Whether something other than a book's directory lies at ``path``: a symlink (dangling or not),
    a FIFO, a file."""
    return os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path))


def writable(path: str) -> bool:
    """Whether the book at ``path`` can be started over and written: its directory, or the directory
    it goes in when there is none (or where ``start_over`` unlinks what is ``planted`` there), is
    writable by this process (no write is made to find out). A full disk is not seen here; a commit
    that fails on one is ``advance_or_start_over``'s case."""
    where = path if os.path.isdir(path) and not os.path.islink(path) else os.path.dirname(os.path.abspath(path))
    return os.access(where, os.W_OK | os.X_OK)


def advance_or_start_over(book: HistoryBook, delta, rec: MovesRecorder, *, durable: bool = True,
                          tolerate: tuple[type[BaseException], ...] = (OSError,)) -> bool:
    """``book.advance(delta, rec)`` after a verified apply, which a book that cannot be written
    (disk full, read-only, permission denied) must not fail: the book is then started over where it
    can be (a version's history unknown is an empty book, which never lies), and left as it was where
    it cannot (its tip then names an older version, so it follows no lineage and decodes nothing of
    the next delta: the decoder refuses such a chunk by its history id before anything is written).
    ``tolerate``: the failures of the advance taken so (a live engine adds ``DeltaRefitError``).
    Returns whether the book advanced."""
    try:
        book.advance(delta, rec, durable=durable)
        return True
    except tolerate as e:
        log.warning("%s: history book cannot be written (%s); starting it over", book.path,
                    getattr(e, "strerror", None) or e)
    try:
        start_over(book.path)
    except OSError as e:
        log.warning("%s: history book cannot be started over either (%s); it is left behind the checkpoint, "
                    "which the next sync sees", book.path, e.strerror or e)
    return False
