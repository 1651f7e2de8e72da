"""A publisher's input changing while it is published (issue 54, item 4): a real thread writing the
tensors ``publish_tensors`` was given, a real process rewriting the checkpoint file under
``deltarefit publish``. No crash (the native kernels read each element once), nothing committed that does
not decode to what was hashed ("the input changed while it was published; nothing committed", exit 6),
and the ways out set aside a committed version whose delta does not decode."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from _stream_util import ENV, run
from safetensors.torch import save_file

from deltarefit.errors import InputChangedError, VerificationError
from deltarefit.storage import LocalStore
from deltarefit.stream import Publisher, Subscriber
from deltarefit.stream.records import head

CHANGED = "the input changed while it was published; nothing committed"

# Each kernel called while two threads write into its target: before the fix, scan16 and the numba scan
# re-read a changed element and handed the coder a change with equal values (SIGSEGV in the coder).
_HAMMER = textwrap.dedent("""
    import sys, threading, numpy as np
    from deltarefit.codec import chunk, native
    from deltarefit.codec.history import History
    from deltarefit.dtypes import dtype
    ext = native.ext
    dt = dtype("BF16")
    rng = np.random.default_rng(0)
    n = 1 << 16
    base = rng.integers(0x3c00, 0x3f80, n, dtype=np.uint16)
    target = base.copy()
    stop = threading.Event()
    def mutate(seed):
        r = np.random.default_rng(seed)
        while not stop.is_set():
            i = int(r.integers(0, n - 4096))
            target[i:i + 4096] ^= 1  # flips between equal and one ulp away, under the scan
            dbase[i:i + 4096] ^= 0x0100  # moves elements between contexts, under the decoder's passes
    shift, mask, nctx = chunk._ctx(dt)
    bufs = [np.empty(n, np.int32) for _ in range(3)] + [np.empty(n, np.uint16) for _ in range(2)]
    out = np.empty(chunk.max_payload_len(dt, n) + 64, np.uint8)
    hist = History.from_moves(n, [])
    target[::7] += 1  # compiled (numba) at rest first: the writers would hold the GIL from the compiler
    enc = chunk.encode_raw(dt, base.view(np.uint8), target.view(np.uint8))
    chunk.encode_hist(dt, base, target, hist)
    from deltarefit.codec.decode import decode_chunk
    from deltarefit.errors import DeltaRefitError
    dbase = base.copy()  # the decoder's base, written under it too (a tensor applied into while in use)
    def decode():
        try:
            decode_chunk(dt, dbase, enc.encoding, enc.payload, enc.n_changed, enc.decoded_len, "hammer",
                         digest=(0, 1, 2))
        except DeltaRefitError:
            pass  # refused: a base that changed may not decode; never a read or write outside it
    decode()
    ths = [threading.Thread(target=mutate, args=(s,)) for s in (1, 2)]
    for t in ths:
        t.start()
    try:
        for k in range(int(sys.argv[1])):
            if ext is not None:
                ext.scan16(base, target, shift, mask, nctx, *bufs, dt.bits, 0, out)
                try:
                    m = ext.scan16(base, target, shift, mask, nctx, *bufs)
                    if m:
                        ext.encode_changes(bufs[1][:m], bufs[2][:m], bufs[3][:m], bufs[4][:m], 2, dt.bits, 0,
                                           nctx, out)
                except ValueError:
                    pass  # arrays changed between the two calls: refused, never followed
            chunk.encode_raw(dt, base.view(np.uint8), target.view(np.uint8))
            chunk.encode_hist(dt, base, target, hist)
            decode()
    finally:
        stop.set()
        for t in ths:
            t.join()
    print("ok")
""")


@pytest.mark.parametrize("kernels", ["native", "numba"])
def test_the_encoder_kernels_survive_a_target_written_under_them(kernels):
    env = dict(ENV, DELTAREFIT_KERNELS=kernels)
    p = subprocess.run([sys.executable, "-c", _HAMMER, "10"], capture_output=True, text=True, timeout=300, env=env,
                       check=False)
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stderr[-2000:])


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(256, 1024, generator=g).to(torch.bfloat16) for i in range(3)}


def _publisher(root) -> Publisher:
    return Publisher(LocalStore(str(root / "store"), create=True), str(root / "state"), keyframe_every=1000,
                     keyframe_ratio=1000.0)


def _writer(tensors: dict[str, torch.Tensor], stop: threading.Event) -> None:
    k = 0
    while not stop.is_set():
        for t in tensors.values():
            t.view(torch.int16)[k % t.shape[0]].add_(1)
        k += 1


@pytest.mark.slow  # a writer thread holding the GIL against the publisher: ~15 s on 2 busy cores
def test_publish_tensors_written_by_a_thread_commits_nothing_that_does_not_decode(tmp_path):
    w = _weights()
    pub = _publisher(tmp_path)
    pub.publish_tensors(w)
    refused = 0
    for _trial in range(3):
        for t in w.values():
            t.add_(0.01)
        before = head(pub.store)
        stop = threading.Event()
        th = threading.Thread(target=_writer, args=(w, stop))
        th.start()
        try:
            pub.publish_tensors(w)
        except InputChangedError as e:
            refused += 1
            assert CHANGED in str(e) and "\n" not in str(e)
            assert head(pub.store) == before  # nothing committed
        finally:
            stop.set()
            th.join()
    assert refused >= 1  # the writer is fast enough to be caught here
    # whatever was committed decodes: a subscriber reaches the head, verified, and the publisher goes on
    rec = pub.publish_tensors(w)
    rep = Subscriber(LocalStore(str(tmp_path / "store")), str(tmp_path / "ck.safetensors")).sync()
    assert rep.verified and rep.version == rec.version == head(pub.store)
    assert rep.fingerprint == rec.fingerprint


def _rewriter_script(path: str) -> str:
    return textwrap.dedent(f"""
        import os, time
        fd = os.open({path!r}, os.O_RDWR)
        size = os.fstat(fd).st_size
        k = 0
        while True:
            os.pwrite(fd, bytes([k % 251]) * 4096, size - 4096 - (k * 4096) % (size // 2))  # in place
            k += 1
            time.sleep(0.0005)
    """)


@pytest.mark.slow  # five CLI processes: ~1 min on 2 busy cores
def test_deltarefit_publish_of_a_file_rewritten_in_place_exits_6_or_commits_what_decodes(tmp_path):
    ck = str(tmp_path / "model.safetensors")
    store, state = str(tmp_path / "store"), str(tmp_path / "state")
    w = _weights(1)
    save_file(w, ck)
    assert run("publish", store, ck, "--state", state).returncode == 0
    codes = []
    for trial in range(3):
        save_file({n: t + 0.01 * (trial + 1) for n, t in w.items()}, ck)
        writer = subprocess.Popen([sys.executable, "-c", _rewriter_script(ck)])
        try:
            p = run("publish", store, ck, "--state", state, *(["--keyframe-every", "1"] if trial == 2 else []))
        finally:
            writer.kill()
            writer.wait()
        assert "Traceback" not in p.stderr, p.stderr
        assert p.returncode in (0, 6), p.stderr
        if p.returncode == 6:
            assert p.stderr.strip().count("\n") == 0 and CHANGED in p.stderr
        codes.append(p.returncode)
    assert 6 in codes, codes
    # what is committed decodes: a subscriber reaches the head, and the next publish (file at rest) works
    assert run("publish", store, ck, "--state", state).returncode == 0
    sub = run("sync", store, str(tmp_path / "follower.safetensors"))
    assert sub.returncode == 0, sub.stderr


def _commit_undecodable(tmp_path, monkeypatch) -> tuple[Publisher, dict]:
    """A stream whose head is a delta that does not decode (what a publisher without the check
    committed when its input changed): the encoder's post-image hashes taken from other bytes than it
    coded, and the check skipped, as before it existed."""
    import deltarefit.encode.work as work
    import deltarefit.stream.publisher as publisher

    w = _weights(2)
    pub = _publisher(tmp_path)
    pub.publish_tensors(w)
    real = work._patch_work

    def torn(*a, **k):
        run = real(*a, **k)

        def hashed_later():
            pre, post, enc = run()
            return pre, (post if enc is None else bytes(x ^ 1 for x in post)), enc

        return hashed_later

    with monkeypatch.context() as mp:
        mp.setattr(publisher, "check_decodes", lambda *a, **k: None)
        mp.setattr(work, "_patch_work", torn)
        for t in w.values():
            t.add_(0.01)
        pub.publish_tensors(w)  # committed; its baseline cannot follow (a warning)
    assert head(pub.store) == 2
    return pub, w


def test_a_committed_delta_that_does_not_decode_stops_the_publisher_and_quarantine_head_sets_it_aside(
        tmp_path, monkeypatch):
    pub, w = _commit_undecodable(tmp_path, monkeypatch)
    with pytest.raises(VerificationError, match="--quarantine-head"):
        pub.publish_tensors(w)
    rec = pub.publish_tensors(w, quarantine_head=True)
    assert rec.version == 2 and head(pub.store) == 2
    assert [k for k in pub.store.list("quarantine/")]
    rep = Subscriber(LocalStore(str(tmp_path / "store")), str(tmp_path / "ck.safetensors")).sync()
    assert rep.verified and rep.fingerprint == rec.fingerprint


def test_reset_baseline_sets_aside_a_head_delta_that_does_not_decode(tmp_path, monkeypatch):
    _, w = _commit_undecodable(tmp_path, monkeypatch)
    fresh = Publisher(LocalStore(str(tmp_path / "store")), str(tmp_path / "state2"), keyframe_every=1000,
                      keyframe_ratio=1000.0)
    st = fresh.reset_baseline()
    assert st.version == 1 and head(fresh.store) == 1
    assert fresh.publish_tensors(w).version == 2


def test_a_keyframe_file_rewritten_after_its_hash_is_refused_before_the_commit(tmp_path):
    ck = str(tmp_path / "model.safetensors")
    save_file(_weights(3), ck)
    pub = _publisher(tmp_path)
    real_put = pub.attempts.store.put_file

    def put_then_rewrite(key, path):  # another process writes the file while it uploads
        real_put(key, path)
        with open(ck, "r+b") as f:
            f.seek(os.path.getsize(ck) - 2)
            f.write(b"\x01\x02")

    pub.attempts.store.put_file = put_then_rewrite
    with pytest.raises(InputChangedError, match=CHANGED):
        pub.publish(ck)
    assert head(pub.store) == 0
