"""Version streams under SIGKILL: real `deltarefit publish` and `deltarefit sync` processes killed at
random moments (seeded, the draws are printed), then run again to completion.

The model: a ~52 MiB bf16 BERT (real AdamW steps, see ``_stream_util.make_chain``), so that a publish
or a sync lasts long enough for kills to land inside its phases. Kill times are drawn over the measured
duration of an uninterrupted run; some are timed from the moment a phase begins (the publisher's staging
directory or pending record, the subscriber's staging directory or apply journal appears), so that the
short phases are hit too.
"""

from __future__ import annotations

import glob
import os
import random
import shutil
import time

import pytest
from _stream_util import (
    check_stream_whole,
    kill_at,
    make_chain,
    run_ok,
    session_chain,
    sha,
    state_of,
)

import deltarefit
from deltarefit.format import DeltaReader
from deltarefit.integrity import SEGMENT_BYTES
from deltarefit.storage import LocalStore
from deltarefit.stream import Publisher, Subscriber
from deltarefit.stream.records import head, load_commit, prepared_key, vkey
from deltarefit.stream.retention import retain
from deltarefit.stream.subscriber import state_path

SEED = int(os.environ.get("DELTAREFIT_STREAM_CRASH_SEED", "20240613"))
STEPS = 10  # step_000 .. step_009
BASE_VERSIONS = 5  # the stream starts with versions 1..5 = steps 1..5
PUB_OPTS = ["--keyframe-every", "1000", "--keyframe-ratio", "1000"]  # one keyframe (version 1), then deltas
# AdamW at lr 3e-5 changes ~45% of the bf16 values per step, more than a third in some 1 MiB chunks: their
# apply journal records take the dense form (see test_journal_records_fit_their_slots), so kills cover both.
LR = 3e-5


@pytest.fixture(scope="session")
def chain(tmp_path_factory) -> list[str]:
    """step_000 .. step_023: bf16 exports of real AdamW steps of a tiny BERT (once per session)."""
    return session_chain(tmp_path_factory)


def _pub(store, state_dir) -> Publisher:
    return Publisher(store, state_dir, keyframe_every=1000, keyframe_ratio=1000)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    d = tmp_path_factory.mktemp("bigstream")
    t_setup = time.monotonic()
    steps = make_chain(str(d / "chain"), steps=STEPS, hidden=512, layers=8, lr=LR)
    fps = [deltarefit.fingerprint(p) for p in steps]
    store = LocalStore(str(d / "store"))
    pub = _pub(store, str(d / "pub"))
    for v in range(1, BASE_VERSIONS):
        pub.publish(steps[v], step=v)
    with DeltaReader(os.path.join(store.url, *load_commit(store, 3).delta.key.split("/"))) as dr:
        dense_ish = sum(1 for e in dr.tensors for c in dr.chunks(e) if 3 * c.n_changed > SEGMENT_BYTES // 2)
    assert dense_ish > 0, "no chunk with more than a third of its values changed: raise LR"
    t0 = time.monotonic()  # the last one through the command line, timed
    run_ok("publish", store.url, steps[BASE_VERSIONS], "--state", str(d / "pub"), *PUB_OPTS)
    pub_seconds = time.monotonic() - t0
    # A subscriber at version 1 (the template for the sync kills), then a timed sync 1 -> 5.
    tmpl = str(d / "tmpl.safetensors")
    Subscriber(store, tmpl, subscriber_id="tmpl").sync(to_version=1)
    work = str(d / "timed.safetensors")
    _clone_sub(tmpl, work)
    t0 = time.monotonic()
    run_ok("sync", store.url, work, "--id", "timed")
    sync_seconds = time.monotonic() - t0
    assert sha(work) == sha(steps[BASE_VERSIONS])
    print(f"setup {time.monotonic() - t_setup:.1f} s; model {os.path.getsize(steps[0]) / 2**20:.1f} MiB; publish {pub_seconds:.2f} s, sync 1->5 "
          f"{sync_seconds:.2f} s")
    return {"dir": str(d), "steps": steps, "fps": fps, "store": store.url, "pub": str(d / "pub"), "tmpl": tmpl,
            "pub_seconds": pub_seconds, "sync_seconds": sync_seconds}


def _clone_sub(src: str, dest: str) -> None:
    shutil.copyfile(src, dest)
    shutil.copyfile(state_path(src), state_path(dest))


def _copy_stream(big, dest: str) -> tuple[LocalStore, str]:
    shutil.copytree(big["store"], os.path.join(dest, "store"))
    shutil.copytree(big["pub"], os.path.join(dest, "pub"))
    return LocalStore(os.path.join(dest, "store")), os.path.join(dest, "pub")


def _staging_or_journal(ckpt: str) -> list[str]:
    return [p for p in (ckpt + ".deltarefit-staging", ckpt + ".deltarefit-journal") if os.path.exists(p)]


# ------------------------------------------------------------------------------------------ publish


def test_publish_killed_then_rerun(big, tmp_path):
    rng = random.Random(SEED)
    print(f"seed {SEED}")
    store, pub_dir = _copy_stream(big, str(tmp_path))
    steps, fps = big["steps"], big["fps"]
    dur = big["pub_seconds"]
    staging = os.path.join(pub_dir, "staging")
    pending = os.path.join(pub_dir, "pending.json")
    # A subscriber at the head before the kills: a killed publish never touches it.
    sub_ck = str(tmp_path / "follower.safetensors")
    _clone_sub(big["tmpl"], sub_ck)
    Subscriber(store, sub_ck, subscriber_id="follower").sync()
    modes = ["anytime", "work", "commit", "advance"]
    for i, mode in enumerate(modes):
        step = BASE_VERSIONS + 1 + i
        args = ["publish", store.url, steps[step], "--state", pub_dir, "--step", str(step), *PUB_OPTS]
        if mode == "commit":
            args += ["--advance", "apply"]  # killed around the commit or while applying the delta in place
        if mode == "anytime":
            t = rng.uniform(0, 1.1 * dur)
            rc, t_kill, err = kill_at(args, delay=t)
        elif mode == "work":  # from the moment the encode begins (publish recreates its staging directory)
            t = rng.uniform(0, 0.6 * dur)
            stale = os.path.join(staging, "stale-marker")  # a staging left by an earlier run is not the signal
            if os.path.isdir(staging):
                open(stale, "w").close()
            rc, t_kill, err = kill_at(args, when=lambda m=stale: os.path.isdir(staging) and not os.path.exists(m),
                                      after_delay=t)
        elif mode == "commit":  # around the commit point and the baseline's advance
            t = rng.uniform(0, 0.3)
            rc, t_kill, err = kill_at(args, when=lambda: os.path.exists(pending), after_delay=t)
        else:  # while the committed checkpoint is copied beside the baseline (the default advance)
            t = rng.uniform(0, 0.02)
            rc, t_kill, err = kill_at(args, when=lambda: bool(glob.glob(os.path.join(pub_dir, "baseline.*.tmp-*"))),
                                      after_delay=t)
        print(f"publish step {step}: {mode} +{t:.3f} s, killed at {t_kill:.3f} s, exit {rc}")
        assert rc in (0, -9), err
        # Whatever the kill left: no half-visible version, and the follower is untouched.
        check_stream_whole(store)
        assert sha(sub_ck) == sha(steps[step - 1]) and state_of(sub_ck)["version"] == step - 1
        # The same publish again (library: same state directory) finishes the job.
        rec = _pub(store, pub_dir).publish(steps[step], step=step)
        recs = check_stream_whole(store)
        assert [v for v, r in recs.items() if r.fingerprint == fps[step]] == [rec.version] == [max(recs)]
        assert rec.version == step  # nothing skipped, nothing doubled
        st = _pub(store, pub_dir).state()
        assert (st.version, st.fingerprint) == (head(store), fps[step])
        assert deltarefit.fingerprint(os.path.join(pub_dir, "baseline.safetensors")) == fps[step]
        assert not os.path.exists(pending)
        assert [f for f in os.listdir(pub_dir) if ".tmp-" in f] == []  # no copy left behind
        rep = Subscriber(store, sub_ck, subscriber_id="follower").sync()
        assert (rep.route, rep.version) == ("chain", step) and sha(sub_ck) == sha(steps[step])
    # The next publish works (a real process, uninterrupted), and a new subscriber reaches the head.
    run_ok("publish", store.url, steps[0], "--state", pub_dir, *PUB_OPTS)
    recs = check_stream_whole(store)
    assert recs[max(recs)].fingerprint == fps[0]
    # Orphans of the killed attempts go with retention (grace 0); committed parts stay.
    retain(store, orphan_grace=0, unsafe_short_grace=True)
    recs = check_stream_whole(store)
    referenced = {p.key for r in recs.values() for p in ([r.delta] if r.delta else []) + [q for _, q in r.keyframe]}
    assert {k for k in store.list("v/") if len(k.split("/")) >= 4} == referenced
    sub = Subscriber(store, str(tmp_path / "new.safetensors"), subscriber_id="new")
    assert sub.sync().version == max(recs)
    assert sha(sub.checkpoint) == sha(steps[0])


# ------------------------------------------------------------------------------------------ sync


def test_sync_killed_then_rerun(big, tmp_path):
    rng = random.Random(SEED + 1)
    print(f"seed {SEED + 1}")
    store = LocalStore(big["store"])
    h = head(store)
    want = big["steps"][h]
    dur = big["sync_seconds"]
    plan = [("anytime", False), ("download", False), ("apply", False), ("apply", True), ("anytime", True)]
    for i, (mode, fresh) in enumerate(plan):
        ck = str(tmp_path / f"sub{i}.safetensors")
        if not fresh:
            _clone_sub(big["tmpl"], ck)  # at version 1: the chain route, 4 deltas
        args = ["sync", big["store"], ck, "--id", f"crash{i}"]
        stage, journal = ck + ".deltarefit-staging", ck + ".deltarefit-journal"
        if mode == "anytime":
            t = rng.uniform(0, 1.1 * dur)
            rc, t_kill, err = kill_at(args, delay=t)
        elif mode == "download":
            t = rng.uniform(0, 0.05)
            rc, t_kill, err = kill_at(args, when=lambda s=stage: os.path.isdir(s), after_delay=t)
        else:
            t = rng.uniform(0, 0.08)  # the write phase of one delta is short: land inside it
            rc, t_kill, err = kill_at(args, when=lambda j=journal: os.path.exists(j), after_delay=t)
        st = state_of(ck)
        print(f"sync {i} ({'new' if fresh else 'from v1'}): {mode} +{t:.3f} s, killed at {t_kill:.3f} s, exit {rc}, "
              f"state {st and st['version']}, journal {os.path.exists(journal)}, staging {os.path.isdir(stage)}")
        assert rc in (0, -9), err
        if st is not None:  # the recorded version is one the checkpoint really is at (or is being applied on)
            assert 1 <= st["version"] <= h
        rep = Subscriber(store, ck, subscriber_id=f"crash{i}").sync()
        assert rep.version == h
        assert sha(ck) == sha(want)
        assert state_of(ck)["version"] == h and state_of(ck)["fingerprint"] == big["fps"][h]
        assert _staging_or_journal(ck) == []
        # A second run has nothing to do.
        again = Subscriber(store, ck, subscriber_id=f"crash{i}").sync()
        assert (again.route, again.bytes_fetched) == ("none", 0)


# ------------------------------------------------------------------------------------------ temp files of dead writers


def _temps_beside(ck: str) -> list[str]:
    """Files beside a checkpoint named after it that are neither it, its version record, its staging
    directory nor its apply journal: temp files of an unfinished write."""
    d, base = os.path.split(ck)
    keep = {base, base + ".deltarefit-version.json", base + ".deltarefit-staging", base + ".deltarefit-journal"}
    return sorted(f for f in os.listdir(d) if f.startswith(base + ".") and f not in keep)


def test_sync_killed_installing_keyframe_leaves_no_temp(big, tmp_path):
    """Regression (bug found in 9639647): subscriber.py _install_keyframe writes f'{checkpoint}.tmp-{pid}'
    and a rerun (another pid) never removes the one a killed sync left: a checkpoint-sized file leaks
    beside the checkpoint
    """
    caught = None
    for i in range(4):
        ck = str(tmp_path / f"kf{i}.safetensors")
        rc, _, err = kill_at(["sync", big["store"], ck, "--to", "1", "--id", f"kf{i}"],
                             when=lambda c=ck: bool(_temps_beside(c)))
        assert rc in (0, -9), err
        if _temps_beside(ck):
            caught = ck
            break
    if caught is None:
        # No kill landed inside the install: leave the same artifact a killed install leaves, by hand.
        caught = str(tmp_path / "kf_fresh.safetensors")  # no copy and no record: sync installs the keyframe
        with open(caught + ".deltarefit-keyframe.tmp", "wb") as f:
            f.write(b"half a checkpoint")
        assert _temps_beside(caught)
    rep = Subscriber(LocalStore(big["store"]), caught, subscriber_id="kf").sync(to_version=1)
    assert rep.version == 1 and sha(caught) == sha(big["steps"][1])
    assert _temps_beside(caught) == []


def test_publish_killed_mid_upload_leaves_nothing_after_retention(big, tmp_path):
    """Regression (bug found in 9639647): LocalStore.put_file (local.py:49-60) uploads through
    '<key>.tmp-<pid>-<id>'; a publisher killed mid-upload leaves it, LocalStore.list hides '.tmp-' names,
    so retention (retention.py: iterates store.list) never deletes it, whatever orphan_grace is
    """
    store, pub_dir = _copy_stream(big, str(tmp_path))
    step = BASE_VERSIONS + 1
    vdir = os.path.join(store.url, "v", f"{BASE_VERSIONS + 1:012d}")
    caught = False
    for _ in range(3):
        rc, _, err = kill_at(["publish", store.url, big["steps"][step], "--state", pub_dir, *PUB_OPTS],
                             when=lambda: bool(glob.glob(os.path.join(vdir, "*", "*.tmp-*"))))
        assert rc in (0, -9), err
        if glob.glob(os.path.join(vdir, "*", "*.tmp-*")):
            caught = True
            break
        if head(store) > BASE_VERSIONS:  # it finished first: start again from the copy
            shutil.rmtree(tmp_path / "store")
            shutil.rmtree(tmp_path / "pub")
            store, pub_dir = _copy_stream(big, str(tmp_path))
    if not caught:
        # No kill landed inside an upload: leave the same artifact a killed upload leaves, by hand.
        os.makedirs(os.path.join(vdir, "deadbeef0000"), exist_ok=True)
        with open(os.path.join(vdir, "deadbeef0000", "delta.tmp-999999-0123456789ab"), "wb") as f:
            f.write(b"half a delta")
    retain(store, orphan_grace=0, unsafe_short_grace=True)
    left = [os.path.relpath(p, store.url) for p in glob.glob(os.path.join(store.url, "v", "**", "*"), recursive=True)
            if os.path.isfile(p) and ".tmp-" in p]
    assert left == []


def test_killed_joint_publish_leaves_no_immortal_orphans(chain, tmp_path):
    """Regression (bug found in 9639647): retention.py:76 spares every unreferenced part of a version whose
    prepared.json exists; a joint publish killed while waiting for acks leaves prepared.json, and a
    publish of that version without quorum never deletes it (publisher.py:263-264 only with quorum), so
    the dead attempt's parts (and the version's acks, retention.py:81) are never collected
    """
    store = LocalStore(str(tmp_path / "store"))
    pub_dir = str(tmp_path / "pub")
    for v in (1, 2):
        _pub(store, pub_dir).publish(chain[v])
    rc, _, err = kill_at(["publish", store.url, chain[3], "--state", pub_dir, "--quorum", "1", "--ack-timeout",
                          "60", *PUB_OPTS], when=lambda: store.exists(prepared_key(3)), after_delay=0.05)
    assert rc == -9, err  # killed while waiting for an acknowledgement
    dead = [k for k in store.list(vkey(3) + "/") if len(k.split("/")) >= 4]
    assert dead and not store.exists(f"{vkey(3)}/commit.json")
    rec = _pub(store, pub_dir).publish(chain[3])  # the operator publishes again, without quorum
    assert rec.version == 3
    retain(store, orphan_grace=0, unsafe_short_grace=True)
    mine = {p.key for p in ([rec.delta] if rec.delta else []) + [p for _, p in rec.keyframe]}
    assert {k for k in store.list(vkey(3) + "/") if len(k.split("/")) >= 4} == mine
    assert not store.exists(prepared_key(3))


# ------------------------------------------------------------------------------------------ apply's journal


def test_journal_records_fit_their_slots(tmp_path):
    """The crash-safety argument needs each writer thread's journal record intact, and enough to
    rebuild its chunk, while the chunk is written. Real AdamW steps at lr 1e-3 change most bf16 values
    of a 1 MiB chunk; the records of two such chunks, written the way apply writes them (one slot per
    writer thread), must read back and rebuild each chunk's post-image from its pre-image.

    Regression (bug found in 9639647): apply.py:104 SLOT_BYTES = header + 2 x SEGMENT_BYTES + 64, but a
    sparse patch's journal record is 6 bytes per changed bf16 element (4 position + 2 value): for a chunk
    with more than a third of its elements changed, Journal.write (apply.py:141-148) writes a record
    longer than its slot, which Journal.read (apply.py:118-131) reads back truncated and drops, and which
    overwrites the next writer thread's slot; a kill while such a chunk is being scattered leaves it torn
    with no record, and the rerun (apply, sync, publisher recover) fails with BaseMismatchError
    """
    import inspect

    from deltarefit.apply.host import _post_image
    from deltarefit.apply.journal import SLOT_BYTES, Journal, _journal_patch
    from deltarefit.apply.protocol import Applier
    from deltarefit.checkpoint import open_checkpoint
    from deltarefit.encode import uint_view
    from deltarefit.format import DeltaReader
    from deltarefit.integrity import SEGMENT_BYTES, seg_hash

    steps = make_chain(str(tmp_path / "chain"), steps=2, hidden=512, layers=1, lr=1e-3)
    delta = str(tmp_path / "d.delta")
    deltarefit.encode(steps[0], steps[1], delta)
    with DeltaReader(delta) as d, open_checkpoint(steps[0]) as ck:
        plans = Applier(d, ck, journal=None, threads=2, cache_bytes=1 << 40).plan()
        todo = [(ti, tp.entry, c) for ti, tp in enumerate(plans) if tp.state == "patch" for c in tp.chunks
                if c.state == "todo"]
        todo.sort(key=lambda x: -x[2].rec.n_changed)
        chosen = todo[:2]  # the two chunks with the most changes, written side by side by two threads

        def pre_view(e, c):
            off = c.rec.chunk_index * SEGMENT_BYTES
            return uint_view(ck.raw(e.name)[off:off + SEGMENT_BYTES], e.base.dtype)

        print(f"largest changes: {[c.rec.n_changed for _, _, c in chosen]} elements; slot {SLOT_BYTES} bytes")
        takes_pre = "pre" in inspect.signature(Journal.write).parameters
        jpath = str(tmp_path / "journal")
        j = Journal(jpath, d.target_fingerprint)
        j.open_for_write(2)
        reads = []
        try:
            for slot, (ti, e, c) in enumerate(chosen):
                extra = (pre_view(e, c),) if takes_pre else ()
                j.write(slot, ti, c.rec.chunk_index, c.rec.post_hash, c.patch, *extra)
                reads.append(Journal(jpath, d.target_fingerprint).read())
        finally:
            j.remove()
        assert set(reads[0]) == {(chosen[0][0], chosen[0][2].rec.chunk_index)}  # one thread's record
        assert set(reads[1]) == {(ti, c.rec.chunk_index) for ti, _, c in chosen}  # both threads' records
        for ti, e, c in chosen:  # each record rebuilds its chunk (what recovery of a torn chunk does)
            pre = pre_view(e, c)
            patch = _journal_patch(reads[1][(ti, c.rec.chunk_index)], e.base.dtype, pre.size)
            assert patch is not None and seg_hash(_post_image(pre, patch)) == c.rec.post_hash
