"""Progress of a publish or a sync, for a caller that shows it (the command line's bars: ``cli.progress``).

An ``Opener`` is ``progress(label, total)``: it opens a phase of ``total`` bytes and returns the callable
that each ``n`` bytes done advance. ``Publisher.progress`` and ``Subscriber.progress`` (None: no calls)
open a phase for each long step: a publish's encode (bytes of the checkpoint), its upload (bytes of the
parts), a sync's download of the staged parts (a keyframe's: the checkpoint's size), each version's
apply (bytes of the checkpoint). The calls cost one callable call per segment or per MiB moved; the
stream imports nothing to show them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..storage.base import SET_PROGRESS, Store

Opener = Callable[[str, int], Callable[[int], None]]


def phase(opener: Opener | None, label: str, total: int) -> Callable[[int], None] | None:
    """The advance callable of a new phase, or None without an opener (the library's ``progress=None``)."""
    return None if opener is None else opener(label, total)


@contextmanager
def store_phase(store: Store, opener: Opener | None, label: str, total: int) -> Iterator[None]:
    """A phase fed by the bytes moved in or out of ``store`` meanwhile (``Store.set_progress``); nothing
    without an opener, a store that does not report them, or nothing to move."""
    if opener is None or total <= 0 or SET_PROGRESS not in store.capabilities:
        yield
        return
    store.set_progress(opener(label, total))
    try:
        yield
    finally:
        store.set_progress(None)


def tensor_bytes(checkpoint: Any) -> int:
    """The bytes of a checkpoint's tensors: a path (read from its headers), or ``ServedTensors``."""
    if isinstance(checkpoint, str):
        from ..checkpoint.read import open_checkpoint

        with open_checkpoint(checkpoint) as ck:
            return sum(t.nbytes for t in ck.tensors.values())
    return sum(t.nbytes for t in checkpoint.tensors.values())


def apply_phase(opener: Opener | None, rec: Any) -> Callable[[int], None] | None:
    """The phase of a sync's apply of version ``rec`` (a ``CommitRecord``): the checkpoint's bytes."""
    return phase(opener, f"sync: apply v{rec.version}", rec.full_bytes)


def reporting(apply: Callable[..., Any], opener: Opener | None, rec: Any) -> Callable[..., Any]:
    """``apply`` (``apply.files.apply``) reporting to the phase of version ``rec``'s apply."""
    return functools.partial(apply, progress=apply_phase(opener, rec))


def encoding(opener: Opener | None, checkpoint: Any) -> Callable[[int], None] | None:
    """The phase of a publish's encode of ``checkpoint`` (a path or ``ServedTensors``): its tensors' bytes."""
    return None if opener is None else opener("publish: encode", tensor_bytes(checkpoint))
