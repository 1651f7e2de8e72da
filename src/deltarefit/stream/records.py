"""Commit records and the stream's key layout. Pure functions over a ``Store``.

Layout of a stream in a store (keys)::

    v/000000000042/commit.json            the commit record: created last, conditionally (commit point)
    v/000000000042/prepared.json          joint commit: a version proposed to subscribers
    v/000000000042/<attempt>/delta        the delta from version 41 (absent for the first version)
    v/000000000042/<attempt>/keyframe/... the full checkpoint's files (keyframe versions only)
    acks/000000000042/<subscriber>.json   joint commit: subscribers that verified they can apply it
    subs/<subscriber>.json                subscriber positions, for retention
    HEAD                                  a hint naming the newest version (the commits are the truth)

Parts live under a per-attempt directory so that racing publishers never overwrite each other's
parts; only the winner's commit record points at its parts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import blake3

from ..errors import MalformedRecordError, SignatureError, StoreError, StreamError, StreamIdentityError
from ..io.fsutil import open_regular, read_capped, write_atomic
from ..io.jsonlimits import LOCAL_STATE_MAX_BYTES, brief, json_shape_problem, small_json
from ..signing import SignableRecord, Verifier, check_stored_signature
from ..storage.base import Store

# The chain layer owns the keys, the head and loading a record; re-exported here for their callers.
from .chain import MAX_RECORD_BYTES, commit_key, get_capped, head, list_versions, load_record, vkey  # noqa: F401
from .held_record import check_held

log = logging.getLogger(__name__)

COMMIT_FORMAT = "deltarefit.commit"
COMMIT_VERSION = 1
MAX_SUBSCRIBER_BYTES = 64 << 10  # a subscriber's report (subs/) or acknowledgement (acks/): a few fields


STREAM_ID_PATTERN = re.compile(r"^(legacy-)?[0-9a-f]{32}$")
LEGACY_PREFIX = "legacy-"


def new_stream_id() -> str:
    """A fresh stream identity: 128 random bits, hex (the first version's record carries it)."""
    return uuid.uuid4().hex


def prepared_key(version: int) -> str:
    return f"{vkey(version)}/prepared.json"


@dataclass(frozen=True)
class Part:
    key: str
    bytes: int
    blake3: str  # hex of the full 32-byte BLAKE3 of the object


@dataclass(frozen=True)
class CommitRecord(SignableRecord):
    version: int
    parent: str | None  # fingerprint of the version it applies to (None for the first)
    fingerprint: str
    kind: str  # "delta" or "keyframe" (a keyframe version may carry a delta too)
    delta: Part | None
    keyframe: list[tuple[str, Part]] = field(default_factory=list)  # (file name, part)
    full_bytes: int = 0
    step: int | None = None
    created: float = 0.0
    publisher: str = ""
    catchup_from: int | None = None  # a catch-up delta from this (keyframe) version straight to this one
    catchup: Part | None = None
    signature: dict[str, str] | None = None
    # The stream's identity, fixed at its first version and carried (and signed) in every record. None
    # only in records written before identities existed (see ``stream_identity``).
    stream: str | None = None
    # The delta was coded against the publisher's history book (it may hold ``ulp_hist`` chunks), which
    # continues the book of the version before (``stream.history``). Absent (False) in records of
    # publishers without a book, and then not in the canonical bytes either.
    history: bool = False

    def body(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("signature")
        if d["stream"] is None:  # records of older streams keep their canonical (signed) bytes
            d.pop("stream")
        if not d["history"]:  # so do records without a history book
            d.pop("history")
        d["keyframe"] = [[name, asdict(p)] for name, p in self.keyframe]
        return {"format": COMMIT_FORMAT, "format_version": COMMIT_VERSION, **d}

    @property
    def part_bytes(self) -> int:
        return ((self.delta.bytes if self.delta else 0) + sum(p.bytes for _, p in self.keyframe)
                + (self.catchup.bytes if self.catchup else 0))


def record_parts(rec: CommitRecord) -> list[Part]:
    """Every object a plain record names: its delta, keyframe files and catch-up delta."""
    return ([rec.delta] if rec.delta else []) + [p for _, p in rec.keyframe] + ([rec.catchup] if rec.catchup else [])


RECORD_BYTES_PER_STRING = 24  # the densest a commit record's text may hold strings (``record_json``)
RECORD_BYTES_PER_VALUE = 16  # ... and values (numbers, strings, containers)


def record_json(data: bytes, where: str) -> Any:
    """A commit record's JSON (plain or sharded), within ``MAX_RECORD_BYTES``; its shape is the caller's."""
    if len(data) > MAX_RECORD_BYTES:
        raise MalformedRecordError(f"{where}: commit record of {len(data)} bytes exceeds the limit "
                                   f"({MAX_RECORD_BYTES >> 20} MiB)")
    # Nesting, containers, strings and values bounded before parsing (a 15 MB record of nested lists cost
    # 430 MB, one of 1.5 M short keys 272 MB): a real record nests 4 levels, and holds one container per
    # ~120 bytes, one string (keys included) per 34 bytes and one value per 40 bytes or more (a sharded
    # record of 2000 ranks, a keyframe of 400 files; a record of a few hundred bytes is within the slack).
    # What they admit parses in at most about 6.5 bytes per byte, 26 MiB at the 4 MiB cap (an object of
    # unshared keys, ``bench.trust_memory``); in a signed stream the signature is checked before (``load_record``).
    why = json_shape_problem(data, max_depth=8, bytes_per_container=32, bytes_per_string=RECORD_BYTES_PER_STRING,
                             bytes_per_value=RECORD_BYTES_PER_VALUE)
    if why is not None:
        raise MalformedRecordError(f"{where}: commit record {why}")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MalformedRecordError(f"{where}: commit record is not valid JSON ({type(e).__name__})") from None


def subscriber_json(store: Store, key: str) -> dict | None:
    """An object a subscriber wrote (``subs/<id>.json``, ``acks/<v>/<id>.json``) as a JSON object, or
    None where it is absent, larger than ``MAX_SUBSCRIBER_BYTES``, nested or not JSON (logged in one
    line): any subscriber credential can write these, and none may stop retention or a publish."""
    try:
        data = get_capped(store, key, MAX_SUBSCRIBER_BYTES)
    except KeyError:
        return None
    except StoreError as e:  # not a regular file (a FIFO planted there): as malformed as any
        log.warning("%s/%s: ignoring unreadable subscriber object (%s)", store.url, key, e)
        return None
    why = None if data is not None else f"larger than {MAX_SUBSCRIBER_BYTES} bytes"
    if why is None:
        why = json_shape_problem(data, max_depth=4, bytes_per_container=16)
    if why is None:
        try:
            d = json.loads(data.decode("utf-8"))
            why = None if isinstance(d, dict) else "not a JSON object"
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            why = f"not valid JSON ({type(e).__name__})"
    if why is not None:
        log.warning("%s/%s: ignoring malformed subscriber object (%s)", store.url, key, why)
        return None
    return d


HEX64 = re.compile(r"^[0-9a-f]{64}$")


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# What each field of a record must be, as (check, what the one-line refusal says it must be).
INT = (is_int, "an integer")
INT_OR_NULL = (lambda x: x is None or is_int(x), "an integer or null")
STR = (lambda x: isinstance(x, str), "a string")
STR_OR_NULL = (lambda x: x is None or isinstance(x, str), "a string or null")
NUMBER = (lambda x: isinstance(x, (int, float)) and not isinstance(x, bool), "a number")
LIST = (lambda x: isinstance(x, list), "a list")
BOOL = (lambda x: isinstance(x, bool), "true or false")

_COMMIT_FIELDS = {"version": INT, "parent": STR_OR_NULL, "fingerprint": STR, "kind": STR, "keyframe": LIST,
                  "full_bytes": INT, "step": INT_OR_NULL, "created": NUMBER, "publisher": STR,
                  "catchup_from": INT_OR_NULL, "stream": STR_OR_NULL, "history": BOOL}


def malformed_field(where: str, name: str, value: Any, what: str) -> MalformedRecordError:
    return MalformedRecordError(f"{where}: malformed commit record: {name} is {brief(value)}, not {what}")


def check_fields(d: dict, where: str, spec: dict) -> None:
    """Refuse (``MalformedRecordError`` naming the field) a record field present in ``d`` that is not
    what ``spec`` says (a missing one is the caller's to refuse)."""
    for name, (ok, what) in spec.items():
        if name in d and not ok(d[name]):
            raise malformed_field(where, name, d[name], what)
    sig = d.get("signature")
    if sig is not None and (not isinstance(sig, dict) or set(sig) != {"alg", "key_id", "sig"}
                            or not all(isinstance(x, str) for x in sig.values())):
        raise malformed_field(where, "signature", sig, "an object of string alg, key_id and sig")


def parse_ref(d: Any, where: str, name: str) -> Part:
    """An object reference of a commit record (plain or sharded): exactly ``key`` (a string), ``bytes``
    (a non-negative integer) and ``blake3`` (64 lowercase hex digits); refused naming the field."""
    if not isinstance(d, dict) or set(d) != {"key", "bytes", "blake3"}:
        raise malformed_field(where, name, d, "an object of key, bytes and blake3")
    if not isinstance(d["key"], str):
        raise malformed_field(where, f"{name}.key", d["key"], "a string")
    if not is_int(d["bytes"]) or d["bytes"] < 0:
        raise malformed_field(where, f"{name}.bytes", d["bytes"], "a non-negative integer")
    if not isinstance(d["blake3"], str) or not HEX64.match(d["blake3"]):
        raise malformed_field(where, f"{name}.blake3", d["blake3"], "64 lowercase hex digits")
    return Part(d["key"], d["bytes"], d["blake3"])


def _keyframe_file(item: Any, where: str, i: int) -> tuple[str, Part]:
    if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str):
        raise malformed_field(where, f"keyframe[{i}]", item, "a [file name, object] pair")
    return item[0], parse_ref(item[1], where, f"keyframe[{i}]")


def parse_commit(data: bytes, where: str) -> CommitRecord:
    """Parse and validate a commit record's shape and field types (not its signature: see
    ``Subscriber``); a field of the wrong type is refused naming it."""
    d = record_json(data, where)
    try:
        if d.pop("format") != COMMIT_FORMAT or d.pop("format_version") != COMMIT_VERSION:
            raise MalformedRecordError(f"{where}: not a {COMMIT_FORMAT} v{COMMIT_VERSION} record")
        check_fields(d, where, _COMMIT_FIELDS)
        delta = parse_ref(d.pop("delta"), where, "delta") if d.get("delta") is not None else d.pop("delta")
        if d.get("catchup") is not None:
            d["catchup"] = parse_ref(d["catchup"], where, "catchup")
        kf = [_keyframe_file(item, where, i) for i, item in enumerate(d.pop("keyframe"))]
        rec = CommitRecord(delta=delta, keyframe=kf, **d)
    except StreamError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise MalformedRecordError(f"{where}: malformed commit record ({type(e).__name__}: {e})") from None
    if rec.stream is not None and not (isinstance(rec.stream, str) and STREAM_ID_PATTERN.match(rec.stream)):
        raise MalformedRecordError(f"{where}: malformed stream identity {str(rec.stream)[:40]!r}")
    if (not isinstance(rec.version, int) or rec.version < 1 or rec.kind not in ("delta", "keyframe")
            or (rec.kind == "keyframe") != bool(rec.keyframe) or (rec.delta is None and rec.parent is not None)
            or (rec.delta is None and not rec.keyframe) or (rec.history and rec.delta is None)
            or (rec.catchup is None) != (rec.catchup_from is None)
            or (rec.catchup_from is not None and not (isinstance(rec.catchup_from, int) and 1 <= rec.catchup_from < rec.version))):
        raise MalformedRecordError(f"{where}: inconsistent commit record (version, kind, parts): version "
                                   f"{brief(rec.version)}, kind {brief(rec.kind)}")
    for p in record_parts(rec):
        if not p.key.startswith(vkey(rec.version) + "/") or ".." in p.key:
            raise MalformedRecordError(f"{where}: part {p.key!r} lies outside its version")
    return rec


def proposal_bytes(rec: CommitRecord, deadline: float) -> bytes:
    """A joint-commit proposal: when its publisher stops waiting, and the record to be committed in its
    stored bytes (``to_bytes``, verbatim), so that a subscriber with a key checks the signature over
    them before parsing anything (``proposal_parts``)."""
    return b"".join((b'{"deadline": ', repr(float(deadline)).encode(), b', "record": ', rec.to_bytes(), b"}"))


_PROPOSAL_HEAD = re.compile(rb'\{"deadline": (-?[0-9][0-9.eE+-]{0,31}), "record": ')


def proposal_parts(data: bytes, where: str) -> tuple[memoryview, float]:
    """A proposal's record bytes (a view into ``data``) and deadline, split without parsing the record:
    what ``proposal_bytes`` writes (and what a publisher that re-serialised the record wrote: its
    signature then no longer checks over the stored bytes)."""
    m = _PROPOSAL_HEAD.match(data)
    try:
        deadline = float(m.group(1)) if m is not None and data.endswith(b"}") else None
    except ValueError:
        deadline = None
    if m is None or deadline is None:
        raise StreamError(f"{where}: malformed proposal (not a deadline and a record)")
    return memoryview(data)[m.end():len(data) - 1], deadline


def parse_proposal(data: bytes, where: str, verifier: Verifier | None = None) -> tuple[CommitRecord, float]:
    """A proposal's record and deadline; with ``verifier``, the record's signature is checked over its
    stored bytes before they are parsed (``SignatureError`` naming ``where``)."""
    view, deadline = proposal_parts(data, where)
    record = bytes(view)
    if verifier is not None:
        check_stored_signature(record, verifier, where)
    return parse_commit(record, where), deadline


def load_commit(store: Store, version: int, verifier: Verifier | None = None) -> CommitRecord:
    """The commit record of ``version``; with ``verifier``, its signature is checked over the bytes read
    before they are parsed (``load_record``)."""
    return load_record(store, version, parse_commit, verifier)


def newest_with_fingerprint(store: Store, fingerprint: str, verifier: Verifier | None = None,
                            ) -> tuple[int | None, SignatureError | None]:
    """The newest version of ``store`` whose commit record names ``fingerprint`` (None: none does), and
    the first ``SignatureError`` met on the way (None: none). With ``verifier``, each record is checked
    over its stored bytes before it is parsed, and one that does not verify is passed over: an older,
    signed one may still name the fingerprint."""
    refused: SignatureError | None = None
    for v in range(head(store), 0, -1):
        if not store.exists(commit_key(v)):  # removed by retention (or a mirror that starts later): no version
            continue
        try:
            rec = load_commit(store, v, verifier)
        except SignatureError as e:  # an unsigned or forged record costs its size, never a parse
            refused = refused or e
            continue
        if rec.fingerprint == fingerprint:
            return v, refused
    return None, refused


def legacy_identity(first: SignableRecord) -> str:
    """The identity of a stream whose first record carries none (written before identities existed):
    derived from that record's canonical bytes, so a store wiped and republished gets another one.
    Publishers write it into every record they add to such a stream."""
    return LEGACY_PREFIX + blake3.blake3(first.canonical_bytes()).hexdigest()[:32]


def stream_identity(store: Store, verifier: Verifier | None = None) -> str | None:
    """The identity of the stream in ``store``: its first version's ``stream`` (or the legacy identity
    derived from that record); None when the store holds no version 1 (an empty stream, or a relay
    mirror that starts at a keyframe). With ``verifier``, version 1 is signature-checked before it is
    parsed."""
    if not store.exists(commit_key(1)):
        return None
    first = load_commit(store, 1, verifier)
    return first.stream or legacy_identity(first)


def check_identity(rec: SignableRecord, identity: str | None, where: str, fix: str = "") -> None:
    """Refuse (``StreamIdentityError``) a record (plain or sharded) that is not of stream ``identity``. Records without an
    identity are accepted only in a legacy stream (``identity`` None or a legacy identity)."""
    if rec.stream is None:
        if identity is None or identity.startswith(LEGACY_PREFIX):
            return
        raise StreamIdentityError(f"{where}: record carries no stream identity, but stream {identity} is followed"
                                  f"{fix}")
    if identity is not None and rec.stream != identity:
        raise StreamIdentityError(f"{where}: record belongs to stream {rec.stream}, not to the followed stream "
                                  f"{identity}{fix}")


def file_hash(path: str, progress: Callable[[int], None] | None = None) -> str:
    """Full BLAKE3 (hex) of a file, as parts are named in commit records; ``progress(n)``: each 16 MiB read."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


def fetch_part(store: Store, part: Part, dest: str) -> int:
    """Download ``part`` to ``dest`` and check it against its record (size and BLAKE3). Returns the
    bytes fetched: 0 when ``dest`` already holds it (a staged download from an interrupted run)."""
    if os.path.exists(dest) and os.path.getsize(dest) == part.bytes and file_hash(dest) == part.blake3:
        return 0
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    try:
        store.get_to(part.key, dest)
    except KeyError:
        raise StreamError(f"{store.url}/{part.key}: part is missing (pruned?)") from None
    if os.path.getsize(dest) != part.bytes or file_hash(dest) != part.blake3:
        raise StreamError(f"{store.url}/{part.key}: part does not match its commit record")
    return part.bytes


def now() -> float:
    return round(time.time(), 3)


def followed_stream(store: Store, held: str | None, pinned: str | None, holder: str, fix: str,
                    quarantine_fix: str, verifier: Verifier | None = None) -> str | None:
    """The identity of the stream a holder (``holder``: its name in refusals) follows: ``held`` (recorded
    with its version), else ``pinned``, else the store's; refused (``fix``: the way out) when ``held``
    is not ``pinned``, or the store's stream is another one."""
    if held is not None and pinned is not None and held != pinned:
        raise StreamIdentityError(f"{holder}: follows stream {held}, not the requested {pinned} (--stream-id); "
                                  "nothing was written; check --stream-id ('deltarefit log --json STORE' shows each "
                                  f"version's stream){fix}")
    try:
        store_ident = stream_identity(store, verifier)
    except (MalformedRecordError, SignatureError) as e:
        raise type(e)(f"{e}{quarantine_fix}") from None
    ident = held or pinned or store_ident
    if store_ident is not None and ident != store_ident:
        raise StreamIdentityError(f"{store.url}: holds stream {store_ident}, {holder} follows stream {ident} "
                                  f"(store wiped and republished, or another run's store?){fix}")
    return ident


def held_state(state_path: str) -> dict | None:
    """What a subscriber recorded at ``state_path`` after a verified apply (``record_version``), or None."""
    try:
        # A regular file only, never through a symlink: a FIFO planted there must not hang the sync.
        # At most LOCAL_STATE_MAX_BYTES read, its shape bounded before it is parsed (``small_json``).
        with os.fdopen(open_regular(state_path, os.O_RDONLY, what="version state"), "rb") as f:
            d = small_json(read_capped(f.fileno(), LOCAL_STATE_MAX_BYTES))
        check_held(d)
        return d
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise StreamError(f"{state_path}: unreadable version state ({e}); 'deltarefit sync --repair' rebuilds "
                          "it") from None


# Timestamps are as coarse as the kernel's clock tick (or the file system's: 1-2 s on some), so a
# write in the tick of the recorded one leaves the identity as it was. Files whose recorded change
# time lies within this margin of the moment the identity was recorded are "racy" (as in git's index)
# and are hashed again at the next check, whatever their identity says.
RACY_NS = 2_000_000_000


def identity_unchanged(state: dict, identity: tuple) -> bool:
    """Whether ``identity`` (``Checkpoint.identity``, taken now) is the one ``state`` recorded, taken
    clear of the racy margin (then the files have not been written since, barring a clock set back)."""
    rec, at = state.get("identity"), state.get("identity_at_ns")
    if not isinstance(rec, list) or not isinstance(at, int) or rec != [list(x) for x in identity]:
        return False
    return all(max(x[4], x[5]) < at - RACY_NS for x in rec)


def held_version(state_path: str) -> tuple[int, str] | None:
    """(version, fingerprint) a subscriber recorded at ``state_path`` after a verified apply, or None."""
    d = held_state(state_path)
    return None if d is None else (d["version"], d["fingerprint"])


def record_version(state_path: str, version: int, fp: str, url: str, *, stream_id: str | None = None,
                   identity: tuple | None = None) -> None:
    """Record, atomically, that the copy beside ``state_path`` holds ``version`` (fingerprint ``fp``) of
    the stream in ``url``; with its stream identity and, where given, the identity of the copy's files
    (``Checkpoint.identity``) when its fingerprint was verified."""
    os.makedirs(os.path.dirname(os.path.abspath(state_path)), exist_ok=True)
    d = {"version": version, "fingerprint": fp, "stream": url, "updated": now()}
    if stream_id is not None:
        d["stream_id"] = stream_id
    if identity is not None:
        d["identity"] = [list(x) for x in identity]
        d["identity_at_ns"] = time.time_ns()  # after the identity was taken: see ``identity_unchanged``
    write_atomic(state_path, json.dumps(d).encode())
