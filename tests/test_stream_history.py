"""A plain stream with history (``Publisher(history=True)``, ``deltarefit publish --history``): deltas
coded against the stream's last versions' moves (encoding 5), subscribers that keep the same book
beside their checkpoint, and the lineage that makes both books the same (``stream.history``): started
over at keyframes and at versions without history, refused by name where a book does not follow.

Real files and a local-directory store; the publisher kills are real ``SIGKILL``s of a real process,
sent by the process to itself at a named point of the publish (deterministic, no timing)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from _chains import encodings, hist_chunks, write_chain
from _pairs import sha

from deltarefit.history_book import HistoryBook, MovesRecorder
from deltarefit.storage import LocalStore
from deltarefit.stream import Publisher, Subscriber
from deltarefit.stream.history import follows, lineage
from deltarefit.stream.records import head, load_commit, parse_commit
from deltarefit.stream.subscriber import history_path


def _files(d, steps: int, seed: int = 11) -> list[str]:
    """``steps`` checkpoints of a momentum-like chain: one full 1 MiB segment and a short one of bf16,
    a small bf16 matrix and a counter (so that every version differs)."""
    return write_chain(d, steps - 1, n=(1 << 19) + 3000, seed=seed, rate=0.05, prefix="c")


def _pub(store: LocalStore, state: str, **kw) -> Publisher:
    opts = {"keyframe_every": 1000, "keyframe_ratio": 1000.0, "history": True}
    opts.update(kw)
    return Publisher(store, state, **opts)


def _delta_encodings(store: LocalStore, version: int) -> dict[int, int]:
    rec = load_commit(store, version)
    return encodings(os.path.join(store.url, *rec.delta.key.split("/")))


def _lineage_of(store: LocalStore, version: int):
    return lineage(lambda v: load_commit(store, v), version)


def _assert_books_agree(store: LocalStore, pub: Publisher, ckpt: str) -> None:
    """The subscriber's book and the publisher's both follow the stream's lineage at the head."""
    want = _lineage_of(store, head(store))
    assert follows(HistoryBook(pub.book_path), want), (HistoryBook(pub.book_path).versions(), want)
    assert follows(HistoryBook(history_path(ckpt)), want), (HistoryBook(history_path(ckpt)).versions(), want)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    return _files(str(tmp_path_factory.mktemp("hchain")), 9)


@pytest.mark.parametrize("advance", ["copy", "apply"])
def test_a_history_stream_followed_version_by_version_is_bit_exact(chain, tmp_path, advance):
    store = LocalStore(str(tmp_path / "store"))
    pub = _pub(store, str(tmp_path / "pub"), keyframe_every=5, advance=advance)  # keyframes at versions 1 and 5
    plain = Publisher(LocalStore(str(tmp_path / "plain")), str(tmp_path / "ppub"), keyframe_every=5,
                      keyframe_ratio=1000.0)
    ckpt = str(tmp_path / "rollout.safetensors")
    sub = Subscriber(store, ckpt, subscriber_id="follower")
    hist_bytes = plain_bytes = 0
    for i, p in enumerate(chain):
        rec = pub.publish(p, step=i)
        prec = plain.publish(p, step=i)
        assert rec.version == i + 1 and rec.kind == prec.kind
        rep = sub.sync()
        assert rep.version == rec.version and sha(ckpt) == sha(p)
        assert rep.route == ("keyframe" if i == 0 else "chain")
        _assert_books_agree(store, pub, ckpt)
        if rec.delta is None:
            continue
        assert rec.history and not prec.history
        assert parse_commit(rec.to_bytes(), "x") == rec
        assert b'"history"' not in prec.to_bytes()  # records without a book keep their canonical bytes
        encs = _delta_encodings(store, rec.version)
        since_kf = rec.version - max(v for v in range(1, rec.version) if load_commit(store, v).keyframe)
        if since_kf >= 2:  # the second delta after a keyframe on
            assert hist_chunks(encs) > 0, (rec.version, encs)
        else:  # the first delta after a keyframe: the book is empty there
            assert hist_chunks(encs) == 0, (rec.version, encs)
        hist_bytes += rec.delta.bytes
        plain_bytes += prec.delta.bytes
    assert [v for v in range(1, 10) if load_commit(store, v).keyframe] == [1, 5]
    print(f"deltas with history {hist_bytes:,} B, without {plain_bytes:,} B")
    assert hist_bytes < plain_bytes


def _publish_all(chain, tmp_path, n: int, **kw) -> tuple[LocalStore, Publisher]:
    store = LocalStore(str(tmp_path / "store"))
    pub = _pub(store, str(tmp_path / "pub"), **kw)
    for i in range(n):
        pub.publish(chain[i], step=i)
    return store, pub


def test_late_joiners_build_the_publishers_history(chain, tmp_path):
    store, pub = _publish_all(chain, tmp_path, 7, keyframe_every=5)
    late = str(tmp_path / "late.safetensors")  # after the keyframe at 5: installs it, applies 6 and 7
    rep = Subscriber(store, late, subscriber_id="late").sync()
    assert (rep.route, rep.versions_applied) == ("keyframe", [5, 6, 7]) and sha(late) == sha(chain[6])
    _assert_books_agree(store, pub, late)
    early = str(tmp_path / "early.safetensors")  # joins at version 3 (keyframe 1, deltas 2, 3)
    assert Subscriber(store, early, subscriber_id="early").sync(to_version=3).route == "keyframe"
    assert sha(early) == sha(chain[2])
    pub.publish(chain[7])
    assert hist_chunks(_delta_encodings(store, 8)) > 0
    # both now follow by the chain, decoding deltas coded with history
    rep = Subscriber(store, late, subscriber_id="late").sync()
    assert (rep.route, rep.versions_applied) == ("chain", [8]) and sha(late) == sha(chain[7])
    rep = Subscriber(store, early, subscriber_id="early").sync()
    assert rep.route == "keyframe" or rep.versions_applied == [4, 5, 6, 7, 8]
    assert sha(early) == sha(chain[7])
    _assert_books_agree(store, pub, early)
    _assert_books_agree(store, pub, late)


def test_a_deleted_book_is_recovered_by_the_keyframe_route(chain, tmp_path):
    store, pub = _publish_all(chain, tmp_path, 4, keyframe_every=5)
    ckpt = str(tmp_path / "r.safetensors")
    sub = Subscriber(store, ckpt, subscriber_id="r")
    sub.sync()
    pub.publish(chain[4])  # version 5, a keyframe
    pub.publish(chain[5])
    pub.publish(chain[6])  # version 7 holds ulp_hist chunks
    assert hist_chunks(_delta_encodings(store, 7)) > 0
    sub.sync(to_version=6)
    shutil.rmtree(history_path(ckpt))
    # The chain's next delta needs the history; no keyframe lies ahead: back to the one at version 5.
    rep = sub.sync()
    assert (rep.route, rep.versions_applied) == ("keyframe", [5, 6, 7]) and sha(ckpt) == sha(chain[6])
    _assert_books_agree(store, pub, ckpt)
    pub.publish(chain[7])
    rep = sub.sync()
    assert (rep.route, rep.versions_applied) == ("chain", [8]) and sha(ckpt) == sha(chain[7])


def test_a_wrong_book_is_refused_by_name_and_the_sync_takes_a_keyframe_route(chain, tmp_path, caplog):
    store, pub = _publish_all(chain, tmp_path, 5, keyframe_every=1000)
    ckpt = str(tmp_path / "r.safetensors")
    sub = Subscriber(store, ckpt, subscriber_id="r")
    sub.sync()
    pub.publish(chain[5])
    assert hist_chunks(_delta_encodings(store, 6)) > 0
    # A book that names the right versions but holds no moves: the lineage check passes, the delta's
    # ulp_hist chunks are refused against it (nothing written), and the sync plans again.
    bp = history_path(ckpt)
    shutil.rmtree(bp)
    book = HistoryBook(bp)
    fps = [load_commit(store, v).fingerprint for v in (3, 4, 5)]
    book.commit(fps[0], MovesRecorder(), parent=None)
    book.commit(fps[1], MovesRecorder(), parent=fps[0])
    book.commit(fps[2], MovesRecorder(), parent=fps[1])
    assert follows(HistoryBook(bp), _lineage_of(store, 5))
    with caplog.at_level("WARNING"):
        rep = sub.sync()
    assert "coded against a history book" in caplog.text and "planning the sync again" in caplog.text
    assert rep.route == "keyframe" and rep.versions_applied == [1, 2, 3, 4, 5, 6] and sha(ckpt) == sha(chain[5])
    _assert_books_agree(store, pub, ckpt)


def test_a_catch_up_is_not_taken_where_the_chain_after_it_needs_history(chain, tmp_path):
    store, pub = _publish_all(chain, tmp_path, 6, catchup=True)
    assert load_commit(store, 6).catchup is not None and load_commit(store, 6).history
    # Landing on a version coded with history, a catch-up would leave a book that cannot follow the
    # next delta: the late joiner takes the keyframe and the chain instead, and can then go on.
    late = str(tmp_path / "late.safetensors")
    rep = Subscriber(store, late, subscriber_id="late").sync()
    assert rep.route == "keyframe" and rep.versions_applied == [1, 2, 3, 4, 5, 6] and sha(late) == sha(chain[5])
    _assert_books_agree(store, pub, late)
    pub.publish(chain[6])
    rep = Subscriber(store, late, subscriber_id="late").sync()
    assert (rep.route, rep.versions_applied) == ("chain", [7]) and sha(late) == sha(chain[6])


def test_publish_history_cli_flag(chain, tmp_path):
    store = str(tmp_path / "store")
    env = dict(os.environ, DELTAREFIT_NO_PROGRESS="1")
    for p in chain[:3]:
        subprocess.run([sys.executable, "-m", "deltarefit", "publish", store, p, "--history", "-q"], env=env,
                       check=True, timeout=120)
    st = LocalStore(store)
    assert [load_commit(st, v).history for v in (2, 3)] == [True, True]
    assert hist_chunks(_delta_encodings(st, 3)) > 0
    log = subprocess.run([sys.executable, "-m", "deltarefit", "log", store, "--json"], env=env, check=True,
                         capture_output=True, text=True, timeout=120)
    assert [row["history"] for row in json.loads(log.stdout)] == [False, True, True]


# ------------------------------------------------------------------------------------ killed publishes

_KILLER = textwrap.dedent("""
    import os, signal, sys
    import deltarefit.history_book as HB
    import deltarefit.stream.baseline as B
    import deltarefit.stream.publisher as P
    from deltarefit.storage import LocalStore

    store, state, ckpt, point, advance = sys.argv[1:]

    def after(owner, name):
        orig = getattr(owner, name)
        def killed(*a, **k):
            out = orig(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)
            return out
        setattr(owner, name, killed)

    owner, name = {"encode": (P, "encode_delta"), "upload": (LocalStore, "put_file"),
                   "commit": (LocalStore, "create"), "advance": (B.Baseline, "advance_by_copy"),
                   "apply": (B, "apply_delta"), "book": (HB.HistoryBook, "commit"),
                   "state": (B.Baseline, "save_state")}[point]
    after(owner, name)
    P.Publisher(LocalStore(store), state, keyframe_every=1000, keyframe_ratio=1000.0, history=True,
                advance=advance).publish(ckpt)
    sys.exit(3)  # the kill point was not reached
""")

KILLS = [("encode", "copy"), ("upload", "copy"), ("commit", "copy"), ("advance", "copy"), ("book", "copy"),
         ("state", "copy"), ("apply", "apply"), ("book", "apply")]


def test_publisher_killed_at_each_point_then_rerun_keeps_the_chain_decodable(tmp_path):
    chain = _files(str(tmp_path / "c"), 3 + len(KILLS) + 2, seed=21)
    store = LocalStore(str(tmp_path / "store"))
    state = str(tmp_path / "pub")
    follower = str(tmp_path / "follower.safetensors")
    fsub = Subscriber(store, follower, subscriber_id="follower")
    for p in chain[:3]:
        _pub(store, state).publish(p)
        fsub.sync()
    nxt = 3
    for point, advance in KILLS:
        p = chain[nxt]
        r = subprocess.run([sys.executable, "-c", _KILLER, store.url, state, p, point, advance],
                           capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, DELTAREFIT_NO_PROGRESS="1"))
        assert r.returncode == -signal.SIGKILL, (point, r.returncode, r.stderr[-2000:])
        rec = _pub(store, state, advance=advance).publish(p)  # the rerun: finishes or publishes it
        assert rec.version == nxt + 1 and rec.fingerprint == load_commit(store, nxt + 1).fingerprint, point
        rep = fsub.sync()
        # the follower never needs a keyframe: the publisher's book and its own are the same
        assert rep.route == "chain" and rep.versions_applied == [nxt + 1] and sha(follower) == sha(p), point
        _assert_books_agree(store, Publisher(store, state), follower)
        nxt += 1
    # after the kills, history is back: the last deltas are coded with it and decoded by the follower
    for p in chain[nxt:]:
        rec = _pub(store, state).publish(p)
        assert rec.history
        assert fsub.sync().route == "chain" and sha(follower) == sha(p)
    assert hist_chunks(_delta_encodings(store, head(store))) > 0
    late = str(tmp_path / "late.safetensors")
    assert Subscriber(store, late, subscriber_id="late").sync().version == head(store)
    assert sha(late) == sha(chain[-1])
    # no kill point cost the stream its history: each rerun advanced the book by the staged moves
    assert all(load_commit(store, v).history for v in range(2, head(store) + 1))


_SYNC_KILLER = textwrap.dedent("""
    import os, signal, sys
    import deltarefit.apply as A
    import deltarefit.history_book as HB
    from deltarefit.storage import LocalStore
    from deltarefit.stream import Subscriber

    store, ckpt, point = sys.argv[1:]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "book":  # after the apply and the book's commit, before the version is recorded
        orig = HB.HistoryBook.commit
        HB.HistoryBook.commit = lambda *a, **k: (orig(*a, **k), die())
    else:  # "written": every chunk written and flushed, before the journal goes and the book advances
        A.Journal.remove = lambda self: die()
    Subscriber(LocalStore(store), ckpt, subscriber_id="r").sync()
    sys.exit(3)  # the kill point was not reached
""")


@pytest.mark.parametrize("point,route_after", [("book", "chain"), ("written", "keyframe")])
def test_a_sync_killed_then_rerun_stays_bit_exact(chain, tmp_path, point, route_after):
    store, pub = _publish_all(chain, tmp_path, 4)
    ckpt = str(tmp_path / "r.safetensors")
    Subscriber(store, ckpt, subscriber_id="r").sync()
    pub.publish(chain[4])
    assert hist_chunks(_delta_encodings(store, 5)) > 0
    r = subprocess.run([sys.executable, "-c", _SYNC_KILLER, store.url, ckpt, point], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, DELTAREFIT_NO_PROGRESS="1"))
    assert r.returncode == -signal.SIGKILL, (point, r.returncode, r.stderr[-2000:])
    rep = Subscriber(store, ckpt, subscriber_id="r").sync()
    assert rep.version == 5 and sha(ckpt) == sha(chain[4])
    pub.publish(chain[5])
    # killed after its book advanced, the rerun keeps the book (the version's chunks are found applied
    # and need no history); killed before, their moves are gone: the book is started over, and the
    # next delta, coded with history, comes by the keyframe route instead. Bit-exact either way.
    rep = Subscriber(store, ckpt, subscriber_id="r").sync()
    assert rep.route == route_after and rep.version == 6 and sha(ckpt) == sha(chain[5])
    _assert_books_agree(store, pub, ckpt)


def test_joint_commit_checks_a_history_delta_against_each_subscribers_book(chain, tmp_path):
    from test_stream import _joint_round  # the joint round of the plain stream's tests

    store, _ = _publish_all(chain, tmp_path, 4)
    subs = [Subscriber(LocalStore(store.url), str(tmp_path / f"{n}.safetensors"), subscriber_id=n)
            for n in ("s1", "s2", "bookless")]
    for s in subs:
        s.sync()
    shutil.rmtree(history_path(subs[2].checkpoint))
    before = {s.id: sha(s.checkpoint) for s in subs}
    jpub = _pub(LocalStore(store.url), str(tmp_path / "pub"), quorum=2, ack_timeout=30)
    rec, got = _joint_round(jpub, chain[4], subs)
    assert not isinstance(rec, BaseException), rec
    assert rec.version == 5 and rec.history and hist_chunks(_delta_encodings(store, 5)) > 0
    assert got == {"s1": [5], "s2": [5], "bookless": []}
    ack = json.loads(store.get("acks/000000000005/bookless.json"))
    assert ack["ok"] is False and "history" in ack["why"], ack
    assert {s.id: sha(s.checkpoint) for s in subs} == before  # prepare never writes
    for s in subs:
        assert s.sync().version == 5 and sha(s.checkpoint) == sha(chain[4])


# --------------------------------------------------------------- a book that cannot be written (issue 34, item 7)


@pytest.mark.parametrize("planted", ["dangling", "to-a-directory"])
def test_a_symlink_at_the_book_is_removed_and_the_checkpoint_never_goes_back(chain, tmp_path, planted):
    """A symlink where the book goes (dangling, or to another user's directory) is never read nor written
    through: the sync removes the link, and ends at the head bit-exact (the book lost, by the keyframe route)."""
    store, pub = _publish_all(chain, tmp_path, 5)
    ckpt = str(tmp_path / "s.safetensors")
    sub = Subscriber(store, ckpt, subscriber_id="s")
    sub.sync(to_version=3)
    assert sha(ckpt) == sha(chain[2])
    victim = tmp_path / "victim"
    if planted == "to-a-directory":
        victim.mkdir()
        (victim / "keep").write_bytes(b"precious")
    shutil.rmtree(history_path(ckpt))
    os.symlink(victim, history_path(ckpt))
    pub.publish(chain[5])
    rep = sub.sync()
    assert rep.version == 6 and sha(ckpt) == sha(chain[5]), rep
    assert not os.path.islink(history_path(ckpt))
    if planted == "to-a-directory":
        assert os.listdir(victim) == ["keep"] and (victim / "keep").read_bytes() == b"precious"
    else:
        assert not os.path.lexists(victim)
    pub.publish(chain[6])
    assert hist_chunks(_delta_encodings(store, 7)) > 0
    rep = sub.sync()
    assert (rep.route, rep.versions_applied) == ("chain", [7]) and sha(ckpt) == sha(chain[6])
    _assert_books_agree(store, pub, ckpt)


def _unprivileged_sync(store: str, ckpt: str, *extra: str):
    from deltarefit.apps.bench import fs_faults as F

    return F.cli(["sync", store, ckpt, *extra], unprivileged=True)


def _can_deny() -> bool:
    from deltarefit.apps.bench import fs_faults as F

    if os.geteuid() != 0:
        return True
    argv, pre = F.unprivileged_argv([sys.executable, "-c", "pass"])
    try:
        subprocess.run(argv, preexec_fn=pre, check=True, capture_output=True, timeout=60)
        return True
    except (subprocess.SubprocessError, OSError):
        return False


@pytest.mark.skipif(not _can_deny(), reason="root cannot drop CAP_DAC_OVERRIDE in a child here")
def test_an_unwritable_book_goes_forward_where_it_decodes_and_never_back(chain, tmp_path):
    """The book's directory without the write bit: a sync whose delta the held book decodes goes forward
    and is verified (the book is left behind, not advanced); the next one, coded against the version the
    book could not take, refuses in one line with the checkpoint where it was (never back to the older
    keyframe it could not go forward from); once the book is writable, the sync ends at the head."""
    store, pub = _publish_all(chain, tmp_path, 3)
    ckpt = str(tmp_path / "u.safetensors")
    sub = Subscriber(store, ckpt, subscriber_id="u")
    sub.sync()
    pub.publish(chain[3])
    book = history_path(ckpt)
    modes = [(p, os.stat(p).st_mode) for p in [book, *(os.path.join(book, f) for f in os.listdir(book))]]
    for p, m in modes:
        os.chmod(p, m & ~0o222)
    try:
        r = _unprivileged_sync(store.url, ckpt)
        assert r.rc == 0 and "verified" in r.stdout and "Traceback" not in r.stderr, (r.stdout, r.stderr)
        assert sha(ckpt) == sha(chain[3])
        pub.publish(chain[4])
        pub.publish(chain[5])
        assert hist_chunks(_delta_encodings(store, 5)) > 0
        r = _unprivileged_sync(store.url, ckpt)
        lines = r.stderr.strip().splitlines()
        assert r.rc != 0 and len(lines) == 1 and "history book cannot be written" in lines[0], r.stderr
        assert book in lines[0] and "stays at version 4" in lines[0]
        assert sha(ckpt) == sha(chain[3])
    finally:
        for p, m in modes:
            os.chmod(p, m)
    rep = Subscriber(store, ckpt, subscriber_id="u").sync()
    assert rep.version == 6 and sha(ckpt) == sha(chain[5])
    _assert_books_agree(store, pub, ckpt)
