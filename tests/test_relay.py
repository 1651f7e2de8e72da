"""Relay tree: pure placement tables, the authenticated frame protocol over real loopback sockets, and
real ``deltarefit relay`` processes (a root and nodes) carrying a published stream bit-exact, with a
middle node SIGKILLed mid-transfer, a node holding the wrong key (told, it stops), a parent serving
rotten bytes (routed around), and unauthenticated connections (bounded in number and memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time

import pytest
from _stream_util import run

import deltarefit
from deltarefit.apps.bench.relay import count_in, listening, start, stop, write_checkpoint
from deltarefit.relay import plan, protocol
from deltarefit.relay.protocol import ProtocolError
from deltarefit.storage import LocalStore
from deltarefit.stream import Publisher, Subscriber
from deltarefit.stream.records import load_commit

DEADLINE = 60.0  # seconds for any one tree to finish


# ------------------------------------------------------------------------------------------ planner

C = plan.Child


@pytest.mark.parametrize(("joiner", "path", "children", "fanout", "new", "want"), [
    ("a", [], [], 2, True, ("accept", "")),
    ("a", [], [C("b", "h:1")], 2, True, ("accept", "")),
    ("a", [], [C("b", "h:1", 3), C("c", "h:2", 1)], 2, True, ("redirect", "h:2")),
    ("a", [], [C("b", "h:1", 2), C("c", "h:2", 2)], 2, True, ("redirect", "h:1")),  # first of equals
    ("a", [], [C("b", "h:1", 1, False), C("c", "h:2", 5)], 2, True, ("redirect", "h:2")),  # b can't start it
    ("a", [], [C("b", "h:1", 1, False), C("c", "h:2", 5)], 2, False, ("redirect", "h:1")),  # it holds a version
    ("a", [], [C("b", "h:1", 1, False)], 1, True, ("refuse", "")),
    ("a", [], [C("a", "h:9", 4), C("c", "h:2", 1)], 2, True, ("accept", "")),  # reconnect replaces itself
    ("me", [], [], 2, True, ("refuse", "")),  # itself
    ("r", ["r", "x"], [], 2, True, ("refuse", "")),  # an ancestor: a cycle
    ("a", [], [], 0, True, ("refuse", "")),  # fan-out 0, no children
])
def test_placement(joiner, path, children, fanout, new, want):
    got = plan.place(joiner, "me", path, children, fanout, new=new)
    assert (got.kind, got.to) == want


@pytest.mark.parametrize(("children", "fanout", "avoid", "want"), [
    ([C("b", "h:1", 1)], 1, {"h:1"}, ("accept", "")),  # the only subtree is avoided: over the fan-out here
    ([C("b", "h:1", 1), C("c", "h:2", 5)], 2, {"h:1"}, ("redirect", "h:2")),  # the other one, though larger
    ([C("b", "h:1", 1), C("c", "h:2", 5)], 2, {"h:9"}, ("redirect", "h:1")),  # avoiding others changes nothing
    ([C("b", "h:1", 1)], 2, {"h:1"}, ("accept", "")),  # capacity left: accepted as before
])
def test_placement_routes_around_avoided_relays(children, fanout, avoid, want):
    got = plan.place("a", "me", [], children, fanout, new=True, avoid=avoid)
    assert (got.kind, got.to) == want


@pytest.mark.parametrize(("held", "known", "want"), [
    (0, {}, plan.WAIT),  # empty stream: wait for the first version
    (3, {}, 4),  # continue the chain once it arrives
    (3, {1: True, 2: False, 3: False, 4: False}, 4),
    (9, {1: True, 2: False}, 10),  # ahead of this relay: wait for it to catch up
    (0, {1: True, 2: False, 5: True, 6: False}, 5),  # newest keyframe held here
    (1, {5: True, 6: False}, 5),  # its chain is gone here: start over from a keyframe
    (0, {4: False, 5: False}, -2),  # nothing to start a new node from
])
def test_start_version(held, known, want):
    assert plan.start_version(held, known) == want


def test_parts_to_send_and_root_parts():
    kf = ["v/5/a/keyframe/model.safetensors"]
    assert plan.parts_to_send(["d", *kf], "d", kf, as_keyframe=True) == kf  # a new node starts here
    assert plan.parts_to_send(["d", *kf], "d", kf, as_keyframe=False) == ["d"]  # a chain goes on
    assert plan.parts_to_send(kf, "d", kf, as_keyframe=False) == kf  # only the files are held here
    assert plan.parts_to_send(["d"], "d", [], as_keyframe=False) == ["d"]
    assert plan.root_parts("d", kf) == ["d", *kf]  # keyframe versions: both
    assert plan.root_parts("d", []) == ["d"]
    assert plan.root_parts(None, kf) == kf  # the first version


def test_subtree_size_and_addresses():
    assert plan.subtree_size([C("a", "x:1", 3), C("b", "x:2", 1)]) == 5
    assert plan.parse_addrs(" h:1, ,h:2 ") == ["h:1", "h:2"]
    assert protocol.split_addr("[::1]:80") == ("::1", 80)
    with pytest.raises(deltarefit.errors.UsageError):
        protocol.split_addr("nohost")


# ------------------------------------------------------------------------------------------ protocol

KEY = b"k" * 32


def _exchange(frames, *, client_key=KEY, server_key=KEY, tamper=None, first_seq: int = 0):
    """Send ``frames`` from a client to a server on loopback; return what the server received, in
    order, ending with the exception that closed the connection (if any). ``tamper(parts)`` may rewrite
    a frame's byte parts (seq+lengths, header, payload, MAC) on their way out."""

    async def main():
        got = []
        finished = asyncio.Event()

        async def handler(r, w):
            try:
                ch = await protocol.accept(r, w, server_key)
                while True:
                    got.append(await ch.recv(5))
            except Exception as e:  # the test inspects it
                got.append(e)
            finally:
                w.close()
                finished.set()

        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        ch = await protocol.connect("127.0.0.1", port, client_key)
        if tamper is not None:
            orig = ch.writer.writelines
            ch.writer.writelines = lambda parts: orig(tamper(list(parts)))
        ch._send_seq = first_seq
        for h, p in frames:
            await ch.send(h, p)
        await ch.writer.drain()
        ch.writer.write_eof()
        await asyncio.wait_for(finished.wait(), 10)
        await ch.close()
        server.close()
        return got

    return asyncio.run(main())


def test_frames_round_trip():
    payload = os.urandom(300_000)
    got = _exchange([({"t": "HELLO", "n": 1}, b""), ({"t": "DATA", "k": "v/1/delta", "o": 0}, payload)])
    assert got[0] == ({"t": "HELLO", "n": 1}, b"")
    assert got[1] == ({"t": "DATA", "k": "v/1/delta", "o": 0}, payload)
    assert isinstance(got[2], asyncio.IncompleteReadError)  # the clean end of the stream


def _flip(i: int, at: int = 0):
    def t(parts):
        b = bytearray(parts[i])
        b[at] ^= 1
        parts[i] = bytes(b)
        return parts
    return t


@pytest.mark.parametrize(("what", "kw"), [
    ("payload", {"tamper": _flip(2, 5)}),
    ("header", {"tamper": _flip(1, 3)}),
    ("sequence number", {"tamper": _flip(0, 7)}),
    ("mac", {"tamper": _flip(3, 0)}),
    ("wrong key", {"client_key": b"x" * 32}),
])
def test_tampered_or_unauthenticated_frames_are_refused(what, kw):
    got = _exchange([({"t": "DATA", "k": "x", "o": 0}, b"some bytes of a part")], **kw)
    assert isinstance(got[0], ProtocolError), what
    assert "failed authentication" in str(got[0])


def test_replayed_and_skipped_frames_are_refused():
    sent = []

    def replay(parts):  # each frame goes out, then the first one again verbatim (valid MAC, old seq)
        sent.append(b"".join(parts))
        return [*parts, sent[0]]

    got = _exchange([({"t": "PING"}, b"")], tamper=replay)
    assert got[0] == ({"t": "PING"}, b"")
    assert isinstance(got[1], ProtocolError) and "sequence 0, expected 1" in str(got[1])
    got = _exchange([({"t": "PING"}, b"")], first_seq=5)  # skips ahead: valid MAC, wrong seq
    assert isinstance(got[0], ProtocolError) and "sequence 5, expected 0" in str(got[0])


def test_a_peer_that_is_not_a_relay_is_refused():
    async def main():
        box = []

        async def handler(r, w):
            try:
                await protocol.accept(r, w, KEY)
            except Exception as e:
                box.append(e)
            w.close()

        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        _r, w = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        w.write(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 40)
        await w.drain()
        await asyncio.sleep(0.2)
        w.close()
        server.close()
        return box

    box = asyncio.run(main())
    assert isinstance(box[0], ProtocolError) and "not a deltarefit relay" in str(box[0])


def test_an_unauthenticated_peer_cannot_make_a_relay_buffer_a_large_frame():
    """Before its first frame verified, a peer may declare at most a small frame: one declaring the
    largest frame is refused from its 16-byte prefix, before a byte of the body is read."""

    async def main():
        box = []

        async def handler(r, w):
            try:
                ch = await protocol.accept(r, w, KEY)
                box.append(await ch.recv(5))
            except Exception as e:  # the test inspects it
                box.append(e)
            w.close()

        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        r, w = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        w.write(protocol.MAGIC + os.urandom(32) + protocol._PREFIX.pack(0, protocol.MAX_HEADER, protocol.MAX_PAYLOAD))
        await w.drain()
        await r.readexactly(40)
        for _ in range(100):  # the server answers without waiting for the body (which never comes)
            if box:
                break
            await asyncio.sleep(0.05)
        w.close()
        server.close()
        return box

    box = asyncio.run(main())
    assert isinstance(box[0], ProtocolError) and "before authenticating" in str(box[0]), box


def test_unauthenticated_connections_are_capped_and_cost_little(tmp_path):
    """40 connections to a root that never authenticate, all open at once, each declaring the largest
    frame and flooding bytes: at most 32 are served a handshake (the rest are answered BUSY), none is
    buffered, and the root's peak memory grows by little. A real node then joins as usual."""
    from deltarefit.apps.bench.hostile import relay_flood, start_root

    f = relay_flood(str(tmp_path), connections=40, seconds=2.0)
    grown = f["hwm_after"] - f["rss_before"]
    print(f"root RSS {f['rss_before'] >> 20} MiB -> peak {f['hwm_after'] >> 20} MiB; {f['hello']} handshakes, "
          f"{f['busy']} BUSY")
    assert f["hello"] <= 32 and f["busy"] >= 8 and f["hello"] + f["busy"] == 40
    assert grown < 128 << 20  # generous: 40 such peers cost ~700 MiB without the bounds
    assert count_in(str(tmp_path / "root.log"), "refused as busy")
    # The root still serves: a node joins it (the stream is empty: it attaches and waits).
    os.makedirs(tmp_path / "again")
    p, root = start_root(str(tmp_path / "again"))
    node_log = str(tmp_path / "node.log")
    node = start(["node", str(tmp_path / "ck.safetensors"), "--join", root, "--listen", "127.0.0.1:0",
                  "--key", str(tmp_path / "again" / "relay.key"), "--id", "n"], node_log)
    try:
        _wait(lambda: count_in(node_log, "attached to"), "the node to attach")
    finally:
        stop([node, p])


def test_a_node_with_the_wrong_key_is_told_and_stops(tmp_path):
    """The root answers a frame that fails its MAC with AUTH_FAILED; the node logs that authentication
    failed and, after a few tries, exits 10 with one line."""
    from deltarefit.apps.bench.hostile import start_root

    p, root = start_root(str(tmp_path))
    bad = str(tmp_path / "bad.key")
    protocol.write_key(bad)
    log = str(tmp_path / "node.log")
    node = start(["node", str(tmp_path / "ck.safetensors"), "--join", root, "--listen", "127.0.0.1:0",
                  "--key", bad, "--id", "n"], log)
    try:
        try:
            rc = node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            rc = None
        text = open(log).read()
        assert rc == 10, text[-2000:]
        assert text.count("authentication failed, the relays' keys differ") == 3
        last = text.strip().splitlines()[-1]
        assert last.startswith("deltarefit: error: relay n: authentication failed 3 times in a row"), last
        assert count_in(str(tmp_path / "root.log"), "failed authentication") == 3
    finally:
        stop([node, p])


def test_short_key_is_a_usage_error(tmp_path):
    short = tmp_path / "short.key"
    short.write_bytes(b"x" * 10)
    r = run("relay", "node", str(tmp_path / "m.safetensors"), "--join", "127.0.0.1:1", "--listen",
            "127.0.0.1:0", "--key", str(short))
    assert r.returncode == 2 and "at least 32 bytes" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    k = tmp_path / "relay.key"
    assert run("relay", "keygen", str(k)).returncode == 0
    assert len(k.read_bytes()) == 64 and (k.stat().st_mode & 0o777) == 0o600
    assert run("relay", "keygen", str(k)).returncode == 2  # never overwrites a key


# ------------------------------------------------------------------------------------------ the mirror


def _record(v: int, data: bytes, parent: str | None) -> bytes:
    import blake3

    from deltarefit.stream.records import CommitRecord, Part
    part = Part(f"v/{v:012d}/a/delta", len(data), blake3.blake3(data).hexdigest())
    if parent is None:
        return CommitRecord(v, None, f"fp{v}", "keyframe", None, [("model.safetensors", part)]).to_bytes()
    return CommitRecord(v, parent, f"fp{v}", "delta", part).to_bytes()


def test_mirror_takes_bytes_only_in_order_checks_them_and_commits_in_version_order(tmp_path):
    from deltarefit.relay.mirror import Mirror
    from deltarefit.stream.records import list_versions

    a, b = os.urandom(3000), os.urandom(2000)

    async def main():
        m = Mirror(str(tmp_path / "m"))
        ka, kb = f"v/{1:012d}/a/delta", f"v/{2:012d}/a/delta"
        m.add_version(1, _record(1, a, None), [ka])
        m.add_version(2, _record(2, b, "fp1"), [kb])
        await m.write(kb, 0, b)  # version 2 is whole first: it must wait for version 1
        assert m.commit_ready() == [] and list_versions(m.store) == []
        with pytest.raises(ProtocolError):
            await m.write(ka, 100, a[100:200])  # a gap: refused
        await m.write(ka, 0, a[:1000])
        with pytest.raises(ProtocolError):
            await m.write(ka, 500, a[500:1500])  # an overlap (bytes applied twice): refused
        epoch = m.parts[ka].epoch
        with pytest.raises(ProtocolError, match="do not match"):
            await m.write(ka, 1000, a[1000:2999] + b"x")  # the last byte is wrong: all of it discarded
        assert m.parts[ka].have == 0 and m.parts[ka].epoch == epoch + 1 and not m.parts[ka].done
        await m.write(ka, 0, a[:1000])
        m.close()
        # A restart resumes from the bytes on disk, then the rest arrives.
        m2 = Mirror(str(tmp_path / "m"))
        assert m2.offsets() == {ka: 1000, kb: 2000}
        m2.add_version(1, _record(1, a, None), [ka])
        m2.add_version(2, _record(2, b, "fp1"), [kb])
        await m2.write(ka, 1000, a[1000:])
        assert m2.commit_ready() == [1, 2] and list_versions(m2.store) == [1, 2]
        assert m2.store.get(ka) == a and m2.store.get(kb) == b
        m2.close()

    asyncio.run(main())


# ------------------------------------------------------------------------------------------ trees of processes


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> list[str]:
    """Six 1 MiB bf16 checkpoints, each 3% of elements one ulp away from the one before (synthetic:
    no torch needed, and quick)."""
    d = tmp_path_factory.mktemp("relay_chain")
    paths = [str(d / f"step_{i:03d}.safetensors") for i in range(6)]
    write_checkpoint(paths[0], 1)
    for i in range(1, 6):
        write_checkpoint(paths[i], 1, seed=i, mutate_from=paths[i - 1], fraction=0.03)
    return paths


def _wait(pred, what: str, timeout: float = DEADLINE, procs=()) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _wait_exit(procs: dict[str, subprocess.Popen], logs: dict[str, str], timeout: float = DEADLINE) -> None:
    end = time.monotonic() + timeout
    for name, p in procs.items():
        try:
            rc = p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 0, f"{name} exited {rc}; log:\n" + open(logs[name], errors="replace").read()[-3000:]


def _fingerprint_ok(ck: str, store: LocalStore, v: int) -> None:
    assert deltarefit.fingerprint(ck) == load_commit(store, v).fingerprint, ck
    assert Subscriber(store, ck).current() == (v, load_commit(store, v).fingerprint)


def _tree(tmp_path, names: list[str]) -> tuple[str, LocalStore, Publisher, dict, dict]:
    store_dir = str(tmp_path / "store")
    store = LocalStore(store_dir)
    logs = {n: str(tmp_path / f"{n}.log") for n in ["root", *names]}
    cks = {n: str(tmp_path / n / "model.safetensors") for n in names}
    for ck in cks.values():
        os.makedirs(os.path.dirname(ck))
    # Keyframes at versions 1, 3 and 6 (every 3rd, and the first).
    return store_dir, store, Publisher(store, str(tmp_path / "pub"), keyframe_every=3, keyframe_ratio=1000.0), \
        logs, cks


def test_the_root_streams_parts_from_the_origin_in_order(tmp_path, monkeypatch):
    """Cut-through from the store on: the root reads a part by ranges and writes each into its mirror
    as it arrives (children's feeders forward bytes before the part is whole); the whole part's BLAKE3
    is checked at its end, and a part changed in the store is discarded, never committed."""
    from deltarefit.relay import origin as origin_mod
    from deltarefit.relay.mirror import Mirror

    monkeypatch.setattr(origin_mod, "ORIGIN_READ_BYTES", 256 << 10)
    write_checkpoint(str(tmp_path / "c.safetensors"), 3)
    store = LocalStore(str(tmp_path / "store"))
    Publisher(store, str(tmp_path / "pub")).publish(str(tmp_path / "c.safetensors"))
    rec = load_commit(store, 1)
    key = rec.keyframe[0][1].key
    size = rec.keyframe[0][1].bytes

    class Root(origin_mod.OriginMixin):
        def __init__(self, origin, mirror_dir):
            self.origin, self.mirror, self.id = origin, Mirror(mirror_dir), "root"
            self._fetch_lock = asyncio.Lock()

    class Recording:
        def __init__(self, inner, root):
            self.inner, self.root, self.url, self.held = inner, root, inner.url, []

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def get_range(self, k, start, length):
            if k in self.root.mirror.parts:  # a part (records are read by ranges too, capped)
                self.held.append(self.root.mirror.parts[k].have)  # what the mirror held when this read began
            return self.inner.get_range(k, start, length)

    async def go(root):
        vs = await root._origin_version(1)
        await root._fetch_parts([vs])
        return vs

    root = Root(store, str(tmp_path / "mirror"))
    root.origin = rec_store = Recording(store, root)
    asyncio.run(go(root))
    assert len(rec_store.held) == -(-size // (256 << 10)) >= 10
    assert any(0 < h < size for h in rec_store.held)  # later reads started while earlier bytes sat in the mirror
    m = Mirror(str(tmp_path / "mirror"))  # reopened: committed, the part whole and equal to the origin's
    assert m.committed_top() == 1
    with open(m.parts[key].final, "rb") as a, open(store.path_of(key), "rb") as b:
        assert a.read() == b.read()
    # The same part changed in the store after its record: streamed, found wrong at its end, discarded.
    with open(store.path_of(key), "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 1]))
    bad = Root(store, str(tmp_path / "mirror2"))
    with pytest.raises(ProtocolError, match="do not match"):
        asyncio.run(go(bad))
    assert bad.mirror.committed_top() == 0 and not bad.mirror.parts[key].done


def test_a_tree_carries_the_stream_bit_exact(tmp_path, chain):
    """Root + 5 nodes at fan-out 2 over versions 1-3 (keyframes at 1 and 3): the node holding version 1
    joins first and gets the chain (the root fetches version 2 for it), the four empty ones start at
    the newest keyframe; versions 4-5 are published while the tree runs; a client with the wrong key is
    refused meanwhile and changes nothing."""
    names = [f"n{i}" for i in range(6)]
    store_dir, store, pub, logs, cks = _tree(tmp_path, names)
    for v in (1, 2, 3):
        pub.publish(chain[v], step=v)
    key, bad_key = str(tmp_path / "relay.key"), str(tmp_path / "bad.key")
    protocol.write_key(key)
    protocol.write_key(bad_key)
    Subscriber(store, cks["n4"]).sync(to_version=1)  # n4 holds version 1 already

    def node(i: int, k: str = key) -> subprocess.Popen:
        return start(["node", cks[names[i]], "--join", root, "--listen", "127.0.0.1:0", "--key", k,
                      "--fanout", "2", "--id", names[i], "--until-version", "5"], logs[names[i]])

    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["root"] = start(["root", store_dir, "--listen", "127.0.0.1:0", "--key", key, "--fanout", "2",
                               "--mirror", str(tmp_path / "root-mirror"), "--poll", "0.1"], logs["root"])
        root = listening(logs["root"], procs["root"])
        procs["n4"] = node(4)
        _wait(lambda: count_in(logs["n4"], "attached to"), "n4 to attach")
        for i in (0, 1, 2, 3):
            procs[names[i]] = node(i)
        procs["n5"] = node(5, bad_key)
        _wait(lambda: count_in(logs["root"], "failed authentication") > 0, "the root to refuse the bad key")
        _wait(lambda: all(count_in(logs[f"n{i}"], "attached to") for i in range(5)), "the tree to form")
        for v in (4, 5):
            pub.publish(chain[v], step=v)
        good = {n: p for n, p in procs.items() if n not in ("root", "n5")}
        _wait_exit(good, logs)
        for i in range(5):
            _fingerprint_ok(cks[f"n{i}"], store, 5)
        assert count_in(logs["n4"], "from version 2") and not count_in(logs["n4"], "via keyframe")
        for i in range(4):  # the empty ones: from the newest keyframe
            assert count_in(logs[f"n{i}"], "from version 3") and count_in(logs[f"n{i}"], "0 -> 3 via keyframe")
        assert count_in(logs["n5"], "attached to") == 0 and not os.path.exists(cks["n5"])
        # The wrong key: told so by the root, it stops after a few tries with one line and exit code 10.
        assert procs["n5"].wait(timeout=DEADLINE) == 10 and count_in(logs["n5"], "joining") >= 2
        assert count_in(logs["n5"], "authentication failed, the relays' keys differ") == 3
        assert "authentication failed 3 times in a row" in open(logs["n5"]).read().strip().splitlines()[-1]
        # Fan-out 2: two nodes below the root, the other three below them.
        assert sum(count_in(logs[f"n{i}"], f"attached to {root}") > 0 for i in range(5)) == 2
    finally:
        stop(list(procs.values()))


def test_a_node_whose_chain_is_gone_restarts_from_a_keyframe(tmp_path, chain):
    """Fan-out 1 (a line): A starts empty at the newest keyframe (3); B holds version 1 and is placed
    below A, which has no version 2 to offer: B gets keyframe 3 and reinstalls its checkpoint from it.
    C holds version 1 without a version record (so it says it holds nothing): the same."""
    names = ["a", "b", "c"]
    store_dir, store, pub, logs, cks = _tree(tmp_path, names)
    for v in (1, 2, 3):
        pub.publish(chain[v], step=v)
    key = str(tmp_path / "relay.key")
    protocol.write_key(key)
    Subscriber(store, cks["b"]).sync(to_version=1)
    Subscriber(store, cks["c"]).sync(to_version=1)
    os.unlink(cks["c"] + ".deltarefit-version.json")
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["root"] = start(["root", store_dir, "--listen", "127.0.0.1:0", "--key", key, "--fanout", "1",
                               "--mirror", str(tmp_path / "root-mirror"), "--poll", "0.1"], logs["root"])
        root = listening(logs["root"], procs["root"])
        for n in names:
            procs[n] = start(["node", cks[n], "--join", root, "--listen", "127.0.0.1:0", "--key", key,
                              "--fanout", "1", "--id", n, "--until-version", "4"], logs[n])
            _wait(lambda n=n: count_in(logs[n], "attached to"), f"{n} to attach")
        pub.publish(chain[4], step=4)
        _wait_exit({n: procs[n] for n in names}, logs)
        for n in names:
            _fingerprint_ok(cks[n], store, 4)
        assert count_in(logs["b"], f"attached to {listening(logs['a'])}, from version 3")
        assert count_in(logs["c"], f"attached to {listening(logs['b'])}, from version 3")
        for n in ("b", "c"):
            assert count_in(logs[n], "installing the mirror's keyframe instead")
            assert not os.path.exists(cks[n] + ".relay-old")
    finally:
        stop(list(procs.values()))


def _partial_bytes(mirror: str) -> int:
    n = 0
    for d, _, files in os.walk(mirror):
        for f in files:
            if f.endswith(".partial"):
                n += os.path.getsize(os.path.join(d, f))
    return n


def test_a_killed_middle_node_is_routed_around_and_resumes(tmp_path):
    """A node with children is SIGKILLed mid-part: its children reattach elsewhere and resume from the
    bytes they hold; restarted, it resumes too; everyone ends bit-exact at the head."""
    store_dir, key = str(tmp_path / "store"), str(tmp_path / "relay.key")
    protocol.write_key(key)
    store = LocalStore(store_dir)
    pub = Publisher(store, str(tmp_path / "pub"), keyframe_ratio=1000.0)
    v1, v2 = str(tmp_path / "v1.safetensors"), str(tmp_path / "v2.safetensors")
    write_checkpoint(v1, 6)  # a 6 MiB keyframe at 3 MB/s per link: about 2 s per hop
    write_checkpoint(v2, 6, seed=1, mutate_from=v1, fraction=0.02)
    rate = "24Mbit"
    names = [f"n{i}" for i in range(5)]
    logs = {n: str(tmp_path / f"{n}.log") for n in ["root", *names]}
    cks = {n: str(tmp_path / n / "model.safetensors") for n in names}

    def node(i: int) -> subprocess.Popen:
        n = names[i]
        os.makedirs(os.path.dirname(cks[n]), exist_ok=True)
        return start(["node", cks[n], "--join", root, "--listen", "127.0.0.1:0", "--key", key,
                      "--fanout", "2", "--rate", rate, "--id", n, "--until-version", "2"], logs[n])

    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["root"] = start(["root", store_dir, "--listen", "127.0.0.1:0", "--key", key, "--fanout", "2",
                               "--rate", rate, "--mirror", str(tmp_path / "root-mirror"), "--poll", "0.1"], logs["root"])
        root = listening(logs["root"], procs["root"])
        for i in (0, 1):  # the root's two children first, then three more below them
            procs[names[i]] = node(i)
        _wait(lambda: all(count_in(logs[n], "attached to") for n in names[:2]), "the first level")
        for i in (2, 3, 4):
            procs[names[i]] = node(i)
        _wait(lambda: all(count_in(logs[n], "attached to") for n in names), "the tree to form")
        middle = next(n for n in names[:2] if count_in(logs[n], "attached, held"))
        pub.publish(v1, step=1)
        mirror = cks[middle] + ".relay-mirror"
        _wait(lambda: _partial_bytes(mirror) > (1 << 20), "the middle node to be mid-part")
        procs[middle].send_signal(signal.SIGKILL)
        procs[middle].wait(timeout=10)
        held = _partial_bytes(mirror)
        assert 0 < held < os.path.getsize(v1) and not os.path.exists(os.path.join(mirror, "v", f"{1:012d}",
                                                                                    "commit.json"))
        orphans = re.findall(r"child (n\d) \(", open(logs[middle]).read())
        assert orphans, "the killed node had children"
        # Its children notice and attach elsewhere, keeping the bytes they hold.
        _wait(lambda: all(count_in(logs[o], "lost parent") for o in orphans), "the orphans to notice")
        procs[middle] = node(names.index(middle))  # restarted with its mirror: resumes from its offsets
        pub.publish(v2, step=2)
        _wait_exit({n: procs[n] for n in names}, logs, timeout=90)
        for n in names:
            _fingerprint_ok(cks[n], store, 2)
        held_at_attach = [int(b) for b in re.findall(r"holding (\d+) bytes", open(logs[middle]).read())]
        assert held_at_attach[0] == 0 and held_at_attach[-1] >= held  # restarted: resumed, not refetched
        for o in orphans:
            assert count_in(logs[o], "attached to") >= 2
    finally:
        stop(list(procs.values()))
        with contextlib.suppress(Exception):
            for n, p in logs.items():
                if os.path.exists(p):
                    print(f"--- {n}\n" + open(p, errors="replace").read()[-1500:])


def test_a_stalled_child_does_not_hold_back_its_sibling(tmp_path):
    """Two children of the root; one is SIGSTOPped (it reads nothing, its socket buffers fill up) while
    a 12 MiB version goes out, more than loopback buffers hold: the other still gets it at full speed;
    resumed, the stalled one finishes."""
    names = ["fast", "stalled"]
    store_dir, store, pub, logs, cks = _tree(tmp_path, names)
    v1 = str(tmp_path / "v1.safetensors")
    write_checkpoint(v1, 12)
    key = str(tmp_path / "relay.key")
    protocol.write_key(key)
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["root"] = start(["root", store_dir, "--listen", "127.0.0.1:0", "--key", key, "--fanout", "2",
                               "--rate", "200Mbit", "--mirror", str(tmp_path / "root-mirror"), "--poll", "0.1"],
                              logs["root"])
        root = listening(logs["root"], procs["root"])
        for n in names:
            procs[n] = start(["node", cks[n], "--join", root, "--listen", "127.0.0.1:0", "--key", key,
                              "--id", n, "--until-version", "1"], logs[n])
        _wait(lambda: all(count_in(logs[n], "attached to") for n in names), "both to attach")
        procs["stalled"].send_signal(signal.SIGSTOP)
        try:
            pub.publish(v1, step=1)
            _wait_exit({"fast": procs["fast"]}, logs, timeout=30)
            assert not os.path.exists(cks["stalled"])
        finally:
            procs["stalled"].send_signal(signal.SIGCONT)
        _wait_exit({"stalled": procs["stalled"]}, logs)
        for n in names:
            _fingerprint_ok(cks[n], store, 1)
    finally:
        stop(list(procs.values()))


def test_a_parent_serving_rotten_bytes_is_routed_around(tmp_path):
    """A (the root's only slot at fan-out 1) holds version 1, then its mirror's copy rots on disk. B,
    redirected below A, gets parts whose BLAKE3 is wrong: after 3 it avoids A, names it in its log, and
    joins the root over its fan-out, from where it finishes bit-exact."""
    names = ["a", "b"]
    store_dir, store, pub, logs, cks = _tree(tmp_path, names)
    v1 = str(tmp_path / "v1.safetensors")
    write_checkpoint(v1, 1)
    pub.publish(v1, step=1)
    key = str(tmp_path / "relay.key")
    protocol.write_key(key)
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["root"] = start(["root", store_dir, "--listen", "127.0.0.1:0", "--key", key, "--fanout", "1",
                               "--mirror", str(tmp_path / "root-mirror"), "--poll", "0.1"], logs["root"])
        root = listening(logs["root"], procs["root"])
        procs["a"] = start(["node", cks["a"], "--join", root, "--listen", "127.0.0.1:0", "--key", key,
                            "--id", "a"], logs["a"])  # serves until stopped
        _wait(lambda: count_in(logs["a"], "checkpoint 0 -> 1"), "a to install version 1")
        a_addr = listening(logs["a"])
        part = load_commit(store, 1).keyframe[0][1].key
        with open(os.path.join(cks["a"] + ".relay-mirror", part), "r+b") as f:  # rot, after its check
            f.seek(1 << 19)
            byte = f.read(1)
            f.seek(1 << 19)
            f.write(bytes([byte[0] ^ 0x40]))
        procs["b"] = start(["node", cks["b"], "--join", root, "--listen", "127.0.0.1:0", "--key", key,
                            "--id", "b", "--until-version", "1"], logs["b"])
        _wait_exit({"b": procs["b"]}, logs)
        _fingerprint_ok(cks["b"], store, 1)
        text = open(logs["b"]).read()
        assert text.count("do not match the record's BLAKE3") == 3  # bounded: then it went elsewhere
        assert f"parent {a_addr} sent 3 parts whose bytes do not match their records" in text
        assert re.findall(r"attached to (\S+),", text) == [a_addr] * 3 + [root]  # below A thrice, then the root
    finally:
        stop(list(procs.values()))
