"""deltarefit: bit-exact compressed weight deltas for RL refit.

Encode the change between two checkpoints, ship it, apply it in place, verify the fingerprint.
"""

# ``apply`` and ``encode`` are the modules, each callable as its function of that name (``_callable``): both
# ``deltarefit.apply(delta, ckpt)`` and ``deltarefit.apply.Journal`` work.
from . import _moved, apply, encode
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
from .format.layout import RELEASE as __version__  # one spelling of the release, below this package

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
    # ``shard`` (sharded trainers and tensor-parallel rollouts, docs/SHARDING.md) is imported on first
    # use (PEP 562): a CLI call or ``import deltarefit`` does not pay for it, nor for numba.
    if name == "shard":
        import importlib

        return importlib.import_module(".shard", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
