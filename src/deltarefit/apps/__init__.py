"""The applications built on the library, kept apart from it: the demo (``deltarefit demo``), the refit-time
model (``deltarefit simulate``) and the benchmarks (``deltarefit bench``, ``python -m deltarefit.apps.bench``).

The library (``deltarefit`` and its other subpackages) never imports from here; only the command line does,
lazily, for those three commands.
"""
