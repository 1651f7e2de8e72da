"""Old import paths of modules that moved, for one release: ``import deltarefit.applier`` gives the module
``deltarefit.apply.protocol`` itself (the same object, so patching either patches both), with a
``DeprecationWarning`` naming the new path.

A meta-path finder answers for the old names in ``MOVED`` only; ``deltarefit/__init__.py`` installs it.
Old names that are now packages (``deltarefit.apply``, ``deltarefit.checkpoint``, ``deltarefit.cli``,
``deltarefit.engines.vllm``) need no alias: each package exports what the module of that name did.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import warnings

MOVED = {
    "deltarefit.applier": "deltarefit.apply.protocol",
    "deltarefit.regions": "deltarefit.apply.host",
    "deltarefit.held": "deltarefit.apply.held",
    "deltarefit.plans": "deltarefit.apply.plans",
    "deltarefit.journal": "deltarefit.apply.journal",
    "deltarefit.torch_api": "deltarefit.apply.tensors",
    "deltarefit.cli_stream": "deltarefit.cli.stream",
    "deltarefit.apps.cli": "deltarefit.cli.apps",
    "deltarefit.engines.vllm_driver": "deltarefit.engines.vllm.driver",
    "deltarefit.engines.vllm_live": "deltarefit.engines.vllm.worker",
    "deltarefit.engines.vllm_backend": "deltarefit.engines.vllm.backend",
    "deltarefit.safetensors_write": "deltarefit.checkpoint.write",
    "deltarefit.elements": "deltarefit.codec.elements",
    "deltarefit.shard.digest": "deltarefit.integrity.additive",
    "deltarefit.shard._digest_numba": "deltarefit.integrity._additive_numba",
    "deltarefit.shard.projection": "deltarefit.geometry.projection",
    "deltarefit.fsutil": "deltarefit.io.fsutil",
    "deltarefit.jsonlimits": "deltarefit.io.jsonlimits",
    "deltarefit.locks": "deltarefit.io.locks",
}


class _Alias:
    """A meta-path finder and its loader (the import system calls these three methods by name). Not
    derived from ``importlib.abc``: that module imports ``importlib.resources`` and with it pathlib,
    tempfile, shutil, bz2, lzma and random, about 30 ms of every command's start for nothing."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return None  # a placeholder: exec_module puts the real module in its place

    def exec_module(self, module):
        old = module.__spec__.name
        new = MOVED[old]
        warnings.warn(f"{old} moved to {new}; the old path goes in the next release", DeprecationWarning,
                      stacklevel=2)
        # The import system returns what sys.modules holds under the old name after this call: the real
        # module, not the placeholder (and sets it as the parent package's attribute).
        sys.modules[old] = importlib.import_module(new)


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
