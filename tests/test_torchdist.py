"""Broadcast refit over a real torch.distributed gloo group: four real processes on loopback, each
applying to its own state (a checkpoint at some version, an empty one, a dict of tensors)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from _stream_util import ENV, chain_fingerprints, communicate_all, free_port, session_chain, sha

import deltarefit
from deltarefit.storage.local import LocalStore
from deltarefit.stream.publisher import Publisher
from deltarefit.stream.records import load_commit
from deltarefit.stream.subscriber import Subscriber

WORKER = os.path.join(os.path.dirname(__file__), "_torchdist_worker.py")
pytest.importorskip("torch.distributed", reason="torch is in the test extra: pip install -e '.[test]' (make test installs it)")


def _run_group(ranks: list[dict]) -> list[tuple[int, dict]]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, json.dumps(dict(r, rank=i, world=len(ranks), port=port))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
             for i, r in enumerate(ranks)]
    out = []
    for rc, so, se in communicate_all(procs, timeout=120):
        lines = [ln for ln in so.splitlines() if ln.startswith("{")]
        assert lines, f"rank printed nothing (rc {rc}): {se[-2000:]}"
        out.append((rc, json.loads(lines[-1])))
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    chain = session_chain(tmp_path_factory)
    fps = chain_fingerprints(chain)
    d = tmp_path_factory.mktemp("tdist")
    store = LocalStore(str(d / "store"))
    pub = Publisher(store, str(d / "pub"), keyframe_every=5, keyframe_ratio=1000.0)
    for v in range(1, 7):
        pub.publish(chain[v], step=v)
    return {"d": d, "store": store, "pub": pub, "chain": chain, "fps": fps}


def test_ranks_at_different_versions_all_reach_head_bit_exact(setup, tmp_path):
    chain, fps, store = setup["chain"], setup["fps"], setup["store"]
    ck0, ck1, ck2 = (str(tmp_path / f"r{i}.safetensors") for i in range(3))
    Subscriber(store, ck0).sync(to_version=2)
    Subscriber(store, ck1).sync(to_version=4)
    out = _run_group([
        {"store": store.url, "checkpoint": ck0, "mirror": str(tmp_path / "m0")},
        {"checkpoint": ck1, "mirror": str(tmp_path / "m1")},
        {"checkpoint": ck2, "mirror": str(tmp_path / "m2")},  # holds nothing: keyframe 5, then 6
        {"tensors_from": chain[3], "held": [3, fps[3]], "tensors_out": str(tmp_path / "t3.safetensors"),
         "mirror": str(tmp_path / "m3")},
    ])
    assert [rc for rc, _ in out] == [0, 0, 0, 0], out
    assert [r["applied"] for _, r in out] == [[3, 4, 5, 6], [5, 6], [5, 6], [4, 5, 6]]
    for _, r in out:
        assert (r["version"], r["fingerprint"]) == (6, fps[6])
    for ck in (ck0, ck1, ck2):
        assert sha(ck) == sha(chain[6])
    assert deltarefit.fingerprint(str(tmp_path / "t3.safetensors")) == fps[6]
    # Parts cross the group once per rank: the same bytes arrived everywhere.
    assert len({r["bytes"] for _, r in out}) == 1
    assert out[0][1]["bytes"] == sum(p.bytes for v in range(3, 7) for p in [load_commit(store, v).delta]) + sum(
        p.bytes for _, p in load_commit(store, 5).keyframe)


def test_a_tampered_part_fails_every_rank_and_writes_nothing(setup, tmp_path):
    chain, store = setup["chain"], setup["store"]
    ck0, ck1 = str(tmp_path / "r0.safetensors"), str(tmp_path / "r1.safetensors")
    for ck in (ck0, ck1):
        Subscriber(store, ck).sync(to_version=6)
    # A private copy of the stream with version 7 whose delta is flipped after publishing.
    shutil.copytree(store.url, tmp_path / "store")
    shutil.copytree(setup["pub"].state_dir, tmp_path / "pub")
    st = LocalStore(str(tmp_path / "store"))
    rec = Publisher(st, str(tmp_path / "pub"), keyframe_every=5, keyframe_ratio=1000.0).publish(chain[7], step=7)
    path = st.path_of(rec.delta.key)
    with open(path, "r+b") as f:
        f.seek(rec.delta.bytes // 2)
        b = f.read(1)
        f.seek(rec.delta.bytes // 2)
        f.write(bytes([b[0] ^ 0x10]))
    before = [sha(ck0), sha(ck1)]
    out = _run_group([{"store": st.url, "checkpoint": ck0, "mirror": str(tmp_path / "m0")},
                      {"checkpoint": ck1, "mirror": str(tmp_path / "m1")}])
    assert [rc for rc, _ in out] == [3, 3], out
    for _, r in out:
        assert "does not match its commit record" in r["error"]
    assert [sha(ck0), sha(ck1)] == before == [sha(chain[6])] * 2


def _history_stream(tmp_path):
    """A stream published with history (encoding 5) along a momentum-like chain: version 1 a keyframe,
    2 the first delta after it (coded without history), 3 and 4 coded against the stream's moves."""
    from _chains import encodings, write_chain

    from deltarefit.codec.chunk import ULP2_HIST, ULP_HIST

    chain = write_chain(str(tmp_path / "chain"), 3, n=(1 << 19) + 3000, seed=11, rate=0.05, prefix="c")
    store = LocalStore(str(tmp_path / "store"))
    pub = Publisher(store, str(tmp_path / "pub"), keyframe_every=1000, keyframe_ratio=1000.0, history=True)
    for v, ck in enumerate(chain, 1):
        pub.publish(ck, step=v)
    used = {e for v in (3, 4) for e in encodings(os.path.join(store.url, *load_commit(store, v).delta.key.split("/")))}
    assert used & {ULP_HIST, ULP2_HIST}, used
    return chain, store


def test_a_tensors_rank_with_its_history_book_follows_a_history_stream_bit_exact(tmp_path):
    chain, store = _history_stream(tmp_path)
    ck0 = str(tmp_path / "r0.safetensors")
    Subscriber(store, ck0).sync(to_version=1)
    fp1 = deltarefit.fingerprint(chain[0])
    out = _run_group([
        {"store": store.url, "checkpoint": ck0, "mirror": str(tmp_path / "m0")},
        {"tensors_from": chain[0], "held": [1, fp1], "tensors_out": str(tmp_path / "t1.safetensors"),
         "history": str(tmp_path / "book1"), "mirror": str(tmp_path / "m1")},
    ])
    assert [rc for rc, _ in out] == [0, 0], out
    assert [r["applied"] for _, r in out] == [[2, 3, 4], [2, 3, 4]]
    assert sha(ck0) == sha(chain[3])
    assert deltarefit.fingerprint(str(tmp_path / "t1.safetensors")) == deltarefit.fingerprint(chain[3])


def test_a_tensors_rank_without_a_book_refuses_a_history_delta_on_every_rank(tmp_path):
    chain, store = _history_stream(tmp_path)
    ck0 = str(tmp_path / "r0.safetensors")
    Subscriber(store, ck0).sync(to_version=2)
    out = _run_group([
        {"store": store.url, "checkpoint": ck0, "mirror": str(tmp_path / "m0")},
        {"tensors_from": chain[1], "held": [2, deltarefit.fingerprint(chain[1])],
         "tensors_out": str(tmp_path / "t1.safetensors"), "mirror": str(tmp_path / "m1")},
    ])
    assert [rc for rc, _ in out] == [3, 3], out
    assert all("rank 1" in r["error"] and "history" in r["error"] for _, r in out), out


def test_a_failure_line_shared_between_ranks_keeps_its_reason_within_its_slot():
    from deltarefit.transport.torchdist import FP_BYTES, _brief

    line = "rank 1: /a/very/long/mirror/path/" + "é" * 300 + "/delta: chunk is coded against history 25da…, none held"
    got = _brief(line)
    assert len(got.encode()) <= FP_BYTES and got.startswith("rank 1: ") and got.endswith("none held")
    assert _brief("short") == "short"
