"""Sharded versions through the version stream: 2 trainer ranks commit parts to a store, TP=2 rollout
ranks (and whole-model holders) sync through it, ranks simulated in one process. Kills between steps,
tampered objects, late ranks, diverged baselines and late joiners."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from _shard_util import SHAPES, masters, step

from deltarefit.errors import BaseMismatchError, UsageError
from deltarefit.integrity import additive as D
from deltarefit.shard import stream as S
from deltarefit.shard import sync as shard_sync
from deltarefit.shard.convert import to_bf16_bits
from deltarefit.shard.names import (
    cuts_from_layouts,
    identity_layout,
    local_from_full,
    tp_layout,
    trainer_layout,
)
from deltarefit.shard.rollout import group_check, slice_digests
from deltarefit.shard.stream import (
    ShardStreamPublisher,
    head_key,
    held_version,
    load_shard_commit,
    new_attempt,
    retain_sharded,
    state_fingerprint,
    sync_sharded,
)
from deltarefit.storage.local import LocalStore
from deltarefit.storage.memory import MemoryStore
from deltarefit.stream.publisher import PublishError
from deltarefit.stream.records import StreamError, commit_key, head, load_commit

TLAYS = [trainer_layout(SHAPES, [2], [r], ["S0"]) for r in range(2)]
RLAYS = [tp_layout(SHAPES, 2, r) for r in range(2)]
CUTS = cuts_from_layouts([*RLAYS, identity_layout(SHAPES)])


def trainers(store, state_dir=None, **kw):
    return [ShardStreamPublisher(store, TLAYS[r], "BF16", cuts=CUTS, rank=r, world=2,
                                 state_dir=None if state_dir is None else str(state_dir), timeout=5, poll=0.01, **kw)
            for r in range(2)]


def publish_all(tps, full, attempt=None, ranks=(0, 1)):
    """The steps every rank takes, in one process: upload, commit (rank 0), advance."""
    attempt = attempt or new_attempt()
    refs = upload_all(tps, full, attempt, ranks)
    v = tps[0].version + 1
    rec = tps[0].commit_version(v, attempt, refs=refs)
    for tp in tps:
        tp.advance(tp.wait_commit(v))
    return rec


def upload_all(tps, full, attempt, ranks=(0, 1)):
    """Each rank's upload, its ref handed over in process (the committer's trusted channel)."""
    return [tps[r].upload(local_from_full(TLAYS[r], full, np.float32), attempt) for r in ranks]


def rollout_tensors():
    return [{n: torch.zeros(lt.shape, dtype=torch.bfloat16) for n, lt in lay.items()} for lay in RLAYS]


def bits(t):
    return t.view(torch.int16).numpy().view(np.uint16) if isinstance(t, torch.Tensor) else t


def assert_exact(tensors, layout, full):
    want = local_from_full(layout, {n: to_bf16_bits(a) for n, a in full.items()}, np.uint16)
    assert set(want) == set(tensors)
    for n in want:
        assert np.array_equal(bits(tensors[n]), want[n]), n


def snapshot(tensors):
    return {n: bits(t).copy() for n, t in tensors.items()}


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    return LocalStore(str(tmp_path / "store")) if request.param == "local" else MemoryStore()


def test_three_versions_tp_rollouts_bit_exact(store, tmp_path):
    tps = trainers(store, tmp_path / "trainer")
    roll = rollout_tensors()
    whole = {n: np.zeros(s, np.uint16) for n, s in SHAPES.items()}  # identity layout, numpy, syncs only at the end
    full = masters()
    rng = np.random.default_rng(1)
    recs = []
    for i in range(3):
        if i:
            step(full, rng)
        rec = publish_all(tps, full)
        recs.append(rec)
        assert rec.version == i + 1 and rec.keyframe == (i == 0) and head(store) == i + 1
        assert [tp.version for tp in tps] == [i + 1, i + 1]
        for r in range(2):
            rep = sync_sharded(store, roll[r], RLAYS[r], state_path=str(tmp_path / f"roll{r}.json"))
            assert rep.version == i + 1 and rep.versions_applied == [i + 1]
            assert_exact(roll[r], RLAYS[r], full)
        # the TP group's summed slice digests are the version's (what an all-reduce would give)
        man = S.load_manifest(store, rec)
        total = {}
        for r in range(2):
            for n, d in slice_digests(roll[r], RLAYS[r], man["tensors"]).items():
                total[n] = D.add(total.get(n, D.ZERO), d)
        assert group_check(total, man) == []
        assert state_fingerprint(man["tensors"]) == rec.fingerprint
    # the chain: each record names its parent's fingerprint; delta manifests start from it
    for a, b in itertools.pairwise(recs):
        assert load_shard_commit(store, b.version).parent == a.fingerprint
        assert state_fingerprint(S.load_manifest(store, b)["tensors"], "base") == a.fingerprint
    # a whole-model holder catching up over all versions (layout from the manifest), then a no-op rerun
    rep = sync_sharded(store, whole, state_path=str(tmp_path / "whole.json"), adopt=False)
    assert rep.route == "keyframe" and rep.versions_applied == [1, 2, 3]
    assert_exact(whole, identity_layout(SHAPES), full)
    rep = sync_sharded(store, whole, state_path=str(tmp_path / "whole.json"))
    assert rep.route == "none" and rep.bytes_fetched == 0
    # plain-stream readers refuse a sharded record clearly
    with pytest.raises(StreamError, match=r"not a deltarefit\.commit"):
        load_commit(store, 1)


def _upload_rank(tp, full, attempt, refs, errs):
    try:
        refs[tp.rank] = tp.upload(local_from_full(TLAYS[tp.rank], full, np.float32), attempt)
    except Exception as e:  # surfaced by the caller
        errs.append(e)


def test_publish_api_with_rank_threads(tmp_path):
    """Ranks in threads, no process group: ``publish`` refuses (the refs would have to come from the store);
    each rank uploads, the refs reach the committer in process, every rank advances."""
    store = MemoryStore()
    tps = trainers(store, tmp_path / "t")
    full = masters()
    with pytest.raises(UsageError, match="channel the store cannot forge"):
        tps[0].publish(local_from_full(TLAYS[0], full, np.float32), attempt=new_attempt())
    assert head(store) == 0 and not store.list("v/")
    rng = np.random.default_rng(2)
    roll = rollout_tensors()
    for i in range(2):
        if i:
            step(full, rng)
        attempt, refs, errs = new_attempt(), {}, []
        ths = [threading.Thread(target=_upload_rank, args=(tps[r], full, attempt, refs, errs)) for r in (1, 0)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        assert not errs
        v = tps[0].version + 1
        rec = tps[0].commit_version(v, attempt, refs=[refs[0], refs[1]], step=10 + i)
        for tp in tps:
            tp.advance(tp.wait_commit(v))
        assert rec.step == 10 + i and [tp.version for tp in tps] == [v, v]
    for r in range(2):
        sync_sharded(store, roll[r], RLAYS[r], state_path=str(tmp_path / f"r{r}.json"))
        assert_exact(roll[r], RLAYS[r], full)


def _planted_part(store, full, attempt):
    """Rank 1's part of version 2 from other masters, made by a second publisher that follows the stream
    (what a store writer who reads the listing can build), written under the honest attempt first."""
    forger = trainers(store)[1]
    forger.recover()
    bad = {n: a.copy() for n, a in full.items()}
    for a in bad.values():
        a.reshape(-1)[:17] = 123.0
    return forger.upload(local_from_full(TLAYS[1], bad, np.float32), attempt)


def test_regression_a_part_planted_in_the_store_is_never_committed(tmp_path):
    """Regression (issue 46, high): a store writer plants rank 1's part and descriptor under the attempt
    it sees in the listing, first. The honest rank's upload is refused, so it hands over no ref; the
    committer, which used to join what it read back and sign it, refuses: nothing is committed, and a
    signed rollout sees no new version."""
    from deltarefit.signing import keygen

    priv = str(tmp_path / "k")
    keygen(priv)
    pub = priv + ".pub"
    store = MemoryStore()
    tps = trainers(store, signing_key=priv)
    full = masters()
    publish_all(tps, full)
    step(full, np.random.default_rng(11))
    attempt = new_attempt()
    ref0 = tps[0].upload(local_from_full(TLAYS[0], full, np.float32), attempt)
    planted = _planted_part(store, full, attempt)
    with pytest.raises(StreamError, match="already holds other bytes"):
        tps[1].upload(local_from_full(TLAYS[1], full, np.float32), attempt)
    with pytest.raises(PublishError, match="no part refs from the ranks"):
        tps[0].commit_version(2, attempt)
    with pytest.raises(PublishError, match="1 part refs for 2 ranks"):
        tps[0].commit_version(2, attempt, refs=[ref0])
    # The planted ref itself, handed over as rank 1's, is not the rank's: the caller gathers what the ranks
    # returned. A ref for another key is refused by shape.
    with pytest.raises(PublishError, match="not its part of version 2"):
        tps[0].commit_version(2, attempt, refs=[ref0, ref0])
    assert not store.exists(commit_key(2)) and head(store) == 1
    roll = rollout_tensors()[1]
    rep = sync_sharded(store, roll, RLAYS[1], state_path=str(tmp_path / "r1.json"), public_key=pub)
    assert rep.version == 1
    assert planted.key == part_key_of(2, attempt, 1)


def part_key_of(version, attempt, rank):
    from deltarefit.shard.stream import part_key

    return part_key(version, attempt, rank)


def test_regression_a_part_overwritten_after_upload_is_never_committed(tmp_path):
    """Regression (issue 46): the honest parts are in; a store writer then overwrites rank 1's part and
    descriptor with its own. The committer, holding the refs the ranks handed it, refuses the descriptor
    that no longer matches; nothing is committed."""
    store = MemoryStore()
    tps = trainers(store)
    full = masters()
    publish_all(tps, full)
    step(full, np.random.default_rng(12))
    attempt = new_attempt()
    refs = upload_all(tps, full, attempt)
    other = MemoryStore()  # the forged part and descriptor, built elsewhere and copied over the honest ones
    for k in store.list(""):
        if not k.startswith("v/000000000002/"):
            other.put(k, store.get(k))
    _planted_part(other, full, attempt)
    for k in (part_key_of(2, attempt, 1), head_key(2, attempt, 1)):
        store.put(k, other.get(k))
    with pytest.raises(PublishError, match="planted by another writer"):
        tps[0].commit_version(2, attempt, refs=refs)
    assert not store.exists(commit_key(2)) and head(store) == 1


def test_kill_before_commit_then_rerun(store, tmp_path):
    sd = tmp_path / "trainer"
    tps = trainers(store, sd)
    full = masters()
    rng = np.random.default_rng(3)
    publish_all(tps, full)
    step(full, rng)
    dead = new_attempt()
    for r in range(2):  # both parts uploaded, then the committer dies: no commit record
        tps[r].upload(local_from_full(TLAYS[r], full, np.float32), dead)
    assert head(store) == 1 and not store.exists(commit_key(2))
    assert [held(store, sd, r) for r in range(2)] == [1, 1]
    # restarted ranks (state from state_dir), the next step's masters, a fresh attempt
    tps = trainers(store, sd)
    step(full, rng)
    rec = publish_all(tps, full)
    assert rec.version == 2 and rec.attempt != dead
    roll = rollout_tensors()
    for r in range(2):
        sync_sharded(store, roll[r], RLAYS[r], state_path=str(tmp_path / f"r{r}.json"))
        assert_exact(roll[r], RLAYS[r], full)
    # the dead attempt's parts are orphans: retention removes them (and the descriptors the committer
    # read, needed by nobody once a version is committed), keeps the committed parts and manifests
    deleted = retain_sharded(store)
    assert any(f"/{dead}/" in k for k in deleted)
    assert all(f"/{dead}/" in k or k.endswith(".head.json") for k in deleted)
    assert all(store.exists(p.key) for p in (rec.manifest, *rec.parts))
    # reusing an attempt id with other bytes is refused
    step(full, rng)
    tps[0].upload(local_from_full(TLAYS[0], full, np.float32), "fixed")
    step(full, rng)
    with pytest.raises(StreamError, match="attempt id reused"):
        trainers(store, sd)[0].upload(local_from_full(TLAYS[0], full, np.float32), "fixed")


def test_retention_keeps_uploads_of_unknown_age():
    """A store that keeps no timestamps (memory) keeps the parts of an attempt no record names yet,
    whatever the grace (they may be an upload in progress), as plain retention does; the descriptors
    of a committed version still go."""
    store = MemoryStore()
    tps = trainers(store)
    full = masters()
    publish_all(tps, full)
    step(full, np.random.default_rng(4))
    pending = new_attempt()
    tps[0].upload(local_from_full(TLAYS[0], full, np.float32), pending)  # rank 1 not yet: no commit
    uploads = [k for k in store.list("v/") if f"/{pending}/" in k]
    assert uploads and head(store) == 1
    deleted = retain_sharded(store, orphan_grace=0, unsafe_short_grace=True)
    assert deleted and all(k.endswith(".head.json") for k in deleted)
    assert all(store.exists(k) for k in uploads)


def held(store, sd, r):
    """The version rank r's saved state holds (without following the stream)."""
    tp = trainers(store, sd)[r]
    tp._load_state()
    return tp.version


def test_kill_after_commit_before_advance(store, tmp_path):
    sd = tmp_path / "trainer"
    tps = trainers(store, sd)
    full = masters()
    rng = np.random.default_rng(4)
    publish_all(tps, full)
    step(full, rng)
    attempt = new_attempt()
    rec = tps[0].commit_version(2, attempt, refs=upload_all(tps, full, attempt))
    tps[0].advance(rec)  # rank 1 dies before advancing: its saved state is still version 1
    assert tps[1].version == 1
    dead = _dead_pid()
    half = sd / f"rank-1.npz.tmp-{dead}"  # what a rank killed while saving its slice leaves
    half.write_bytes(b"half a slice")
    tps = [tps[0], trainers(store, sd)[1]]
    assert tps[1].recover() == 2 and tps[1].fingerprint == rec.fingerprint
    assert not half.exists()
    step(full, rng)
    publish_all(tps, full)
    # a rank that lost its state altogether rebuilds its baseline from the keyframe chain
    fresh = trainers(store, None)[1]
    assert fresh.recover() == 3
    tps = [tps[0], fresh]
    step(full, rng)
    publish_all(tps, full)
    roll = rollout_tensors()
    for r in range(2):
        rep = sync_sharded(store, roll[r], RLAYS[r], state_path=str(tmp_path / f"r{r}.json"))
        assert rep.versions_applied == [1, 2, 3, 4]
        assert_exact(roll[r], RLAYS[r], full)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _rollout_synced_at_v1(store, tmp_path, seed):
    """Two trainer ranks publish version 1, rollout rank 0 syncs it (version state in ``tmp_path``),
    then the masters take a step. Returns (trainers, masters, rng, rollout tensors, state path)."""
    tps = trainers(store)
    full = masters()
    rng = np.random.default_rng(seed)
    publish_all(tps, full)
    roll = rollout_tensors()[0]
    sp = str(tmp_path / "r0.json")
    sync_sharded(store, roll, RLAYS[0], state_path=sp)
    step(full, rng)
    return tps, full, rng, roll, sp


def test_rollout_killed_between_apply_and_record(tmp_path, monkeypatch):
    store = MemoryStore()
    tps, full, _rng, roll, sp = _rollout_synced_at_v1(store, tmp_path, 5)
    publish_all(tps, full)
    real = shard_sync.record_version

    def killed(path, v, fp, url, **kw):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(shard_sync, "record_version", killed)
    with pytest.raises(KeyboardInterrupt):
        sync_sharded(store, roll, RLAYS[0], state_path=sp)
    monkeypatch.setattr(shard_sync, "record_version", real)
    assert held_version(sp)[0] == 1
    half = f"{sp}.tmp-{_dead_pid()}"  # a kill inside record_version's write leaves its temp
    with open(half, "wb") as f:
        f.write(b"{")
    rep = sync_sharded(store, roll, RLAYS[0], state_path=sp)  # applied already: every cell skipped
    assert rep.versions_applied == [2] and rep.applied[0].written == 0
    assert held_version(sp)[0] == 2 and not os.path.exists(half)
    assert_exact(roll, RLAYS[0], full)


def test_tampered_objects_refused_nothing_written(store, tmp_path):
    tps, full, rng, roll, sp = _rollout_synced_at_v1(store, tmp_path, 6)
    publish_all(tps, full)
    step(full, rng)
    rec = publish_all(tps, full)
    before = snapshot(roll)
    for ref in (rec.parts[0], rec.manifest):
        good = store.get(ref.key)
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 1
        store.put(ref.key, bytes(bad))
        with pytest.raises(StreamError, match="does not match its commit record"):
            sync_sharded(store, roll, RLAYS[0], state_path=sp)
        # version 3 is tampered: nothing of version 2 was written either (everything staged first)
        assert all(np.array_equal(bits(roll[n]), before[n]) for n in roll)
        assert held_version(sp)[0] == 1
        store.put(ref.key, good)
    # a rollout whose tensors are not what its state says is refused before any write
    wrong = {n: t.clone() for n, t in roll.items()}
    name = next(iter(wrong))
    wrong[name].view(torch.int16).view(-1)[0] ^= 1
    with pytest.raises(BaseMismatchError):
        sync_sharded(store, wrong, RLAYS[0], state_path=sp)
    assert held_version(sp)[0] == 1
    sync_sharded(store, roll, RLAYS[0], state_path=sp)
    assert_exact(roll, RLAYS[0], full)


def test_late_rank_times_out_without_commit(tmp_path):
    store = MemoryStore()
    tps = trainers(store, tmp_path / "t")
    for tp in tps:
        tp.timeout = 0.3
    full = masters()
    publish_all(tps, full)
    step(full, np.random.default_rng(7))
    attempt = new_attempt()
    ref0 = tps[0].upload(local_from_full(TLAYS[0], full, np.float32), attempt)
    with pytest.raises(PublishError, match="1 part refs for 2 ranks; not committed"):
        tps[0].commit_version(2, attempt, refs=[ref0])
    with pytest.raises(PublishError, match="was not committed within"):
        tps[1].wait_commit(2)
    # rank 1's ref arrives before its descriptor is in the store (dropped here): the committer waits, then gives up
    ref1 = tps[1].upload(local_from_full(TLAYS[1], full, np.float32), attempt)
    store.delete(head_key(2, attempt, 1))
    with pytest.raises(PublishError, match=r"no part from ranks \[1\] within 0.3 s; not committed"):
        tps[0].commit_version(2, attempt, refs=[ref0, ref1])
    assert not store.exists(commit_key(2)) and head(store) == 1 and [tp.version for tp in tps] == [1, 1]
    # the late rank uploads again (the same bytes): the same attempt can still be committed
    assert tps[1].upload(local_from_full(TLAYS[1], full, np.float32), attempt) == ref1
    rec = tps[0].commit_version(2, attempt, refs=[ref0, ref1])
    for tp in tps:
        tp.advance(rec)
    roll = rollout_tensors()[1]
    sync_sharded(store, roll, RLAYS[1], state_path=str(tmp_path / "r1.json"))
    assert_exact(roll, RLAYS[1], full)


def test_diverged_baseline_not_committed(tmp_path):
    store = MemoryStore()
    tps = trainers(store)
    full = masters()
    publish_all(tps, full)
    tps[1].pub.baseline[next(iter(tps[1].pub.baseline))].reshape(-1)[0] ^= 1  # a rank's baseline drifts
    step(full, np.random.default_rng(8))
    with pytest.raises(PublishError, match="do not start from version 1"):
        publish_all(tps, full)
    assert head(store) == 1


def test_keyframes_late_joiner_and_adoption(tmp_path):
    store = MemoryStore()
    tps = trainers(store, keyframe_every=2)
    full = masters()
    rng = np.random.default_rng(9)
    recs, convs = [], []
    for i in range(3):
        if i:
            step(full, rng)
        recs.append(publish_all(tps, full))
        convs.append({n: to_bf16_bits(a) for n, a in full.items()})
    assert [r.keyframe for r in recs] == [True, True, False]
    # a late joiner holding nothing starts at the newest keyframe (version 2), never fetching version 1
    roll = rollout_tensors()[0]
    rep = sync_sharded(store, roll, RLAYS[0], state_path=str(tmp_path / "late.json"))
    assert rep.route == "keyframe" and rep.versions_applied == [2, 3]
    assert rep.bytes_fetched <= sum(p.bytes for r in recs[1:] for p in (r.manifest, *r.parts))
    assert_exact(roll, RLAYS[0], full)
    # a rank whose engine loaded the full export of version 2 adopts it by its cell digests
    loaded = {n: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).clone()
              for n, a in local_from_full(RLAYS[1], convs[1], np.uint16).items()}
    rep = sync_sharded(store, loaded, RLAYS[1], state_path=str(tmp_path / "adopt.json"))
    assert rep.route == "adopted" and rep.from_version == 0 and rep.versions_applied == [3]
    assert_exact(loaded, RLAYS[1], full)


GLOO_RANK = r'''
import datetime, json, sys
import numpy as np
import torch.distributed as dist
sys.path.insert(0, sys.argv[2])
import test_shard_stream as T
from deltarefit.errors import DeltaRefitError
from deltarefit.shard.stream import ShardStreamPublisher
a = json.loads(sys.argv[1])
r = a["rank"]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a['port']}", rank=r, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
tp = ShardStreamPublisher(a["store"], T.TLAYS[r], "BF16", cuts=T.CUTS, rank=r, world=2, group=dist.group.WORLD,
                          state_dir=a["state"], timeout=30)
full = T.masters()
rng = np.random.default_rng(11)
out = []
for i in range(3):
    if i:
        T.step(full, rng)
    m = T.local_from_full(T.TLAYS[r], full, np.float32)
    if i == 1 and r == 1:  # this rank fails locally: every rank must hear it, nothing committed
        m.pop(next(iter(m)))
    try:
        out.append(tp.publish(m, step=i).version)
    except DeltaRefitError as e:
        out.append(type(e).__name__ + ": " + str(e)[:200])
np.savez(a["ref"], **{n: v for n, v in full.items()}) if r == 0 else None
print(json.dumps({"rank": r, "out": out, "version": tp.version}))
dist.destroy_process_group()
'''


def test_gloo_group_publish_and_a_failing_rank(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from _stream_util import communicate_all, free_port

    port = free_port()
    here = os.path.dirname(os.path.abspath(__file__))
    args = {"port": port, "store": str(tmp_path / "store"), "state": str(tmp_path / "state"),
            "ref": str(tmp_path / "ref.npz")}
    procs = [subprocess.Popen([sys.executable, "-c", GLOO_RANK, json.dumps(dict(args, rank=r)), here],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, DELTAREFIT_NO_PROGRESS="1", OMP_NUM_THREADS="1"))
             for r in range(2)]
    res = []
    for rc, so, se in communicate_all(procs, timeout=120):
        assert rc == 0, se[-3000:]
        res.append(json.loads(so.strip().splitlines()[-1]))
    for r in res:
        assert r["out"][0] == 1 and r["out"][2] == 2 and r["version"] == 2, r
        assert r["out"][1].startswith("PublishError") and "rank 1" in r["out"][1], r
    store = LocalStore(str(tmp_path / "store"))
    assert head(store) == 2
    with np.load(tmp_path / "ref.npz") as z:
        full = {n: z[n] for n in z.files}
    roll = rollout_tensors()
    for r in range(2):
        rep = sync_sharded(store, roll[r], RLAYS[r], state_path=str(tmp_path / f"r{r}.json"))
        assert rep.versions_applied == [1, 2]
        assert_exact(roll[r], RLAYS[r], full)


def test_the_committer_reads_descriptors_never_whole_parts(tmp_path):
    """At scale a keyframe's parts are the whole served model: joining them must not read them."""

    class Counting(MemoryStore):
        def __init__(self, name):
            super().__init__(name)
            self.reads: list[str] = []

        def get(self, key):
            self.reads.append(key)
            return super().get(key)

        def get_to(self, key, dest):
            self.reads.append(key)
            return super().get_to(key, dest)

    store = Counting("committer-reads")
    tps = trainers(store)
    full = masters()
    attempt = new_attempt()
    refs = upload_all(tps, full, attempt)
    store.reads.clear()
    rec = tps[0].commit_version(1, attempt, refs=refs)
    assert rec.keyframe and store.reads
    assert not [k for k in store.reads if "/parts/" in k and not k.endswith(".head.json")], store.reads
    for tp in tps:
        tp.advance(tp.wait_commit(1))
    roll = rollout_tensors()
    for r in range(2):
        S.sync_sharded(store, roll[r], RLAYS[r], state_path=str(tmp_path / f"r{r}.json"))
        assert_exact(roll[r], RLAYS[r], full)


def test_signed_sharded_records_verified_by_rollouts(tmp_path):
    """The committer signs each record (Ed25519); a rollout given the public key refuses unsigned
    records, records signed by another key and records edited after signing, with nothing written."""
    import json as _json

    from deltarefit.signing import SignatureError, keygen

    key, other = str(tmp_path / "trainer.key"), str(tmp_path / "other.key")
    keygen(key)
    keygen(other)
    full = masters()
    signed = MemoryStore("signed-shards")
    tps = trainers(signed, signing_key=key)
    publish_all(tps, full)
    roll = rollout_tensors()
    rep = S.sync_sharded(signed, roll[0], RLAYS[0], state_path=str(tmp_path / "a.json"), public_key=key + ".pub")
    assert rep.version == 1
    assert_exact(roll[0], RLAYS[0], full)
    for store_kind, pub in (("wrong key", other + ".pub"), ("unsigned", key + ".pub")):
        store = signed if store_kind == "wrong key" else MemoryStore(f"unsigned-{tmp_path.name}")
        if store_kind == "unsigned":
            publish_all(trainers(store), full)
        fresh = rollout_tensors()[0]
        before = snapshot(fresh)
        with pytest.raises(SignatureError):
            S.sync_sharded(store, fresh, RLAYS[0], state_path=str(tmp_path / f"{store_kind}.json"), public_key=pub,
                           adopt=False)
        after = snapshot(fresh)
        assert all(np.array_equal(after[n], before[n]) for n in before)
    # an edited record (its step changed after signing) is refused
    d = _json.loads(signed.get(commit_key(1)))
    d["step"] = 12345
    signed.put(commit_key(1), _json.dumps(d).encode())
    fresh = rollout_tensors()[0]
    with pytest.raises(SignatureError, match="does not verify"):
        S.sync_sharded(signed, fresh, RLAYS[0], state_path=str(tmp_path / "edited.json"), public_key=key + ".pub",
                       adopt=False)
