"""Signed commit records: Ed25519 over the record's canonical bytes (``cryptography``).

Keys are PEM files: ``keygen`` writes a private key (mode 0600) and its public key beside it.
A subscriber configured with a public key refuses records that are unsigned, signed by another key,
or altered after signing.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .errors import SignatureError, UsageError
from .io.fsutil import read_small, write_new

KEY_MAX_BYTES = 8 << 10  # an Ed25519 key's PEM is about 120 bytes; a key file past this is no key


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

    def signed_bytes(self) -> bytes:
        """The canonical bytes a signature covers: sorted-key compact JSON of everything but it."""
        return json.dumps(self.body(), sort_keys=True, separators=(",", ":")).encode("utf-8")

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
    return {"alg": "ed25519", "key_id": signer.key_id, "sig": signer.sign(message)}


def check_record_signature(signature: dict[str, str] | None, message: bytes, verifier: Verifier,
                           where: str) -> None:
    """Refuse (SignatureError) a record without an Ed25519 signature, or one whose signature does not
    verify with ``verifier``'s key over ``message`` (its ``signed_bytes()``)."""
    if not signature or signature.get("alg") != "ed25519" or "sig" not in signature:
        raise SignatureError(f"{where}: commit record is not signed")
    try:
        verifier.verify(message, signature["sig"], where)
    except SignatureError as e:
        other = signature.get("key_id")
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
