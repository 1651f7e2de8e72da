"""deltarefit: bit-exact compressed weight deltas for RL refit.

Encode the change between two checkpoints, ship it, apply it in place, verify the fingerprint.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import _moved
from ._release import RELEASE as __version__  # the one spelling of the release (format.RELEASE is this)

# Every public name is imported on first use (PEP 562): ``import deltarefit`` loads neither numpy nor any
# codec, so the command line decides how numpy starts (``cli.common._numpy_with_one_blas_thread``) and a command that
# needs none of them (``--help``, ``--version``) does not pay for them. ``from deltarefit import X`` and
# ``deltarefit.X`` work as eager imports would, for every name in ``__all__``. ``apply`` and ``encode``
# are the modules, each callable as its function of that name (``_callable``): both
# ``deltarefit.apply(delta, ckpt)`` and ``deltarefit.apply.Journal`` work. ``shard`` (sharded trainers
# and tensor-parallel rollouts, docs/SHARDING.md) is a subpackage, with numba behind it.
_ERRORS = (
    "AuthError", "BadPartError", "BaseMismatchError", "BroadcastError", "CheckpointError", "DecodeError",
    "DeltaRefitError", "FileSystemError", "FormatError", "InputChangedError", "IntegrityError", "LimitError",
    "LockedError",
    "MalformedRecordError", "ProtocolError", "PublishError", "SignatureError", "StoreError", "StreamError",
    "StreamIdentityError", "UnsupportedVersionError", "UntrustedError", "UsageError", "VerificationError",
)
_WHERE = {
    **dict.fromkeys(_ERRORS, ".errors"),
    "fingerprint": ".api", "inspect": ".api", "verify": ".api",
    "ApplyReport": ".apply", "EncodeReport": ".encode", "KnownHashes": ".encode", "known_hashes": ".encode",
}
_MODULES = ("apply", "encode", "shard")

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from . import apply, encode, shard
    from .api import fingerprint, inspect, verify
    from .apply import ApplyReport
    from .encode import EncodeReport, KnownHashes, known_hashes
    from .errors import (
        AuthError,
        BadPartError,
        BaseMismatchError,
        BroadcastError,
        CheckpointError,
        DecodeError,
        DeltaRefitError,
        FileSystemError,
        FormatError,
        InputChangedError,
        IntegrityError,
        LimitError,
        LockedError,
        MalformedRecordError,
        ProtocolError,
        PublishError,
        SignatureError,
        StoreError,
        StreamError,
        StreamIdentityError,
        UnsupportedVersionError,
        UntrustedError,
        UsageError,
        VerificationError,
    )

_moved.install()  # the old module paths (``deltarefit.applier``, ...), for one release

__all__ = [
    "ApplyReport",
    "AuthError",
    "BadPartError",
    "BaseMismatchError",
    "BroadcastError",
    "CheckpointError",
    "DecodeError",
    "DeltaRefitError",
    "EncodeReport",
    "FileSystemError",
    "FormatError",
    "InputChangedError",
    "IntegrityError",
    "KnownHashes",
    "LimitError",
    "LockedError",
    "MalformedRecordError",
    "ProtocolError",
    "PublishError",
    "SignatureError",
    "StoreError",
    "StreamError",
    "StreamIdentityError",
    "UnsupportedVersionError",
    "UntrustedError",
    "UsageError",
    "VerificationError",
    "__version__",
    "apply",
    "encode",
    "fingerprint",
    "inspect",
    "known_hashes",
    "shard",
    "verify",
]


def __getattr__(name: str):
    if name in _MODULES:
        value = importlib.import_module(f".{name}", __name__)
    elif name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    elif not name.startswith("_") and f"{__name__}.{name}" not in _moved.MOVED:
        # A subpackage by attribute (``deltarefit.format.DeltaReader`` after ``import deltarefit``), as
        # when this package imported them all.
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # the next look-up is an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
