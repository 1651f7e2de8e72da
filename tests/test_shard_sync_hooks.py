"""``sync_sharded``'s two options for holders that are engines (``engines.vllm.sharded``): ``holds_all``
(a version with a tensor the rank holds no piece of is refused before any write) and ``on_applied``
(called after each version's write, before its record; a refusal there leaves the version unrecorded,
and the rerun calls it again). And how an engine tells a sharded stream from a plain one, and reads
either's fingerprint for the trainer's acknowledgement (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest
from _shard_util import SHAPES, masters, step
from test_shard_stream import CUTS, TLAYS, bits, publish_all

from deltarefit.errors import UsageError, VerificationError
from deltarefit.shard.convert import to_bf16_bits
from deltarefit.shard.names import identity_layout
from deltarefit.shard.stream import ShardStreamPublisher, held_version, sync_sharded
from deltarefit.storage.memory import MemoryStore


def _stream(tmp_path, versions: int):
    store = MemoryStore()
    tps = [ShardStreamPublisher(store, TLAYS[r], "BF16", cuts=CUTS, rank=r, world=2, timeout=5, poll=0.01)
           for r in range(2)]
    full, rng, fulls = masters(), np.random.default_rng(3), []
    for i in range(versions):
        if i:
            step(full, rng)
        publish_all(tps, full)
        fulls.append({n: a.copy() for n, a in full.items()})
    return store, fulls


def test_holds_all_refuses_a_version_with_a_tensor_the_rank_lacks_before_any_write(tmp_path):
    import torch

    store, _ = _stream(tmp_path, 1)
    lacking = "model.norm.weight"
    shapes = {n: s for n, s in SHAPES.items() if n != lacking}
    tensors = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    with pytest.raises(UsageError, match=f"has tensor '{lacking}'.*nothing written"):
        sync_sharded(store, tensors, identity_layout(shapes), state_path=str(tmp_path / "a.json"), adopt=False,
                     holds_all=True)
    assert all(not t.view(torch.int16).any() for t in tensors.values())
    assert held_version(str(tmp_path / "a.json")) is None
    # without it, the rank's own tensors are synced (a rank of a pipeline stage holds only its layers)
    rep = sync_sharded(store, tensors, identity_layout(shapes), state_path=str(tmp_path / "b.json"), adopt=False)
    assert rep.version == 1


def test_on_applied_runs_after_each_write_and_its_refusal_leaves_the_version_unrecorded(tmp_path):
    import torch

    store, fulls = _stream(tmp_path, 3)
    tensors = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
    layout, state = identity_layout(SHAPES), str(tmp_path / "held.json")
    seen: list[tuple[int, bool]] = []

    def hook(man):
        # called after the write: the tensors already hold the version
        at = all(np.array_equal(bits(tensors[n]), to_bf16_bits(fulls[man["version"] - 1][n])) for n in SHAPES)
        seen.append((man["version"], at))
        if man["version"] == 2 and len(seen) == 2:
            raise VerificationError("the holder's check after the write failed")

    with pytest.raises(VerificationError, match="after the write failed"):
        sync_sharded(store, tensors, layout, state_path=state, adopt=False, on_applied=hook)
    assert seen == [(1, True), (2, True)]
    assert held_version(state)[0] == 1  # version 2 written, not recorded
    rep = sync_sharded(store, tensors, layout, state_path=state, on_applied=hook)
    assert rep.versions_applied == [2, 3] and seen[2:] == [(2, True), (3, True)]
    assert rep.applied[0].skipped > 0 and rep.applied[0].cells == 0  # version 2's cells were already there


def test_stream_kind_and_version_fingerprint_of_plain_and_sharded_streams(tmp_path):
    from safetensors.numpy import save_file

    from deltarefit.engines.vllm.sharded import stream_kind, version_fingerprint
    from deltarefit.shard.stream import load_shard_commit
    from deltarefit.storage.local import LocalStore
    from deltarefit.stream.publisher import Publisher
    from deltarefit.stream.records import load_commit

    assert stream_kind(MemoryStore()) is None
    sharded, _ = _stream(tmp_path, 2)
    assert stream_kind(sharded) == "sharded"
    assert version_fingerprint(sharded, 2) == load_shard_commit(sharded, 2).fingerprint
    ck = tmp_path / "ck"
    ck.mkdir()
    save_file({"w": np.arange(64, dtype=np.float32)}, str(ck / "model.safetensors"))
    Publisher(str(tmp_path / "plain"), str(tmp_path / "pub")).publish(str(ck))
    plain = LocalStore(str(tmp_path / "plain"))
    assert stream_kind(plain) == "plain"
    assert version_fingerprint(plain, 1) == load_commit(plain, 1).fingerprint
