"""One closed exception hierarchy. Callers catch by meaning; the CLI renders each as one line.

Every error names *what* is wrong and *where* (file, tensor, chunk) and, where it helps, what to do.
Every class deltarefit raises on purpose is defined here (the modules that raise them re-export
them: ``deltarefit.stream.records.StreamError`` is this module's ``StreamError``), so the set is
closed: :data:`ERRORS` names each, and :func:`error_from_name` rebuilds one from its name without
unpickling anything (a worker's error that crossed a process boundary as ``(name, message)``).

Each class's ``exit_code`` is what the CLI returns for it (a subclass shares its parent's); the CLI's
module docstring and docs/COMMAND-LINE.md list them.
"""

from __future__ import annotations


class DeltaRefitError(Exception):
    """Base of every error deltarefit raises on purpose. ``exit_code`` is what the CLI returns."""

    exit_code = 1


class FormatError(DeltaRefitError):
    """A delta file is malformed: bad magic, unknown version, lying lengths, a broken record."""

    exit_code = 3


class UnsupportedVersionError(FormatError):
    """The delta was written by a newer (or unknown) format version."""


class IntegrityError(FormatError):
    """Bytes do not hash to what the file says: truncation, bit flips, tampering."""


class LimitError(FormatError):
    """A declared size exceeds a hard limit (header, manifest, chunk, decompressed size)."""


class DecodeError(FormatError):
    """An encoded chunk does not decode: out-of-range positions, overrun streams, bad counts."""


class CheckpointError(DeltaRefitError):
    """A checkpoint cannot be read or written: missing file, bad safetensors header, bad index."""

    exit_code = 4


class FileSystemError(DeltaRefitError, OSError):
    """A local file operation failed: no space left, a read-only filesystem, permission denied, a
    missing directory, a path that is not what it must be (a directory, a loop of links).

    The message names the operation and the path, and the system's reason (:meth:`of`). Also an
    ``OSError`` carrying the cause's ``errno`` and ``strerror``, so that code which handles ``OSError``
    still does (not its subclasses: a missing directory is no longer a ``FileNotFoundError``)."""

    exit_code = 12

    @classmethod
    def of(cls, what: str, e: OSError) -> FileSystemError:
        """``what`` (``"PATH: cannot write the delta"``) failed with ``e``: one line, its errno kept."""
        if isinstance(e, FileSystemError):
            return e
        err = cls(f"{what} ({e.strerror or e})")
        err.errno, err.strerror = e.errno, e.strerror  # for code that reads them off any OSError
        return err

    def __str__(self) -> str:  # the message, not OSError's "[Errno N] strerror"
        return str(self.args[0]) if self.args else ""


class BaseMismatchError(DeltaRefitError):
    """The checkpoint is not the base this delta applies to (wrong tensor, dtype, shape or bytes).

    Raised before any byte is written.
    """

    exit_code = 5


class VerificationError(DeltaRefitError):
    """A result does not match its expected fingerprint or digest."""

    exit_code = 6


class InputChangedError(VerificationError):
    """A publisher's input (a checkpoint file, tensors in memory) changed while it was published: what
    was hashed is not what was encoded or uploaded. Nothing was committed; publishing again is safe."""


class UsageError(DeltaRefitError):
    """The caller asked for something that cannot work (bad option combination, wrong argument)."""

    exit_code = 2


class LockedError(DeltaRefitError):
    """Another run holds what this one would write (a checkpoint, a publisher's state directory).

    Raised before anything is read or written; the message names the holder (pid and host)."""

    exit_code = 11


class StoreError(DeltaRefitError):
    """A storage operation failed (I/O, permissions, a lost connection)."""

    exit_code = 7


class SignatureError(DeltaRefitError):
    """A commit record is unsigned, or its signature does not verify with the configured key."""

    exit_code = 8


class UntrustedError(SignatureError):
    """An engine was asked to follow, or to load from, what its own configuration does not trust: a
    stream outside its pinned streams, another verify key than its pinned one (or none), a path outside
    its pinned roots, a version no record signed by its pinned key names."""


class StreamError(DeltaRefitError):
    """A version stream is inconsistent with what the caller holds: broken chain, wrong parent,
    a version that does not exist or was pruned, a lost publish race."""

    exit_code = 9


class MalformedRecordError(StreamError):
    """A commit record that is not a well-formed record of its version: not JSON, another format,
    inconsistent fields, a part outside its version, a record that names another version."""


class StreamIdentityError(StreamError):
    """A commit record belongs to another stream than the one the caller follows (a version copied
    from another run's store, a store wiped and republished, a record stripped of its identity)."""


class PublishError(StreamError):
    """This publish did not commit (lost a race, or the joint commit was not acknowledged)."""


class BroadcastError(StreamError):
    """A broadcast refit failed on some rank (the message names the rank and the cause)."""


class ProtocolError(DeltaRefitError):
    """A peer broke the relay protocol: failed authentication, a tampered or malformed frame, an
    unexpected message, or a relay that cannot be reached or joined."""

    exit_code = 10


class AuthError(ProtocolError):
    """The peer's frame did not verify under our key (the relays' keys differ, or a frame was
    tampered with), or the peer said ours did not."""


class BadPartError(ProtocolError):
    """A part's received bytes do not hash to its commit record's BLAKE3 (its sender serves rotten
    bytes, or they were damaged on the way)."""


ERRORS: dict[str, type[DeltaRefitError]] = {
    n: c for n, c in sorted(globals().items()) if isinstance(c, type) and issubclass(c, DeltaRefitError)
}
"""Every error class of the hierarchy, by name (the base included)."""


def error_from_name(name: object, message: str) -> DeltaRefitError:
    """The error of class ``name`` (one of :data:`ERRORS`) with ``message``; a ``DeltaRefitError``
    when ``name`` is not one of them. Only a look-up: nothing is unpickled or imported."""
    cls = ERRORS.get(name) if isinstance(name, str) else None
    return (cls or DeltaRefitError)(message)
