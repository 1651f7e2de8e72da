"""Modules that are also their main function: ``deltarefit.apply`` and ``deltarefit.encode``.

``deltarefit.apply(delta, checkpoint)`` is the library's entry point, and ``deltarefit.apply`` is also the
module that holds the protocol's names (``deltarefit.apply.Journal``). A module whose class is
``CallableModule`` is both: calling it calls the function it names, and ``import deltarefit.apply`` then
``deltarefit.apply.Journal`` work as well as ``from deltarefit import apply; apply(...)``.
"""

from __future__ import annotations

import sys
import types


class CallableModule(types.ModuleType):
    """A module that, called, calls its function of the same name (``__call_name__``)."""

    def __call__(self, *args, **kwargs):
        return getattr(self, self.__call_name__)(*args, **kwargs)


def make_callable(module_name: str, function_name: str) -> None:
    """Make module ``module_name`` callable as its function ``function_name`` (call at its end)."""
    mod = sys.modules[module_name]
    mod.__class__ = CallableModule
    mod.__call_name__ = function_name
