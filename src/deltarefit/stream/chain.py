"""The version chain of a stream, whatever kind of record it holds: the commit keys, the head, loading
a record, the newest keyframe, the link check, and the retention policy. Pure functions over a
``Store``; the record kind plugs in (plain ``records.CommitRecord``, sharded
``shard.records.ShardCommit``).

What the chain needs of a record: ``version``; ``parent`` (the fingerprint of the version it applies
to, None for a start); ``fingerprint``; ``keyframe`` (truthy on a keyframe version: the plain
record's keyframe files, the sharded record's flag). Retention also asks the kind which objects a
record names (``RecordKind.parts``) and which of them are still needed (``RecordKind.needed``).

Keys (every kind)::

    v/000000000042/commit.json     the commit record of version 42: created last, conditionally
    v/000000000042/<attempt>/...   the objects it names, under the attempt that won
    HEAD                           a hint naming the newest version (the commit records are the truth)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import MalformedRecordError, StreamError, UsageError
from ..signing import check_stored_signature
from ..storage.base import GET_RANGE, MTIME, Store

log = logging.getLogger(__name__)

# A commit record (``records.MAX_RECORD_BYTES``). Real ones are far smaller: by the publishers' own
# serialisers, a sharded record of 2048 ranks is 352 KiB (256 ranks, a 1T MoE: 44 KiB) and a keyframe of
# 2000 files 493 KiB. At 4 MiB the densest text the shape bounds admit parses under 2x + 32 MiB.
MAX_RECORD_BYTES = 4 << 20
MAX_HEAD_BYTES = 64  # the HEAD hint: a version number


def get_capped(store: Store, key: str, limit: int) -> bytes | None:
    """Object ``key`` if it holds at most ``limit`` bytes; None if it holds more (never read whole:
    a ranged read of ``limit + 1`` bytes where the store has one, else its size first); ``KeyError``
    if absent. Memory before trust: a store object is bounded before it is read."""
    if GET_RANGE in store.capabilities:
        data = store.get_range(key, 0, limit + 1)
    else:
        if store.size(key) > limit:
            return None
        data = store.get(key)
    return data if len(data) <= limit else None


def get_bounded(store: Store, key: str, limit: int, what: str) -> bytes:
    """Object ``key`` (``get_capped``), refused (``StreamError`` naming it) where it holds more than
    ``limit`` bytes; ``KeyError`` if absent."""
    data = get_capped(store, key, limit)
    if data is None:
        raise StreamError(f"{store.url}/{key}: {what} is larger than {limit} bytes")
    return data


def holds(store: Store, key: str, expected: bytes) -> bool:
    """Whether object ``key`` holds exactly ``expected`` (read no further than one byte past it);
    False where it is absent."""
    try:
        return get_capped(store, key, len(expected)) == expected
    except KeyError:
        return False


def vkey(version: int) -> str:
    return f"v/{version:012d}"


def commit_key(version: int) -> str:
    return f"{vkey(version)}/commit.json"


def version_of(name: str) -> int | None:
    """The version a directory name under ``v/`` stands for: exactly ``vkey``'s 12 ASCII digits; None
    for any other name (``²``, 13 digits, ``-1``: not a version of this stream, whoever wrote it)."""
    return int(name) if len(name) == 12 and name.isascii() and name.isdigit() else None


def list_versions(store: Store) -> list[int]:
    """Committed version numbers, ascending (names under ``v/`` that are no version are skipped,
    logged once per listing)."""
    out, odd = [], set()
    for k in store.list("v/"):
        parts = k.split("/")
        v = version_of(parts[1]) if len(parts) >= 2 else None
        if v is None:
            odd.add(parts[1] if len(parts) >= 2 else k)
        elif len(parts) == 3 and parts[2] == "commit.json":
            out.append(v)
    if odd:
        log.warning("%s: ignoring %d names under v/ that are no version (%s)", store.url, len(odd),
                    ", ".join(repr(x) for x in sorted(odd)[:3]))
    return sorted(out)


def head(store: Store) -> int:
    """The newest committed version (0 for an empty stream): the HEAD hint, probed forward, since a
    publisher killed between its commit and the hint leaves the hint one behind."""
    try:
        raw = get_capped(store, "HEAD", MAX_HEAD_BYTES)
        if raw is None or not raw.strip().isdigit() or not raw.strip().isascii():
            raise ValueError("HEAD is no version number")  # a hint only: the commits are listed instead
        h = int(raw.decode().strip())
    except (KeyError, ValueError):
        vs = list_versions(store)
        return vs[-1] if vs else 0
    if h > 0 and not store.exists(commit_key(h)):
        vs = list_versions(store)  # a hint ahead of the commits (pruned or hand-edited): don't trust it
        return vs[-1] if vs else 0
    while store.exists(commit_key(h + 1)):
        h += 1
    return h


def sync_target(url: str, h: int, to_version: int | None) -> int:
    """The version a sync goes to: ``to_version``, or the head ``h``; refused unless committed."""
    target = h if to_version is None else to_version
    if h == 0:
        raise StreamError(f"{url}: the stream has no versions yet (nothing published, nothing written here); "
                          f"publish one first: deltarefit publish {url} CHECKPOINT")
    if target < 1 or target > h:
        raise StreamError(f"{url}: no committed version {target} (head is {h}); nothing was written. "
                          f"'deltarefit log {url}' lists the versions")
    return target


def load_record(store: Store, version: int, parse: Callable[[bytes, str], Any], verifier: Any = None):
    """The commit record of ``version``, parsed by ``parse(data, where)`` (plain or sharded records),
    refused unless it says it is that version. With ``verifier`` (``signing.Verifier``), its signature
    is checked over the bytes read before anything parses them (``signing.check_stored_signature``;
    ``SignatureError`` naming ``<url> version <v>``): a forged record costs its size, not its parse."""
    try:
        data = get_capped(store, commit_key(version), MAX_RECORD_BYTES)
    except KeyError:
        raise StreamError(f"{store.url}: version {version} is not committed") from None
    if data is None:
        raise MalformedRecordError(f"{store.url}/{commit_key(version)}: commit record exceeds the limit "
                                   f"({MAX_RECORD_BYTES >> 20} MiB)")
    if verifier is not None:
        check_stored_signature(data, verifier, f"{store.url} version {version}")
    rec = parse(data, f"{store.url}/{commit_key(version)}")
    if rec.version != version:
        raise MalformedRecordError(f"{store.url}/{commit_key(version)}: record says version {rec.version}")
    return rec


def newest_keyframe(load: Callable[[int], Any], at: int) -> int:
    """The newest keyframe version at or below ``at`` (where a holder of nothing starts), walking the
    records back with ``load(version)``; version 1 when none after it is one (publishers make a
    stream's first version a keyframe)."""
    v = at
    while v > 1 and not load(v).keyframe:
        v -= 1
    return v


def chain_bytes(load: Callable[[int], Any], version: int) -> int:
    """Delta bytes since the newest keyframe before ``version`` (``load(v)``: the record of version v)."""
    total = 0
    v = version - 1
    while v >= 1:
        rec = load(v)
        if rec.kind == "keyframe":
            break
        total += rec.delta.bytes if rec.delta else 0
        v -= 1
    return total


def check_links(recs: Mapping[int, Any], held: tuple[int, str] | None, url: str, fix: str = "") -> None:
    """Refuse (``StreamError``) a route whose records do not link up: ``recs`` holds consecutive
    versions, each of which must apply to the fingerprint of the one before; the first to ``held``
    (version, fingerprint), or, with ``held`` None, to nothing (it is where a holder of nothing starts:
    a keyframe, or a version adopted). ``fix``: the way out, named when the first link breaks."""
    first = min(recs, default=0)
    for v, rec in sorted(recs.items()):
        if held is None and v == first:
            continue
        parent = recs[v - 1].fingerprint if v - 1 in recs else held[1]
        if rec.parent != parent:
            raise StreamError(f"{url}: version {v} applies to {str(rec.parent)[:16]}…, not to "
                              f"{str(parent)[:16]}… held at version {v - 1}: broken chain"
                              + (fix if v == first else ""))


# ------------------------------------------------------------------------------------- retention


@dataclass(frozen=True)
class RecordKind:
    """A record kind, as retention sees it. ``parts(rec)``: every object the record names.
    ``needed(rec, cut, keyframe)``: those still needed when holders are at ``cut`` or later and late
    joiners start at the newest keyframe ``keyframe`` (both 0 when there is none).
    ``committed_orphans_expire``: an object no record names, under a version that is committed, goes
    at once (no publish can still commit it); otherwise, like orphans of later versions, only once
    older than the grace."""

    parts: Callable[[Any], Iterable[Any]]
    needed: Callable[[Any, int, int], Iterable[Any]]
    committed_orphans_expire: bool = False


@dataclass
class RetentionPlan:
    head: int
    keyframe: int  # the newest keyframe (0: none)
    delete: list[str] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)  # objects kept because a reader needs them


# The shortest ``orphan_grace`` retention takes: an unfinished upload (a temp file, a multipart upload)
# or a joint commit's proposal younger than the grace is kept, and one of a publish still running is
# younger than that publish's longest upload. Ten minutes is a floor, not a fit: a grace must exceed the
# longest part upload and ack wait of the stream's publishes (a keyframe of a large model takes longer).
MIN_ORPHAN_GRACE = 600.0


def check_orphan_grace(orphan_grace: float, unsafe_short_grace: bool = False) -> None:
    """Refuse (``UsageError``) a grace under ``MIN_ORPHAN_GRACE``, or one that is no number of seconds,
    unless ``unsafe_short_grace``: the caller knows that no publish runs on the stream meanwhile (tests,
    a stream whose publisher is stopped)."""
    if not orphan_grace >= 0:  # NaN too
        raise UsageError(f"orphan grace must be a number of seconds, not {orphan_grace!r}")
    if orphan_grace < MIN_ORPHAN_GRACE and not unsafe_short_grace:
        raise UsageError(f"orphan grace {orphan_grace:g} s is under the {MIN_ORPHAN_GRACE:g} s floor: the parts "
                         "and proposals of a publish still uploading would be deleted (use "
                         "--unsafe-short-grace / unsafe_short_grace=True only where no publish runs meanwhile)")


def older_than(store: Store, key: str, seconds: float) -> bool:
    """Whether object ``key`` was written more than ``seconds`` ago. A store that keeps no timestamps
    answers False: an object of unknown age may be an upload in progress, and retention keeps it (the
    one choice that never deletes what a publish or a reader may still need)."""
    if MTIME not in store.capabilities:
        return False
    return time.time() - store.mtime(key) > seconds


def plan_retention(store: Store, h: int, recs: Mapping[int, Any], kind: RecordKind, *, keep_from: int | None,
                   orphan_grace: float, unreadable: Iterable[int] = (), open_versions: Iterable[int] = ()
                   ) -> RetentionPlan:
    """Which objects under ``v/`` go (commit records always stay). ``h``: the head, read before the
    records (so every version up to it is in ``recs`` or ``unreadable``: an object of a later commit is
    never taken for an orphan of a committed version); ``recs``: the readable records by version;
    ``keep_from``: the oldest version a holder still needs to follow from (default the head);
    the cut is the older of it and the newest keyframe, and ``kind.needed`` says what each record keeps.
    Every object of an ``unreadable`` version (its parts cannot be told from orphans) and every orphan
    of an ``open_versions`` one (a proposal still waiting) stays; other orphans go once older than
    ``orphan_grace`` seconds (``older_than``), or at once under a committed version when the kind says
    so. An orphan of a version after ``h`` is never deleted, whatever its age: it may be a part of a
    publish still in progress, which commits it next (a dead publish's go once its version is
    committed by another, or its rerun drops them)."""
    k = max((v for v, r in recs.items() if r.keyframe), default=0)
    cut = min(h if keep_from is None else keep_from, k)
    keep = {p.key for r in recs.values() for p in kind.needed(r, cut, k)}
    referenced = {p.key for r in recs.values() for p in kind.parts(r)}
    unreadable, open_versions = set(unreadable), set(open_versions)
    plan = RetentionPlan(h, k)
    for key in store.list("v/"):
        parts = key.split("/")
        v = version_of(parts[1]) if len(parts) >= 4 else None
        if v is None:
            continue  # commit and prepared records; names that are no version stay (not ours)
        if key in keep or v in unreadable:
            plan.keep.append(key)
        elif key in referenced or (v <= h and v not in open_versions and (
                (kind.committed_orphans_expire and v <= h) or older_than(store, key, orphan_grace))):
            plan.delete.append(key)
    return plan
