"""The disk room a fresh sync needs, as a multiple of the checkpoint's size (docs/STREAMS.md):
``python -m deltarefit.apps.bench.fs_faults --room [--mib N]`` (root: it mounts tmpfs file systems)."""

from __future__ import annotations

import os
import tempfile

from .fs_machinery import cli, mount_refusal, sha, sha_or_none, tmpfs
from .relay import write_checkpoint


def fresh_sync_room(work: str, mib: float = 16.0, *, layout: str = "file") -> tuple[int, int]:
    """The smallest tmpfs (in 4 KiB pages, found by bisection over real ``python -m deltarefit sync``
    children) on which a fresh sync of a ``mib`` MiB checkpoint succeeds: a store (on plain disk) of
    versions 1..3, version 1 a keyframe, so that the sync installs the keyframe and applies two deltas;
    ``layout``: the checkpoint a file, or a directory. Returns (that size, the checkpoint's size) in
    bytes. Needs root (``mount_refusal``)."""
    from ...stream.publisher import Publisher

    steps = [os.path.join(work, f"s{i}.safetensors") for i in range(3)]
    write_checkpoint(steps[0], mib, seed=1)
    for i in (1, 2):
        write_checkpoint(steps[i], mib, seed=1 + i, mutate_from=steps[i - 1])
    store = os.path.join(work, "store")
    pub = Publisher(store, os.path.join(work, "publisher"), keyframe_every=50, keyframe_ratio=1000.0)
    for p in steps:
        pub.publish(p)
    size = os.path.getsize(steps[0])
    want = sha(steps[2])
    fs = os.path.join(work, "fs")

    def fits(pages: int) -> bool:
        with tmpfs(fs, pages * 4096):
            ck = os.path.join(fs, "ck.safetensors" if layout == "file" else "ck")
            run = cli(["sync", store, ck])
            got = sha_or_none(ck if layout == "file" else os.path.join(ck, "model.safetensors"))
            return run.rc == 0 and got == want

    lo, hi = size // 4096, 4 * size // 4096  # lo fails (a checkpoint needs its own size), hi fits
    if not fits(hi):
        raise RuntimeError(f"a fresh sync of {size} bytes did not fit in {hi * 4096} bytes")
    while hi - lo > max(1, lo // 200):  # to within half a percent
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi * 4096, size




def report(mib: float) -> None:
    """Print the room for a file and a directory checkpoint of ``mib`` MiB; SystemExit without root."""
    refused = mount_refusal()
    if refused is not None:
        raise SystemExit(f"--room: {refused}")
    for layout in ("file", "directory"):
        with tempfile.TemporaryDirectory(prefix="deltarefit-room-") as work:
            need, size = fresh_sync_room(work, mib, layout=layout)
        print(f"fresh sync, checkpoint a {layout} of {size:,} bytes: needs {need:,} bytes free "
              f"({need / size:.2f}x the checkpoint)")
