"""The verl checkpoint engine's inputs, each checked before it is used (``deltarefit.integrations.verl_args``):
what a rollout hands verl is the bytes its sync verified (a copy renamed over the path, or written in place,
after the verification is refused, nothing of it handed over); the round's handoff a peer writes in the store
is read capped and shape-checked; the engine's arguments are type-checked at construction."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

import pytest
import torch
from _verl_rounds import run_round, same_bits

from deltarefit.errors import StreamError, UsageError, VerificationError
from deltarefit.integrations import verl as dv


def _small() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(64, 32, generator=g).to(torch.bfloat16) for i in range(3)}


def _pair(tmp_path):
    stream = str(tmp_path / "stream")
    t = dv.DeltaRefitEngine(bucket_size=1, is_master=True, stream=stream, state_dir=str(tmp_path / "state"))
    r = dv.DeltaRefitEngine(bucket_size=1, stream=stream, checkpoint=str(tmp_path / "copy.safetensors"),
                            subscriber_id="r0", timeout_s=30)
    return t, r


def test_a_copy_renamed_over_the_rollouts_copy_after_its_sync_is_not_handed_to_verl(tmp_path):
    t, r = _pair(tmp_path)
    w = _small()
    _, got = asyncio.run(run_round(dv.DeltaRefitEngine, [t], [r], lambda: iter(w.items()), 1))
    same_bits(got[0], w)
    # another process renames an edited copy over the path between the sync's verification and the handover
    evil = tmp_path / "evil.safetensors"
    real_sync = r.sync_to

    def sync_then_swap(version, fingerprint):
        rep = real_sync(version, fingerprint)
        subprocess.run(["cp", r.checkpoint, str(evil)], check=True)
        with open(evil, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            f.write(b"\x7f")
        subprocess.run(["mv", str(evil), r.checkpoint], check=True)
        return rep

    r.sync_to = sync_then_swap
    w2 = {**w, "w1": w["w1"] + 1}
    received: list[str] = []

    async def receive(e, s):
        async for n, _ in e.receive_weights(s):
            received.append(n)

    _, got = asyncio.run(run_round(dv.DeltaRefitEngine, [t], [r], lambda: iter(w2.items()), 2, receive))
    assert isinstance(got[0], VerificationError) and "not the files that were verified" in str(got[0]), got[0]
    assert received == []


def test_a_copy_written_in_place_while_handed_over_stops_the_handover(tmp_path):
    t, r = _pair(tmp_path)
    w = _small()
    received: list[str] = []

    async def receive(e, s):
        async for n, _ in e.receive_weights(s):
            received.append(n)
            if len(received) == 1:
                time.sleep(0.05)  # past the timestamps' clock tick (the identity's documented hazard)
                subprocess.run(["dd", "of=" + e.checkpoint, "bs=1", "seek=200", "count=1", "conv=notrunc",
                                "status=none"], input=b"\x01", check=True)

    _, got = asyncio.run(run_round(dv.DeltaRefitEngine, [t], [r], lambda: iter(w.items()), 1, receive))
    assert isinstance(got[0], VerificationError) and "written by another process" in str(got[0]), got[0]
    assert len(received) == 1


def _handoff(tmp_path, body: bytes):
    stream = tmp_path / "stream"
    t = dv.DeltaRefitEngine(bucket_size=1, is_master=True, stream=str(stream), state_dir=str(tmp_path / "state"))
    t.store  # noqa: B018 (the trainer's store property creates the store)
    token = "abc123"
    (stream / "verl").mkdir(parents=True, exist_ok=True)
    (stream / "verl" / f"{token}.json").write_bytes(body)
    r = dv.DeltaRefitEngine(stream=str(stream), checkpoint=str(tmp_path / "c.safetensors"), timeout_s=5)
    r.init_process_group(token=token)
    return asyncio.run(r.wait_handoff())


@pytest.mark.parametrize(("body", "why"), [
    (b" " * (2 << 20) + b"{}", "larger than"),  # read no further than the cap
    (b"[" * 20_000 + b"]" * 20_000, "malformed handoff"),  # no RecursionError
    (b'{"version": true, "fingerprint": "ab"}', "malformed handoff"),  # a bool is no version
    (b'{"version": 2, "fingerprint": "ab", "step": "7"}', "malformed handoff"),
    (b'{"version": 2, "fingerprint": 5}', "malformed handoff"),
    (b'["version", 2]', "not an object"),
    (b'{"error": "boom\\u001b[2J"}', "failed: boom\\\\x1b"),  # the trainer's error, escapes shown, not sent
])
def test_a_malformed_or_oversized_handoff_is_refused_in_one_line(tmp_path, body, why):
    with pytest.raises(StreamError, match=why) as e:
        _handoff(tmp_path, body)
    assert "\n" not in str(e.value) and len(str(e.value)) < 800


def test_a_well_formed_handoff_is_taken(tmp_path):
    assert _handoff(tmp_path, b'{"version": 3, "fingerprint": "ab", "step": null}')["version"] == 3


@pytest.mark.parametrize(("kw", "key"), [
    ({"timeout_s": "5"}, "timeout_s"),
    ({"timeout_s": float("nan")}, "timeout_s"),
    ({"timeout_s": True}, "timeout_s"),
    ({"keyframe_every": "x"}, "keyframe_every"),
    ({"keyframe_every": 0}, "keyframe_every"),
    ({"keyframe_every": 2.5}, "keyframe_every"),
    ({"subscriber_id": "../../etc/x"}, "subscriber_id"),
    ({"subscriber_id": "a/b"}, "subscriber_id"),
    ({"subscriber_id": ".."}, "subscriber_id"),
    ({"subscriber_id": 7}, "subscriber_id"),
    ({"in_place": "false"}, "in_place"),
    ({"verify_key": 3}, "verify_key"),
    ({"local_dir": ["/a"]}, "local_dir"),
    ({"stream": 5}, "stream"),
])
def test_engine_arguments_of_the_wrong_type_are_refused_in_one_line(tmp_path, kw, key):
    args = {"stream": str(tmp_path / "s"), "local_dir": str(tmp_path / "copies"), **kw}
    with pytest.raises(UsageError, match=key) as e:
        dv.DeltaRefitEngine(bucket_size=1, **args)
    assert "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "copies") and not os.path.exists(tmp_path / "etc")


def test_a_round_token_that_is_not_a_short_ascii_word_is_refused(tmp_path):
    r = dv.DeltaRefitEngine(stream=str(tmp_path / "s"), checkpoint=str(tmp_path / "c.safetensors"))
    for token in (None, 5, "a/b", "٣", "x" * 65):
        with pytest.raises(UsageError, match="round token"):
            r.init_process_group(token=token)
