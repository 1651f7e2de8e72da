"""Where elements are: ``projection``, the affine maps between a local piece (a trainer's shard, a rank's
slice, a row range of a fused engine parameter) and the checkpoint tensor it covers, DTensor placements,
and box intersections. Sharded publishing (``shard``) and live engines (``engines``) both place bits by it.
"""
