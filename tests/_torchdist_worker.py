"""One rank of a torch.distributed (gloo, loopback) broadcast refit, for tests/test_torchdist.py.

argv[1] is a JSON object: rank, world, port, mirror, and either ``checkpoint`` or ``tensors_from``
(+ ``held`` [version, fingerprint], ``tensors_out`` and optionally ``history``, the tensors' book
directory); rank 0 also gets ``store``. Prints one JSON
line: the report, or the error; exits 0, or 3 on a deltarefit error.
"""

import datetime
import json
import sys

import torch.distributed as dist
from safetensors.torch import load_file, save_file

from deltarefit.errors import DeltaRefitError
from deltarefit.transport.torchdist import broadcast_sync

a = json.loads(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a['port']}", rank=a["rank"],
                        world_size=a["world"], timeout=datetime.timedelta(seconds=60))
kw = {"store": a.get("store"), "mirror": a["mirror"], "chunk_bytes": a.get("chunk", 1 << 16)}
tensors = None
if "tensors_from" in a:
    tensors = load_file(a["tensors_from"])
    kw.update(tensors=tensors, held=tuple(a["held"]), history=a.get("history"))
else:
    kw.update(checkpoint=a["checkpoint"])
try:
    rep = broadcast_sync(None, src=0, **kw)
except DeltaRefitError as e:
    print(json.dumps({"error": str(e)}), flush=True)
    dist.destroy_process_group()
    sys.exit(3)
if tensors is not None:
    save_file(tensors, a["tensors_out"])
print(json.dumps({"version": rep.version, "fingerprint": rep.fingerprint, "applied": rep.versions_applied,
                  "bytes": rep.bytes_received}), flush=True)
dist.destroy_process_group()
