"""History books in a plain stream: which book each version's delta was coded against, whether a
holder's book is that one, and starting a book over (FORMAT.md, "Encoding 5: ulp_hist" and the commit
record's ``history``; docs/STREAMS.md, "History").

Contract (the *lineage*): the book after version V, the publisher's and every subscriber's, is a
function of the commit records alone:

* empty (started over at V) when V is a keyframe or V's record has no ``history`` flag (a keyframe,
  a catch-up delta and a delta coded without a book carry no history);
* else the book after V-1 advanced by V's moves.

A flagged delta (``history`` true) was coded against the book after its parent; it decodes only
against that book. A publisher flags a delta only when its own book follows the lineage at its
baseline (``follows``), else it publishes the version unflagged (its delta v1-coded) and so starts
every book over there: never a delta coded against a book no subscriber can rebuild.

An absent book is the empty one (it gives no chunk a history), so starting over is removing the
book: ``start_over`` unlinks HEAD first (atomic: the book is empty from that moment), then the rest.
A book that does not follow the lineage makes a flagged delta's ``ulp_hist`` chunks refuse by name
(``DecodeError``, nothing written): a wrong book costs a route, never bytes.

A subscriber's book (``stream.subscriber``): a subscriber keeps a history book beside its checkpoint
(``history_path``), which deltas coded with history (record ``history``) decode against; each such
delta advances it, and a keyframe install, a catch-up step or a version without history starts it
over. The route is chosen among those the book can decode (``route.decodable``):
a book that does not follow the stream's lineage at the held version (deleted, or after a rerun that
found chunks already applied) makes the chain refused and a keyframe route taken, and a catch-up
step is taken only where it leaves a book that can follow. Should a delta still be refused for its
history (``DecodeError``, nothing written), the book is started over and the sync planned again once,
which then takes a keyframe route.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..apply.protocol import ApplyReport
from ..codec.history import DEPTH
from ..errors import DecodeError
from ..history_book import HistoryBook
from ..history_book import planted as book_planted
from ..history_book import start_over as book_start_over
from ..history_book import writable as book_writable
from .records import CommitRecord

log = logging.getLogger(__name__)


def resets(rec: CommitRecord) -> bool:
    """Whether the book after ``rec``'s version is empty (a keyframe, or a version without history)."""
    return bool(rec.keyframe) or not rec.history


def lineage(load: Callable[[int], CommitRecord], version: int) -> tuple[list[str], bool]:
    """The versions (fingerprints, newest first) the book after ``version`` holds by the lineage, and
    whether the oldest of them is a start (an empty moves file, which a book may lack)."""
    out: list[str] = []
    v = version
    while v >= 1 and len(out) < DEPTH:
        rec = load(v)
        out.append(rec.fingerprint)
        if resets(rec):
            return out, True
        v -= 1
    return out, False


def follows(book: HistoryBook, expected: tuple[list[str], bool]) -> bool:
    """Whether ``book`` holds the versions ``lineage`` names (the start's empty file may be missing)."""
    want, started = expected
    got = book.versions()
    return got == want or (started and got == want[:-1])


def open_book(path: str) -> HistoryBook:
    """The book at ``path``; a malformed one is started over (logged), since it is local state that
    the lineage rebuilds, and a wrong book only costs a route."""
    try:
        return HistoryBook(path)
    except (DecodeError, OSError) as e:
        log.warning("%s: history book unreadable (%s); starting it over", path, e)
        if not start_over(path):
            return HistoryBook.empty(path)  # never read again; a commit to it fails, and is caught
        return HistoryBook(path)


def settle(path: str, report: ApplyReport) -> None:
    """After an apply with the book at ``path``: one that found chunks already applied (a rerun) or
    torn lost their moves, and the book it committed names the version with an empty moves file,
    which the lineage check cannot tell from a start; the book is started over instead (so that
    ``follows`` says no, unless the version is a start anyway)."""
    if report.chunks_skipped or report.chunks_recovered:
        start_over(path)


def start_over(path: str) -> bool:
    """Empty the book at ``path`` (``history_book.start_over``: HEAD first, a symlink or other file
    there unlinked, never followed). A book that cannot be emptied (its directory not writable) is
    logged, not raised: it is left as it was, where its tip names an older version, which follows
    no lineage (``follows``) and decodes no chunk of a later delta (refused by its history id).
    Returns whether the book is empty now."""
    try:
        book_start_over(path)
        return True
    except OSError as e:
        log.warning("%s: history book cannot be started over (%s)", path, e.strerror or e)
        return False


def book_writable_at(path: str) -> bool:
    """Whether the history book at ``path`` can be started over and advanced. Whatever else lies at its
    path (a symlink, dangling or planted, a FIFO, a file) is removed first, never followed."""
    if book_planted(path):
        start_over(path)
    return book_writable(path)
