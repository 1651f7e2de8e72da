"""The group's side of the one apply protocol (``protocol``) on a collective target
(``targets.CollectiveTarget``: segments assembled from parts several processes hold): every process
makes the same collective calls in the same order (``Inline``, ``in_step``), and after each step the
group agrees whether every process succeeded (``settle``, ``agreed``), so that a refusal in one process
stops all of them at the same point."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TypeVar

import numpy as np

from ..errors import DecodeError, VerificationError
from .targets import Capabilities, SegmentTarget

# What a process of a group raises when another one refused or failed at the same step.
GROUP_REFUSED = "another process of the group refused or failed at the same step of this apply (see its log)"
GROUP_DECODE_REFUSED = ("another process of the group refused to decode a chunk at the same step of this apply "
                        "(a corrupt payload, or a history its book does not hold; see its log)")

T = TypeVar("T")
R = TypeVar("R")


class Inline:
    """A stand-in for a thread pool that runs each task at once, on the calling thread, in order."""

    def __init__(self, *_a, **_k) -> None:
        self.failed: BaseException | None = None

    def __enter__(self) -> Inline:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def map(self, fn, it):
        return [fn(x) for x in it]

    def submit(self, fn, *args):
        f: Future = Future()
        if self.failed is not None:  # after a failure the rest is not run (results are taken in order)
            f.set_exception(self.failed)
            return f
        try:
            f.set_result(fn(*args))
        except BaseException as e:  # delivered by result(), as a pool would
            self.failed = e
            f.set_exception(e)
        return f


def in_step(fn: Callable[[T], R], calls: Callable[[T], object], items: Iterable[T]) -> list[R]:
    """``[fn(i) for i in items]`` on a collective target, where ``fn(i)`` makes the group's call for item
    ``i`` (``calls(i)``: a segment assembled over the group) and then local work that may fail in one
    process alone (a chunk whose history only some books hold): after the first failure the remaining
    items make their group call only, so that every process makes the same calls in the same order,
    and the failure is raised at the end (the group agrees on it next)."""
    out: list[R] = []
    err: Exception | None = None
    for i in items:
        if err is not None:
            calls(i)
            continue
        try:
            out.append(fn(i))
        except Exception as ex:
            err = ex
    if err is not None:
        raise err
    return out


def settle(caps: Capabilities, segs: SegmentTarget, err: BaseException | None) -> None:
    """The group's agreement on whether every process got here without a failure (``err``): raises
    ``err`` where it failed, ``VerificationError`` in the others, when any did. Where one process
    refused to decode (``DecodeError``: a corrupt payload, or a history its book does not hold),
    every process raises ``DecodeError``, so that all of them take the same way out (a subscriber
    starts its book over and plans again on that error alone)."""
    if caps.agree_each is not None:
        ok, decodes = (bool(x) for x in caps.agree_each(np.array([err is None, not isinstance(err, DecodeError)])))
    else:
        ok, decodes = segs.agree(err is None), True
    if err is not None and (decodes or isinstance(err, DecodeError)):
        raise err
    if not decodes:
        raise DecodeError(GROUP_DECODE_REFUSED + (f": {err}" if err is not None else "")) from err
    if not ok:
        raise VerificationError(GROUP_REFUSED)


def agreed(caps: Capabilities, segs: SegmentTarget, fn: Callable[..., R], *args) -> R:
    """``fn(*args)``; for a collective target, also the group's agreement that nobody failed."""
    if not caps.collective:
        return fn(*args)
    try:
        out = fn(*args)
    except Exception as ex:
        settle(caps, segs, ex)
    settle(caps, segs, None)
    return out
