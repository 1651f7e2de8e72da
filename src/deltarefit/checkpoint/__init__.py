"""Safetensors checkpoints as raw bit patterns (the contract is in ``read``'s docstring).

* ``read``    open and validate a file or directory checkpoint over mmap, view and patch tensors in place,
              fingerprint it
* ``parse``   a file's header, parsed strictly into ``TensorInfo``
* ``write``   ``write_safetensors``: stream tensors into a new file, atomically
* ``header``  what both share: the header size limit, ``TensorSource``, the entry checks
"""

from .header import MAX_HEADER_BYTES, TensorSource
from .read import (
    INDEX_NAME,
    Checkpoint,
    TensorInfo,
    fingerprint_checkpoint,
    is_checkpoint,
    modified_since,
    open_checkpoint,
    replaced_since,
)
from .write import write_safetensors

__all__ = [
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "Checkpoint",
    "TensorInfo",
    "TensorSource",
    "fingerprint_checkpoint",
    "is_checkpoint",
    "modified_since",
    "open_checkpoint",
    "replaced_since",
    "write_safetensors",
]
