"""Transports that move a version's parts: link emulation, and (in sibling modules) fan-out paths."""

from .ratelimit import TokenBucket, parse_rate

__all__ = ["TokenBucket", "parse_rate"]
