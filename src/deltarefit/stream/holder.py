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

import os
from typing import Protocol

from ..checkpoint.read import check_not_replaced, open_checkpoint
from ..errors import VerificationError
from ..history_book import HistoryBook
from .records import StreamError, held_state, held_version, identity_unchanged, record_version

# The way out of a checkpoint that no longer holds its recorded version, named in the refusals.
REPAIR_FIX = "; 'deltarefit sync --repair' (same arguments) restores the checkpoint from the stream"


def state_path(checkpoint: str) -> str:
    p = os.path.abspath(checkpoint)
    return os.path.join(p, ".deltarefit-version.json") if os.path.isdir(p) else p + ".deltarefit-version.json"


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


class CheckpointHolder:
    """A checkpoint on disk (a file or a directory of files), its version recorded beside it."""

    adopts = True
    plans = False  # a checkpoint's apply plans as it writes

    def __init__(self, checkpoint: str, *, threads: int | None = None) -> None:
        self.checkpoint = os.path.abspath(checkpoint)
        self.threads = threads

    def held(self) -> tuple[int, str] | None:
        return held_version(state_path(self.checkpoint))

    def held_stream(self, *, repair: bool) -> str | None:
        state = None if repair else held_state(state_path(self.checkpoint))
        return state.get("stream_id") if state else None

    def bind_stream(self, ident: str | None) -> None:
        pass  # recorded with each version

    def record(self, version: int, fp: str, *, url: str, stream_id: str | None, identity: tuple | None) -> None:
        record_version(state_path(self.checkpoint), version, fp, url, stream_id=stream_id, identity=identity)

    def identity(self) -> tuple:
        with open_checkpoint(self.checkpoint) as ck:
            return ck.identity()

    def hash(self) -> tuple[str, tuple]:
        return hash_identity(self.checkpoint, self.threads)

    def check_held(self, version: int, fp: str, *, verify: bool) -> tuple[bool, tuple | None]:
        """Unhashed where its files' identity is unchanged since they were verified (and not ``verify``),
        else hashed, and recorded again with the identity taken by that hash."""
        ident = self.identity()
        if not verify and identity_unchanged(held_state(state_path(self.checkpoint)) or {}, ident):
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
