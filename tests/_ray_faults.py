"""Faults injected into a vLLM worker of an engine actor (tests/test_ray.py), through ``collective_rpc``."""

from __future__ import annotations

import os
import time

from deltarefit.engines.vllm import DeltaRefitWorkerExtension


def stall_mid_write(worker, marker: str, seconds: float = 600.0) -> None:
    """In the worker: the next segment write writes half its changes, then the worker writes ``marker`` and
    sleeps, holding the update open (the test kills the engine's process there)."""
    from deltarefit.codec.chunk import Patch

    live = worker.weight_transfer_engine.live
    for tgt in (live.live, *live.target._of.values()):
        real = tgt.write_segment

        def stalled(name, ci, region, view, patch, real=real):
            if patch.dense is None and patch.positions.size > 1:
                k = patch.positions.size // 2
                real(name, ci, region, view, Patch(patch.positions[:k], patch.values[:k], None))
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(seconds)
            raise TimeoutError("stalled write was not killed")

        tgt.write_segment = stalled


STALLING_EXTENSION = "_ray_faults.StallingExtension"  # importable where tests/ is on PYTHONPATH


class StallingExtension(DeltaRefitWorkerExtension):
    """deltarefit's worker extension plus ``deltarefit_test_stall(marker)``: ``stall_mid_write`` by name,
    for a server whose ``POST /collective_rpc`` takes a method's name and string arguments only."""

    def deltarefit_test_stall(self, marker: str) -> None:
        stall_mid_write(self, marker)
