"""What ``enable`` was given and what it replaced, shared by the package's ``enable`` and the client TRL
builds (``client.DeltaRefitVLLMClient``): ``TRLSync``, ``RolloutVersion``, ``settings()``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import UsageError


@dataclass(frozen=True)
class TRLSync:
    """What ``enable`` was given; read by each client TRL builds afterwards."""

    stream: str  # a directory or an s3:// URL the server can read
    state_dir: str  # the publisher's baseline (default: beside a local stream, else in the user cache)
    signing_key: str | None = None  # Ed25519 private key PEM: every record signed
    verify_key: str | None = None  # its public key, handed to the server's workers at init
    served: str | None = None  # "BF16" / "F16" / "F32"; default: the server's model dtype
    keyframe_every: int = 20
    timeout: float = 300.0  # seconds for one route call to the server
    format_version: int | None = None  # of the deltas, 1 or 2; None: the stream's (``Publisher``)


@dataclass(frozen=True)
class RolloutVersion:
    """The version a server's workers hold, as they report it after their last verified update."""

    version: int
    fingerprint: str
    weight_version: str  # vLLM's label (``GET /weight_info``): ``str(version)`` after a deltarefit sync


class _State:
    settings: TRLSync | None = None
    original: Any = None  # TRL's own VLLMClient, while enabled
    clients: list[Any] = []  # noqa: RUF012 (one instance) clients built since enable, newest last


_state = _State()


def settings() -> TRLSync:
    """The settings of the last ``enable``; refuses when it was not called."""
    if _state.settings is None:
        raise UsageError("deltarefit.integrations.trl: call enable(stream=...) before the trainer is built")
    return _state.settings
