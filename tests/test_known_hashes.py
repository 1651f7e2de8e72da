"""Known base hashes: an encode that takes the base's segment hashes instead of hashing it.

The publisher keeps its baseline's hashes between publishes (the baseline is the previous target,
verified when it advanced). These tests hold that such an encode writes the very bytes of a cold one,
that hashes of a file that changed since are not used, and that wrong hashes cannot make a rollout
accept wrong bytes.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil

import blake3
import pytest
import torch
from _pairs import pair_tensors, sha, write_tensors
from _stream_util import flip_tensor_byte

import deltarefit
from deltarefit.checkpoint import open_checkpoint
from deltarefit.errors import BaseMismatchError, UsageError
from deltarefit.storage import LocalStore
from deltarefit.stream import Publisher, StreamError, Subscriber

E = importlib.import_module("deltarefit.encode")  # the package exports a function of the same name


@pytest.fixture
def pair(tmp_path):
    """A pair with every op: patched tensors (one unchanged, one over three segments), one removed,
    one added, one replaced by another dtype."""
    base, target = pair_tensors(n_tensors=2, shape=(256, 1024), change=0.03)
    base["gone.weight"] = torch.zeros(300, dtype=torch.bfloat16)
    target["new.weight"] = torch.ones(700, dtype=torch.bfloat16)
    target["norm.f32"] = target["norm.f32"].to(torch.bfloat16)  # replace: same name, another dtype
    return (write_tensors(tmp_path / "base.safetensors", base), write_tensors(tmp_path / "target.safetensors", target))


def test_known_hashes_write_the_same_delta(pair, tmp_path):
    bp, tp = pair
    known = E.known_hashes(bp)
    cold = E.encode(bp, tp, str(tmp_path / "cold.delta"))
    warm = E.encode(bp, tp, str(tmp_path / "warm.delta"), known_base=known)
    assert (cold.base_hashes_known, warm.base_hashes_known) == (False, True)
    assert sha(tmp_path / "cold.delta") == sha(tmp_path / "warm.delta")
    assert warm.base_fingerprint == deltarefit.fingerprint(bp)
    # The report's target hashes are the target's own: they serve as the next encode's known base.
    assert warm.target_hashes == dict(E.known_hashes(tp).hashes)
    ops = {e["name"]: e["op"] for e in deltarefit.inspect(str(tmp_path / "warm.delta"))["tensors"]}
    assert {ops["gone.weight"], ops["new.weight"], ops["norm.f32"], ops["frozen.bias"]} == \
        {"remove", "add", "replace", "same"}


def test_hashes_of_a_file_written_since_are_not_used(pair, tmp_path):
    bp, tp = pair
    known = E.known_hashes(bp)
    flip_tensor_byte(bp, "big.weight")  # same size, same inode: only the timestamps tell
    rep = E.encode(bp, tp, str(tmp_path / "d.delta"), known_base=known)
    assert not rep.base_hashes_known
    assert rep.base_fingerprint == deltarefit.fingerprint(bp)  # the file as it is now
    ck = tmp_path / "ck.safetensors"
    shutil.copyfile(bp, ck)
    deltarefit.apply(str(tmp_path / "d.delta"), str(ck))
    assert deltarefit.fingerprint(str(ck)) == deltarefit.fingerprint(tp)


def test_a_replaced_file_has_another_identity(pair, tmp_path):
    bp, _ = pair
    with open_checkpoint(bp) as ck:
        before = ck.identity()
    tmp = bp + ".new"
    shutil.copyfile(bp, tmp)
    os.replace(tmp, bp)  # same bytes, new inode
    with open_checkpoint(bp) as ck:
        assert ck.identity() != before


def test_wrong_hashes_cannot_make_a_rollout_accept_wrong_bytes(pair, tmp_path):
    # Hashes that do not belong to the base (here the target's, under the base's identity) bind the
    # delta to a base it does not fit: a rollout holding the real base refuses it and writes nothing.
    bp, tp = pair
    theirs = {n: h for n, h in E.known_hashes(tp).hashes.items() if n != "new.weight"}  # not in the base
    rep = E.encode(bp, tp, str(tmp_path / "d.delta"), known_base=E.KnownHashes(E.known_hashes(bp).identity, theirs))
    assert rep.base_hashes_known and rep.base_fingerprint != deltarefit.fingerprint(bp)
    ck = tmp_path / "ck.safetensors"
    shutil.copyfile(bp, ck)
    before = sha(ck)
    with pytest.raises(BaseMismatchError):
        deltarefit.apply(str(tmp_path / "d.delta"), str(ck))
    assert sha(ck) == before


def test_hashes_of_the_wrong_length_are_refused(pair, tmp_path):
    bp, tp = pair
    known = dict(E.known_hashes(bp).hashes)
    known["big.weight"] = known["big.weight"][:16]
    with open_checkpoint(bp) as b, open_checkpoint(tp) as t, \
            pytest.raises(UsageError, match=r"tensor 'big.weight': 1 segments, the base holds 3"):
        E.encode_checkpoints(b, t, str(tmp_path / "d.delta"), base_hashes=known)
    assert not os.path.exists(tmp_path / "d.delta")


# ---------------------------------------------------------------------------------------- publisher


def _steps(tmp_path, n: int) -> list[str]:
    """``n`` consecutive checkpoints, each moving 3% of the bf16 elements of the one before by one ulp."""
    g = torch.Generator().manual_seed(7)
    cur = pair_tensors(n_tensors=2, shape=(256, 1024), change=0.03)[0]
    out = []
    for i in range(n):
        out.append(write_tensors(tmp_path / f"step{i}.safetensors", cur))
        cur = {k: (v.view(torch.int16) + (torch.rand(v.shape, generator=g) < 0.03).to(torch.int16)).view(v.dtype)
               if v.dtype == torch.bfloat16 else v for k, v in cur.items()}
    return out


@pytest.fixture
def spy(monkeypatch):
    """The publisher's encodes run for real; their reports are kept."""
    import deltarefit.stream.publisher as P

    reports = []
    real = P.encode_delta

    def encode_delta(*a, **kw):
        reports.append(real(*a, **kw))
        return reports[-1]

    monkeypatch.setattr(P, "encode_delta", encode_delta)
    return reports


@pytest.mark.parametrize("advance", ["copy", "apply"])
def test_publisher_reuses_its_baselines_hashes(tmp_path, spy, advance):
    steps = _steps(tmp_path, 4)
    store = LocalStore(str(tmp_path / "store"))
    pub = Publisher(store, str(tmp_path / "pub"), keyframe_every=100, keyframe_ratio=1000.0, advance=advance)
    recs = [pub.publish(s) for s in steps]
    # Version 1 is a keyframe (no encode); version 2's encode hashes the baseline; 3 and 4 reuse it.
    assert [r.base_hashes_known for r in spy] == [False, True, True]
    for i, rec in enumerate(recs[1:]):  # each published delta is the very bytes of a cold encode
        cold = str(tmp_path / f"cold{i}.delta")
        E.encode(steps[i], steps[i + 1], cold, sums=True)  # a Publisher writes additive digests
        with open(cold, "rb") as f:
            assert store.get(rec.delta.key) == f.read()
    sub = Subscriber(store, str(tmp_path / "rollout.safetensors"), subscriber_id="r")
    sub.sync()
    assert deltarefit.fingerprint(sub.checkpoint) == deltarefit.fingerprint(steps[-1])


def test_a_baseline_changed_by_hand_is_still_caught(tmp_path, spy):
    steps = _steps(tmp_path, 3)
    store = LocalStore(str(tmp_path / "store"))
    pub = Publisher(store, str(tmp_path / "pub"), keyframe_every=100, keyframe_ratio=1000.0)
    pub.publish(steps[0])
    pub.publish(steps[1])
    flip_tensor_byte(pub.baseline, "big.weight")
    with pytest.raises(StreamError, match="modified by hand"):
        pub.publish(steps[2])
    assert not spy[-1].base_hashes_known


def test_a_delta_staged_without_fsync_is_the_same_file(pair, tmp_path, monkeypatch):
    bp, tp = pair
    E.encode(bp, tp, str(tmp_path / "durable.delta"))
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    E.encode(bp, tp, str(tmp_path / "staged.delta"), durable=False)
    assert synced == []
    assert sha(tmp_path / "staged.delta") == sha(tmp_path / "durable.delta")
    E.encode(bp, tp, str(tmp_path / "again.delta"))
    assert len(synced) == 2  # the file, then its directory


def test_a_sharded_base_is_known_file_by_file(tmp_path):
    base, target = pair_tensors(n_tensors=2, shape=(256, 1024), change=0.03)
    d = tmp_path / "base"
    d.mkdir()
    names = sorted(base)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, ns in shards.items():
        write_tensors(d / fname, {n: base[n] for n in ns})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    tp = write_tensors(tmp_path / "target.safetensors", target)
    known = E.known_hashes(str(d))
    assert len(known.identity) == 2  # one entry per shard file
    E.encode(str(d), tp, str(tmp_path / "cold.delta"))
    warm = E.encode(str(d), tp, str(tmp_path / "warm.delta"), known_base=known)
    assert warm.base_hashes_known and sha(tmp_path / "cold.delta") == sha(tmp_path / "warm.delta")
    flip_tensor_byte(str(d / "model-00002-of-00002.safetensors"))  # the other shard is untouched
    assert not E.encode(str(d), tp, str(tmp_path / "again.delta"), known_base=known).base_hashes_known


def test_a_new_publisher_process_finds_the_kept_hashes(tmp_path, spy):
    # `deltarefit publish` is a new process each time: the hashes live in the state directory too.
    steps = _steps(tmp_path, 4)
    store = LocalStore(str(tmp_path / "store"))

    def pub() -> Publisher:  # a fresh object per publish: nothing carried in memory
        return Publisher(store, str(tmp_path / "pub"), keyframe_every=100, keyframe_ratio=1000.0)

    for s in steps:
        pub().publish(s)
    assert [r.base_hashes_known for r in spy] == [False, True, True]
    p = pub()
    assert p.base.known_base().hashes == E.known_hashes(p.baseline).hashes


@pytest.mark.parametrize("damage", ["torn", "edited", "forged"])
def test_a_damaged_hashes_file_never_breaks_a_publish(tmp_path, spy, damage, caplog):
    steps = _steps(tmp_path, 3)
    store = LocalStore(str(tmp_path / "store"))
    p = Publisher(store, str(tmp_path / "pub"), keyframe_every=100, keyframe_ratio=1000.0)
    p.publish(steps[0])
    p.publish(steps[1])
    path = p.known_path
    data = open(path, "rb").read()
    if damage == "torn":
        data = data[: len(data) // 2]
    elif damage == "edited":  # one hex digit of one hash changed, checksum left as it was
        i = data.index(b'"hashes":{') + 40
        data = data[:i] + (b"0" if data[i:i + 1] != b"0" else b"1") + data[i + 1:]
    else:  # forged: the same identity, another checkpoint's hashes, a valid checksum
        k = E.KnownHashes.from_bytes(data)
        data = E.KnownHashes(k.identity, E.known_hashes(steps[0]).hashes).to_bytes()
    with open(path, "wb") as f:
        f.write(data)
    rec = Publisher(store, str(tmp_path / "pub"), keyframe_every=100, keyframe_ratio=1000.0).publish(steps[2])
    cold = str(tmp_path / "cold.delta")
    E.encode(steps[1], steps[2], cold, sums=True)
    with open(cold, "rb") as f:
        assert store.get(rec.delta.key) == f.read()  # the delta a cold encode writes
    assert not spy[-1].base_hashes_known
    assert "hashing the baseline" in caplog.text or "the baseline is hashed instead" in caplog.text


def test_known_hashes_round_trip_and_refuse_what_is_not_theirs(pair):
    bp, _ = pair
    k = E.known_hashes(bp)
    assert E.KnownHashes.from_bytes(k.to_bytes()) == k
    data = k.to_bytes()
    last = b"1" if data[-1:] == b"0" else b"0"
    for bad, why in [(b"", "checksum"), (data[:-1] + last, "checksum"),
                     (b'{"format":"other"}\n' + blake3.blake3(b'{"format":"other"}').hexdigest().encode(),
                      "not a known-hashes file")]:
        with pytest.raises(ValueError, match=why):
            E.KnownHashes.from_bytes(bad)


def test_publisher_reuses_its_baselines_additive_digests(tmp_path, spy, monkeypatch):
    """A publish after the first delta takes its base's additive digests from the encode before (the
    baseline is that encode's target), and every encode moves them by the changes its scan found: the
    first delta sums its base once, the later ones sum nothing, and every delta is still byte for
    byte a cold encode's, whose target digests are those of a pass over the target."""
    summed: list[int] = []
    real = E.additive_digests

    def counting(tensors, **kw):
        summed.append(len(tensors))
        return real(tensors, **kw)

    monkeypatch.setattr(E.encoder, "additive_digests", counting)  # the module whose encode calls it
    steps = _steps(tmp_path, 4)
    store = LocalStore(str(tmp_path / "store"))
    pub = Publisher(store, str(tmp_path / "pub"), keyframe_every=100, keyframe_ratio=1000.0)
    recs = [pub.publish(s) for s in steps]
    n = len(spy[0].target_sums)
    assert n > 0 and all(r.target_sums for r in spy)
    patched = [sum(1 for e in _entries(store, r) if e.op == "patch") for r in recs[1:]]
    # version 2: every tensor of the base; the targets' digests: the base's moved by the changes
    assert all(patched) and summed == [n, 0, 0]
    for i, rec in enumerate(recs[1:]):
        cold = str(tmp_path / f"cold{i}.delta")
        E.encode(steps[i], steps[i + 1], cold, sums=True)
        with open(cold, "rb") as f:
            assert store.get(rec.delta.key) == f.read()
        with open_checkpoint(steps[i + 1]) as ck:
            full = dict(zip(sorted(ck.tensors), real([(ck, t) for t in sorted(ck.tensors)]), strict=True))
        assert {e.name: e.target.sum for e in _entries(store, rec)} == full


def test_target_digests_moved_by_the_changes_match_a_pass_over_the_target(tmp_path):
    """Every dtype the scan handles (16-bit through the native scan, the others through numba), a
    tensor at an odd offset in its file (copied before the scan), chunks coded densely, a tensor whose
    second chunk has no change, and one with none at all: the target digests an encode derives from
    its scan are those of a pass over the target."""
    g = torch.Generator().manual_seed(3)
    base = {"a_odd": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
            "bf16": torch.randn(700_000, generator=g).to(torch.bfloat16),
            "f32": torch.randn(300_000, generator=g),
            "f16": torch.randn(2000, generator=g).to(torch.float16),
            "f8": torch.randn(5000, generator=g).to(torch.float8_e4m3fn),
            "i64": torch.randint(-10**12, 10**12, (4000,), generator=g),
            "flag": torch.rand(3000, generator=g) < 0.5,
            "same": torch.randn(1000, generator=g).to(torch.bfloat16)}
    target = {k: v.clone() for k, v in base.items()}
    for k, rate in (("bf16", 0.03), ("f32", 0.98), ("f16", 0.02), ("f8", 0.4), ("i64", 0.1), ("flag", 0.05),
                    ("a_odd", 1.0)):
        t = target[k]
        ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
                torch.float8_e4m3fn: torch.uint8, torch.bool: torch.uint8}
        u = t.view(ints.get(t.dtype, t.dtype))  # the bits, moved by one (or flipped, for bool)
        if k == "bf16":
            u = u[: 400_000]  # the second chunk (from element 524,288) unchanged
        mask = torch.rand(u.shape, generator=g) < rate
        if k == "f32":  # random bits: no ulp model codes them well
            u[mask] = torch.randint(-2**31, 2**31 - 1, (int(mask.sum()),), dtype=torch.int32, generator=g)
        else:
            u[mask] = 1 - u[mask] if t.dtype == torch.bool else u[mask] + 1
    b = write_tensors(tmp_path / "b.safetensors", base)
    t = write_tensors(tmp_path / "t.safetensors", target)
    out = str(tmp_path / "d.delta")
    E.encode(b, t, out, sums=True)
    from deltarefit.format import DeltaReader

    with DeltaReader(out) as d, open_checkpoint(b) as bk, open_checkpoint(t) as tk:
        entries = {e.name: e for e in d.tensors}
        assert {n for n, e in entries.items() if e.op == "patch"} == set(base) - {"same"}
        names = sorted(base)
        assert {n: entries[n].base.sum for n in names} == dict(zip(names, E.additive_digests([(bk, n) for n in names]),
                                                                   strict=True))
        assert {n: entries[n].target.sum for n in names} == dict(zip(names, E.additive_digests([(tk, n) for n in names]),
                                                                     strict=True))
        # nearly every element: coded densely (3, 4), or by format 2's per-element lanes (6) where smaller
        assert {d.chunks(entries["f32"])[0].encoding} <= {3, 4, 6}
    work = str(tmp_path / "w.safetensors")
    shutil.copyfile(b, work)
    deltarefit.apply(out, work)
    assert sha(work) == sha(t)


def _entries(store, rec):
    from deltarefit.format import DeltaReader

    with DeltaReader(os.path.join(store.root, rec.delta.key)) as d:
        return list(d.tensors)
