"""What a subscriber's sync ends with: ``SyncReport`` (``Subscriber.sync``), and ``Planned`` (a plan-only
sync, ``Subscriber.plan``, that stopped before its first write)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SyncReport:
    from_version: int
    version: int
    fingerprint: str
    route: str  # "none", "chain", "keyframe"
    bytes_fetched: int
    versions_applied: list[int] = field(default_factory=list)
    seconds: float = 0.0
    # True only when this sync hashed the checkpoint and it gave ``fingerprint`` (every apply does; at
    # the head, files whose identity changed since the last verification, or ``verify=True``). False
    # at the head when the checkpoint's files are unchanged since they were verified at ``version``.
    verified: bool = False
    # Chunk payloads the plan read before their part had wholly arrived: the download and the first
    # plan overlapped (0 on the staged path: keyframe routes, engine hooks, stores without ranged reads).
    early_reads: int = 0


@dataclass(frozen=True)
class Planned:
    """What a plan-only sync (``Subscriber.plan``) ends with when the holder is behind: the route from
    ``from_version`` to ``version`` staged and checked, its first step handed to ``Holder.plan`` (a
    delta, where the holder ``plans``), nothing written and nothing recorded."""

    from_version: int
    version: int
    route: str
