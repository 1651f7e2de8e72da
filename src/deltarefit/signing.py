"""Signed commit records: Ed25519 over the record's stored bytes (``cryptography``).

Keys are PEM files: ``keygen`` writes a private key (mode 0600) and its public key beside it.
A subscriber configured with a public key refuses records that are unsigned, signed by another key,
or altered after signing.

What a signature covers (``SIGNATURE_ALG``, FORMAT.md "Commit record"): ``SIGNED_PREFIX`` followed by
the record's bytes as stored (``to_bytes``: sorted keys, one-space indent) with its ``signature``
member cut out. A reader holding a key therefore checks a record over the raw bytes it read, before
any JSON is parsed (``check_stored_signature``): a forged or unsigned record costs its size, never a
parse of it (memory before trust).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from .errors import SignatureError, UsageError
from .io.fsutil import read_small, write_new

KEY_MAX_BYTES = 8 << 10  # an Ed25519 key's PEM is about 120 bytes; a key file past this is no key

SIGNATURE_ALG = "ed25519-stored"  # Ed25519 over SIGNED_PREFIX + the stored record less its signature
SIGNED_PREFIX = b"deltarefit.signed-record.v2\0"  # never the start of JSON: no message of another form
# The signature member exactly as ``SignableRecord.to_bytes`` writes it (sorted keys, indent 1): never
# the first member ("format" sorts before it), so always preceded by a comma. A raw newline never
# occurs inside a JSON string, so this text can only be structure.
_STORED_SIGNATURE = re.compile(rb',\n "signature": \{\n  "alg": "([^"\\\n]{0,64})",\n  "key_id": "([^"\\\n]{0,64})",'
                               rb'\n  "sig": "([0-9a-f]{0,256})"\n \}')


def read_key(path: str, what: str) -> bytes:
    """A key file's PEM bytes, read as every input named by a path is (``io.fsutil.read_small``: a regular
    file only, never hung on a FIFO, at most ``KEY_MAX_BYTES`` read); ``UsageError`` otherwise."""
    return read_small(path, KEY_MAX_BYTES, what=what)


class SignableRecord:
    """Canonical bytes for a commit record (plain or sharded): a subclass gives ``body()``, the record
    without its signature, and has a ``signature`` field."""

    signature: dict[str, str] | None
    stream: str | None  # the identity of the stream the record belongs to (signed with the rest)

    def body(self) -> dict[str, Any]:
        raise NotImplementedError

    def canonical_bytes(self) -> bytes:
        """Sorted-key compact JSON of everything but the signature (a legacy stream's identity is
        derived from version 1's: ``stream.records.legacy_identity``)."""
        return json.dumps(self.body(), sort_keys=True, separators=(",", ":")).encode("utf-8")

    def signed_bytes(self) -> bytes:
        """What a signature covers: ``SIGNED_PREFIX`` and the record's stored bytes (``to_bytes``)
        without its signature member, which is exactly what ``check_stored_signature`` rebuilds from
        the bytes read."""
        return SIGNED_PREFIX + json.dumps(self.body(), sort_keys=True, indent=1).encode("utf-8")

    def to_bytes(self) -> bytes:
        d = self.body()
        if self.signature is not None:
            d["signature"] = self.signature
        return json.dumps(d, sort_keys=True, indent=1).encode("utf-8")


def keygen(private_path: str) -> str:
    """Write a new Ed25519 private key to ``private_path`` and its public key to ``private_path + '.pub'``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if os.path.exists(private_path):
        raise UsageError(f"{private_path} exists; refusing to overwrite a key (nothing was written): name a new "
                         "path, or remove the old key first")
    key = Ed25519PrivateKey.generate()
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    write_new(private_path, priv)
    try:
        write_new(private_path + ".pub", pub, mode=0o644)
    except OSError:
        os.unlink(private_path)  # a key without its public half: none, so that a rerun makes both
        raise
    return private_path + ".pub"


class Signer:
    def __init__(self, private_path: str) -> None:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        try:
            key = serialization.load_pem_private_key(read_key(private_path, "private key"), password=None)
        except (ValueError, TypeError) as e:
            hint = (f"; it is a public key: sign with its private key{' ' + private_path[:-4] if private_path.endswith('.pub') else ''}"
                    if b"PUBLIC KEY" in read_key(private_path, "private key") else "")
            raise UsageError(f"{private_path}: cannot load a private key ({e}); nothing was written{hint}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise UsageError(f"{private_path}: not an Ed25519 private key")
        self._key = key
        self.key_id = key_id(key.public_key())

    def sign(self, message: bytes) -> str:
        return self._key.sign(message).hex()

    def verifier(self) -> Verifier:
        """A verifier of this key's signatures (a publisher checks the records it follows with it)."""
        return Verifier.of_key(self._key.public_key())


class Verifier:
    def __init__(self, public_path: str) -> None:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            key = serialization.load_pem_public_key(read_key(public_path, "public key"))
        except (ValueError, TypeError) as e:
            hint = (f"; it is a private key: pass its public half, {public_path}.pub (deltarefit keygen writes both)"
                    if b"PRIVATE KEY" in read_key(public_path, "public key") else "")
            raise UsageError(f"{public_path}: cannot load a public key ({e}); nothing was written{hint}") from None
        if not isinstance(key, Ed25519PublicKey):
            raise UsageError(f"{public_path}: not an Ed25519 public key")
        self._key = key
        self.key_id = key_id(key)

    @classmethod
    def of_key(cls, public_key) -> Verifier:
        """A verifier over an already loaded Ed25519 public key."""
        v = cls.__new__(cls)
        v._key = public_key
        v.key_id = key_id(public_key)
        return v

    def verify(self, message: bytes, signature_hex: str, where: str) -> None:
        from cryptography.exceptions import InvalidSignature

        try:
            self._key.verify(bytes.fromhex(signature_hex), message)
        except (InvalidSignature, ValueError):
            raise SignatureError(f"{where}: signature does not verify with key {self.key_id}") from None


def record_signature(signer: Signer, message: bytes) -> dict[str, str]:
    """The ``signature`` field of a commit record (plain or sharded) over its ``signed_bytes()``."""
    return {"alg": SIGNATURE_ALG, "key_id": signer.key_id, "sig": signer.sign(message)}


def _other_alg(alg: object, where: str) -> SignatureError:
    return SignatureError(f"{where}: commit record is signed with {str(alg)[:40]!r}, not {SIGNATURE_ALG} (signed "
                          "over a re-serialisation by an older publisher: republish it with this one)")


def check_record_signature(signature: dict[str, str] | None, message: bytes, verifier: Verifier,
                           where: str) -> None:
    """Refuse (SignatureError) a record without an Ed25519 signature, or one whose signature does not
    verify with ``verifier``'s key over ``message`` (its ``signed_bytes()``)."""
    if not signature or "sig" not in signature:
        raise SignatureError(f"{where}: commit record is not signed")
    if signature.get("alg") != SIGNATURE_ALG:
        raise _other_alg(signature.get("alg"), where)
    _verify(verifier, message, signature["sig"], signature.get("key_id"), where)


def check_stored_signature(data: bytes, verifier: Verifier, where: str) -> None:
    """Refuse (SignatureError) a record's stored bytes ``data`` unless they carry one signature member
    in the form ``to_bytes`` writes it, whose signature verifies with ``verifier``'s key over the rest
    of the bytes (``signed_bytes``). Nothing is parsed: a scan of the text for the member and one copy
    of it, so a forged or unsigned record of any shape costs about twice its size before it is refused."""
    found = _STORED_SIGNATURE.finditer(data)
    m = next(found, None)
    if m is None:
        if b'"signature"' in data:  # a signature, but not in the bytes as signed: re-serialised or edited
            raise SignatureError(f"{where}: signature does not verify with key {verifier.key_id} (the record's "
                                 "bytes are not as signed: re-serialised or edited after signing)")
        raise SignatureError(f"{where}: commit record is not signed")
    if next(found, None) is not None:
        raise SignatureError(f"{where}: commit record carries more than one signature")
    alg, key, sig = (g.decode("ascii", "replace") for g in m.groups())
    if alg != SIGNATURE_ALG:
        raise _other_alg(alg, where)
    _verify(verifier, b"".join((SIGNED_PREFIX, memoryview(data)[:m.start()], memoryview(data)[m.end():])), sig,
            key, where)


def _verify(verifier: Verifier, message: bytes, sig: str, other: str | None, where: str) -> None:
    try:
        verifier.verify(message, sig, where)
    except SignatureError as e:
        if other and other != verifier.key_id:
            raise SignatureError(f"{e} (the record names key {other}): the key given is likely not the publisher's; "
                                 f"give the public key of the pair it signs with (key {other})") from None
        raise


def key_id(public_key) -> str:
    """A short stable id of a public key: the first 16 hex digits of BLAKE3 of its raw bytes."""
    import blake3
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return blake3.blake3(raw).hexdigest(8)
