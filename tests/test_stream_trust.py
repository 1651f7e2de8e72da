"""Trust in version streams: a sync says "verified" only for what it hashed, records are bound to their
stream's identity, an unsigned publish cannot enter a signed stream, and every stuck state is refused
with a one-line error that names the command that leaves it (and that command works).

Real checkpoints (the tiny-BERT AdamW chain of ``_stream_util``), real stores on disk, real CLI
processes. Version v of a stream published from ``chain[a..]`` is ``chain[a + v - 1]``.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from _stream_util import (
    chain_fingerprints,
    flip_tensor_byte,
    read_bytes,
    run,
    run_ok,
    session_chain,
    sha,
)

import deltarefit
from deltarefit.errors import VerificationError
from deltarefit.signing import KEY_MAX_BYTES, SIGNED_PREFIX, SignatureError
from deltarefit.storage import LocalStore
from deltarefit.stream import Publisher, StreamError, Subscriber
from deltarefit.stream import records as records_mod
from deltarefit.stream.records import (
    LEGACY_PREFIX,
    StreamIdentityError,
    commit_key,
    list_versions,
    load_commit,
    stream_identity,
)
from deltarefit.stream.retention import retain
from deltarefit.stream.subscriber import state_path

KF = ("--keyframe-every", "5", "--keyframe-ratio", "1000")


@pytest.fixture(scope="session")
def chain(tmp_path_factory) -> list[str]:
    return session_chain(tmp_path_factory)


@pytest.fixture(scope="session")
def fps(chain) -> list[str]:
    return chain_fingerprints(chain)


@pytest.fixture(scope="session")
def key(tmp_path_factory) -> str:
    k = str(tmp_path_factory.mktemp("trust-key") / "k.pem")
    run_ok("keygen", k)
    return k


def _publisher(store, state, **kw) -> Publisher:
    return Publisher(store, state, keyframe_every=5, keyframe_ratio=1000.0, **kw)


def _stream(tmp_path, chain, name: str, steps, state: str | None = None, **kw) -> tuple[str, str]:
    """A store ``name`` with ``chain[s]`` published for each s of ``steps``; (store dir, state dir)."""
    store, state = str(tmp_path / name), state or str(tmp_path / f"{name}-pub")
    pub = _publisher(store, state, **kw)
    for s in steps:
        pub.publish(chain[s])
    return store, state


def _wipe(*dirs: str) -> None:
    """Empty each directory (as an operator's ``rm -rf DIR/*`` would)."""
    for d in dirs:
        shutil.rmtree(d)
        os.makedirs(d)


def _publish(store, state, ck, *extra):
    return run("publish", store, ck, "--state", state, *KF, *extra)


def _one_line_naming(r, *words) -> None:
    err = r.stderr.strip()
    assert r.returncode != 0 and err.count("\n") == 0 and "Traceback" not in r.stderr, r.stderr
    assert err.startswith("deltarefit: error: ")
    for w in words:
        assert w in err, (w, err)


def _age_identity(ck: str) -> None:
    """Make the recorded file identity look as if recorded long after the last write (as it is for a
    rollout that synced minutes ago), so the racy-timestamp margin does not force a hash."""
    p = state_path(ck)
    d = json.loads(read_bytes(p))
    d["identity_at_ns"] += 10 * records_mod.RACY_NS
    with open(p, "w") as f:
        json.dump(d, f)


def _exact(ck: str, step_file: str, fp: str) -> None:
    assert deltarefit.fingerprint(ck) == fp and sha(ck) == sha(step_file)


# ------------------------------------------------------------------------- item 1: verified means hashed


def test_sync_at_head_says_verified_only_after_hashing(tmp_path, chain, fps):
    store, _ = _stream(tmp_path, chain, "s", [1, 2])
    ck = str(tmp_path / "r.safetensors")
    r = run_ok("sync", store, ck)
    assert "verified" in r.stdout
    # Unchanged files, identity recorded clear of the racy margin: up to date, not "verified".
    _age_identity(ck)
    r = run_ok("sync", store, ck, "--json")
    rep = json.loads(r.stdout)
    assert rep["route"] == "none" and rep["version"] == 2 and rep["verified"] is False
    r = run_ok("sync", store, ck)
    assert "verified" not in r.stdout.replace("since verified at version 2", "") and "up to date" in r.stdout
    # --verify hashes, and says so.
    r = run_ok("sync", store, ck, "--verify", "--json")
    assert json.loads(r.stdout)["verified"] is True
    # Racy identity (recorded within the margin of the last write): hashed even without --verify.
    p = state_path(ck)
    d = json.loads(read_bytes(p))
    d["identity_at_ns"] = max(max(x[4], x[5]) for x in d["identity"]) + 1000
    with open(p, "w") as f:
        json.dump(d, f)
    rep = Subscriber(store, ck).sync()
    assert rep.verified is True and rep.route == "none"


@pytest.mark.parametrize("aged", [False, True])
def test_checkpoint_edited_at_head_is_refused_then_repaired(tmp_path, chain, fps, aged):
    """Never "verified" for a checkpoint that does not hash to its recorded version, whatever its
    identity looks like; the refusal names 'sync --repair', which restores the head bit for bit."""
    store, _ = _stream(tmp_path, chain, "s", [1, 2, 3])
    ck = str(tmp_path / "r.safetensors")
    run_ok("sync", store, ck)
    flip_tensor_byte(ck)
    if aged:
        _age_identity(ck)
    r = run("sync", store, ck)
    _one_line_naming(r, "changed since it was synced", "sync --repair")
    assert r.returncode == VerificationError.exit_code and "verified" not in r.stdout
    with pytest.raises(VerificationError):
        Subscriber(store, ck).sync()
    r = run_ok("sync", store, ck, "--repair")
    assert "verified" in r.stdout
    _exact(ck, chain[3], fps[3])
    assert Subscriber(store, ck).sync(verify=True).verified


def test_store_wiped_and_republished_is_refused_not_verified(tmp_path, chain, fps):
    # Same checkpoints republished (same fingerprints, same version numbers): another stream all the same.
    store, state = _stream(tmp_path, chain, "s", [1, 2])
    ck = str(tmp_path / "r.safetensors")
    run_ok("sync", store, ck)
    _wipe(store, state)
    _stream(tmp_path, chain, "s", [1, 2])
    r = run("sync", store, ck)
    _one_line_naming(r, "sync --repair")
    assert r.returncode == StreamIdentityError.exit_code and "verified" not in r.stdout
    # Other checkpoints at the same version numbers.
    _wipe(store, state)
    _stream(tmp_path, chain, "s", [5, 6])
    with pytest.raises(StreamError, match="sync --repair"):
        Subscriber(store, ck).sync()
    r = run_ok("sync", store, ck, "--repair")
    _exact(ck, chain[6], fps[6])
    assert "verified" in r.stdout


def test_checkpoint_synced_from_another_stream_with_the_same_version_is_refused(tmp_path, chain, fps):
    a, _ = _stream(tmp_path, chain, "a", [1, 2])
    b, _ = _stream(tmp_path, chain, "b", [3, 4])
    ck = str(tmp_path / "r.safetensors")
    run_ok("sync", a, ck)
    before, st_before = sha(ck), read_bytes(state_path(ck))
    r = run("sync", b, ck)
    _one_line_naming(r, "holds stream", "sync --repair")
    assert "verified" not in r.stdout and sha(ck) == before and read_bytes(state_path(ck)) == st_before
    # Even with the very same weights at that version in the other stream.
    c, _ = _stream(tmp_path, chain, "c", [1, 2])
    with pytest.raises(StreamIdentityError):
        Subscriber(c, ck).sync()


# ------------------------------------------------------------------------- item 2: bound to the stream


def test_every_record_carries_the_stream_identity_under_the_signature(tmp_path, chain, key):
    store, _ = _stream(tmp_path, chain, "s", [1, 2, 3], signing_key=key)
    st = LocalStore(store)
    recs = [load_commit(st, v) for v in list_versions(st)]
    ident = recs[0].stream
    assert ident and len(ident) == 32 and all(r.stream == ident for r in recs)
    assert stream_identity(st) == ident
    assert all(json.loads(r.signed_bytes().removeprefix(SIGNED_PREFIX))["stream"] == ident for r in recs)
    rows = json.loads(run_ok("log", store, "--json").stdout)
    assert [row["stream"] for row in rows] == [ident] * 3


def test_version_copied_from_another_stream_signed_by_the_same_key_is_refused(tmp_path, chain, fps, key):
    """Two runs on the same base, one key: run B's version 3 copied into run A's store (its parent is
    A's version 2, its signature valid) is refused by old and new subscribers, and A's publisher sets it
    aside with --quarantine-head and publishes its own version 3."""
    a, a_state = _stream(tmp_path, chain, "a", [1, 2], signing_key=key)
    b, _ = _stream(tmp_path, chain, "b", [1, 2, 7], signing_key=key)
    old = str(tmp_path / "old.safetensors")
    run_ok("sync", a, old, "--verify-key", key + ".pub")
    shutil.copytree(os.path.join(b, "v", "000000000003"), os.path.join(a, "v", "000000000003"))
    assert load_commit(LocalStore(a), 3).parent == fps[2]
    before = sha(old)
    r = run("sync", a, old, "--verify-key", key + ".pub")
    _one_line_naming(r, "belongs to stream", "--quarantine-head")
    assert r.returncode == StreamIdentityError.exit_code and sha(old) == before
    new = str(tmp_path / "new.safetensors")
    with pytest.raises(StreamIdentityError):
        Subscriber(a, new, public_key=key + ".pub").sync()
    assert not os.path.exists(new)
    # Pinned to B's identity, a new subscriber refuses A's records too.
    with pytest.raises(StreamIdentityError):
        Subscriber(a, new, stream_id=load_commit(LocalStore(b), 1).stream).sync(to_version=2)
    # The publisher refuses to build on it, names the way out, and that way works.
    r = _publish(a, a_state, chain[3], "--sign", key)
    _one_line_naming(r, "--quarantine-head")
    run_ok("publish", a, chain[3], "--state", a_state, *KF, "--sign", key, "--quarantine-head")
    assert load_commit(LocalStore(a), 3).fingerprint == fps[3]
    assert LocalStore(a).list("quarantine/")
    run_ok("sync", a, old, "--verify-key", key + ".pub")
    _exact(old, chain[3], fps[3])


def test_record_stripped_of_its_identity_is_refused(tmp_path, chain):
    store, _ = _stream(tmp_path, chain, "s", [1, 2])
    ck = str(tmp_path / "r.safetensors")
    Subscriber(store, ck).sync(to_version=1)
    st = LocalStore(store)
    d = json.loads(st.get(commit_key(2)))
    del d["stream"]
    st.put(commit_key(2), json.dumps(d).encode())
    with pytest.raises(StreamIdentityError, match="carries no stream identity"):
        Subscriber(store, ck).sync()


def test_unsigned_publish_into_a_signed_stream_is_refused(tmp_path, chain, key):
    store, state = _stream(tmp_path, chain, "s", [1, 2], signing_key=key)
    keys = sorted(LocalStore(store).list(""))
    r = _publish(store, state, chain[3])
    _one_line_naming(r, "is signed", "--sign")
    assert r.returncode == 2 and sorted(LocalStore(store).list("")) == keys
    run_ok("publish", store, chain[3], "--state", state, *KF, "--sign", key)
    run_ok("sync", store, str(tmp_path / "r.safetensors"), "--verify-key", key + ".pub")


def test_log_signed_column_means_verified_given_a_key(tmp_path, chain, fps, key):
    store, _ = _stream(tmp_path, chain, "s", [1, 2], signing_key=key)
    st = LocalStore(store)
    d = json.loads(st.get(commit_key(2)))
    d["fingerprint"] = fps[9]  # the signature kept: it no longer verifies
    st.put(commit_key(2), json.dumps(d, sort_keys=True, indent=1).encode())
    text = run_ok("log", store).stdout.splitlines()
    assert all(line.endswith("signed (unchecked)") for line in text)
    text = run_ok("log", store, "--verify-key", key + ".pub").stdout.splitlines()
    assert text[0].endswith("  signed") and text[1].endswith("SIGNATURE DOES NOT VERIFY")
    rows = json.loads(run_ok("log", store, "--json", "--verify-key", key + ".pub").stdout)
    assert [row["signature_verified"] for row in rows] == [True, False]
    assert [row["signature_verified"] for row in json.loads(run_ok("log", store, "--json").stdout)] == [None, None]


def test_legacy_stream_without_identities(tmp_path, chain, fps):
    """Records written before identities: the stream's identity is derived from its first record, a
    subscriber follows it, a publisher stamps it into the versions it adds, and a republished legacy
    store is another stream."""
    store, state = _stream(tmp_path, chain, "s", [1, 2])
    st = LocalStore(store)
    for v in (1, 2):
        d = json.loads(st.get(commit_key(v)))
        del d["stream"]
        st.put(commit_key(v), json.dumps(d).encode())
    with open(os.path.join(state, "publisher.json")) as f:
        ps = json.load(f)
    del ps["stream_id"]
    with open(os.path.join(state, "publisher.json"), "w") as f:
        json.dump(ps, f)
    ident = stream_identity(st)
    assert ident.startswith(LEGACY_PREFIX)
    ck = str(tmp_path / "r.safetensors")
    Subscriber(store, ck).sync()
    assert json.loads(read_bytes(state_path(ck)))["stream_id"] == ident
    rec = _publisher(store, state).publish(chain[3])
    assert rec.stream == ident
    assert Subscriber(store, ck).sync().version == 3
    _exact(ck, chain[3], fps[3])
    # Wiped and republished (still without identities): another derived identity, refused.
    _wipe(store, state)
    _stream(tmp_path, chain, "s", [1, 2, 3])
    for v in (1, 2, 3):
        d = json.loads(st.get(commit_key(v)))
        del d["stream"]
        st.put(commit_key(v), json.dumps(d).encode())
    with pytest.raises(StreamIdentityError, match="sync --repair"):
        Subscriber(store, ck).sync()


# ------------------------------------------------------------------------- item 9: every refusal names its way out


def test_publisher_baseline_edited_is_refused_then_reset(tmp_path, chain, fps):
    store, state = _stream(tmp_path, chain, "s", [1, 2, 3])
    flip_tensor_byte(os.path.join(state, "baseline.safetensors"))
    keys = sorted(LocalStore(store).list(""))
    r = _publish(store, state, chain[4])
    _one_line_naming(r, "modified by hand", "publish --reset-baseline")
    assert sorted(LocalStore(store).list("")) == keys
    r = run_ok("publish", store, chain[4], "--state", state, *KF, "--reset-baseline", "--json")
    assert json.loads(r.stdout)["version"] == 4
    ck = str(tmp_path / "r.safetensors")
    run_ok("sync", store, ck)
    _exact(ck, chain[4], fps[4])
    _exact(os.path.join(state, "baseline.safetensors"), chain[4], fps[4])


def test_store_wiped_under_the_publisher_is_refused_then_reset(tmp_path, chain, fps):
    store, state = _stream(tmp_path, chain, "s", [1, 2, 3])
    _wipe(store)
    r = _publish(store, state, chain[4])
    _one_line_naming(r, "older than this publisher", "publish --reset-baseline")
    r = run_ok("publish", store, chain[4], "--state", state, *KF, "--reset-baseline", "--json")
    assert json.loads(r.stdout)["version"] == 1  # a new stream
    # Wiped and republished by another publisher: the state is refused, and reset follows that stream.
    _wipe(store)
    _stream(tmp_path, chain, "s", [6, 7, 8, 9, 10, 11, 12], state=str(tmp_path / "other-pub"))  # keyframes 1, 5
    r = _publish(store, state, chain[13])
    _one_line_naming(r, "publish --reset-baseline")
    r = run_ok("publish", store, chain[13], "--state", state, *KF, "--reset-baseline", "--json")
    assert json.loads(r.stdout)["version"] == 8
    ck = str(tmp_path / "r.safetensors")
    run_ok("sync", store, ck)
    _exact(ck, chain[13], fps[13])


def test_publisher_without_state_on_an_existing_stream_is_told_how_to_adopt_it(tmp_path, chain, fps):
    store, _ = _stream(tmp_path, chain, "s", [1, 2])
    fresh = str(tmp_path / "fresh-pub")
    r = _publish(store, fresh, chain[3])
    _one_line_naming(r, "has no baseline", "publish --reset-baseline")
    r = run_ok("publish", store, chain[3], "--state", fresh, *KF, "--reset-baseline", "--json")
    assert json.loads(r.stdout)["version"] == 3 and json.loads(r.stdout)["parent"] == fps[2]


def test_rollout_edited_while_a_newer_version_exists_is_refused_then_repaired(tmp_path, chain, fps):
    store, state = _stream(tmp_path, chain, "s", [1, 2])
    ck = str(tmp_path / "r.safetensors")
    run_ok("sync", store, ck)
    _publisher(store, state).publish(chain[3])
    flip_tensor_byte(ck)
    before = sha(ck)
    r = run("sync", store, ck)
    _one_line_naming(r, "sync --repair")
    assert sha(ck) == before
    r = run_ok("sync", store, ck, "--repair")
    assert "verified" in r.stdout
    _exact(ck, chain[3], fps[3])


def test_missing_checkpoint_with_a_version_record_is_told_to_repair(tmp_path, chain, fps):
    store, _ = _stream(tmp_path, chain, "s", [1, 2])
    ck = str(tmp_path / "r.safetensors")
    run_ok("sync", store, ck)
    os.unlink(ck)
    _one_line_naming(run("sync", store, ck), "sync --repair")
    run_ok("sync", store, ck, "--repair")
    _exact(ck, chain[2], fps[2])


@pytest.mark.parametrize("bad", ["garbage", "unsigned"])
def test_bad_record_at_the_next_version_of_a_signed_stream(tmp_path, chain, fps, key, bad):
    """A garbage (or unsigned) commit.json at the next version: log and retain report it and go on,
    subscribers and the publisher refuse naming --quarantine-head, and the publisher's
    --quarantine-head sets it aside and publishes; every subscriber then follows."""
    store, state = _stream(tmp_path, chain, "s", [1, 2, 3], signing_key=key)
    ck = str(tmp_path / "r.safetensors")
    run_ok("sync", store, ck, "--verify-key", key + ".pub")
    st = LocalStore(store)
    if bad == "garbage":
        st.put(commit_key(4), b"{not json at all")
    else:  # well formed, unsigned, following version 3, pointing at version 3's delta
        d = json.loads(st.get(commit_key(3)))
        del d["signature"]
        d["version"] = 4
        d["parent"], d["fingerprint"] = fps[3], fps[9]
        for p in ["delta"]:
            d[p]["key"] = d[p]["key"].replace("000000000003", "000000000004")
        st.put(commit_key(4), json.dumps(d).encode())
    # log: every version listed, the bad one as such; an error (one line) at the end.
    r = run("log", store)
    lines = r.stdout.splitlines()
    if bad == "garbage":
        assert len(lines) == 4 and "malformed record" in lines[3] and r.returncode == 9
        assert r.stderr.strip().count("\n") == 0 and "not valid JSON" in r.stderr
        rows = json.loads(run("log", store, "--json").stdout)
        assert [row["version"] for row in rows] == [1, 2, 3, 4] and "malformed" in rows[3]
        # retain: goes on, keeps the version's objects, says so.
        rep = retain(st, orphan_grace=0, unsafe_short_grace=True)
        assert 4 in rep.malformed and rep.head == 4
        r = run_ok("retain", store, "--dry-run")
        assert "version 4: malformed record" in r.stdout
    else:
        r = run_ok("log", store, "--verify-key", key + ".pub")
        assert r.stdout.splitlines()[3].endswith("UNSIGNED")
    # Subscribers refuse (nothing written) and are told who can fix it.
    before = sha(ck)
    r = run("sync", store, ck, "--verify-key", key + ".pub")
    _one_line_naming(r, "--quarantine-head")
    assert sha(ck) == before
    # The publisher refuses to build on it, naming the way out.
    r = _publish(store, state, chain[4], "--sign", key)
    _one_line_naming(r, "--quarantine-head")
    r = run_ok("publish", store, chain[4], "--state", state, *KF, "--sign", key, "--quarantine-head", "--json")
    assert json.loads(r.stdout)["version"] == 4
    assert len(st.list("quarantine/")) == 1
    run_ok("sync", store, ck, "--verify-key", key + ".pub")
    _exact(ck, chain[4], fps[4])
    run_ok("log", store, "--verify-key", key + ".pub")
    run_ok("retain", store)


def test_quarantine_never_sets_aside_a_valid_head(tmp_path, chain, key):
    store, state = _stream(tmp_path, chain, "s", [1, 2], signing_key=key)
    pub = _publisher(store, state, signing_key=key)
    assert pub.quarantine_head() == []
    assert list_versions(LocalStore(store)) == [1, 2]
    # Another (valid, signed) publisher's version on our head: followed, not set aside.
    other = str(tmp_path / "other-pub")
    shutil.copytree(state, other)
    _publisher(store, other, signing_key=key).publish(chain[3])
    assert pub.quarantine_head() == []
    assert pub.publish(chain[4]).version == 4


def test_signed_publisher_does_not_follow_a_record_it_cannot_verify(tmp_path, chain, fps, key):
    """A record forged by a party that writes to the store (well formed, on our parent, unsigned) is
    not applied to a signing publisher's baseline."""
    store, state = _stream(tmp_path, chain, "s", [1, 2], signing_key=key)
    other = str(tmp_path / "other-pub")
    shutil.copytree(state, other)
    forger = Publisher(store, other, keyframe_every=5, keyframe_ratio=1000.0)
    with pytest.raises(deltarefit.errors.UsageError, match="--sign"):
        forger.publish(chain[3])
    # Forge it by hand, as the store's writer could.
    st = LocalStore(store)
    d = json.loads(st.get(commit_key(2)))
    del d["signature"]
    d["version"], d["parent"], d["fingerprint"] = 3, fps[2], fps[3]
    d["delta"]["key"] = d["delta"]["key"].replace("000000000002", "000000000003")
    st.put(commit_key(3), json.dumps(d).encode())
    baseline = sha(os.path.join(state, "baseline.safetensors"))
    with pytest.raises(SignatureError, match="quarantine-head"):
        _publisher(store, state, signing_key=key).publish(chain[3])
    assert sha(os.path.join(state, "baseline.safetensors")) == baseline


# ------------------------------------------------------------------------- sharded records


def test_sharded_version_copied_from_another_stream_is_refused(tmp_path, key):
    """Sharded records carry the stream's identity too: two sharded runs from the same masters, one key;
    run B's version 2 copied into run A's store (its parent is A's version 1, its signature valid) is
    refused by A's rollouts, with nothing written."""
    import numpy as np
    from _shard_util import masters, step
    from test_shard_stream import RLAYS, publish_all, rollout_tensors, snapshot, trainers

    from deltarefit.shard import stream as S
    from deltarefit.storage.memory import MemoryStore

    full = masters()
    a, b = MemoryStore(f"trust-a-{tmp_path.name}"), MemoryStore(f"trust-b-{tmp_path.name}")
    publish_all(trainers(a, signing_key=key), full)
    tb = trainers(b, signing_key=key)
    publish_all(tb, full)
    step(full, np.random.default_rng(3))
    publish_all(tb, full)
    ra, rb = S.load_shard_commit(a, 1), S.load_shard_commit(b, 2)
    assert ra.stream and rb.stream and ra.stream != rb.stream and rb.parent == ra.fingerprint
    roll = rollout_tensors()[0]
    sp = str(tmp_path / "a.json")
    assert S.sync_sharded(a, roll, RLAYS[0], state_path=sp, public_key=key + ".pub").version == 1
    assert json.loads(read_bytes(sp))["stream_id"] == ra.stream
    for k in b.list("v/000000000002/"):
        a.put(k, b.get(k))
    before = snapshot(roll)
    with pytest.raises(StreamIdentityError, match="belongs to stream"):
        S.sync_sharded(a, roll, RLAYS[0], state_path=sp, public_key=key + ".pub")
    after = snapshot(roll)
    assert all(np.array_equal(after[n], before[n]) for n in before)
    # A new rollout of A takes A's identity from version 1 and refuses the copy too.
    with pytest.raises(StreamIdentityError):
        S.sync_sharded(a, rollout_tensors()[0], RLAYS[0], state_path=str(tmp_path / "new.json"),
                       public_key=key + ".pub", adopt=False)


def test_quarantine_never_touches_the_publishers_own_history(tmp_path, chain, key, fps):
    """A publisher given the wrong key, or none of its state, sets aside nothing that may be valid: only
    versions after its committed one, and without a state only malformed records."""
    store, state = _stream(tmp_path, chain, "s", [1, 2, 3], signing_key=key)
    other = str(tmp_path / "other.pem")
    run_ok("keygen", other)
    assert _publisher(store, state, signing_key=other).quarantine_head() == []
    assert _publisher(store, str(tmp_path / "none-pub"), signing_key=other).quarantine_head() == []
    assert list_versions(LocalStore(store)) == [1, 2, 3]
    LocalStore(store).put(commit_key(4), b"garbage")
    assert _publisher(store, str(tmp_path / "none-pub")).quarantine_head() == [4]
    assert list_versions(LocalStore(store)) == [1, 2, 3]


# ------------------------------------------------------------------------------------------ issue 34
# Structural versions with history, retention racing a publish, history books that cannot lie or be
# written, memory before trust for every store object, version directory names.


def _structural_chain(d: str) -> list[str]:
    """Four checkpoints along a momentum chain (``_chains.write_chain``); the last two are structural
    versions of the first two: ``count`` removed, ``extra`` added and ``small`` re-typed to float16."""
    import safetensors.torch
    import torch
    from _chains import write_chain

    paths = write_chain(d, 3, n=(1 << 16) + 300, seed=5, prefix="s")
    for i in (2, 3):
        t = safetensors.torch.load_file(paths[i])
        del t["count"]
        t["small"] = t["small"].to(torch.float16)
        t["extra"] = torch.full((300,), float(i), dtype=torch.bfloat16)
        safetensors.torch.save_file(t, paths[i])
    return paths


def test_structural_versions_with_history_publish_encode_and_apply(tmp_path):
    """Issue 34 item 4: a version that adds, removes and re-types a tensor, published, encoded and
    applied with history (``MovesRecorder.reset``), to the target's fingerprint (a structural apply lays
    the file out its own way), and an apply rerun changes nothing."""
    paths = _structural_chain(str(tmp_path / "c"))
    store, state = str(tmp_path / "store"), str(tmp_path / "pub")
    ck = str(tmp_path / "rollout.safetensors")
    for i, p in enumerate(paths):
        run_ok("publish", store, p, "--step", str(i), "--state", state, "--history", *KF, "-q")
        run_ok("sync", store, ck, "-q")
        assert deltarefit.fingerprint(ck) == deltarefit.fingerprint(p)
    from _chains import encodings

    # the last delta (structural version to structural version) was coded against the history
    got = encodings(os.path.join(store, *load_commit(LocalStore(store), 4).delta.key.split("/")))
    assert got.get(5) or got.get(7), got  # (encoding 5 in format 1, 7 in format 2)

    book, abook = str(tmp_path / "enc.history"), str(tmp_path / "app.history")
    target = str(tmp_path / "applied.safetensors")
    shutil.copyfile(paths[0], target)
    for i in range(1, len(paths)):
        delta = str(tmp_path / f"d{i}.delta")
        run_ok("encode", paths[i - 1], paths[i], "-o", delta, "--history", book, "-q")
        run_ok("apply", delta, target, "--history", abook, "-q")
        assert deltarefit.fingerprint(target) == deltarefit.fingerprint(paths[i])
        if i == 3:
            assert encodings(delta).get(5) or encodings(delta).get(7)  # (format 1: 5, format 2: 7)
        r = run_ok("apply", delta, target, "--history", abook, "-q")  # a rerun: already the target
        assert "verified" in r.stdout and deltarefit.fingerprint(target) == deltarefit.fingerprint(paths[i])



_RETAIN_LOOP = """
import sys, time
from deltarefit.storage import LocalStore
from deltarefit.stream.retention import retain
store = LocalStore(sys.argv[1])
while time.monotonic() < float(sys.argv[2]):
    retain(store, orphan_grace=float(sys.argv[3]), unsafe_short_grace=True)
"""

# A publisher on a slow link (100 KB/s): each version's delta part is uploaded first, then its
# keyframe files for ~3 s, so the finished delta waits beside them for longer than the grace.
_SLOW_PUBLISH = """
import sys
from deltarefit.storage import LocalStore
from deltarefit.stream import Publisher
pub = Publisher(LocalStore(sys.argv[1], rate=100_000), sys.argv[2], keyframe_every=1)
for p in sys.argv[3:]:
    rec = pub.publish(p)
    # at the head, with a subscriber at version 1: retention keeps every part of this record
    missing = [q.key for q in [rec.delta] + [q for _, q in rec.keyframe] if not pub.store.exists(q.key)]
    print(rec.version, "missing:", *missing, flush=True)
"""


def test_retain_racing_a_slow_publish_never_leaves_a_commit_naming_missing_parts(tmp_path, chain, fps):
    """Issue 34 item 3: ``retain`` with a 1.5 s grace in a tight loop in another process while a
    publisher on a slow link uploads parts for longer than that (real processes, a local-directory
    store): every commit's parts exist and hash to the record, and a new subscriber reaches the head."""
    import subprocess
    import sys
    import time

    from _stream_util import ENV

    store, state = str(tmp_path / "store"), str(tmp_path / "pub")
    run_ok("publish", store, chain[0], "--state", state, *KF, "-q")
    # a live subscriber at version 1: retention keeps every later delta (and the newest keyframe)
    LocalStore(store).put("subs/watcher.json", json.dumps({"version": 1, "updated": time.time() + 600}).encode())
    loop = subprocess.Popen([sys.executable, "-c", _RETAIN_LOOP, store, str(time.monotonic() + 600), "1.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        pub = subprocess.run([sys.executable, "-c", _SLOW_PUBLISH, store, state, *chain[1:4]],
                             capture_output=True, text=True, env=ENV, timeout=120, check=False)
    finally:
        loop.kill()
        _, err = loop.communicate(timeout=60)
    assert "Traceback" not in err, err
    assert pub.returncode == 0, pub.stderr
    assert pub.stdout.split("\n")[:3] == [f"{v} missing:" for v in (2, 3, 4)], pub.stdout
    ck = str(tmp_path / "late.safetensors")
    run_ok("sync", store, ck, "-q")
    assert deltarefit.fingerprint(ck) == fps[3]


def test_bit_flips_in_the_publishers_history_book_are_detected_or_harmless(tmp_path):
    """Issue 34 item 6: 200 random single-bit flips over the publisher's history book (its moves files
    and HEAD). Each is either detected when the book is opened (``open_book`` starts the book over, so
    the next version goes out without history), or harmless: the next delta coded against the flipped
    book is byte-identical to the one coded against the intact book, which the subscriber decodes."""
    import random

    from _chains import write_chain

    from deltarefit.encode import encode
    from deltarefit.stream.history import open_book

    paths = write_chain(str(tmp_path / "c"), 5, n=(1 << 16) + 300, seed=9, prefix="h")
    store = LocalStore(str(tmp_path / "store"))
    pub = Publisher(store, str(tmp_path / "pub"), keyframe_every=1000, keyframe_ratio=1000.0, history=True)
    ck = str(tmp_path / "rollout.safetensors")
    for i, p in enumerate(paths[:5]):
        pub.publish(p, step=i)
        Subscriber(store, ck).sync()
    book = pub.book_path
    files = sorted(os.listdir(book))
    assert len(files) == 4 and "HEAD.json" in files  # HEAD and the last three versions' moves
    pristine = str(tmp_path / "pristine")
    shutil.copytree(book, pristine)
    want = encode(pub.baseline, paths[5], str(tmp_path / "want.delta"), history=open_book(book))
    want_bytes = read_bytes(want.path)
    rng = random.Random(34)
    detected = harmless = 0
    for trial in range(200):
        shutil.rmtree(book, ignore_errors=True)
        shutil.copytree(pristine, book)
        f = os.path.join(book, rng.choice(files))
        data = bytearray(read_bytes(f))
        bit = rng.randrange(8 * len(data))
        data[bit // 8] ^= 1 << (bit % 8)
        with open(f, "wb") as fh:
            fh.write(data)
        opened = open_book(book)
        if opened.versions() == [] and not os.path.exists(os.path.join(book, "HEAD.json")):
            detected += 1  # started over: never trusted
            continue
        got = encode(pub.baseline, paths[5], str(tmp_path / "got.delta"), history=opened)
        assert read_bytes(got.path) == want_bytes, f"trial {trial}: flip of bit {bit} of {f} went undetected"
        harmless += 1
    assert detected + harmless == 200 and detected >= 190, (detected, harmless)
    # and the intact book's next delta decodes bit-exact for the subscriber
    shutil.rmtree(book, ignore_errors=True)
    shutil.copytree(pristine, book)
    pub.publish(paths[5], step=5)
    Subscriber(store, ck).sync()
    assert deltarefit.fingerprint(ck) == deltarefit.fingerprint(paths[5])


_PEAK = ("import resource, subprocess, sys\n"
         "r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
         "sys.stderr.write(r.stderr)\n"
         "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")


def _peak(*args: str) -> tuple[int, float, str]:
    """(exit status, peak RSS in MiB, stderr) of ``deltarefit *args`` in a process of its own."""
    import subprocess
    import sys

    from _stream_util import ENV, cmd

    r = subprocess.run([sys.executable, "-c", _PEAK, *cmd(*args)], capture_output=True, text=True, env=ENV,
                       timeout=120, check=False)
    rc, kib = r.stdout.split()
    return int(rc), int(kib) / 1024, r.stderr


def _one_line(err: str) -> None:
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3, err


@pytest.fixture
def small_stream(tmp_path, chain):
    store, state = str(tmp_path / "store"), str(tmp_path / "pub")
    for i in range(2):
        run_ok("publish", store, chain[i], "--state", state, *KF, "-q")
    return store


def test_version_directory_names_that_are_no_version_are_ignored(small_stream):
    """Issue 34 item 10: ``v/²/`` and a 13-digit version directory (and their parts) crash neither
    ``log`` nor ``retain``: they are no version of the stream, skipped with a warning."""
    for name in ("²", "0000000000001", "-00000000001", "00000000000x"):
        d = os.path.join(small_stream, "v", name)
        os.makedirs(os.path.join(d, "attempt"), exist_ok=True)
        with open(os.path.join(d, "commit.json"), "wb") as f:
            f.write(b"{}")
        with open(os.path.join(d, "attempt", "delta"), "wb") as f:
            f.write(b"x")
    r = run("log", small_stream)
    assert r.returncode == 0, r.stderr
    _one_line(r.stderr)
    assert "v1" in r.stdout and "v2" in r.stdout
    r = run("retain", small_stream, "--orphan-grace", "0", "--unsafe-short-grace")
    assert r.returncode == 0, r.stderr
    _one_line(r.stderr)
    assert os.path.exists(os.path.join(small_stream, "v", "²", "attempt", "delta"))  # not ours: kept


def _sparse(path: str, size: int, head: bytes = b"") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


@pytest.mark.parametrize("case", ["head-300MB", "commit-600MB", "commit-nested-15MB", "subs-nested",
                                  "subs-overflow"])
def test_store_objects_cost_bounded_memory_before_trust(small_stream, case):
    """Issue 34 item 9: a huge ``HEAD`` or ``commit.json``, a record of nested lists, and malformed
    subscriber objects: ``log`` and ``retain`` stay under 256 MiB (peak RSS of the process), refuse or
    skip in one line, and retention is never stopped by a subscriber's object."""
    s = small_stream
    if case == "head-300MB":
        _sparse(os.path.join(s, "HEAD"), 300 << 20, b"2")
    elif case == "commit-600MB":
        _sparse(os.path.join(s, "v", "000000000003", "commit.json"), 600 << 20, b"{")
    elif case == "commit-nested-15MB":
        os.makedirs(os.path.join(s, "v", "000000000003"))
        with open(os.path.join(s, "v", "000000000003", "commit.json"), "wb") as f:
            f.write(b"[" * (15 << 20))
    elif case == "subs-nested":
        os.makedirs(os.path.join(s, "subs"), exist_ok=True)
        with open(os.path.join(s, "subs", "evil.json"), "wb") as f:
            f.write(b"[" * 60_000 + b"]" * 60_000)
    else:
        os.makedirs(os.path.join(s, "subs"), exist_ok=True)
        with open(os.path.join(s, "subs", "evil.json"), "wb") as f:
            f.write(b'{"version": 1e400, "updated": 1e400}')
    for args in (("log", s), ("retain", s)):
        rc, mib, err = _peak(*args)
        assert mib < 256, f"{args[0]} ({case}): peak RSS {mib:.0f} MiB"
        _one_line(err)
        if case.startswith(("subs", "head")):
            assert rc == 0, err


def test_an_oversized_head_record_is_quarantined_without_being_read(tmp_path, chain):
    """A 600 MB "commit record" at the head (no record: over ``MAX_RECORD_BYTES``) is set aside by
    ``publish --quarantine-head`` without reading it whole: peak RSS under 256 MiB, and the next
    version is published after the one before it."""
    store, state = str(tmp_path / "store"), str(tmp_path / "pub")
    for i in range(2):
        run_ok("publish", store, chain[i], "--state", state, *KF, "-q")
    _sparse(os.path.join(store, "v", "000000000003", "commit.json"), 600 << 20, b"{")
    with open(os.path.join(store, "HEAD"), "w") as f:
        f.write("3\n")
    rc, mib, err = _peak("publish", store, chain[2], "--state", state, *KF, "-q", "--quarantine-head")
    assert rc == 0 and mib < 256, (rc, mib, err)
    q = os.listdir(os.path.join(store, "quarantine"))
    assert len(q) == 1 and os.path.getsize(os.path.join(store, "quarantine", q[0])) < 4096
    assert "larger than" in open(os.path.join(store, "quarantine", q[0])).read()
    assert json.loads(open(os.path.join(store, "v", "000000000003", "commit.json"), "rb").read())["version"] == 3


def test_store_reads_of_shard_objects_and_proposals_stop_at_the_declared_size(tmp_path):
    """Objects whose size a record declares (a shard's manifest and parts), proposals and part
    descriptors are read no further than that size (``stream.chain.get_capped``): a 300 MB object
    where a record says 10 bytes is refused without reading it."""
    from deltarefit.errors import StreamError
    from deltarefit.shard.records import _get_checked, get_descriptor
    from deltarefit.storage import LocalStore
    from deltarefit.stream.chain import get_bounded, holds
    from deltarefit.stream.records import Part

    st = LocalStore(str(tmp_path / "s"))
    _sparse(os.path.join(st.root, "big"), 300 << 20, b"x")
    st.put("small", b"0123456789")
    with pytest.raises(StreamError, match="does not match its commit record"):
        _get_checked(st, Part("big", 10, "0" * 64), "manifest")
    assert not holds(st, "big", b"x" + b"\0" * 9) and holds(st, "small", b"0123456789")
    assert not holds(st, "absent", b"")
    with pytest.raises(StreamError, match="larger than"):
        get_bounded(st, "big", 1 << 20, "proposal")
    with pytest.raises(StreamError, match="part descriptor is larger than"):
        get_descriptor(st, "big")



# ------------------------------------------------------------------------- key files are read as inputs


@pytest.mark.parametrize("kind", ["device", "fifo", "oversized"])
def test_a_key_file_that_is_no_key_file_is_refused_in_one_line_without_hanging(tmp_path, chain, key, kind):
    """``--verify-key`` and ``--sign`` read a regular file of a few KiB (``signing.read_key``): a device that
    never ends (``/dev/zero``), a FIFO nobody writes (which would hang the open), a file past the cap and
    are each refused in one line, exit 2, at once, reading at most the cap."""
    store, _ = _stream(tmp_path, chain, "s", [0], signing_key=key)
    if kind == "device":
        bad = "/dev/zero"
    else:
        bad = str(tmp_path / f"{kind}.pem")
        if kind == "fifo":
            os.mkfifo(bad)
        elif kind == "oversized":
            with open(bad, "wb") as f:
                f.write(read_bytes(key + ".pub") + b"\n" * (16 << 10))
    words = {"device": "not a regular file", "fifo": "not a regular file", "oversized": "more than"}[kind]
    for r in (run("sync", store, str(tmp_path / "r.safetensors"), "--verify-key", bad, timeout=30),
              run("publish", store, chain[1], "--state", str(tmp_path / "s-pub"), *KF, "--sign", bad, timeout=30)):
        _one_line_naming(r, bad, words)
        assert r.returncode == 2, r.stderr
    assert os.path.getsize(key + ".pub") < KEY_MAX_BYTES


# ------------------------------------------------------------------------- local state files, bounded


@pytest.mark.parametrize("shape", ["nested", "strings", "fifo"])
def test_a_hostile_version_state_is_refused_in_one_line_with_the_repair_fix(tmp_path, chain, shape):
    """``CKPT.deltarefit-version.json`` of 500,000 nested brackets (a ``RecursionError`` when parsed whole),
    of 60 MiB of strings (parsed whole before) or a FIFO: refused in one line, at once, and
    ``sync --repair`` restores the checkpoint."""
    store, _ = _stream(tmp_path, chain, "s", [0, 1])
    ck = str(tmp_path / "r.safetensors")
    run_ok("sync", store, ck)
    _plant_state(state_path(ck), shape)
    r = run("sync", store, ck, timeout=30)
    if shape == "fifo":
        _one_line_naming(r, state_path(ck), "not a regular file")
        os.unlink(state_path(ck))
    else:
        _one_line_naming(r, state_path(ck), "unreadable version state", "--repair")
        run_ok("sync", store, ck, "--repair")
    run_ok("sync", store, ck)


@pytest.mark.parametrize("shape", ["nested", "strings", "fifo"])
def test_a_hostile_publisher_state_is_refused_in_one_line_with_the_reset_fix(tmp_path, chain, shape):
    """``STATE/publisher.json`` the same: refused in one line (``--reset-baseline`` for a malformed one; a
    FIFO named, not hung on), and the publish goes on once it is reset or removed."""
    store, state = _stream(tmp_path, chain, "s", [0])
    _plant_state(os.path.join(state, "publisher.json"), shape)
    r = run("publish", store, chain[1], "--state", state, *KF, timeout=30)
    if shape == "fifo":
        _one_line_naming(r, "publisher.json", "not a regular file")
        os.unlink(os.path.join(state, "publisher.json"))
        run_ok("publish", store, chain[1], "--state", state, *KF, "--reset-baseline")
    else:
        _one_line_naming(r, "publisher.json", "unreadable publisher state", "--reset-baseline")
        run_ok("publish", store, chain[1], "--state", state, *KF, "--reset-baseline")


def test_a_fifo_at_the_kept_baseline_hashes_is_not_hung_on(tmp_path, chain):
    """``STATE/baseline.hashes`` is a cache: a FIFO planted there is passed over (the baseline is hashed
    instead), not opened blocking."""
    store, state = _stream(tmp_path, chain, "s", [0])
    known = os.path.join(state, "baseline.hashes")
    if os.path.exists(known):
        os.unlink(known)
    os.mkfifo(known)
    r = run_ok("publish", store, chain[1], "--state", state, *KF, timeout=60)
    assert "Traceback" not in r.stderr


def _plant_state(path: str, shape: str) -> None:
    os.unlink(path)
    if shape == "fifo":
        os.mkfifo(path)
        return
    with open(path, "wb") as f:
        if shape == "nested":
            f.write(b"[" * 500_000 + b"]" * 500_000)
        else:
            f.write(b'{"version": 1, "fingerprint": "' + b"a" * (60 << 20) + b'"}')


@pytest.mark.parametrize("name", ["attempt.json", "pending.json"])
def test_a_fifo_at_a_publishers_upload_marker_or_pending_record_is_not_hung_on(tmp_path, chain, name):
    """``STATE/attempt.json`` (an upload's marker: unreadable, so passed over and removed) and
    ``STATE/pending.json`` (a killed publish's record: named in one line) are opened as regular files only."""
    store, state = _stream(tmp_path, chain, "s", [0])
    os.mkfifo(os.path.join(state, name))
    r = run("publish", store, chain[1], "--state", state, *KF, timeout=60)
    if name == "attempt.json":
        assert r.returncode == 0 and not os.path.exists(os.path.join(state, name)), r.stderr
    else:
        _one_line_naming(r, name, "not a regular file")
