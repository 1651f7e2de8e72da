"""What a quiet run (``pytest -q``, ``make test``) says before its first dot: collection imports every test
module (torch, transformers, numba) and rewrites its asserts, which takes 35 s to minutes on 2 busy cores
and printed nothing. A line at the start, and one with the count and the time once collected.

Light on purpose: this module is imported by every run, before any test module.
"""

from __future__ import annotations

import os
import time

import pytest

_started: list[float] = []


def _quiet(config: pytest.Config) -> bool:
    return config.get_verbosity() < 0 and not config.option.collectonly


def pytest_collection(session: pytest.Session) -> None:
    if _quiet(session.config):
        _started.append(time.monotonic())
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        dirs = [a for a in session.config.args if os.path.isdir(a)]
        if tr is not None and dirs:  # a whole directory: the long collection (a file or two is quick)
            n = sum(f.startswith("test_") and f.endswith(".py") for d in dirs for f in os.listdir(d))
            tr.write_line(f"collecting {n} test files: every module is imported first (torch, transformers), "
                          "35 s to a few minutes on 2 busy cores before the first dot")


def pytest_collection_finish(session: pytest.Session) -> None:
    if _quiet(session.config) and _started:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line(f"collected {len(session.items)} tests in {time.monotonic() - _started[0]:.0f} s; "
                          "a dot per test passed")
