"""One closed exception hierarchy. Callers catch by meaning; the CLI renders each as one line.

Every error names *what* is wrong and *where* (file, tensor, chunk) and, where it helps, what to do.
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


class BaseMismatchError(DeltaRefitError):
    """The checkpoint is not the base this delta applies to (wrong tensor, dtype, shape or bytes).

    Raised before any byte is written.
    """

    exit_code = 5


class VerificationError(DeltaRefitError):
    """A result does not match its expected fingerprint or digest."""

    exit_code = 6


class UsageError(DeltaRefitError):
    """The caller asked for something that cannot work (bad option combination, wrong argument)."""

    exit_code = 2


class LockedError(DeltaRefitError):
    """Another run holds what this one would write (a checkpoint, a publisher's state directory).

    Raised before anything is read or written; the message names the holder (pid and host)."""

    exit_code = 11
