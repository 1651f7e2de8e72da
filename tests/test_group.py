"""The one ``Group`` protocol (``shard.group``): a process alone, where every collective is the identity,
and a real two-process gloo group (two processes on loopback) for each implementation: the
``TorchGroup`` under the live target, a vLLM worker's ``WorkerGroup`` and a rollout rank's ``TPGroup``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from deltarefit.engines.vllm.group import WorkerGroup
from deltarefit.shard.group import ALONE, Group, TorchGroup, TPGroup, agree_each, sum_and_agree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("group", [ALONE, TorchGroup(None), TPGroup(None), WorkerGroup(None)],
                         ids=["alone", "torch", "tp", "worker"])
def test_a_process_alone_is_a_group_whose_collectives_are_the_identity(group):
    assert isinstance(group, Group)
    assert (group.rank, group.size) == (0, 1)
    a = np.array([3, -1, 7], np.int64)
    for op in (group.sum, group.min, group.max):
        out = op(a)
        assert out.tolist() == [3, -1, 7] and out is not a
    group.reduce_in_place(a)
    group.sum_to(a, 0)
    group.broadcast(a, 0)
    assert a.tolist() == [3, -1, 7]
    assert group.agree(True) is True and group.agree(False) is False
    assert group.shared_buffer(1 << 20) is None
    moved = np.array([2**64 - 1, 5], np.uint64)
    total, ok = sum_and_agree(group, moved, False)
    assert total.dtype == np.uint64 and total.tolist() == [2**64 - 1, 5] and ok is False
    assert agree_each(group, np.array([True, False])).tolist() == [True, False]


_RANK = r"""
import json, os, sys
import numpy as np
import torch.distributed as dist
from deltarefit.engines.vllm.group import WorkerGroup
from deltarefit.shard.group import TorchGroup, TPGroup, agree_each, sum_and_agree

rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
g = TorchGroup(dist.group.WORLD)
out = {"rank": g.rank, "size": g.size}
moved = np.array([2**64 - 1, 5], np.uint64) if rank == 0 else np.array([2, 7], np.uint64)
total, ok = sum_and_agree(g, moved, rank == 0)
out["sum_and_agree"] = [[int(x) for x in total], ok]
out["agree_each"] = agree_each(g, np.array([True, rank == 0])).tolist()
out["agree"] = [g.agree(True), g.agree(rank == 0)]
a = np.array([rank + 1, 10 * (rank + 1)], np.int64)
out["sum"], out["min"], out["max"] = g.sum(a).tolist(), g.min(a).tolist(), g.max(a).tolist()
b = np.array([rank + 1], np.int64)
g.sum_to(b, 1)
out["sum_to"] = int(b[0])
c = np.array([rank * 4 + 1], np.int64)
g.broadcast(c, 1)
out["broadcast"] = int(c[0])
tp = TPGroup(dist.group.WORLD)
out["same"] = [tp.same([3, 4]), tp.same([3, rank])]
w = WorkerGroup(dist.group.WORLD)
out["union"] = w.union({"a": "mine"} if rank == 0 else {}, ["a", "b"])
print(json.dumps(out), flush=True)
# Both peers leave together, and without the destructors run at interpreter exit: a gloo group torn
# down while its peer's pair threads still run aborts the process ("terminate called without an active
# exception"), as tests/_live_tp_worker.py notes. The result is printed by now.
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def test_a_two_process_gloo_group_sums_agrees_and_fails_together(tmp_path):
    pytest.importorskip("torch", reason="torch is in the test extra: pip install -e '.[test]' (make test installs it)")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, store, str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = []
    for p in procs:
        so, se = p.communicate(timeout=120)
        assert p.returncode == 0, se[-3000:]
        outs.append(json.loads(so.strip().splitlines()[-1]))
    for r, o in enumerate(outs):
        assert (o["rank"], o["size"]) == (r, 2)
        # uint64 lanes add modulo 2**64; one member's failure is every member's
        assert o["sum_and_agree"] == [[1, 12], False]
        assert o["agree_each"] == [True, False]
        assert o["agree"] == [True, False]
        assert (o["sum"], o["min"], o["max"]) == ([3, 30], [1, 10], [2, 20])
        assert o["broadcast"] == 5
        assert o["same"] == [True, False]
        assert o["union"] == {"a": "mine" if r == 0 else "another worker of its tensor-parallel group reloads it"}
    assert outs[1]["sum_to"] == 3  # summed into rank 1's array
