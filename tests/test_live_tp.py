"""Collective live targets: two tensor-parallel workers (real processes, a real gloo group on loopback)
refit their slices in place, each checking whole segments assembled over the group."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from _pairs import Delta
from safetensors.torch import load_file, save_file

from deltarefit.encode import encode

WORKER = os.path.join(os.path.dirname(__file__), "_live_tp_worker.py")


def _ckpt(d: str, ts: dict) -> str:
    os.makedirs(d, exist_ok=True)
    save_file(ts, os.path.join(d, "model.safetensors"))
    return d


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, base: str, delta: str, corrupt_rank: int | None = None, held: bool = False, **opts) -> list[dict]:
    port = _port()
    procs = []
    for r in range(2):
        arg = {"rank": r, "world": 2, "port": port, "base": base, "delta": delta,
               "out": str(tmp_path / f"rank{r}.safetensors"), "corrupt": r == corrupt_rank,
               "held": held, **opts}
        procs.append(subprocess.Popen([sys.executable, WORKER, json.dumps(arg)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def _pair(tmp_path):
    g = torch.Generator().manual_seed(0)
    # 1100 x 512 bf16: a segment (512 Ki elements) spans the two workers' rows of "up"
    base = {"up.weight": (torch.randn(1100, 512, generator=g) * 0.05).to(torch.bfloat16),
            "down.weight": (torch.randn(256, 1100, generator=g) * 0.05).to(torch.bfloat16),
            "norm.weight": torch.ones(512, dtype=torch.bfloat16)}
    rng = np.random.default_rng(1)
    target = {}
    for n, t in base.items():
        bits = t.clone().view(torch.int16).view(-1).numpy()
        idx = rng.choice(bits.size, bits.size // 30, replace=False)
        bits[idx] += 1
        target[n] = torch.from_numpy(bits).view(torch.bfloat16).view(t.shape)
    b, t = _ckpt(str(tmp_path / "base"), base), _ckpt(str(tmp_path / "target"), target)
    delta = str(tmp_path / "step.delta")
    encode(b, t, delta, sums=True)  # additive digests: read by held-digest applies, ignored by the others
    return base, target, b, delta


@pytest.mark.parametrize("held", [False, True], ids=["segments", "held-digests"])
def test_two_workers_refit_their_slices_in_place_bit_exact(tmp_path, held):
    _base, target, b, delta = _pair(tmp_path)
    outs = _run(tmp_path, b, delta, held=held)
    assert all(o.get("ok") for o in outs), outs
    assert all(o["held"] == (3 if held else 0) for o in outs), outs
    assert outs[0]["shared"] == ["down.weight", "up.weight"]  # the norm is replicated: each checks its own
    r0, r1 = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2))
    assert torch.equal(torch.cat([r0["up"], r1["up"]]).view(torch.int16), target["up.weight"].view(torch.int16))
    assert torch.equal(torch.cat([r0["down"], r1["down"]], 1).view(torch.int16),
                       target["down.weight"].view(torch.int16))
    for r in (r0, r1):
        assert torch.equal(r["norm"].view(torch.int16), target["norm.weight"].view(torch.int16))


@pytest.mark.parametrize("held", [False, True], ids=["segments", "held-digests"])
def test_one_workers_refusal_stops_both_before_any_write(tmp_path, held):
    _base, _target, b, delta = _pair(tmp_path)
    outs = _run(tmp_path, b, delta, corrupt_rank=1, held=held)
    assert outs[1]["error"] == "BaseMismatchError" and "norm" in outs[1]["message"], outs
    assert outs[0]["error"] == "VerificationError" and "another process" in outs[0]["message"], outs
    assert outs[0]["untouched"] and outs[1]["untouched"]


def _bits(t: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    bits = t.clone().view(torch.int16).view(-1).numpy()
    bits[rng.choice(bits.size, bits.size // 30, replace=False)] += 1
    return torch.from_numpy(bits).view(torch.bfloat16).view(t.shape)


def _whole_pair(tmp_path):
    """A pair whose column-parallel tensor has segments each worker holds whole: "up" is 4096 x 512, so
    rows 0-2047 (segments 0 and 1) are rank 0's and rows 2048-4095 (segments 2 and 3) rank 1's; every
    segment of the row-parallel "down" (512 x 2048, split by columns) is split between them."""
    g = torch.Generator().manual_seed(2)
    base = {"up.weight": (torch.randn(4096, 512, generator=g) * 0.05).to(torch.bfloat16),
            "down.weight": (torch.randn(512, 2048, generator=g) * 0.05).to(torch.bfloat16),
            "norm.weight": torch.ones(512, dtype=torch.bfloat16)}
    target = {n: _bits(t, np.random.default_rng(3)) for n, t in base.items()}
    other = {n: _bits(t, np.random.default_rng(4)) for n, t in base.items()}
    b = _ckpt(str(tmp_path / "base"), base)
    delta, other_delta = str(tmp_path / "step.delta"), str(tmp_path / "other.delta")
    encode(b, _ckpt(str(tmp_path / "target"), target), delta, sums=True)
    encode(b, _ckpt(str(tmp_path / "other"), other), other_delta, sums=True)
    return target, b, delta, other_delta


@pytest.mark.parametrize("shm", [True, False], ids=["shared-memory", "gloo-sum"])
def test_segments_a_worker_holds_whole_are_decoded_there_once(tmp_path, shm):
    if shm and not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm here: split segments go by gloo (the other case)")
    target, b, delta, _ = _whole_pair(tmp_path)
    before = set(os.listdir("/dev/shm")) if shm else set()
    # with different apply threads per worker (the group's window of split chunks in flight is its own)
    outs = _run(tmp_path, b, delta, held=True, threads=[1, 3], no_shm=not shm)
    assert all(o.get("ok") for o in outs), outs
    assert [o["shm"] for o in outs] == [shm, shm]  # where split segments were assembled
    if shm:  # the shared file's name was removed once both workers had it open
        assert not [n for n in set(os.listdir("/dev/shm")) - before if "deltarefit-tp-" in n]
    assert outs[0]["roles"]["up.weight"] == ["mine", "mine", "other", "other"]
    assert outs[1]["roles"]["up.weight"] == ["other", "other", "mine", "mine"]
    assert all(set(o["roles"]["down.weight"]) == {"group"} for o in outs)
    # each of "up"'s 4 chunks decoded, checked and written by its holder alone
    assert [o["elsewhere"] for o in outs] == [2, 2]
    # each of "down"'s 2 split chunks decoded by one worker, which sent the other its changes
    assert [o["split"] for o in outs] == [[1, 2], [1, 2]]
    _assert_at(tmp_path, target)


def _assert_at(tmp_path, target: dict) -> None:
    """Both workers' saved parameters are their slices of ``target``, bit for bit."""
    r0, r1 = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2))
    assert torch.equal(torch.cat([r0["up"], r1["up"]]).view(torch.int16), target["up.weight"].view(torch.int16))
    assert torch.equal(torch.cat([r0["down"], r1["down"]], 1).view(torch.int16),
                       target["down.weight"].view(torch.int16))
    for r in (r0, r1):
        assert torch.equal(r["norm"].view(torch.int16), target["norm.weight"].view(torch.int16))


def test_split_chunks_whose_changes_outgrow_their_shared_slot_are_broadcast(tmp_path):
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm here: no shared slots to outgrow")
    g = torch.Generator().manual_seed(5)
    base = {"up.weight": (torch.randn(4096, 512, generator=g) * 0.05).to(torch.bfloat16),
            "down.weight": (torch.randn(512, 2048, generator=g) * 0.05).to(torch.bfloat16),
            "norm.weight": torch.ones(512, dtype=torch.bfloat16)}
    target = {n: _bits(t, np.random.default_rng(6)) for n, t in base.items()}
    bits = base["down.weight"].clone().view(torch.int16).view(-1).numpy()
    bits[::2] += 1  # half of every segment: 262,144 changes of 6 bytes each, more than a slot's MiB
    target["down.weight"] = torch.from_numpy(bits).view(torch.bfloat16).view(512, 2048)
    b = _ckpt(str(tmp_path / "base"), base)
    delta = str(tmp_path / "step.delta")
    encode(b, _ckpt(str(tmp_path / "target"), target), delta, sums=True)
    outs = _run(tmp_path, b, delta, held=True)
    assert all(o.get("ok") for o in outs), outs
    assert [o["shm"] for o in outs] == [True, True] and [o["split"] for o in outs] == [[1, 2], [1, 2]]
    _assert_at(tmp_path, target)


def test_with_a_journal_that_keeps_pre_images_every_worker_decodes_the_split_segments(tmp_path):
    target, b, delta, _ = _whole_pair(tmp_path)
    outs = _run(tmp_path, b, delta, held=True, file_journal=True)
    assert all(o.get("ok") for o in outs), outs
    assert [o["split"] for o in outs] == [[0, 0], [0, 0]]  # assembled over the group and decoded by each
    assert [o["elsewhere"] for o in outs] == [2, 2]  # the segments of "up" each holds whole: there alone
    _assert_at(tmp_path, target)


def test_split_chunks_dropped_by_the_memory_budget_are_decoded_and_sent_again_when_written(tmp_path):
    target, b, delta, _ = _whole_pair(tmp_path)
    outs = _run(tmp_path, b, delta, held=True, cache=0)  # nothing kept from plan to write
    assert all(o.get("ok") for o in outs), outs
    assert [o["split"] for o in outs] == [[1, 2], [1, 2]]
    _assert_at(tmp_path, target)


def test_a_split_chunk_its_decoder_refuses_stops_both_before_any_write(tmp_path):
    _target, b, delta, _ = _whole_pair(tmp_path)
    # "down"'s second chunk, split between the workers, is decoded by rank 1 alone (split chunks are
    # dealt round the group): its payload cut short, every hash made consistent
    d = Delta.load(delta)
    k = d.record_of("down.weight", 1)
    d.payloads[k] = d.payloads[k][: len(d.payloads[k]) // 2]
    bad = d.write(tmp_path / "cut.delta")
    outs = _run(tmp_path, b, bad, held=True)
    assert outs[1]["error"] == "DecodeError" and "down.weight" in outs[1]["message"], outs
    # the other worker raises DecodeError too (what the group refused is the delta's coding), naming the chunk
    assert outs[0]["error"] == "DecodeError" and "decodes it refused" in outs[0]["message"], outs
    assert outs[0]["untouched"] and outs[1]["untouched"]


@pytest.mark.parametrize(("n", "fail_rank", "torn"), [(1, 1, 2), (2, 0, 1), (2, 1, 1)])
def test_a_worker_failing_mid_write_of_a_split_chunk_is_completed_by_a_rerun(tmp_path, n, fail_rank, torn):
    target, b, delta, _ = _whole_pair(tmp_path)
    # The failing worker's write of one of "down"'s 2 split chunks fails; the other writes its parts of
    # the tensor's chunks up to the group's agreement at the end of the tensor's run, so every split
    # chunk from the failed one on is torn across the workers. The failed worker journals them anyway.
    outs = _run(tmp_path, b, delta, held=True, fail={"call": "write_split", "n": n, "rank": fail_rank})
    assert all(o.get("ok") for o in outs), outs
    assert "injected failure" in outs[fail_rank]["first"], outs
    assert "another process" in outs[1 - fail_rank]["first"], outs
    assert [o["recovered"] for o in outs] == [torn, torn], outs  # restored from each one's journal
    _assert_at(tmp_path, target)


def test_a_worker_failing_mid_write_of_a_chunk_it_holds_whole_is_completed_by_a_rerun(tmp_path):
    target, b, delta, _ = _whole_pair(tmp_path)
    # Rank 1's write of its first chunk of "up" (held whole: written by it alone) fails; rank 0 writes
    # its own chunks of "up" meanwhile, up to the group's agreement at the end of the tensor's run.
    outs = _run(tmp_path, b, delta, held=True, fail={"call": "write_own", "n": 1, "rank": 1})
    assert all(o.get("ok") for o in outs), outs
    assert "injected failure" in outs[1]["first"] and "another process" in outs[0]["first"], outs
    _assert_at(tmp_path, target)


def test_a_lie_in_a_segment_one_worker_holds_stops_both_before_any_write(tmp_path):
    _target, b, delta, other_delta = _whole_pair(tmp_path)
    # chunk 3 of "up" (rank 1's alone) replaced by the same chunk of another step's delta, every hash and
    # count made consistent: only rank 1 decodes it, and only the group's digest sum can refuse it
    with open(delta, "rb") as f:
        d = Delta.parse(f.read())
    d2 = Delta.load(other_delta)
    k, k2 = d.record_of("up.weight", 3), d2.record_of("up.weight", 3)
    d.payloads[k] = d2.payloads[k2]
    d.tensor("up.weight")[1]["changed"] += d2.records[k2].n_changed - d.records[k].n_changed
    d.records[k] = replace(d.records[k], n_changed=d2.records[k2].n_changed)
    lie = d.write(tmp_path / "lie.delta")
    outs = _run(tmp_path, b, lie, held=True)
    for o in outs:
        assert o["error"] == "VerificationError" and "up.weight" in o["message"], outs
        assert o["untouched"], outs


def _history_chain(tmp_path, steps: int = 3):
    """``_whole_pair``'s layout along a momentum chain (``_chains``): the base checkpoint, each version's
    tensors, and the deltas between them encoded as a publisher with a history book does."""
    from _chains import deltas_with_history, momentum_chain

    shapes = {"up.weight": (4096, 512), "down.weight": (512, 2048), "norm.weight": (512,)}
    series = {n: momentum_chain(int(np.prod(s)), steps, seed=10 + i, rate=0.04)
              for i, (n, s) in enumerate(shapes.items())}
    versions = [{n: torch.from_numpy(series[n][v].view(np.int16).copy()).view(torch.bfloat16).view(s)
                 for n, s in shapes.items()} for v in range(steps + 1)]
    dirs = [_ckpt(str(tmp_path / f"v{v}"), versions[v]) for v in range(steps + 1)]
    deltas = list(deltas_with_history([os.path.join(d, "model.safetensors") for d in dirs], str(tmp_path)))
    return dirs[0], versions, deltas


def test_a_group_follows_a_history_chain_each_worker_keeping_the_book_of_what_it_decodes(tmp_path):
    b, versions, deltas = _history_chain(tmp_path)
    assert all(n5 > 0 for _, _, n5 in deltas[1:]), [n5 for _, _, n5 in deltas]  # coded with history from step 2
    outs = _run(tmp_path, b, "", chain=[p for p, _, _ in deltas], book=str(tmp_path / "books"))
    assert all(o.get("ok") for o in outs), outs
    for o in outs:
        assert [s.get("fingerprint") for s in o["steps"]] == [rep.target_fingerprint for _, rep, _ in deltas], o
        assert all(s["held"] == 3 and not s["incomplete"] for s in o["steps"]), o
        assert o["tip"] == deltas[-1][1].target_fingerprint
    # each worker's book holds the moves of the chunks it decodes, and only those: the segments of "up" it
    # holds whole, the split chunk of "down" dealt to it, and the replicated norm
    assert outs[0]["steps"][-1]["book"] == ["down.weight:0", "norm.weight:0", "up.weight:0", "up.weight:1"]
    assert outs[1]["steps"][-1]["book"] == ["down.weight:1", "norm.weight:0", "up.weight:2", "up.weight:3"]
    _assert_at(tmp_path, versions[-1])


@pytest.mark.parametrize("rank", [0, 1])
def test_a_worker_without_the_history_stops_the_group_by_a_decode_refusal_before_any_write(tmp_path, rank):
    b, _versions, deltas = _history_chain(tmp_path, steps=2)
    outs = _run(tmp_path, b, "", chain=[p for p, _, _ in deltas], book=str(tmp_path / "books"),
                empty_book={"rank": rank, "step": 1})
    for o in outs:
        assert o.get("ok"), o
        first, second = o["steps"]
        assert first["fingerprint"] == deltas[0][1].target_fingerprint
        # every worker raises DecodeError (the refusal a subscriber answers by starting its book over),
        # and none wrote a byte of the step
        assert second["error"] == "DecodeError" and second["untouched"], o
    assert "history" in outs[rank]["steps"][1]["message"], outs
    assert "refused to decode" in outs[1 - rank]["steps"][1]["message"], outs



@pytest.mark.parametrize(("call", "n", "fail_rank"), [("write_split", 1, 1), ("write_own", 1, 1), ("write_own", 2, 0)])
def test_a_rerun_after_a_failed_write_of_a_history_delta_is_refused_alike_by_every_worker(tmp_path, call, n,
                                                                                        fail_rank):
    """The rerun after a failed write checks by segments: every worker decodes every chunk not yet written,
    some of them against a history its book does not hold. Each worker keeps making the group's calls in
    step after its refusal, and every one of them raises DecodeError (no hang, no worker left behind): a
    subscriber then starts its book over and takes a keyframe route."""
    b, _versions, deltas = _history_chain(tmp_path)
    outs = _run(tmp_path, b, "", chain=[p for p, _, _ in deltas], book=str(tmp_path / "books"),
                fail={"call": call, "n": n, "rank": fail_rank})
    for r, o in enumerate(outs):
        assert o.get("ok"), o
        *done, first, rerun = o["steps"]
        assert [s["fingerprint"] for s in done] == [rep.target_fingerprint for _, rep, _ in deltas[:-1]]
        assert first["error"] == ("OSError" if r == fail_rank else "VerificationError"), o
        assert rerun["rerun"] == "DecodeError", o
    assert any("none is held here" in o["steps"][-1]["message"] for o in outs), outs
