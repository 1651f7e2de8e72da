"""One tensor-parallel worker of tests/test_live_tp.py: a model whose loader keeps this rank's rows of a
column-parallel weight and columns of a row-parallel one (and a replicated norm), refitted in place
through a collective LiveTarget over a real gloo group on loopback.

argv[1] is a JSON object: rank, world, port, base (checkpoint dir), delta, out (where to save the
parameters after), and optionally ``corrupt`` (this rank flips one bit of its norm first). Prints one JSON
line: {"ok": true, ...} or {"error": class name, "message": ...}. With ``held``, the apply is checked by held
digests; ``no_shm`` gives the group no shared memory; ``threads`` (a list: per rank) the apply threads; ``cache`` (bytes) bounds the patches kept from plan to write; ``fail`` {"call": a LiveTarget
write method, "n": n, "rank": r} makes rank r's n-th call of it fail once, and the apply is then run again.
``file_journal`` journals the held apply in a file
(which needs pre-images). ``chain`` (delta paths, in order from the base) applies each in turn with held digests, each rank decoding
against its own history book in ``book``/rank<r> and advancing it as a live engine does; ``empty_book``
{"rank": r, "step": i} gives rank r an empty book at step i (0-based), and the chain stops at that step's
refusal. With ``fail``, the failure and the rerun are those of the chain's last step.
"""

import datetime
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from deltarefit.engines.capture import capture_layout
from deltarefit.engines.live import apply_live
from deltarefit.engines.vllm.worker import _Group
from deltarefit.errors import DeltaRefitError

a = json.loads(sys.argv[1])
rank, world = a["rank"], a["world"]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a['port']}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))
ck = load_file(a["base"] + "/model.safetensors")


class Shard(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        up, down = ck["up.weight"].shape, ck["down.weight"].shape
        self.up = torch.nn.Parameter(torch.zeros(up[0] // world, up[1], dtype=torch.bfloat16), requires_grad=False)
        self.down = torch.nn.Parameter(torch.zeros(down[0], down[1] // world, dtype=torch.bfloat16),
                                       requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(ck["norm.weight"].shape, dtype=torch.bfloat16),
                                       requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            if name == "up.weight":  # column parallel: this rank's rows
                n = w.shape[0] // world
                self.up.data.copy_(w.narrow(0, rank * n, n))
            elif name == "down.weight":  # row parallel: this rank's columns
                n = w.shape[1] // world
                self.down.data.copy_(w.narrow(1, rank * n, n))
            else:
                self.norm.data.copy_(w)


m = Shard()
with torch.no_grad():
    m.load_weights(ck.items())
if a.get("corrupt"):
    m.norm.data.view(torch.int16)[3] ^= 1
params = dict(m.named_parameters())
lay = capture_layout(m.load_weights, params, {n: (t.dtype, tuple(t.shape)) for n, t in ck.items()})
group = _Group(dist.group.WORLD)
if a.get("no_shm"):  # as on workers of different hosts: split segments assembled by a sum over gloo
    group.shared_buffer = lambda nbytes: None
names = sorted(ck)
held = np.array([sum(p.piece.count for p in lay.placements.get(n, ())) for n in names], np.int64)
least = group.min(held)
shared = {n for i, n in enumerate(names) if least[i] != ck[n].numel()}
live = group.target(params, {n: lay.placements.get(n, []) for n in names},
                    {n: ("BF16", tuple(ck[n].shape)) for n in names}, shared)
before = {n: p.detach().clone() for n, p in params.items()}
first = None  # the first apply's failure, where it was made to fail and then run again
threads = a.get("threads", [2, 2])[rank]  # apply threads, per rank

def _inject(fail: dict):
    """Make rank ``fail["rank"]``'s ``fail["n"]``-th call of the live target's ``fail["call"]`` raise, once; the
    real method (to put back)."""
    calls, real = [0], getattr(live, fail["call"])

    def failing(*args):
        calls[0] += 1
        if rank == fail["rank"] and calls[0] == fail["n"]:
            raise OSError("injected failure mid-write")
        return real(*args)

    setattr(live, fail["call"], failing)
    return real


def _untouched(ref: dict) -> bool:
    """Whether every parameter holds the bits of ``ref`` (name -> tensor)."""
    return all(torch.equal(ref[n].view(torch.int16), p.view(torch.int16)) for n, p in params.items())


def _chain() -> dict:
    """``chain`` mode (module docstring): each delta applied with held digests and this rank's book."""
    from deltarefit.apply import run_apply
    from deltarefit.apply.tensors import _TorchTarget
    from deltarefit.engines.live import TargetUnion, state_through
    from deltarefit.engines.vllm.worker import MemoryJournal
    from deltarefit.format import DeltaReader
    from deltarefit.history_book import HistoryBook, MovesRecorder

    union = TargetUnion(live, _TorchTarget({}))
    book = HistoryBook(os.path.join(a["book"], f"rank{rank}"))
    journal = MemoryJournal()
    empty, fail = a.get("empty_book") or {}, a.get("fail")
    steps = []
    for i, path in enumerate(a["chain"]):
        sums = {n: state_through(union, n)[1] for n in names}
        hist = HistoryBook(os.path.join(a["book"], f"empty{rank}")) if empty.get("step") == i and \
            empty.get("rank") == rank else book
        if fail is not None and i == len(a["chain"]) - 1:
            real = _inject(fail)
        at = {n: p.detach().clone() for n, p in params.items()}
        with DeltaReader(path) as d:
            moves = MovesRecorder()
            try:
                rep = run_apply(d, union, journal=journal.bind(d.target_fingerprint), threads=threads, held=sums,
                                history=hist, moves=moves)
            except (OSError, DeltaRefitError) as e:
                steps.append({"step": i, "error": type(e).__name__, "message": str(e), "untouched": _untouched(at)})
                if fail is None or i != len(a["chain"]) - 1:
                    return {"steps": steps}
                setattr(live, fail["call"], real)
                # the rerun, as LiveEngine makes it after a failed write: by segments, with the book
                moves = MovesRecorder()
                try:
                    rep = run_apply(d, union, journal=journal.bind(d.target_fingerprint), threads=threads,
                                    history=book, moves=moves)
                except DeltaRefitError as e2:
                    steps.append({"step": i, "rerun": type(e2).__name__, "message": str(e2)})
                    return {"steps": steps}
            hist.advance(d, moves, durable=False)
            steps.append({"step": i, "fingerprint": rep.target_fingerprint, "held": rep.held,
                          "split": [rep.split_decoded, rep.split_chunks], "elsewhere": rep.elsewhere,
                          "book": sorted(f"{n}:{c}" for n, c in moves.moves), "incomplete": moves.incomplete})
    return {"steps": steps, "tip": book.tip}


try:
    if a.get("chain"):
        out = {"ok": True, "shared": sorted(shared), **_chain()}
    else:
        if a.get("held"):  # held digests, taken as LiveEngine takes them (a collective pass for shared tensors)
            from deltarefit.apply import run_apply
            from deltarefit.apply.tensors import _TorchTarget
            from deltarefit.engines.live import TargetUnion, state_through
            from deltarefit.engines.vllm.worker import MemoryJournal
            from deltarefit.format import DeltaReader

            # as LiveEngine holds it: live placements beside host copies
            union = TargetUnion(live, _TorchTarget({}))
            sums = {n: state_through(union, n)[1] for n in names}
            journal = MemoryJournal()
            if a.get("file_journal"):  # one that keeps pre-images: every worker decodes every split segment
                from deltarefit.apply.journal import Journal

                path = a["out"] + ".journal"
                journal.bind = lambda fp: Journal(path, fp)
            fail = a.get("fail")
            if fail is not None:  # rank fail["rank"] fails its n-th call of fail["call"], once
                real = _inject(fail)
            with DeltaReader(a["delta"]) as d:
                try:
                    rep = run_apply(d, union, journal=journal.bind(d.target_fingerprint), threads=threads, held=sums,
                                    cache_bytes=a.get("cache", 512 << 20))
                except (OSError, DeltaRefitError) as e:
                    if fail is None:
                        raise
                    # the rerun, as LiveEngine does it after a failed write: segment by segment, every chunk
                    # written before the failure found at its post-image, a torn one restored from the journal
                    setattr(live, fail["call"], real)
                    first = f"{type(e).__name__}: {e}"
                    rep = run_apply(d, union, journal=journal.bind(d.target_fingerprint), threads=2)
        else:
            rep = apply_live(a["delta"], live, threads=2)
        out = {"ok": True, "shared": sorted(shared), "written": rep.written_bytes, "held": rep.held,
               "elsewhere": rep.elsewhere, "split": [rep.split_decoded, rep.split_chunks], "first": first,
               "shm": live._slots is not None, "recovered": rep.chunks_recovered, "roles": {n: live.chunk_roles(n) for n in sorted(shared)}}
except DeltaRefitError as e:
    out = {"error": type(e).__name__, "message": str(e), "untouched": _untouched(before)}
save_file({n: p.detach().contiguous() for n, p in params.items()}, a["out"])
print(json.dumps(out), flush=True)
# Both peers leave together: a gloo group torn down while its peer's pair threads still run aborts the
# process at exit ("terminate called without an active exception"). That abort was still seen once
# after the barrier (in the destructors run at interpreter exit), so the worker leaves without them:
# its result is printed and its file saved by now.
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
