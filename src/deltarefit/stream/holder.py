"""What holds the version a ``Subscriber`` follows: the ``Holder`` seam.

The subscriber reads the stream (records, routes, parts, the history book) and moves a holder along it;
the holder says which version it holds, records a new one once verified, and vouches at the head that it
still holds it. Two holders:

* ``CheckpointHolder`` (the default): a checkpoint on disk. Its version is recorded in a file beside it
  (``state_path``) with the identity of its files when last verified; a checkpoint without a record is
  found in the stream by its fingerprint (``adopts``).
* ``EngineHolder`` (``engines.vllm.holder``): a live engine's weights, in memory. It knows its version
  (a restarted engine holds what it loaded, whatever a file says), has no files to vouch for it, agrees
  with the other workers of its tensor-parallel group, and plans a delta ahead (``plan``) for the
  subscriber's plan-only sync (``Subscriber.plan``).

How a staged delta or keyframe reaches the holder stays the subscriber's: its plain apply to the
checkpoint, or the ``apply_hook`` and ``keyframe_hook`` it is given.
"""

from __future__ import annotations

import contextlib
import os
from typing import Protocol

from ..checkpoint.read import Checkpoint, check_not_replaced, open_checkpoint, sole_weight_file
from ..errors import VerificationError
from ..history_book import HistoryBook
from .records import StreamError, held_state, identity_unchanged, record_version

# The way out of a checkpoint that no longer holds its recorded version, named in the refusals.
REPAIR_FIX = "; 'deltarefit sync --repair' (same arguments) restores the checkpoint from the stream"


RECORD = ".deltarefit-version.json"


def state_path(checkpoint: str) -> str:
    """The checkpoint's version record: one per checkpoint, whichever form names it. Beside a file
    (``F.deltarefit-version.json``); inside a directory (``D/.deltarefit-version.json``), except for a
    directory holding one weight file and no index (``sole_weight_file``), the same checkpoint as that
    file: both forms name the record beside the file."""
    p = os.path.abspath(checkpoint)
    if not os.path.isdir(p):
        return p + RECORD
    one = sole_weight_file(p)
    return one + RECORD if one is not None else os.path.join(p, RECORD)


def other_state_paths(checkpoint: str) -> list[str]:
    """Records of the same checkpoint at another place than ``state_path``: the record inside a directory
    that holds one weight file, written there by a sync that named the directory before the two forms
    shared one record. ``CheckpointHolder`` reads them, keeps the one that verifies, and removes them."""
    p = os.path.abspath(checkpoint)
    d = p if os.path.isdir(p) else os.path.dirname(p)
    one = sole_weight_file(d)
    return [os.path.join(d, RECORD)] if one is not None and (p in (d, one)) else []


def history_path(checkpoint: str) -> str:
    """The checkpoint's history book: a directory beside it (beside, so that a keyframe renamed over a
    directory checkpoint leaves it where it is)."""
    return os.path.abspath(checkpoint) + ".deltarefit-history"


def hash_identity(checkpoint: str, threads: int | None) -> tuple[str, tuple]:
    """The checkpoint's fingerprint and the identity of the files hashed (taken before the hash, from the
    same handles: ``Checkpoint.hash_with_identity``)."""
    with open_checkpoint(checkpoint) as ck:
        fp, _, ident = ck.hash_with_identity(threads=threads)
    return fp, ident


class Holder(Protocol):
    """What holds a subscriber's version. The subscriber calls it under its sync lock, one call at a time."""

    # Whether a holder with no recorded version is found in the stream by its fingerprint (the
    # subscriber hashes the checkpoint's files and looks the fingerprint up). False: ``held()`` always
    # names its version, and the subscriber never adopts one.
    adopts: bool
    # Whether ``plan`` plans anything; else a plan-only sync stages its route and stops there.
    plans: bool

    def held(self) -> tuple[int, str] | None:
        """(version, fingerprint) the holder holds as last verified, or None (a new checkpoint)."""
        ...

    def held_stream(self, *, repair: bool) -> str | None:
        """The identity of the stream the held version is of, as recorded, or None (none recorded, or
        ``repair``: the record is ignored where the holder keeps one)."""
        ...

    def bind_stream(self, ident: str | None) -> None:
        """The identity of the stream this sync follows, once the subscriber settled it: a holder that
        records it only with a version (a checkpoint) ignores it."""
        ...

    def record(self, version: int, fp: str, *, url: str, stream_id: str | None, identity: tuple | None) -> None:
        """The holder now holds ``version`` (fingerprint ``fp``, of the stream ``stream_id`` in ``url``),
        verified; ``identity``: its files' identity, taken after the last write and before (or by) the
        hash that verified ``fp``. Called only after that verification."""
        ...

    def identity(self) -> tuple:
        """The identity of the files that hold the version now (``Checkpoint.identity``); () where no
        file vouches for it (memory)."""
        ...

    def check_held(self, version: int, fp: str, *, verify: bool) -> tuple[bool, tuple | None]:
        """At the head, the store's record of ``version`` naming ``fp``: check that the holder still holds
        it (``verify``: hash it even where nothing says it changed), raising ``VerificationError`` (with
        the way out) where it does not. Returns (whether it was hashed, the identity to record the
        version again with, or None to record nothing)."""
        ...

    def mismatch(self, url: str, version: int, fp: str, recorded: str) -> StreamError:
        """The refusal (returned, the subscriber raises it) for a store whose record of the held
        ``version`` names ``recorded``, not the ``fp`` held."""
        ...

    def agree(self, mine: bool) -> bool:
        """Whether every member of the holder's group answers ``mine``'s question the same way (one
        collective call, at the same point of the same sync on each member); a lone holder: ``mine``.
        Never called by a plan-only sync, which runs beside the holder's serving and makes no group call."""
        ...

    def plan(self, delta_path: str, book: HistoryBook | None) -> None:
        """A plan-only sync's first step, a staged and checked delta (``book``: the history book it
        decodes against, or None): plan it against what the holder holds, writing nothing, and keep the
        plan for the apply of that same delta. Called only where ``plans``."""
        ...


def _of_files(state: dict, file: str) -> bool:
    """Whether a record inside a directory is of its one weight file ``file``: not where its recorded
    identity names other files (the directory held more when it was recorded: another checkpoint)."""
    ident = state.get("identity")
    return not isinstance(ident, list) or all(isinstance(x, list) and x and x[0] == file for x in ident)


class CheckpointHolder:
    """A checkpoint on disk (a file or a directory of files), its version recorded beside it."""

    adopts = True
    plans = False  # a checkpoint's apply plans as it writes

    def __init__(self, checkpoint: str, *, threads: int | None = None) -> None:
        self.checkpoint = os.path.abspath(checkpoint)
        self.threads = threads

    def state(self) -> dict | None:
        """The checkpoint's version record (``state_path``), or None. Where another form of the same
        checkpoint left a record too (``other_state_paths``), the one that verifies is kept at
        ``state_path`` and the others removed: one whose files' identity is unchanged since it was
        recorded, else one whose fingerprint the checkpoint has (hashed); records that agree are one.
        None verifies: ``StreamError`` naming them, nothing written, with the way out (--repair)."""
        canon = state_path(self.checkpoint)
        found = [(p, st) for p in (canon, *other_state_paths(self.checkpoint)) if (st := held_state(p)) is not None
                 and (p == canon or _of_files(st, canon[:-len(RECORD)]))]
        if len(found) <= 1 and (not found or found[0][0] == canon):
            return found[0][1] if found else None
        keep = self._verifying(found)
        if keep is None:
            said = "; ".join(f"{p} says version {st['version']} ({st['fingerprint'][:16]}…)" for p, st in found)
            raise StreamError(f"{self.checkpoint}: two version records of one checkpoint disagree ({said}), and "
                              f"the checkpoint is neither; nothing was written{REPAIR_FIX}")
        path, st = keep
        if path != canon:
            os.replace(path, canon)  # one rename: never a moment without a record
        for p, _ in found:
            if p not in (path, canon):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
        return st

    def _verifying(self, found: list[tuple[str, dict]]) -> tuple[str, dict] | None:
        """Of records of this checkpoint (``state``), the one to keep, or None."""
        if len({(st["version"], st["fingerprint"]) for _, st in found}) == 1:
            return found[0]
        if not os.path.exists(self.checkpoint):
            return None
        ident = self.identity()
        unchanged = [f for f in found if identity_unchanged(f[1], ident)]
        if unchanged:
            return max(unchanged, key=lambda f: f[1]["version"])
        fp, _ = self.hash()
        same = [f for f in found if f[1]["fingerprint"] == fp]
        return max(same, key=lambda f: f[1]["version"]) if same else None

    def held(self) -> tuple[int, str] | None:
        st = self.state()
        return None if st is None else (st["version"], st["fingerprint"])

    def held_stream(self, *, repair: bool) -> str | None:
        state = None if repair else self.state()
        return state.get("stream_id") if state else None

    def bind_stream(self, ident: str | None) -> None:
        pass  # recorded with each version

    def record(self, version: int, fp: str, *, url: str, stream_id: str | None, identity: tuple | None) -> None:
        record_version(state_path(self.checkpoint), version, fp, url, stream_id=stream_id, identity=identity)
        for p in other_state_paths(self.checkpoint):  # one record per checkpoint (``state``)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def identity(self) -> tuple:
        with open_checkpoint(self.checkpoint) as ck:
            return ck.identity()

    def hash(self) -> tuple[str, tuple]:
        return hash_identity(self.checkpoint, self.threads)

    def open_verified(self) -> Checkpoint:
        """The checkpoint opened read-only, refused (``VerificationError``, nothing opened) unless the files
        opened are those its version record says were verified: same paths, devices, inodes, sizes and
        times. Whatever is read through the returned handles is then the verified bytes, whatever is renamed
        over the path meanwhile; a write in place after this is seen by ``still_verified``. What hands a
        synced checkpoint's tensors on reads them so, never by opening the path again after the sync."""
        state = self.state() or {}
        ck = open_checkpoint(self.checkpoint)
        if state.get("identity") != [list(x) for x in ck.identity()]:
            ck.close()
            raise VerificationError(f"{self.checkpoint}: not the files that were verified at version "
                                    f"{state.get('version')} (replaced or written by another process since the "
                                    f"sync); nothing handed over{REPAIR_FIX}")
        return ck

    def check_held(self, version: int, fp: str, *, verify: bool) -> tuple[bool, tuple | None]:
        """Unhashed where its files' identity is unchanged since they were verified (and not ``verify``),
        else hashed, and recorded again with the identity taken by that hash."""
        ident = self.identity()
        if not verify and identity_unchanged(self.state() or {}, ident):
            return False, None
        got, ident = self.hash()
        if got != fp:
            raise VerificationError(f"{self.checkpoint}: fingerprint {got[:16]}… is not version {version}'s "
                                    f"{fp[:16]}… (changed since it was synced){REPAIR_FIX}")
        check_not_replaced(ident, f"verified at version {version}")
        return True, ident

    def mismatch(self, url: str, version: int, fp: str, recorded: str) -> StreamError:
        return StreamError(f"{url}: version {version} is {recorded[:16]}…, but {self.checkpoint} was synced to "
                           f"{fp[:16]}… at that version (store wiped and republished?){REPAIR_FIX}")

    def agree(self, mine: bool) -> bool:
        return mine

    def plan(self, delta_path: str, book: HistoryBook | None) -> None:
        raise NotImplementedError("a checkpoint plans no delta ahead (plans is False)")


def still_verified(ck: Checkpoint, identity: tuple) -> None:
    """Refuse (``VerificationError``) once a file of ``ck`` (opened by ``open_verified``, its identity then
    ``identity``) was written since: what was read from it before this check is what was verified."""
    if ck.identity() != identity:
        raise VerificationError(f"{ck.path}: written by another process while its verified tensors were handed "
                                f"over; what was handed over is not verified{REPAIR_FIX}")
