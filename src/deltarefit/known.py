"""What a publisher keeps of its baseline between publishes: the segment hashes and additive digests of
its tensors, bound to the identity of its files, in a file that a torn write or an edit cannot make
half-readable (``KnownHashes``; ``encode.known_hashes`` takes them from a checkpoint)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import blake3

from .integrity import SEG_HASH_BYTES


@dataclass(frozen=True)
class KnownHashes:
    """Segment hashes of a checkpoint's tensors (per tensor, the 16-byte hashes concatenated) and the
    identity of its files when they were taken (``Checkpoint.identity``).

    ``encode(..., known_base=)`` uses them instead of hashing the base, while the base's files still
    have that identity. A publisher holds them for its baseline between publishes: the base of each
    encode is the target of the one before, verified when the baseline advanced, so hashing it again
    is a pass over the whole checkpoint that can only repeat a known answer."""

    identity: tuple
    hashes: Mapping[str, bytes]
    sums: Mapping[str, bytes] = field(default_factory=dict)  # additive digests of tensors, where known

    _FORMAT = "deltarefit.known-hashes"

    def to_bytes(self) -> bytes:
        """JSON (hashes in hex), then a newline and the hex BLAKE3 of the JSON: a torn or edited file
        is refused by ``from_bytes``, never half read."""
        body = json.dumps({"format": self._FORMAT, "version": 1, "identity": [list(x) for x in self.identity],
                           "hashes": {n: h.hex() for n, h in self.hashes.items()},
                           "sums": {n: h.hex() for n, h in self.sums.items()}},
                          sort_keys=True, separators=(",", ":")).encode()
        return body + b"\n" + blake3.blake3(body).hexdigest().encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> KnownHashes:
        """Parse ``to_bytes``' output; ValueError (naming what is wrong) for anything else."""
        body, sep, digest = data.rpartition(b"\n")
        if not sep or blake3.blake3(body).hexdigest().encode() != digest:
            raise ValueError("checksum mismatch (torn or edited)")
        d = json.loads(body)
        if not isinstance(d, dict) or d.get("format") != cls._FORMAT or d.get("version") != 1:
            raise ValueError("not a known-hashes file of version 1")
        ident, hashes = d.get("identity"), d.get("hashes")
        if not isinstance(ident, list) or not all(
                isinstance(x, list) and len(x) == 6 and isinstance(x[0], str)
                and all(isinstance(v, int) and not isinstance(v, bool) for v in x[1:]) for x in ident):
            raise ValueError("bad identity")
        if not isinstance(hashes, dict) or not all(
                isinstance(n, str) and isinstance(h, str) and len(h) % (2 * SEG_HASH_BYTES) == 0
                for n, h in hashes.items()):
            raise ValueError("bad hashes")
        sums = d.get("sums", {})
        if not isinstance(sums, dict) or not all(
                isinstance(n, str) and isinstance(h, str) and len(h) == 32 for n, h in sums.items()):
            raise ValueError("bad sums")
        return cls(tuple(tuple(x) for x in ident), {n: bytes.fromhex(h) for n, h in hashes.items()},
                   {n: bytes.fromhex(h) for n, h in sums.items()})
