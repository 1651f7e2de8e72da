"""Apply a delta to a safetensors checkpoint (a file, or a directory of shards) in place: the checkpoint
target of the one apply protocol (``protocol``), with its lock, journal, and the structural rewrites
(added, removed, re-typed tensors) through a temp file and an atomic rename.

The package ``deltarefit.apply`` exports this target's functions with the protocol's names.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import struct
from collections.abc import Callable, Iterator

import numpy as np

from ..checkpoint.header import TensorSource
from ..checkpoint.read import INDEX_NAME, Checkpoint, check_not_replaced, open_checkpoint
from ..checkpoint.write import write_safetensors
from ..errors import UsageError, VerificationError
from ..format import DeltaReader, TensorEntry, TensorMeta
from ..history_book import HistoryBook, MovesRecorder, advance_or_start_over
from ..integrity import SEGMENT_BYTES, seg_hash
from ..io.fsutil import fs_error
from .host import (  # noqa: F401
    HOST_REGIONS,
    HostRegions,
    _changes,
    _decode,
    _moved,
    _patched_copy,
    _post_image,
    _post_image_hash,
    _where,
)
from .journal import JOURNAL_MAGIC, SLOT_BYTES, Journal, _journal_patch, journal_path  # noqa: F401

# The protocol's names, re-exported for callers that import them from here.
from .protocol import DEFAULT_CACHE_BYTES, Applier, ApplyReport, _ChunkPlan, _TensorPlan, run_apply  # noqa: F401
from .targets import RawSegments, SegmentTarget, TensorTarget, segments_of  # noqa: F401

log = logging.getLogger(__name__)



# ------------------------------------------------------------------------------- safetensors on disk


REPLACED_LIST = ".deltarefit-replaced.json"


def _indexed(ck: Checkpoint) -> str | None:
    """The index file of a Hugging Face directory checkpoint, or None."""
    idx = os.path.join(ck.path, INDEX_NAME)
    return idx if os.path.isdir(ck.path) and os.path.exists(idx) else None


def _check_structural(ck: Checkpoint, todo: list[_TensorPlan]) -> None:
    if len(ck.files()) != 1 and _indexed(ck) is None:
        e = todo[0].entry
        raise UsageError(f"{ck.path}: tensor {e.name!r} is {e.op}d by this delta; adding, removing or re-typing "
                         "tensors needs a single-file checkpoint or a directory with "
                         f"{INDEX_NAME}, and this one has several files and no index")


def _source(name: str, meta: TensorMeta, chunks: Callable[[], object]) -> TensorSource:
    return TensorSource(name, meta.dtype, meta.shape, meta.nbytes, chunks)


def _raw_chunks(raw: np.ndarray) -> Callable[[], Iterator[np.ndarray]]:
    return lambda: (raw[o:o + SEGMENT_BYTES] for o in range(0, raw.size, SEGMENT_BYTES))


def _rewrite_indexed_dir(ck: Checkpoint, delta: DeltaReader, plans: list[_TensorPlan]) -> list[str]:
    """Structural changes in a directory with an index: only the shards they touch are rewritten, under
    new names; then the index is replaced (the commit point: before it the old shards and index are
    intact, after it the new ones are); then the replaced shards are deleted. A kill between the
    commit and the deletes leaves them listed in ``.deltarefit-replaced.json`` for the next run."""
    import json

    from ..io.fsutil import write_atomic

    idx_path = _indexed(ck)
    with open(idx_path) as f:
        index = json.load(f)
    tag = delta.target_fingerprint[:12]
    by_name = {tp.entry.name: tp for tp in plans}
    file_of = {n: os.path.basename(i.file) for n, i in ck.tensors.items()}
    touched = sorted({file_of[n] for n, tp in by_name.items() if tp.state in ("remove", "replace")})
    new_name = {f: f"{f.removesuffix('.safetensors')}.dr-{tag}.safetensors" for f in touched}
    groups: dict[str, list[TensorSource]] = {}
    weight_map: dict[str, str] = {}
    changed: list[str] = []
    for e in delta.tensors:
        tp = by_name[e.name]
        if tp.state in ("add", "remove", "replace"):
            changed.append(e.name)
        if e.target is None:
            continue
        if tp.state == "add":
            dest = f"model-added.dr-{tag}.safetensors"
        else:
            dest = new_name.get(file_of[e.name], file_of[e.name])
        weight_map[e.name] = dest
        if dest == file_of.get(e.name) and tp.state != "replace":
            continue  # untouched shard: stays as it is
        chunks = (lambda e=e: _new_tensor_chunks(delta, e)) if tp.state in ("add", "replace") \
            else _raw_chunks(ck.raw(e.name))
        groups.setdefault(dest, []).append(_source(e.name, e.target, chunks))
    for dest, sources in groups.items():
        old = next((f for f, n in new_name.items() if n == dest), None)
        meta = _metadata_of(os.path.join(ck.path, old)) if old else None
        # A rewritten shard keeps its old file's mode; a new one (added tensors) takes the index's.
        write_safetensors(os.path.join(ck.path, dest), sources, metadata=meta,
                          mode=_mode_of(os.path.join(ck.path, old) if old else idx_path))
    write_atomic(os.path.join(ck.path, REPLACED_LIST), json.dumps(touched).encode())
    write_atomic(idx_path, json.dumps({"metadata": index.get("metadata", {}), "weight_map": weight_map},
                                      indent=2, sort_keys=True).encode(), mode=_mode_of(idx_path))
    remove_replaced_shards(ck.path)
    return changed


def remove_replaced_shards(directory: str) -> None:
    """Delete shards a committed structural rewrite replaced (those its index no longer names)."""
    import json

    listing = os.path.join(directory, REPLACED_LIST)
    if not os.path.exists(listing):
        return
    with open(listing) as f:
        replaced = json.load(f)
    with open(os.path.join(directory, INDEX_NAME)) as f:
        live = set(json.load(f).get("weight_map", {}).values())
    for name in replaced:
        if isinstance(name, str) and name not in live and "/" not in name and name.endswith(".safetensors"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
    os.unlink(listing)


def _rewrite_file(ck: Checkpoint, delta: DeltaReader, plans: list[_TensorPlan]) -> list[str]:
    """Structural changes in a single-file checkpoint: write the target file whole, then rename it in."""
    files = ck.files()
    by_name = {tp.entry.name: tp for tp in plans}
    sources: list[TensorSource] = []
    changed: list[str] = []
    for e in delta.tensors:
        tp = by_name[e.name]
        if e.target is None:
            if tp.state == "remove":
                changed.append(e.name)
            continue
        if tp.state in ("add", "replace"):
            changed.append(e.name)
            sources.append(_source(e.name, e.target, lambda e=e: _new_tensor_chunks(delta, e)))
        else:
            sources.append(_source(e.name, e.target, _raw_chunks(ck.raw(e.name))))
    write_safetensors(files[0], sources, metadata=_metadata_of(files[0]), mode=_mode_of(files[0]))
    return changed


def _mode_of(file: str) -> int:
    """Permission bits a rewritten file keeps (a 0600 checkpoint must not become 0644)."""
    return stat.S_IMODE(os.stat(file).st_mode)


def _new_tensor_chunks(delta: DeltaReader, e: TensorEntry) -> Iterator[bytes]:
    for r in delta.chunks(e):
        patch = _decode(delta, e, r, None)
        data = patch.dense.tobytes()
        if seg_hash(data) != r.post_hash:
            raise VerificationError(f"{_where(e, r)}: decoded bytes miss the post-image hash")
        yield data


def _metadata_of(file: str) -> dict[str, str] | None:
    import json

    with open(file, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
    meta = head.get("__metadata__")
    return meta if isinstance(meta, dict) else None


def checkpoint_lock(checkpoint_path: str) -> contextlib.AbstractContextManager[None]:
    """The exclusive lock of a checkpoint (file or directory) that apply, check and sync hold: a second
    run on it is refused with ``LockedError`` instead of racing the first one's journal and temps."""
    from ..io.locks import checkpoint_lock as lock

    return lock(checkpoint_path)


# Temp files the structural rewrite leaves when killed (write_safetensors / write_atomic naming), and
# those of the state files kept beside or in a checkpoint under its lock (``.deltarefit-version.json``).
_OURS = r"\.deltarefit-[a-z.-]+"
_DIR_TEMPS = (r".+\.safetensors", re.escape(INDEX_NAME), re.escape(REPLACED_LIST), _OURS)


def remove_dead_temps_of(checkpoint_path: str) -> list[str]:
    """Remove temp files a killed apply left in or beside the checkpoint (a shard-sized
    ``NAME.tmp-PID`` of a structural rewrite), those whose writer is dead. Call under its lock."""
    from ..io.locks import remove_dead_temps, remove_dead_temps_beside, temp_pattern

    p = os.path.abspath(checkpoint_path)
    if os.path.isdir(p):
        removed = remove_dead_temps(p, temp_pattern(*_DIR_TEMPS))
    else:
        removed = remove_dead_temps_beside(p, _OURS)
    for r in removed:
        log.info("removed %s, left by a killed run", r)
    return removed


def apply(delta_path: str, checkpoint_path: str, *, threads: int | None = None,
          cache_bytes: int = DEFAULT_CACHE_BYTES, progress: Callable[[int], None] | None = None,
          lock: bool = True, reader: DeltaReader | None = None,
          before_write: Callable[[], None] | None = None, history: HistoryBook | None = None) -> ApplyReport:
    """Apply the delta file to the checkpoint in place; idempotent, crash-safe, verified at the end.
    ``history``: the checkpoint's history book: ``ulp_hist`` chunks decode against it, and once the
    apply is verified and durable it advances to the target (started over where a rerun found chunks
    already applied, whose moves are gone).
    Holds the checkpoint's lock (``checkpoint_lock``) throughout. ``lock=False``: another process holds
    it on this one's behalf (an engine's workers apply while their driver holds it, see
    ``engines.vllm.refit_engine``) and serializes the appliers itself. ``reader``: an open reader of
    ``delta_path`` to apply through (closed at the end), and ``before_write``: as in ``run_apply``."""
    try:
        with checkpoint_lock(checkpoint_path) if lock else contextlib.nullcontext():
            return _apply_locked(delta_path, checkpoint_path, threads=threads, cache_bytes=cache_bytes,
                                 progress=progress, reader=reader, before_write=before_write, history=history)
    except OSError as e:  # a full disk, a read-only or forbidden file: one line, the apply resumable
        raise fs_error(e, checkpoint_path, "apply failed (rerun once fixed: it resumes)") from None


def _apply_locked(delta_path: str, checkpoint_path: str, *, threads: int | None, cache_bytes: int,
                  progress: Callable[[int], None] | None, reader: DeltaReader | None = None,
                  before_write: Callable[[], None] | None = None,
                  history: HistoryBook | None = None) -> ApplyReport:
    if os.path.exists(checkpoint_path):
        remove_dead_temps_of(checkpoint_path)
    if os.path.isdir(checkpoint_path):
        remove_replaced_shards(checkpoint_path)  # finish a structural rewrite killed after its commit
    with reader if reader is not None else DeltaReader(delta_path) as d:
        with open_checkpoint(checkpoint_path, writable=True) as ck:
            journal = Journal(journal_path(checkpoint_path), d.target_fingerprint)
            structural_done: list[str] = []
            ops: dict[str, str] = {}

            def structural(delta: DeltaReader, plans: list[_TensorPlan]) -> list[str]:
                ck.flush()  # in-place patches first become durable, then the files are rewritten
                rewrite = _rewrite_indexed_dir if _indexed(ck) else _rewrite_file
                ops.update((tp.entry.name, tp.state) for tp in plans if tp.state in ("add", "remove", "replace"))
                structural_done.extend(rewrite(ck, delta, plans))
                return structural_done

            opened = ck.identity()  # before the plan reads a byte

            def unchanged_then_write() -> None:
                if before_write is not None:
                    before_write()
                # The plan checked the bytes it read; another process that wrote, truncated or renamed
                # over the files meanwhile (a ``cp`` over it, which no lock stops) leaves other bytes.
                check_not_replaced(opened, f"read to apply {os.path.basename(delta_path)}")
                if ck.identity() != opened:
                    raise VerificationError(f"{checkpoint_path}: modified by another process while the apply read it "
                                            "(size or times changed; nothing written); stop that process and run "
                                            "again")

            written: list[tuple] = []  # the identity right after this apply's last write

            moves = MovesRecorder() if history is not None else None
            rep = run_apply(d, ck, journal=journal, threads=threads, cache_bytes=cache_bytes, progress=progress,
                            structural=structural, structural_check=lambda todo: _check_structural(ck, todo),
                            before_write=unchanged_then_write, history=history, moves=moves,
                            after_write=lambda: written.append(ck.identity()))
            rep.structural_ops = {n: ops[n] for n in rep.structural if n in ops}
            ck.flush()
            # The identity of what was verified: the handles written through, not what the path
            # names after the fact (another process may have renamed a file over it meanwhile).
            ident = None if rep.structural else ck.identity()
            if ident is not None and written and ident != written[0]:
                # Written to after this apply's own last write (a ``cp`` onto the same inode): the
                # bytes verified are no longer the file's. Hazard: a writer during the writes
                # themselves is seen only by each chunk's read-back (timestamps cannot tell whose).
                raise VerificationError(f"{checkpoint_path}: modified by another process after the apply wrote "
                                        "it (size or times changed); nothing recorded, stop that process and "
                                        "run again")
        journal.remove()
        if ident is None:
            # A structural rewrite renamed new files in, which ``ck`` never opened: hash them as they
            # are now, their identity taken before the hash from the handles hashed.
            with open_checkpoint(checkpoint_path) as again:
                got, _, ident = again.hash_with_identity(threads=threads)
            if got != d.target_fingerprint:
                raise VerificationError(f"{checkpoint_path}: fingerprint after the rewrite {got[:16]}… is not the "
                                        f"delta's target {d.target_fingerprint[:16]}… (changed by another process?)")
        check_not_replaced(ident, f"applied and verified {os.path.basename(delta_path)}")
        rep.identity = ident
        if history is not None and moves is not None:
            if moves.incomplete and history.tip == d.target_fingerprint:
                pass  # a rerun after the book's commit: it already holds this version's moves
            else:  # a book that cannot be written does not fail the verified apply: it starts over
                advance_or_start_over(history, d, moves)
    log.info("applied %s to %s: %d chunks (%d skipped, %d recovered), %d tensors added/removed/replaced in %.2f s",
             delta_path, checkpoint_path, rep.chunks_applied, rep.chunks_skipped, rep.chunks_recovered,
             len(rep.structural), rep.seconds)
    return rep


def check(delta_path: str, checkpoint_path: str, *, threads: int | None = None,
          history: HistoryBook | None = None) -> None:
    """Everything apply verifies before writing, and nothing else: raises if the delta would not apply.
    Holds the checkpoint's lock, so it never reads a checkpoint another run is writing. ``history``:
    the checkpoint's history book, which ``ulp_hist`` chunks decode against (it is not advanced)."""
    with checkpoint_lock(checkpoint_path), DeltaReader(delta_path) as d, open_checkpoint(checkpoint_path) as ck:
        Applier(d, ck, journal=None, threads=threads, cache_bytes=0, history=history).plan()

