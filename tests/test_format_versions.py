"""Format versions 1 and 2 through everything that writes, reads and ships deltas (FORMAT.md, "Versions"):
the CLI's encode writes version 2 by default and ``--format-version 1`` today's bytes (a golden vector's),
readers refuse any other version in one line, a version 1 delta may not hold encodings 6 and 7, a stream
switched between the two formats is followed to its head, and sharded parts carry their own version."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _pairs import fix_header_hash, write_pair
from _vectors import VECTORS_DIR, checkpoints

import deltarefit
from deltarefit import format as fmt
from deltarefit.errors import FormatError, UnsupportedVersionError, UsageError
from deltarefit.integrity import seg_hash

ENV = dict(os.environ, DELTAREFIT_NO_PROGRESS="1",
           PYTHONPATH=os.pathsep.join([str(Path(deltarefit.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
READS = "this build reads format versions 1 and 2"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltarefit", *args], capture_output=True, text=True, env=ENV,
                          timeout=300, check=False)


def header_version(path: str | os.PathLike[str]) -> int:
    return fmt.HEADER.unpack(Path(path).read_bytes()[:fmt.HEADER_SIZE])[1]


def with_version(data: bytes, version: int) -> bytes:
    """The delta with its header's version replaced and its header hash recomputed."""
    return fix_header_hash(data[:8] + struct.pack("<H", version) + data[10:])


def with_record(data: bytes, k: int, encoding: int) -> bytes:
    """The delta with record ``k``'s encoding replaced and its index and header hashes recomputed."""
    h = list(fmt.HEADER.unpack(data[:fmt.HEADER_SIZE]))
    man_off, man_len, tab_off, tab_len = h[6], h[7], h[8], h[9]
    out = bytearray(data)
    out[tab_off + k * fmt.RECORD_SIZE + 8] = encoding
    h[10] = seg_hash(bytes(out[man_off:man_off + man_len + tab_len]))
    head = fmt.HEADER.pack(*h)
    return fix_header_hash(head + bytes(out[fmt.HEADER_SIZE:]))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("pair"), n_tensors=2, shape=(256, 512))


def test_the_cli_encodes_version_2_by_default_and_it_applies_bit_exact(pair, tmp_path):
    base, target = pair
    delta = str(tmp_path / "d.delta")
    r = cli("encode", base, target, "-o", delta, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["format_version"] == 2 and header_version(delta) == 2
    with fmt.DeltaReader(delta) as d:
        assert d.version == 2 and d.manifest["version"] == 2
    ck = str(tmp_path / "ck.safetensors")
    Path(ck).write_bytes(Path(base).read_bytes())
    r = cli("apply", delta, ck)
    assert r.returncode == 0, r.stderr
    assert deltarefit.fingerprint(ck) == deltarefit.fingerprint(target) == out["target_fingerprint"]
    r = cli("inspect", delta)
    assert r.returncode == 0 and "format version 2; chunks per encoding: " in r.stdout, r.stdout
    info = json.loads(cli("inspect", delta, "--json").stdout)
    assert info["format_version"] == 2 and sum(info["encodings"].values()) == len(fmt.DeltaReader(delta).records)
    assert info["encodings"].get("ulp2", 0) > 0, info["encodings"]  # real ulp2 chunks, applied above


@pytest.mark.parametrize("name", ["ulp_floats", "ulp_ints"])
def test_format_version_1_writes_the_golden_vectors_bytes(name, tmp_path):
    base, target = checkpoints(name, tmp_path)
    delta = tmp_path / "v1.delta"
    r = cli("encode", base, target, "-o", str(delta), "--format-version", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert delta.read_bytes() == (VECTORS_DIR / name / "delta.drd").read_bytes()
    assert header_version(delta) == 1


def test_a_delta_of_version_3_is_refused_in_one_line_naming_both(pair, tmp_path):
    base, target = pair
    good = tmp_path / "good.delta"
    deltarefit.encode(base, target, str(good))
    bad = tmp_path / "v3.delta"
    bad.write_bytes(with_version(good.read_bytes(), 3))
    want = f"{bad}: format version 3 is not supported; {READS}"
    with pytest.raises(UnsupportedVersionError) as e:
        fmt.DeltaReader(str(bad))
    assert str(e.value) == want
    ck = tmp_path / "ck.safetensors"
    ck.write_bytes(Path(base).read_bytes())
    r = cli("apply", str(bad), str(ck))
    assert r.returncode == 3, r.stderr  # FormatError's exit code (docs/COMMAND-LINE.md)
    assert r.stderr.strip().splitlines() == [f"deltarefit: error: {want}"], r.stderr
    with pytest.raises(UnsupportedVersionError, match=re.escape(want)):
        deltarefit.inspect(str(bad))
    assert ck.read_bytes() == Path(base).read_bytes()  # nothing written


def test_a_version_1_delta_with_an_encoding_7_record_is_refused(pair, tmp_path):
    base, target = pair
    v1 = tmp_path / "v1.delta"
    deltarefit.encode(base, target, str(v1), format_version=1)
    bad = tmp_path / "bad.delta"
    bad.write_bytes(with_record(v1.read_bytes(), 0, 7))
    with pytest.raises(FormatError, match=r"encoding 7 is not one of a format version 1 delta's \(1, 2, 3, 4, 5\)"):
        fmt.DeltaReader(str(bad))
    # A header that says 2 over a manifest that says 1: the two versions of one delta disagree.
    mixed = tmp_path / "mixed.delta"
    mixed.write_bytes(with_version(v1.read_bytes(), 2))
    with pytest.raises(FormatError, match="manifest says version 1, the header 2"):
        fmt.DeltaReader(str(mixed))


def test_a_writer_refuses_an_encoding_6_chunk_in_a_version_1_delta(tmp_path):
    w = fmt.DeltaWriter(str(tmp_path / "x.delta"))
    w.add_chunk(0, 0, 6, 1, b"\0" * 8, 0, bytes(16), bytes(16))
    with pytest.raises(FormatError, match="encoding 6 is not one of a format version 1 delta's"):
        w.finish({"format": "deltarefit.delta", "version": 1, "tensors": []})
    w.abort()
    assert os.listdir(tmp_path) == []


def test_encode_refuses_a_format_version_it_does_not_write(pair, tmp_path):
    with pytest.raises(UsageError, match=f"format_version: format version 3 is not supported; {READS}"):
        deltarefit.encode(*pair, str(tmp_path / "x.delta"), format_version=3)
    r = cli("encode", *pair, "-o", str(tmp_path / "y.delta"), "--format-version", "3")
    assert r.returncode == 2 and "--format-version" in r.stderr
    assert os.listdir(tmp_path) == []


def test_compose_writes_the_version_asked(pair, tmp_path):
    from deltarefit.compose import compose

    base, target = pair
    d = tmp_path / "d.delta"
    deltarefit.encode(base, target, str(d), format_version=1)
    c1 = tmp_path / "c1.delta"
    r = cli("compose", str(d), "--base", base, "-o", str(c1), "--format-version", "1")
    assert r.returncode == 0, r.stderr
    compose([str(d)], str(tmp_path / "c2.delta"), base=base)
    assert header_version(c1) == 1 and header_version(tmp_path / "c2.delta") == 2
    with fmt.DeltaReader(str(c1)) as a, fmt.DeltaReader(str(d)) as b:  # one v1 delta composed: its chunks
        assert a.records == b.records and a.payload_len == b.payload_len


# ------------------------------------------------------------------------------------------ streams


def _versions_in_store(store: str) -> dict[int, int]:
    """{version: its delta's header format version} of a local store."""
    from deltarefit.storage.base import open_store
    from deltarefit.stream.records import head, load_commit

    st = open_store(store)
    recs = [load_commit(st, v) for v in range(1, head(st) + 1)]
    return {r.version: header_version(os.path.join(store, r.delta.key)) for r in recs if r.delta is not None}


def test_a_stream_switched_between_formats_is_followed_to_its_head(tmp_path):
    """Published with format 1, then 2, then the setting left out (remembered: 2), then 1 again, then 2
    through the CLI; a subscriber joining at the keyframe follows every delta, each verified."""
    from _pairs import pair_tensors, write_tensors

    from deltarefit.stream.publisher import Publisher
    from deltarefit.stream.subscriber import Subscriber

    base, _ = pair_tensors(n_tensors=1, shape=(128, 256), seed=3)
    ckpts = []
    cur = base
    for i in range(6):
        if i:
            _, cur = pair_tensors(n_tensors=1, shape=(128, 256), seed=3, change=0.02 * i)
        ckpts.append(write_tensors(tmp_path / f"s{i}.safetensors", cur))
    store, state = str(tmp_path / "store"), str(tmp_path / "state")
    asked = [None, 1, 2, None, 1]
    for ck, fv in zip(ckpts[:5], asked, strict=True):
        Publisher(store, state, keyframe_every=100, keyframe_ratio=100.0, format_version=fv).publish(ck)
    r = cli("publish", store, ckpts[5], "--state", state, "--keyframe-every", "100", "--keyframe-ratio", "100",
            "--format-version", "2", "--quiet")
    assert r.returncode == 0, r.stderr
    assert _versions_in_store(store) == {2: 1, 3: 2, 4: 2, 5: 1, 6: 2}
    sub = Subscriber(store, str(tmp_path / "sub.safetensors"), subscriber_id="s")
    rep = sub.sync()
    assert rep.version == 6
    assert deltarefit.fingerprint(str(tmp_path / "sub.safetensors")) == deltarefit.fingerprint(ckpts[5])


def test_a_history_stream_switched_between_formats_codes_with_5_or_7_and_is_followed(tmp_path):
    """With history, a format 2 delta's chunks coded against the book are ``ulp2_hist`` (7), a format 1
    delta's ``ulp_hist`` (5): the book (moves, taken from the patches) is the same for both, so a stream
    switched 2, 1, 2 is followed by a subscriber with its book, version by version, bit-exact."""
    from _chains import encodings, write_chain
    from _pairs import sha

    from deltarefit.stream.publisher import Publisher
    from deltarefit.stream.subscriber import Subscriber

    chain = write_chain(str(tmp_path / "chain"), 4, n=(1 << 19) + 3000, seed=11, rate=0.05, prefix="c")
    store = str(tmp_path / "store")
    ck = str(tmp_path / "sub.safetensors")
    sub = Subscriber(store, ck, subscriber_id="s")
    got = {}
    for v, (p, fv) in enumerate(zip(chain, (2, 2, 2, 1, 2), strict=True), 1):
        rec = Publisher(store, str(tmp_path / "pub"), keyframe_every=1000, keyframe_ratio=1000.0, history=True,
                        format_version=fv).publish(p)
        rep = sub.sync()
        assert rep.version == v and sha(ck) == sha(p) and rep.route == ("keyframe" if v == 1 else "chain")
        if rec.delta is not None:
            got[v] = encodings(os.path.join(store, rec.delta.key))
    assert got[3].get(7, 0) > 0, got  # from the second delta after the keyframe on
    assert got[4].get(5, 0) > 0 and not {6, 7} & set(got[4]), got
    assert got[5].get(7, 0) > 0 and got[5].get(6, 0) + got[2].get(6, 0) > 0, got


def test_a_stream_published_before_format_versions_stays_at_version_1(tmp_path):
    from _pairs import pair_tensors, write_tensors

    from deltarefit.stream.publish_state import FORMAT_NAME
    from deltarefit.stream.publisher import Publisher

    a, b = pair_tensors(n_tensors=1, shape=(64, 256), seed=4)
    store, state = str(tmp_path / "store"), str(tmp_path / "state")
    Publisher(store, state).publish(write_tensors(tmp_path / "a.safetensors", a))
    os.unlink(os.path.join(state, FORMAT_NAME))  # as a publisher of an earlier release left its state
    Publisher(store, state).publish(write_tensors(tmp_path / "b.safetensors", b))
    assert _versions_in_store(store) == {2: 1}
    with pytest.raises(UsageError, match="format_version 1, 2 or None"):
        Publisher(store, state, format_version=3)


# ------------------------------------------------------------------------------------------- shards


def test_sharded_parts_of_both_versions_round_trip_and_others_are_refused():
    from _shard_util import SHAPES, masters, step

    from deltarefit.shard.convert import to_bf16_bits
    from deltarefit.shard.names import identity_layout, local_from_full
    from deltarefit.shard.part import _PREFIX, MAGIC, join, read_part, write_part
    from deltarefit.shard.publish import ShardPublisher
    from deltarefit.shard.rollout import apply_version

    lay = identity_layout(SHAPES)
    full = masters(7)
    rng = np.random.default_rng(8)
    state = {n: np.zeros(lt.shape, np.uint16) for n, lt in lay.items()}
    pub = ShardPublisher(lay, "BF16")
    for v, fv in enumerate((2, 1, 2)):
        if v:
            step(full, rng)
        pub.format_version = fv
        blob = pub.publish(local_from_full(lay, full, np.float32), v)[0]
        part = read_part(blob)
        assert _PREFIX.unpack(blob[:_PREFIX.size])[1] == part.header["format_version"] == fv
        apply_version(join([part], [blob]), [blob], state, lay)
        pub.commit(blob)
        ref = {n: to_bf16_bits(a) for n, a in full.items()}
        for n in state:
            np.testing.assert_array_equal(state[n], ref[n], err_msg=f"version {v} ({fv}) {n}")
    hlen = _PREFIX.unpack(blob[:_PREFIX.size])[3]
    h = json.loads(blob[_PREFIX.size:_PREFIX.size + hlen])
    bad = _PREFIX.pack(MAGIC, 3, 0, hlen) + blob[_PREFIX.size:]
    with pytest.raises(UnsupportedVersionError) as e:
        read_part(bad, "rank 0 part")
    assert str(e.value) == f"rank 0 part: part format version 3 is not supported; {READS}"
    t0 = dict(h["tensors"][0], cells=[dict(h["tensors"][0]["cells"][0], chunks=[[0, 1, 7, 1, 0, 0, 0]])])
    with pytest.raises(FormatError, match=r"part: encoding 7 is not one of a format version 1 part's \(1, 2, 3, 4, 5\)"):
        write_part({"version": 3, "rank": 0, "world": 1, "keyframe": False, "tensors": [t0]}, b"", 1)
