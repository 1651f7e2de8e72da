"""A worker extension for tests/test_trl.py: deltarefit's, plus a method that stalls the next update's first
segment write (after it marks a file), so that a test kills the server while the workers are mid-update."""

from __future__ import annotations

import time

from deltarefit.engines.vllm import DeltaRefitWorkerExtension

EXTENSION = "_trl_stall.StallingExtension"


class StallingExtension(DeltaRefitWorkerExtension):
    def deltarefit_test_stall_writes(self, marker: str) -> bool:
        """The next segment write (in place or into a host copy) creates ``marker`` and then waits for a
        minute before it writes: the test kills the server in that minute."""
        live = self.weight_transfer_engine.live
        for tgt in {id(t): t for t in (live.live, *live.target._of.values())}.values():
            real = tgt.write_segment

            def stalled(name, ci, region, view, patch, real=real):
                with open(marker, "w") as f:
                    f.write(name)
                time.sleep(60)
                return real(name, ci, region, view, patch)

            tgt.write_segment = stalled
        return True
