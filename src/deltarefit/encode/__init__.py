"""Encode a delta between two checkpoints (``encode``), the change a rollout applies to reach the target.

* ``encoder``   ``encode``, ``encode_checkpoints``: drive an encode and write the delta file atomically;
                ``EncodeReport``; ``known_hashes`` and ``additive_digests`` of a checkpoint
* ``work``      the work per segment of each tensor (``Work``) and per tensor (``_Job``): hash and code
* ``pipeline``  the worker pool that runs the works in batches and returns their results in order

``deltarefit.encode`` is also callable as ``encoder.encode`` (``_callable``): ``deltarefit.encode(base,
target, out)``. It exports every public name the module ``deltarefit.encode`` had before it was this
package.
"""

from .._callable import make_callable
from ..known import KnownHashes
from .encoder import EncodeReport, additive_digests, encode, encode_checkpoints, known_hashes
from .pipeline import BATCH_BYTES, default_threads
from .pipeline import _ordered as _ordered  # (tests reach the pipeline through this path)
from .work import PatchWorks, Work, tensor_meta, uint_view
from .work import _Job as _Job

__all__ = ["BATCH_BYTES", "EncodeReport", "KnownHashes", "PatchWorks", "Work", "additive_digests",
           "default_threads", "encode", "encode_checkpoints", "known_hashes", "tensor_meta", "uint_view"]

make_callable(__name__, "encode")
