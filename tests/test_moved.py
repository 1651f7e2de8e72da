"""Old module paths keep working for one release (``deltarefit._moved``): each imports as the very module at
its new path, with a DeprecationWarning naming it; the paths users pass by name keep resolving."""

import importlib
import importlib.util
import sys
import warnings

import pytest

from deltarefit._moved import MOVED

NEEDS = {"deltarefit.engines.vllm.backend": "vllm", "deltarefit.apply.tensors": "torch"}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_the_new_module(old):
    new = MOVED[old]
    if new in NEEDS and importlib.util.find_spec(NEEDS[new]) is None:
        pytest.skip(f"{new} needs {NEEDS[new]} (torch: the test extra; vllm: make test-vllm)")
    mod = importlib.import_module(new)
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        got = importlib.import_module(old)
    assert got is mod and sys.modules[old] is mod
    parent, _, last = old.rpartition(".")
    assert getattr(sys.modules[parent], last) is mod
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module(old) is mod  # imported once: no second warning


def test_from_old_path_import_name():
    sys.modules.pop("deltarefit.applier", None)
    with pytest.warns(DeprecationWarning):
        from deltarefit.applier import run_apply
    from deltarefit.apply.protocol import run_apply as new

    assert run_apply is new


def test_unknown_names_are_still_missing():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("deltarefit.no_such_module")


def test_worker_extension_by_its_dotted_path():
    """vLLM resolves ``worker_extension_cls`` by module path and attribute, as here; neither vLLM nor torch is
    imported by it."""
    from deltarefit.engines.vllm import EXTENSION
    from deltarefit.engines.vllm.extension import DeltaRefitWorkerExtension

    assert EXTENSION == "deltarefit.engines.vllm.DeltaRefitWorkerExtension"
    module, _, name = EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(module), name) is DeltaRefitWorkerExtension


def test_the_plugin_names_the_backend_module():
    import deltarefit_vllm_plugin as plugin

    assert plugin.MODULE == "deltarefit.engines.vllm.backend"
    assert importlib.util.find_spec(plugin.MODULE) is not None


def test_packages_keep_the_old_modules_names():
    """``deltarefit.apply``, ``deltarefit.cli`` and ``deltarefit.engines.vllm`` were modules and are packages:
    each still has the names callers used, and ``deltarefit.apply`` is still callable."""
    import deltarefit.apply
    import deltarefit.cli
    import deltarefit.engines.vllm
    from deltarefit.apply import files, journal, protocol

    assert callable(deltarefit.apply) and deltarefit.apply.apply is files.apply
    assert deltarefit.apply.Journal is journal.Journal and deltarefit.apply.run_apply is protocol.run_apply
    assert deltarefit.apply.ApplyReport is deltarefit.ApplyReport
    with pytest.warns(DeprecationWarning):
        assert deltarefit.apply._new_tensor_chunks is files._new_tensor_chunks
    assert callable(deltarefit.cli.main)
    for name in ("refit_engine", "refit_engine_in_place", "prepare_refit_in_place", "reload_engine",
                 "sync_engine", "engine_digests", "layer_key", "reload_set"):
        assert callable(getattr(deltarefit.engines.vllm, name)), name
    assert deltarefit.__version__


def test_release_has_one_spelling_below_the_package():
    """``deltarefit.__version__`` is ``format.RELEASE`` (what encode and compose name in a manifest's
    ``encoder``, importable without the package's ``__init__``), which pyproject.toml reads as its version."""
    import tomllib
    from pathlib import Path

    import deltarefit
    from deltarefit.format import RELEASE

    assert deltarefit.__version__ is RELEASE
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    meta = tomllib.loads(pyproject.read_text())
    assert meta["project"]["dynamic"] == ["version"]  # read from the one place it is written
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "deltarefit._release.RELEASE"}


def _fresh(code: str) -> str:
    """Run ``code`` in a new interpreter (a package imported from nothing) and return its stdout."""
    import subprocess

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_every_public_name_imports_lazily():
    """``import deltarefit`` loads no numpy and no public module; then, in a new process each, ``from
    deltarefit import X`` and ``deltarefit.X`` give, for every name of ``__all__``, the object its
    defining module holds (``apply`` and ``encode`` the callable modules), and ``dir()`` lists them."""
    import deltarefit

    mods = ("numpy", "deltarefit.apply", "deltarefit.encode", "deltarefit.api", "deltarefit.format")
    assert _fresh(f"import sys, deltarefit; print([m for m in {mods!r} if m in sys.modules])") == "[]"
    where = {**dict.fromkeys(("fingerprint", "inspect", "verify"), "deltarefit.api"),
             "ApplyReport": "deltarefit.apply", "EncodeReport": "deltarefit.encode",
             "KnownHashes": "deltarefit.encode", "known_hashes": "deltarefit.encode",
             "__version__": "deltarefit._release"}
    checks = []
    for name in deltarefit.__all__:
        if name in ("apply", "encode", "shard"):
            want = f"importlib.import_module('deltarefit.{name}')"
        elif name == "__version__":
            want = "importlib.import_module('deltarefit._release').RELEASE"
        else:
            want = f"getattr(importlib.import_module({where.get(name, 'deltarefit.errors')!r}), {name!r})"
        checks.append(f"from deltarefit import {name} as got\nassert got is {want}, {name!r}\n"
                      f"assert deltarefit.{name} is got, {name!r}\nassert {name!r} in dir(deltarefit)")
    code = "import importlib, deltarefit\n" + "\n".join(checks) + "\nprint('ok')"
    assert _fresh(code) == "ok"
    assert callable(deltarefit.apply) and callable(deltarefit.encode)
    assert deltarefit.apply.Journal is importlib.import_module("deltarefit.apply.journal").Journal
    # Subpackages by attribute, as when the package imported them; the old paths only by import
    assert _fresh("import deltarefit\nprint(deltarefit.format.DeltaReader.__name__, deltarefit.errors.UsageError"
                  ".__name__, hasattr(deltarefit, 'applier'), hasattr(deltarefit, '_nothing'))") == (
        "DeltaReader UsageError False False")
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        deltarefit.nothing_here  # noqa: B018
    with pytest.raises(ImportError):
        exec("from deltarefit import nothing_here", {})
