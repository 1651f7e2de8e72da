"""The records of a sharded stream: the commit record (``ShardCommit``), its keys, the part
descriptors the committer joins, the layout-independent identity of a version (``state_fingerprint``),
and reading what a record names, checked against it. Pure functions over a ``Store``.

Keys (the chain's layout, ``stream/chain.py``; a stream holds either plain or sharded versions)::

    v/000000000042/commit.json                       the sharded commit record: created last, conditionally
    v/000000000042/<attempt>/parts/rank-<r>          trainer rank r's part (``part.py`` format)
    v/000000000042/<attempt>/parts/rank-<r>.head.json  its descriptor: size, BLAKE3 and the part's head
    v/000000000042/<attempt>/manifest.json           the version manifest (``part.join``), canonical bytes
    HEAD                                             a hint naming the newest version

Records may be signed (Ed25519 over ``signed_bytes()``, as plain records): the committer signs with
``signing_key``, a rollout rank given ``public_key`` refuses a record without a valid signature.
"""

from __future__ import annotations

import base64
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import blake3

from ..errors import FormatError, UsageError
from ..io.jsonlimits import json_shape_problem
from ..signing import SignableRecord
from ..storage.base import Store
from ..stream.chain import MAX_RECORD_BYTES, commit_key, get_bounded, get_capped, holds, load_record, vkey
from ..stream.records import (
    BOOL,
    HEX64,
    INT,
    INT_OR_NULL,
    LIST,
    NUMBER,
    STR,
    STR_OR_NULL,
    STREAM_ID_PATTERN,
    Part,
    StreamError,
    check_fields,
    legacy_identity,
    parse_ref,
    record_json,
)
from .manifest import TensorTable, VersionManifest
from .part import MAX_MANIFEST_BYTES, part_head

SHARD_COMMIT_FORMAT = "deltarefit.shard_commit"
SHARD_COMMIT_VERSION = 1
_ATTEMPT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def part_key(version: int, attempt: str, rank: int) -> str:
    return f"{vkey(version)}/{attempt}/parts/rank-{rank}"


def head_key(version: int, attempt: str, rank: int) -> str:
    """A rank's descriptor of its part: size, BLAKE3 and the part's head (what the committer joins)."""
    return part_key(version, attempt, rank) + ".head.json"


@dataclass(frozen=True)
class PartRef(Part):
    """What a rank's ``upload`` returns for the committer: its part (key, size, BLAKE3) and ``head``, the
    BLAKE3 (hex) of the part's head, the bytes the committer joins into the manifest. The descriptor in
    the store carries that head too; the committer takes it only where it hashes to this (a descriptor
    rewritten after the upload, with the rank's true part but another part's head, is refused)."""

    head: str = ""

    def part(self) -> Part:
        return Part(self.key, self.bytes, self.blake3)


def part_ref(key: str, blob: bytes) -> PartRef:
    """``blob``'s ref as its rank hands it to the committer."""
    return PartRef(key, len(blob), blake3.blake3(blob).hexdigest(), blake3.blake3(part_head(blob)).hexdigest())


def _descriptor(key: str, blob: bytes) -> bytes:
    ref = _ref(key, blob)
    return json.dumps({"key": ref.key, "bytes": ref.bytes, "blake3": ref.blake3,
                       "head": base64.b64encode(part_head(blob)).decode()}, sort_keys=True).encode()


def get_descriptor(store: Store, key: str) -> tuple[Part, bytes]:
    """A rank's part descriptor (``head_key``), read no further than a record's size."""
    return _parse_descriptor(get_bounded(store, key, MAX_RECORD_BYTES, "part descriptor"), f"{store.url}/{key}")


def _parse_descriptor(data: bytes, where: str) -> tuple[Part, bytes]:
    why = json_shape_problem(data, max_depth=4, bytes_per_container=16)  # a flat object of 4 keys
    if why is not None:
        raise StreamError(f"{where}: malformed part descriptor ({why})")
    try:
        d = json.loads(data)
        ref = Part(str(d["key"]), int(d["bytes"]), str(d["blake3"]))
        head_bytes = base64.b64decode(d["head"], validate=True)
    except (ValueError, KeyError, TypeError) as e:
        raise StreamError(f"{where}: malformed part descriptor ({type(e).__name__})") from None
    return ref, head_bytes


def manifest_key(version: int, attempt: str) -> str:
    return f"{vkey(version)}/{attempt}/manifest.json"


def new_attempt() -> str:
    """A fresh attempt id (the committer picks one per publish and hands it to every rank)."""
    return uuid.uuid4().hex[:16]


def _check_attempt(attempt: str) -> str:
    if not isinstance(attempt, str) or not _ATTEMPT.match(attempt):
        raise UsageError(f"attempt id {attempt!r}: use 1-64 letters, digits, '-' or '_'")
    return attempt


def state_fingerprint(tensors: Mapping[str, Mapping], which: str = "target") -> str | None:
    """The layout-independent identity of a sharded state: BLAKE3 of the sorted (name, dtype, shape,
    additive digest) of every tensor (``which``: the manifest's "target" or "base" digests). None when
    the digests are absent (the base of a keyframe)."""
    # Hashed entry by entry (the bytes of json.dumps of the whole list, without building it: a 1T
    # MoE's list of 71,000 entries would cost several times its manifest).
    if isinstance(tensors, TensorTable):  # the same bytes, cut from the manifest's own
        items = tensors.state_items(which)
    else:
        items = (_state_item(n, tensors[n], which) for n in sorted(tensors))
    h = blake3.blake3(b"deltarefit.shard_state.v1\0[")
    sep = b""
    for item in items:
        if item is None:
            return None
        h.update(sep + item)
        sep = b","
    h.update(b"]")
    return h.hexdigest()


def _state_item(name: str, t: Mapping, which: str) -> bytes | None:
    """``[name, dtype, shape, digest]`` as the fingerprint hashes it; None for a null digest."""
    d = t[which]
    return None if d is None else json.dumps([name, str(t["dtype"]), [int(x) for x in t["shape"]], str(d)],
                                             separators=(",", ":")).encode("utf-8")


# --------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ShardCommit(SignableRecord):
    """The commit record of a sharded version (``v/<version>/commit.json``)."""

    version: int
    parent: str | None  # fingerprint of the previous version (None for version 1)
    fingerprint: str  # state_fingerprint of the manifest's target digests
    keyframe: bool
    world: int
    manifest: Part
    parts: tuple[Part, ...]  # rank order
    step: int | None = None
    created: float = 0.0
    publisher: str = ""
    signature: dict[str, str] | None = None  # Ed25519 over signed_bytes(), as plain commit records
    stream: str | None = None  # the stream's identity (None only in records from before identities)

    @property
    def attempt(self) -> str:
        return self.manifest.key.split("/")[2]

    @property
    def part_bytes(self) -> int:
        return sum(p.bytes for p in self.parts)

    def body(self) -> dict:
        return {"format": SHARD_COMMIT_FORMAT, "format_version": SHARD_COMMIT_VERSION, "version": self.version,
                "parent": self.parent, "fingerprint": self.fingerprint, "keyframe": self.keyframe,
                "world": self.world, "manifest": asdict(self.manifest), "parts": [asdict(p) for p in self.parts],
                "step": self.step, "created": self.created, "publisher": self.publisher,
                **({} if self.stream is None else {"stream": self.stream})}

    def same_version(self, other: ShardCommit) -> bool:
        """Same committed content (ignores who/when): a rerun recognises its own commit."""
        return (self.version, self.parent, self.fingerprint, self.keyframe, self.world, self.manifest, self.parts) == (
            other.version, other.parent, other.fingerprint, other.keyframe, other.world, other.manifest, other.parts)


_SHARD_FIELDS = {"version": INT, "world": INT, "keyframe": BOOL, "fingerprint": STR, "parent": STR_OR_NULL,
                 "step": INT_OR_NULL, "parts": LIST, "created": NUMBER, "publisher": STR, "stream": STR_OR_NULL}


def parse_shard_commit(data: bytes, where: str) -> ShardCommit:
    """Parse and validate a sharded commit record (field types, shape, keys inside its version and one
    attempt); a field of the wrong type is refused naming it, as plain records are."""
    d = record_json(data, where)
    if not isinstance(d, dict):
        raise StreamError(f"{where}: commit record is not an object")
    if d.get("format") != SHARD_COMMIT_FORMAT or d.get("format_version") != SHARD_COMMIT_VERSION:
        raise StreamError(f"{where}: not a {SHARD_COMMIT_FORMAT} v{SHARD_COMMIT_VERSION} record (format "
                          f"{d.get('format')!r}: a plain stream is read with deltarefit.stream)")
    check_fields(d, where, _SHARD_FIELDS)
    try:
        v, world = d["version"], d["world"]
        if (v < 1 or world < 1 or not HEX64.match(d["fingerprint"])
                or (d["parent"] is not None and not HEX64.match(d["parent"]))):
            raise StreamError(f"{where}: inconsistent sharded commit record")
        stream = d.get("stream")
        if stream is not None and not STREAM_ID_PATTERN.match(stream):
            raise StreamError(f"{where}: malformed stream identity")
        rec = ShardCommit(v, d["parent"], d["fingerprint"], d["keyframe"], world,
                          parse_ref(d["manifest"], where, "manifest"),
                          tuple(parse_ref(p, where, f"parts[{r}]") for r, p in enumerate(d["parts"])), d["step"],
                          float(d["created"]), d["publisher"], d.get("signature"), stream)
    except KeyError as e:
        raise StreamError(f"{where}: malformed sharded commit record (no {e})") from None
    if len(rec.parts) != rec.world or (rec.version == 1) != (rec.parent is None) or (
            rec.version == 1 and not rec.keyframe):
        raise StreamError(f"{where}: inconsistent sharded commit record (version, parent, world, parts)")
    attempt = rec.manifest.key.split("/")[2] if rec.manifest.key.count("/") >= 2 else ""
    if not _ATTEMPT.match(attempt) or rec.manifest.key != manifest_key(rec.version, attempt) or any(
            p.key != part_key(rec.version, attempt, r) for r, p in enumerate(rec.parts)):
        raise StreamError(f"{where}: parts lie outside the version's attempt directory")
    return rec


def load_shard_commit(store: Store, version: int, verifier=None) -> ShardCommit:
    """The sharded commit record of ``version``; with ``verifier`` (``signing.Verifier``), its signature
    is checked over the bytes read before they are parsed (``load_record``)."""
    return load_record(store, version, parse_shard_commit, verifier)


def shard_stream_identity(store: Store, verifier=None) -> str | None:
    """The identity of the sharded stream in ``store`` (its version 1's, or the legacy identity derived
    from that record); None without a version 1. With ``verifier``, signature-checked before parsing."""
    if not store.exists(commit_key(1)):
        return None
    first = load_shard_commit(store, 1, verifier)
    return first.stream or legacy_identity(first)


def _ref(key: str, data: bytes | memoryview) -> Part:
    return Part(key, len(data), blake3.blake3(data).hexdigest())


def _get_checked(store: Store, ref: Part, what: str) -> bytes:
    """The object ``ref`` names, refused unless it has the record's size and BLAKE3."""
    try:
        data = get_capped(store, ref.key, ref.bytes)  # never more than the record says (memory before trust)
    except KeyError:
        raise StreamError(f"{store.url}/{ref.key}: {what} is missing (pruned, or never uploaded)") from None
    if data is None or len(data) != ref.bytes or blake3.blake3(data).hexdigest() != ref.blake3:
        raise StreamError(f"{store.url}/{ref.key}: {what} does not match its commit record (size/BLAKE3)")
    return data


def _put_once(store: Store, key: str, data: bytes) -> None:
    """Create ``key``; an existing object must hold the same bytes (an idempotent rerun of this attempt)."""
    if store.create(key, data):
        return
    if not holds(store, key, data):
        raise StreamError(f"{store.url}/{key}: already holds other bytes (an attempt id reused across runs?); "
                          "publish under a fresh attempt id")


def load_manifest(store: Store, rec: ShardCommit) -> VersionManifest:
    """The version manifest of a commit, checked against the record (bytes, parts, fingerprints).

    Memory before trust (the record may be unsigned): a manifest past ``MAX_MANIFEST_BYTES`` is never
    read; one within it is checked in one pass and kept as offsets into its bytes (``manifest.py``:
    the bytes and under half of them more), never parsed into an object per entry."""
    where = f"{store.url}/{rec.manifest.key}"
    if rec.manifest.bytes > MAX_MANIFEST_BYTES:  # never read, whatever an (unsigned) record says
        raise StreamError(f"{where}: manifest of {rec.manifest.bytes} bytes exceeds the limit "
                          f"({MAX_MANIFEST_BYTES >> 20} MiB)")
    data = _get_checked(store, rec.manifest, f"manifest of version {rec.version}")
    try:
        man = VersionManifest(data)
    except FormatError as e:  # (the form departed from: one line naming the byte)
        raise StreamError(f"{where}: malformed manifest ({e})") from None
    del data
    if not (man["version"] == rec.version and man["keyframe"] == rec.keyframe and man["world"] == rec.world
            and man.part_count() == len(rec.parts)
            and all(man.part_ref(r) == (p.bytes, p.blake3) for r, p in enumerate(rec.parts))):
        raise StreamError(f"{where}: manifest does not describe the committed version {rec.version}")
    fp, links = version_fingerprint(man, rec.parent)
    if fp != rec.fingerprint or not links:
        raise StreamError(f"{where}: manifest digests do not give the record's fingerprint/parent")
    return man


def version_fingerprint(man: dict, parent: str | None) -> tuple[str | None, bool]:
    """A version manifest's fingerprint (its target digests) and whether it applies to ``parent``: a
    keyframe applies to anything, a delta version to the state its base digests fingerprint."""
    linked = bool(man["keyframe"]) or state_fingerprint(man["tensors"], "base") == parent
    return state_fingerprint(man["tensors"]), linked
