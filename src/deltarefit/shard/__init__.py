"""Sharded trainers and tensor-parallel rollouts (docs/SHARDING.md).

* ``convert``     the one fp32 master -> served bits function (bf16, fp16, block-scaled fp8)
* ``projection``  affine maps local shard <-> checkpoint tensor, DTensor placements, intersections
* ``names``       name tables (``tables.py``) -> trainer / tensor-parallel rollout layouts
* ``digest``      additive per-tensor digests, combinable across any partition
* ``part``        the part format (JSON header + codec payloads) and the version manifest (``join``)
* ``publish``     ``ShardPublisher``: each trainer rank diffs its own shard into its part
* ``rollout``     ``apply_version``: in place into a rank's slices, pre-image checked, O(chunk) memory
* ``stream``      sharded versions in a version stream: ``ShardStreamPublisher`` (``trainer``: every
                  trainer rank uploads its part, one commits), ``sync_sharded`` (``sync``: a rollout rank
                  follows the stream), ``retain_sharded`` (``retention``); records in ``records``
"""

from .convert import export_full, to_served_bits
from .names import cuts_from_layouts, identity_layout, llama_shapes, tp_layout, trainer_layout
from .part import join, read_part
from .publish import PartStats, ShardPublisher
from .rollout import apply_version, apply_version_to_module, group_check, needed_ranks, slice_digests
from .stream import ShardStreamPublisher, retain_sharded, sync_sharded

__all__ = ["PartStats", "ShardPublisher", "ShardStreamPublisher", "apply_version", "apply_version_to_module",
           "cuts_from_layouts", "export_full", "group_check", "identity_layout", "join", "llama_shapes", "needed_ranks", "read_part",
           "retain_sharded", "slice_digests", "sync_sharded", "to_served_bits", "tp_layout", "trainer_layout"]
