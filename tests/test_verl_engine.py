"""deltarefit's side of the verl checkpoint engine (``deltarefit.integrations.verl.DeltaRefitEngine``), without
verl: two trainer ranks (rank 0 publishes from memory, rank 1 walks its weights) and two rollout workers
(each with its own local copy) through verl's round (tests/_verl_rounds.py) over a real directory stream.
Against verl's own base class, registry and rollout worker: tests/test_verl.py (make test-verl).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from _verl_rounds import model, run_round, same_bits, served, train_step

from deltarefit.errors import DeltaRefitError, StreamError, UsageError
from deltarefit.integrations import verl as dv
from deltarefit.signing import keygen
from deltarefit.stream.records import load_commit


def _engines(tmp_path, *, trainers: int = 2, rollouts: int = 2, **kw):
    stream = str(tmp_path / "stream")
    t = [dv.DeltaRefitEngine(bucket_size=1 << 20, is_master=(i == 0), stream=stream,
                             state_dir=str(tmp_path / "state"), served="BF16", keyframe_every=10,
                             **{k: v for k, v in kw.items() if k in ("signing_key",)}) for i in range(trainers)]
    r = [dv.DeltaRefitEngine(bucket_size=1 << 20, stream=stream, checkpoint=str(tmp_path / f"rollout{i}.safetensors"),
                             subscriber_id=f"rollout{i}", timeout_s=30,
                             **{k: v for k, v in kw.items() if k in ("verify_key",)}) for i in range(rollouts)]
    return stream, t, r


def _fp32_params(m):
    return lambda: ((n, t.detach()) for n, t in m.state_dict().items())


def test_rounds_hand_over_the_served_bits(tmp_path):
    """Four rounds (a keyframe, then deltas): every rollout receives exactly the trainer's served bits;
    the trainer's metrics name each version; later versions ship fewer bytes than the checkpoint."""
    _, trainers, rollouts = _engines(tmp_path)
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    kept = []
    for step in range(1, 5):
        if step > 1:
            train_step(m, opt, step)
        sent, got = asyncio.run(run_round(dv.DeltaRefitEngine, trainers, rollouts, _fp32_params(m), step))
        kept.append((got[0], served(m)))
        assert sent[1] == {}
        metrics = sent[0]
        assert metrics["deltarefit/version"] == step, metrics
        assert metrics["deltarefit/keyframe"] == float(step == 1)
        if step > 1:
            assert metrics["deltarefit/bytes"] < metrics["deltarefit/full_bytes"]
        for r, g in zip(rollouts, got, strict=True):
            assert not isinstance(g, BaseException), g
            same_bits(g, served(m))
            assert r.subscriber.current()[0] == step
        assert load_commit(trainers[0].store, step).step == step
    # what a round handed over is verl's own: the later rounds' in-place applies to the copy did not touch it
    for g, want in kept:
        same_bits(g, want)
    # each round's handoff is gone once the round is finalized
    assert not [k for k in trainers[0].store.list("verl/")]


def test_async_weights_and_unchanged_weights(tmp_path):
    """An async iterable of weights (bf16 already: published as given) is published as a sync one; a
    round whose weights did not change hands over the same version again."""
    _, trainers, rollouts = _engines(tmp_path, trainers=1, rollouts=1)
    for t in trainers:
        t.served = None
    m = model()

    def weights():
        async def gen():
            for n, t in served(m).items():
                await asyncio.sleep(0)
                yield n, t
        return gen()

    for step in (1, 2):
        sent, got = asyncio.run(run_round(dv.DeltaRefitEngine, trainers, rollouts, weights, step))
        assert sent[0]["deltarefit/version"] == 1
        same_bits(got[0], served(m))


def test_async_weights_failing_midway_publish_nothing(tmp_path):
    _, trainers, rollouts = _engines(tmp_path, trainers=1, rollouts=1)
    m = model()

    def weights():
        async def gen():
            for i, (n, t) in enumerate(served(m).items()):
                if i == 3:
                    raise RuntimeError("gather failed")
                yield n, t
        return gen()

    sent, got = asyncio.run(run_round(dv.DeltaRefitEngine, trainers, rollouts, weights, 1))
    assert isinstance(sent[0], RuntimeError)
    assert isinstance(got[0], StreamError) and "gather failed" in str(got[0]), got[0]
    assert not trainers[0].store.list("v/")


def _flip_byte(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def test_tampered_delta_and_wrong_base_are_refused(tmp_path):
    """A delta part changed in the store, and a rollout copy that is not the delta's base: the rollout
    yields nothing and stays at its verified version; the next good round goes on."""
    stream, trainers, rollouts = _engines(tmp_path, rollouts=1)
    (r,) = rollouts
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    asyncio.run(run_round(dv.DeltaRefitEngine, trainers, rollouts, _fp32_params(m), 1))
    train_step(m, opt, 2)

    tampered, yielded = [], []

    async def tamper_then_receive(e, step):
        body = await e.wait_handoff()
        rec = load_commit(e.store, body["version"])
        tampered.append((os.path.join(stream, rec.delta.key), rec.delta.bytes // 2))
        _flip_byte(*tampered[0])
        async for n, _ in e.receive_weights(global_steps=step):
            yielded.append(n)

    sent, got = asyncio.run(run_round(dv.DeltaRefitEngine, trainers, rollouts, _fp32_params(m), 2,
                                      receive=tamper_then_receive))
    assert sent[0]["deltarefit/version"] == 2
    assert isinstance(got[0], DeltaRefitError) and not yielded, got[0]
    assert r.subscriber.current()[0] == 1
    _flip_byte(*tampered[0])  # the part as published again

    # wrong base: the rollout's copy edited by hand (still recorded at version 1)
    train_step(m, opt, 3)
    _flip_byte(r.checkpoint, os.path.getsize(r.checkpoint) - 5)
    sent, got = asyncio.run(run_round(dv.DeltaRefitEngine, trainers, rollouts, _fp32_params(m), 3))
    assert sent[0]["deltarefit/version"] == 3
    assert isinstance(got[0], DeltaRefitError), got[0]
    assert "repair" in str(got[0]), got[0]

    # a fresh rollout copy (the edited one removed) catches up by the keyframe route, bit-exact
    os.remove(r.checkpoint)
    os.remove(r.checkpoint + ".deltarefit-version.json")
    r._subscriber = None
    train_step(m, opt, 4)
    sent, got = asyncio.run(run_round(dv.DeltaRefitEngine, trainers, rollouts, _fp32_params(m), 4))
    same_bits(got[0], served(m))


def test_signed_stream(tmp_path):
    """Records signed by the trainer; a rollout with another verify key refuses them."""
    keygen(str(tmp_path / "trainer.key"))
    keygen(str(tmp_path / "other.key"))
    _, trainers, rollouts = _engines(tmp_path, rollouts=1, signing_key=str(tmp_path / "trainer.key"),
                                     verify_key=str(tmp_path / "trainer.key.pub"))
    m = model()
    _, got = asyncio.run(run_round(dv.DeltaRefitEngine, trainers, rollouts, _fp32_params(m), 1))
    same_bits(got[0], served(m))
    stranger = dv.DeltaRefitEngine(stream=str(tmp_path / "stream"), checkpoint=str(tmp_path / "s.safetensors"),
                                   verify_key=str(tmp_path / "other.key.pub"), timeout_s=30)
    _, got = asyncio.run(run_round(dv.DeltaRefitEngine, trainers, [stranger], _fp32_params(m), 2))
    assert isinstance(got[0], DeltaRefitError) and not os.path.exists(stranger.checkpoint), got[0]


def test_refusals(tmp_path):
    with pytest.raises(UsageError, match="stream is required"):
        dv.DeltaRefitEngine(bucket_size=1)
    with pytest.raises(UsageError, match="unknown key"):
        dv.DeltaRefitEngine(stream="x", bucket=3)
    with pytest.raises(UsageError, match="served"):
        dv.DeltaRefitEngine(stream="x", served="fp8")
    with pytest.raises(UsageError, match="actor rank 0"):
        dv.DeltaRefitEngine.build_topology(1, 1, [{}, {}])
    # a trainer that fails its publish hands the failure to the rollouts at once
    _, trainers, rollouts = _engines(tmp_path, trainers=1, rollouts=1)
    sent, got = asyncio.run(run_round(dv.DeltaRefitEngine, trainers, rollouts, lambda: [("x", "not a tensor")], 1))
    assert isinstance(sent[0], UsageError)
    assert isinstance(got[0], StreamError) and "failed" in str(got[0]), got[0]
    # a rollout with no trainer waits out its timeout, in one line
    lone = dv.DeltaRefitEngine(stream=str(tmp_path / "stream"), checkpoint=str(tmp_path / "l.safetensors"),
                               timeout_s=0.3)
    lone.init_process_group(token="abc123")

    async def go():
        return [x async for x in lone.receive_weights(1)]

    with pytest.raises(StreamError, match="no handoff"):
        asyncio.run(go())


def test_in_place_hands_the_update_request(tmp_path):
    """in_place: the rollout keeps no copy and yields one item, the vLLM backend's update request for the
    trainer's version (its workers sync and verify themselves)."""
    _, trainers, _ = _engines(tmp_path, trainers=1, rollouts=0)
    r = dv.DeltaRefitEngine(stream=str(tmp_path / "stream"), verify_key="/keys/t.pub", in_place=True,
                            checkpoint=str(tmp_path / "unused.safetensors"))
    assert r.wire_format == "deltarefit"
    m = model()
    for step in (1, 2):
        m[0].weight.data[step, :4] += 1.0
        _, got = asyncio.run(run_round(dv.DeltaRefitEngine, trainers, [r], _fp32_params(m), step))
        assert got[0] == {"deltarefit": {"init_info": {"stream": str(tmp_path / "stream"),
                                                       "verify_key": "/keys/t.pub"},
                                         "update_info": {"version": step}}}, got[0]
    assert not os.path.exists(r.checkpoint)
