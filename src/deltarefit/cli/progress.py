"""The command line's progress bars: rich bars on stderr, over bytes, with a rate and an ETA.

Shown only where stderr is a terminal, and neither ``--quiet`` nor ``DELTAREFIT_NO_PROGRESS=1`` turns
them off; rich is imported only then (a command run in a script, or with ``-q``, never loads it). What
the bars count comes from the library's ``progress`` callables, which import nothing to show them:

* ``bar(label, total, quiet)``: one bar over ``total`` bytes, for ``progress(n)`` callables (encode,
  apply, compose: bytes of the checkpoint processed).
* ``phases(quiet)``: a ``stream.progress.Opener`` for a publish or a sync, ``opener(label, total)``
  opening one bar per phase (the encode, the upload, a keyframe's download, each version's apply),
  the one before it removed.

Every bar is transient: it is erased when the work ends, and stdout carries only the command's output.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def enabled(quiet: bool) -> bool:
    """Whether bars are shown: stderr is a terminal, no ``--quiet``, no ``DELTAREFIT_NO_PROGRESS``."""
    return not quiet and sys.stderr.isatty() and os.environ.get("DELTAREFIT_NO_PROGRESS", "") in ("", "0")


def _display(file=None):
    """A rich Progress on stderr (``file``: drawn there as to a terminal, whatever it is): label, bar, bytes
    done of the total, rate, time left."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    console = Console(stderr=True) if file is None else Console(file=file, force_terminal=True)
    return Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), transient=True, console=console)


@contextmanager
def bar(label: str, total: int, quiet: bool, *, file=None) -> Iterator[Callable[[int], None] | None]:
    """A bar over ``total`` bytes, advanced by the callable yielded; None when bars are off or ``total`` is 0.
    ``file``: draw it there, as to a terminal, whether or not stderr is one (``apps.bench.progress``)."""
    if (file is None and not enabled(quiet)) or total <= 0:
        yield None
        return
    with _display(file) as p:
        task = p.add_task(label, total=total)
        yield lambda n: p.update(task, advance=n)


@contextmanager
def phases(quiet: bool) -> Iterator[Callable[[str, int], Callable[[int], None]] | None]:
    """An opener of one bar per phase (``stream.progress.Opener``); None when bars are off. The display
    starts with the first phase, so a publish or sync with no long phase (a no-op) shows nothing."""
    if not enabled(quiet):
        yield None
        return
    shown: dict = {}

    def opener(label: str, total: int) -> Callable[[int], None]:
        if "p" not in shown:
            shown["p"] = _display()
            shown["p"].start()
        p = shown["p"]
        if "task" in shown:
            p.refresh()  # the phase's last state, its rate included, drawn once (a fast one may have had no frame)
            p.remove_task(shown["task"])
        task = shown["task"] = p.add_task(label, total=max(total, 1))
        return lambda n: p.update(task, advance=n)

    try:
        yield opener
    finally:
        if "p" in shown:
            shown["p"].stop()
