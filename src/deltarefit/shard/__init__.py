"""Sharded trainers and tensor-parallel rollouts (docs/SHARDING.md). The piece geometry they use is
``geometry.projection``; the additive digests, ``integrity.additive``.

* ``convert``     the one fp32 master -> served bits function (bf16, fp16, block-scaled fp8)
* ``names``       name tables (``tables.py``) -> trainer / tensor-parallel rollout layouts
* ``part``        the part format (JSON header + codec payloads) and the version manifest (``join``)
* ``publish``     ``ShardPublisher``: each trainer rank diffs its own shard into its part
* ``rollout``     ``apply_version``: in place into a rank's slices, pre-image checked, O(chunk) memory
* ``stream``      sharded versions in a version stream: ``ShardStreamPublisher`` (``trainer``: every
                  trainer rank uploads its part, one commits), ``sync_sharded`` (``sync``: a rollout rank
                  follows the stream), ``retain_sharded`` (``retention``); records in ``records``
"""

import importlib

# Imported on first use (``deltarefit.shard.X``): ``from deltarefit.shard import names`` then loads the
# name tables alone, not numba and the part format with it.
_FROM = {"export_full": "convert", "to_served_bits": "convert", "cuts_from_layouts": "names",
         "identity_layout": "names", "llama_shapes": "names", "tp_layout": "names", "trainer_layout": "names",
         "join": "part", "read_part": "part", "PartStats": "publish", "ShardPublisher": "publish",
         "apply_version": "rollout", "apply_version_to_module": "rollout", "group_check": "rollout",
         "needed_ranks": "rollout", "slice_digests": "rollout", "ShardStreamPublisher": "stream",
         "retain_sharded": "stream", "sync_sharded": "stream"}


_SUBMODULES = {'convert', 'group', 'names', 'part', 'publish', 'records', 'retention', 'rollout', 'stream', 'sync', 'tables', 'trainer'}


def __getattr__(name: str):
    if name in _FROM:
        return getattr(importlib.import_module(f".{_FROM[name]}", __name__), name)
    if name in _SUBMODULES:  # ``deltarefit.shard.stream`` without importing it first, as before
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PartStats", "ShardPublisher", "ShardStreamPublisher", "apply_version", "apply_version_to_module",
           "cuts_from_layouts", "export_full", "group_check", "identity_layout", "join", "llama_shapes", "needed_ranks", "read_part",
           "retain_sharded", "slice_digests", "sync_sharded", "to_served_bits", "tp_layout", "trainer_layout"]
