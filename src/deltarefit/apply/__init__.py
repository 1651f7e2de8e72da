"""The one apply protocol and its targets.

* ``protocol``  ``Applier``, ``run_apply``: plan (every check, nothing written), then write, against any target
* ``write``     ``ChunkWriter``: the protocol's write step (journal, write, read back, per chunk)
* ``verify``    the checks after the plan: a prepared plan rechecked, chunks read back, digests, fingerprint
* ``collective`` a collective target's agreements (one order, every process stops at the same step)
* ``targets``   the ``TensorTarget`` and ``SegmentTarget`` protocols a target implements, its optional
                capabilities, ``Capabilities`` (found once per apply), ``RawSegments``
* ``host``      the region operations on host memory (decode, post-image, hash, additive digest moves)
* ``plans``     the per-tensor and per-chunk plans the protocol builds
* ``held``      ``HeldPlans``: plans checked by a held additive digest (a live engine's tensors)
* ``journal``   the crash journal: pre-images of segments being written
* ``files``     the safetensors target: ``apply``/``check`` on a file or directory checkpoint in place
* ``tensors``   the torch target: ``apply_to_tensors``, ``apply_to_module`` (imports torch)

``deltarefit.apply`` is also callable as ``files.apply`` (``_callable``): ``deltarefit.apply(delta, ckpt)``.
"""

from .._callable import make_callable
from .files import (
    REPLACED_LIST,
    apply,
    check,
    checkpoint_lock,
    remove_dead_temps_of,
    remove_replaced_shards,
)
from .host import HOST_REGIONS, HostRegions
from .journal import JOURNAL_MAGIC, SLOT_BYTES, Journal, journal_path
from .protocol import DEFAULT_CACHE_BYTES, Applier, ApplyReport, run_apply
from .targets import RawSegments, SegmentTarget, TensorTarget, segments_of

__all__ = ["DEFAULT_CACHE_BYTES", "HOST_REGIONS", "JOURNAL_MAGIC", "REPLACED_LIST", "SLOT_BYTES", "Applier",
           "ApplyReport", "HostRegions", "Journal", "RawSegments", "SegmentTarget", "TensorTarget", "apply", "check",
           "checkpoint_lock", "journal_path", "remove_dead_temps_of", "remove_replaced_shards", "run_apply",
           "segments_of"]


def __getattr__(name: str):
    # Names the module ``deltarefit.apply`` had before it was this package (private ones included), for one
    # release: they live in ``files`` (which imports the protocol's).
    from . import files

    if name.startswith("__") or not hasattr(files, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings

    warnings.warn(f"deltarefit.apply.{name} moved: import it from its module in deltarefit.apply",
                  DeprecationWarning, stacklevel=2)
    return getattr(files, name)


make_callable(__name__, "apply")
