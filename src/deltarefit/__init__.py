"""deltarefit: bit-exact compressed weight deltas for RL refit.

Encode the change between two checkpoints, ship it, apply it in place, verify the fingerprint.
"""

__version__ = "0.1.0"

from .apply import ApplyReport, apply  # noqa: E402
from .api import fingerprint, inspect, verify  # noqa: E402
from .encode import EncodeReport, encode  # noqa: E402
from .errors import (  # noqa: E402
    BaseMismatchError,
    CheckpointError,
    DecodeError,
    DeltaRefitError,
    FormatError,
    IntegrityError,
    LimitError,
    UnsupportedVersionError,
    UsageError,
    VerificationError,
)

__all__ = [
    "ApplyReport",
    "BaseMismatchError",
    "CheckpointError",
    "DecodeError",
    "DeltaRefitError",
    "EncodeReport",
    "FormatError",
    "IntegrityError",
    "LimitError",
    "UnsupportedVersionError",
    "UsageError",
    "VerificationError",
    "__version__",
    "apply",
    "encode",
    "fingerprint",
    "inspect",
    "verify",
]
