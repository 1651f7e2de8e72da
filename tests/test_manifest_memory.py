"""Memory before trust: a delta file's manifest and chunk table cost a reader at most 32 MiB + 32 times
their size (FORMAT.md, "Memory before trust"), whatever they expand to. Each bomb of ``bench.bombs`` is a
real file, refused with a typed one-line error naming it, the checkpoint untouched; the peak of the
Python heap while it is read (tracemalloc: deterministic, not timed) stays within the bound. Before the
bound, a 73 KB file of one entry repeated took 485 MiB to refuse, 8-deep nests 672 MiB, tiny objects
894 MiB (``python -m deltarefit.apps.bench.bombs``)."""

from __future__ import annotations

import json
import os
import random
import shutil
import tracemalloc

import pytest
from _hostile import make_pair
from _pairs import leftovers, sha

import deltarefit
from deltarefit import format as fmt
from deltarefit.apps.bench.bombs import write_bomb
from deltarefit.apps.bench.hostile import measure
from deltarefit.errors import DeltaRefitError, FormatError, IntegrityError, LimitError
from deltarefit.integrity import SEGMENT_BYTES, fingerprint_from_digests
from deltarefit.io.jsonlimits import json_shape_problem, json_shape_problem_of_pieces

MIB = 1 << 20


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture
def ckpt(pair, tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    p = str(d / "model.safetensors")
    shutil.copyfile(pair["base"], p)
    return p


def traced(f):
    """(f's result or the DeltaRefitError it raised, the peak bytes of the Python heap while it ran)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        out = f()
    except DeltaRefitError as e:
        out = e
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return out, peak


def refused_by_apply(delta: str, ckpt: str, exc) -> DeltaRefitError:
    before = sha(ckpt)
    with pytest.raises(exc) as got:
        deltarefit.apply(delta, ckpt)
    assert sha(ckpt) == before and leftovers(ckpt) == []
    assert delta in str(got.value) and "\n" not in str(got.value)
    return got.value


# What each bomb is refused with (``unique`` is a valid delta: it reads, within its budget).
REFUSALS = {
    "same-entry": (FormatError, "listed twice"),
    "unique-digests": (IntegrityError, "fingerprint"),
    "long-string": (LimitError, "more than 262144 characters"),
    "deep": (LimitError, "more than 262144 characters"),
    "tiny-containers": (LimitError, "more than 262144 characters"),
    "many-keys": (IntegrityError, "fingerprint"),
}


@pytest.mark.parametrize("kind", sorted(REFUSALS))
def test_a_manifest_bomb_is_refused_in_bounded_memory(kind, ckpt, tmp_path):
    """A 16 KB bomb of each kind (expanding up to 16 MiB) is refused, typed and one line, nothing
    written, in under 8 MiB of Python heap (the bound for its size is 32.5 MiB; before it: 50-170 MiB
    of RSS for 14 KB)."""
    p = str(tmp_path / f"{kind}.delta")
    size, expanded = write_bomb(p, kind, 16 << 10)
    exc, pattern = REFUSALS[kind]
    err, peak = traced(lambda: fmt.DeltaReader(p))
    print(f"{kind}: {size} bytes expanding to {expanded}: peak {peak / MIB:.1f} MiB: {err}")
    assert isinstance(err, exc) and pattern in str(err), err
    assert peak < 8 * MIB
    refused_by_apply(p, ckpt, exc)


def _dense_manifest(n: int, prefix: str = "t") -> dict:
    """A manifest of ``n`` unchanged tensors named ``prefix`` and a number, sharing one digest."""
    digest = bytes(32)
    names = sorted(f"{prefix}{i:08d}" for i in range(n))
    fp = fingerprint_from_digests(dict.fromkeys(names, digest))
    meta = fmt.TensorMeta("U8", (1,), digest)
    return {"format": "deltarefit.delta", "version": fmt.VERSION, "segment_bytes": SEGMENT_BYTES,
            "hash": "blake3-128", "base_fingerprint": fp, "target_fingerprint": fp, "stats": {},
            "tensors": [fmt.TensorEntry(x, "same", meta, meta, 0, 0, 0).to_json() for x in names]}


def test_a_valid_dense_manifest_keeps_no_more_than_it_is_charged(tmp_path):
    """Distinct names sharing one digest (the densest real manifest, 1-3 bytes of file per tensor),
    written by the writer: it reads, and what the reader keeps (tracemalloc, after the load) is within
    what it charged, which is within the budget: the charges are an upper bound of the objects."""
    p = str(tmp_path / "dense.delta")
    w = fmt.DeltaWriter(p)
    size = w.finish(_dense_manifest(20000))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    r = fmt.DeltaReader(p)
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    print(f"{len(r.tensors)} tensors in {size} bytes: kept {kept}, charged {r.charged}")
    assert len(r.tensors) == 20000 and kept <= r.charged <= fmt.memory_budget(size)
    assert w.charged == r.charged  # the writer charged the same: it never writes what readers refuse
    r.close()


def test_writer_and_reader_charge_a_real_delta_alike(pair, monkeypatch):
    """A real encoded delta (patch, add, remove, replace and same entries, records, additive digests):
    the reader charges exactly what the writer did, records included."""
    d = str(pair["dir"] / "again.delta")
    seen = {}
    real_finish = fmt.DeltaWriter.finish

    def finish(self, manifest):
        size = real_finish(self, manifest)
        seen["charged"] = self.charged
        return size

    monkeypatch.setattr(fmt.DeltaWriter, "finish", finish)
    deltarefit.encode(pair["base"], pair["target"], d, sums=True)
    with fmt.DeltaReader(d) as r:
        assert r.records and "patch" in {e.op for e in r.tensors}
        assert seen["charged"] == r.charged > len(r.records) * fmt.layout.RECORD_COST


def test_past_its_budget_a_manifest_is_refused_and_never_written(ckpt, tmp_path):
    """20k tensors with names of 2000 characters (differing in their last digits) sharing one digest
    fit in ~100 KB of file, and would keep ~45 MiB, past the ~36 MiB that size allows: the writer
    refuses to write it (nothing left), and a reader refuses the same bytes, crafted, within the
    budget's memory."""
    man = _dense_manifest(20000, "x" * 1992)
    out = tmp_path / "w"
    out.mkdir()
    w = fmt.DeltaWriter(str(out / "dense.delta"))
    with pytest.raises(LimitError, match=r"need more than \d+ bytes of memory to read"):
        w.finish(man)
    w.abort()
    assert os.listdir(out) == []

    from deltarefit.apps.bench.hostile import write_delta_with_manifest

    text = json.dumps(man, separators=(",", ":"), sort_keys=True).encode()
    import zstandard

    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(text)
    p = str(tmp_path / "dense.delta")
    size = write_delta_with_manifest(p, frame)
    err, peak = traced(lambda: fmt.DeltaReader(p))
    print(f"{size} bytes, {len(text)} of text: peak {peak / MIB:.1f} MiB, budget "
          f"{fmt.memory_budget(len(frame)) / MIB:.1f} MiB: {err}")
    assert isinstance(err, LimitError) and "need more than" in str(err) and p in str(err)
    assert peak < fmt.memory_budget(len(frame)) + 8 * MIB
    refused_by_apply(p, ckpt, LimitError)


def test_inspect_refuses_a_bomb_in_one_line(tmp_path):
    p = str(tmp_path / "long.delta")
    write_bomb(p, "long-string", 16 << 10)
    r = measure(["inspect", p])
    assert r.rc == LimitError.exit_code and p in r.last_line and "more than 262144 characters" in r.last_line


def test_the_writer_refuses_an_entry_longer_than_a_reader_reads(tmp_path):
    man = _dense_manifest(3)
    man["tensors"][1]["name"] = "x" * (300 << 10)
    w = fmt.DeltaWriter(str(tmp_path / "long.delta"))
    with pytest.raises(LimitError, match="longer than 262144 characters"):
        w.finish(man)
    w.abort()
    assert os.listdir(tmp_path) == []


def test_a_manifest_of_unsorted_names_is_refused(tmp_path):
    """Tensors are listed in the order of their names' UTF-8 bytes (FORMAT.md): the reader checks it
    as it reads (so no set of names is built to find one listed twice)."""
    from deltarefit.apps.bench.hostile import write_delta_with_manifest

    man = _dense_manifest(3)
    man["tensors"][0], man["tensors"][1] = man["tensors"][1], man["tensors"][0]
    import zstandard

    frame = zstandard.ZstdCompressor(write_content_size=True).compress(json.dumps(man).encode())
    p = str(tmp_path / "unsorted.delta")
    write_delta_with_manifest(p, frame)
    with pytest.raises(FormatError, match="'t00000000' is listed after 't00000001'"):
        fmt.DeltaReader(p)


def test_shape_checks_of_pieces_agree_with_the_whole_text():
    """``json_shape_problem_of_pieces`` (the manifest's text as it is decompressed) says what
    ``json_shape_problem`` says of the whole, however the text is cut (escapes and strings included)."""
    rng = random.Random(7)
    alpha = b'[]{}"\\,a1 :'
    for _ in range(3000):
        raw = bytes(rng.choice(alpha) for _ in range(rng.randint(0, 300)))
        kw = {"max_depth": rng.randint(1, 6), "bytes_per_container": rng.choice([1, 4, 16]),
              "slack": rng.randint(0, 8), "arrays_of_numbers": rng.random() < 0.5}
        if kw["arrays_of_numbers"] and rng.random() < 0.5:
            kw["max_array_len"] = rng.randint(0, 5)
        if rng.random() < 0.5:
            kw["bytes_per_string"] = rng.choice([1, 4, 12])
        cuts = sorted(rng.randint(0, len(raw)) for _ in range(rng.randint(0, 6)))
        pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
        assert json_shape_problem_of_pieces(pieces, **kw) == json_shape_problem(raw, **kw), (raw, pieces, kw)


def test_the_zstd_window_is_bounded(pair, tmp_path):
    """A manifest frame may need a zstd window of 8 MiB (what level 19 uses; the writer's level 1 uses
    512 KiB), not more: the reader decompresses it piece by piece, and a larger window would be memory
    the file does not pay for. The same manifest, followed by 12 MiB of whitespace, reads with an
    8 MiB window and is refused, as not a valid frame, with a 16 MiB one (keys a reader does not know,
    here ``pad``, are parsed and dropped)."""
    import zstandard
    from _pairs import Delta

    d = Delta.parse(pair["data"])
    d.manifest["pad"] = os.urandom(1 << 15).hex()  # buys the expansion allowance for the whitespace
    raw = json.dumps(d.manifest, separators=(",", ":"), sort_keys=True).encode() + b" " * (12 << 20)
    for window_log, ok in ((23, True), (24, False)):
        params = zstandard.ZstdCompressionParameters.from_level(1, window_log=window_log, write_content_size=True)
        d.manifest_frame = zstandard.ZstdCompressor(compression_params=params).compress(raw)
        p = d.write(tmp_path / f"w{window_log}.delta")
        if ok:
            with fmt.DeltaReader(p) as r:
                assert len(r.tensors) == len(d.manifest["tensors"])
        else:
            with pytest.raises(FormatError, match="not a valid zstd frame"):
                fmt.DeltaReader(p)


# ------------------------------------------------------------------ other JSON read from untrusted bytes


def _nested_lists(n: int) -> bytes:
    return b"[" + b"[]," * n + b"[]]"


def test_a_shard_part_header_bomb_is_refused_before_parsing():
    """A part whose 6 MiB header is ``[[],[],...]`` (2M lists: json.loads would build ~130 MiB) is
    refused from its shape, a LimitError naming it, in about the header's own size."""
    from deltarefit.shard import part as sp

    header = b'{"format":"deltarefit.shard_part","format_version":1,"tensors":' + _nested_lists(2 << 20) + b"}"
    blob = sp._PREFIX.pack(sp.MAGIC, sp.FORMAT_VERSION, 0, len(header)) + header
    err, peak = traced(lambda: sp.read_part(blob, "part r0"))
    print(f"part header of {len(header)} bytes: peak {peak / MIB:.1f} MiB: {err}")
    assert isinstance(err, LimitError) and str(err).startswith("part r0: header holds")
    assert peak < len(blob) + 8 * MIB


def test_a_version_manifest_bomb_and_a_descriptor_bomb_are_refused_before_parsing(tmp_path):
    """A version manifest that matches its commit record's size and BLAKE3 (the record unsigned, so
    anyone could have written both) but is 6 MiB of nested lists, and a part descriptor likewise:
    each refused as malformed from its shape, without building the lists."""
    import blake3

    from deltarefit.errors import StreamError
    from deltarefit.shard.records import ShardCommit, _parse_descriptor, load_manifest
    from deltarefit.storage.local import LocalStore
    from deltarefit.stream.records import Part

    store = LocalStore(str(tmp_path / "store"))
    data = b'{"format":"deltarefit.shard_version","parts":' + _nested_lists(2 << 20) + b"}"
    key = "v/000000000001/0123456789abcdef/manifest.json"
    store.put(key, data)
    rec = ShardCommit(1, None, "00" * 32, True, 1, Part(key, len(data), blake3.blake3(data).hexdigest()), ())
    err, peak = traced(lambda: load_manifest(store, rec))
    print(f"version manifest of {len(data)} bytes: peak {peak / MIB:.1f} MiB: {err}")
    assert isinstance(err, StreamError) and "malformed manifest (byte 0: expected" in str(err) and key in str(err)
    assert peak < 2 * len(data) + 8 * MIB
    err, peak = traced(lambda: _parse_descriptor(data, "d.head.json"))
    assert isinstance(err, StreamError) and "malformed part descriptor (holds" in str(err)
    assert peak < len(data) + 8 * MIB


def test_short_strings_and_keys_are_refused_by_their_count_before_parsing():
    """Regression (issue 46 item 7): a 15 MiB commit record of 1.5 M short keys peaked at +272 MB before its
    signature was checked, and a part header of short strings at about 11x its size: the shape pass
    now bounds strings (keys included) per byte, and such text is refused in about its own size."""
    from deltarefit.errors import MalformedRecordError
    from deltarefit.shard import part as sp
    from deltarefit.stream.records import record_json

    digits = b"0123456789abcdefghijklmnopqrstuvwxyz"

    def name(i: int) -> bytes:  # 5 base-36 digits: 1.5 M distinct keys of 10 bytes each ("....."):0,
        return bytes(digits[i // 36 ** k % 36] for k in range(5))

    def record(n: int) -> bytes:
        return b'{"format":"deltarefit.commit","x":{' + b"".join(b'"%s":0,' % name(i) for i in range(n)) + b'"z":0}}'

    keys = record(1_500_000)  # past the record cap now: refused from its size
    err, peak = traced(lambda: record_json(keys, "commit.json"))
    assert isinstance(err, MalformedRecordError) and "exceeds the limit" in str(err), err
    keys = record(400_000)  # the same shape under the cap: refused by its count of strings
    assert len(keys) < 4 * MIB
    err, peak = traced(lambda: record_json(keys, "commit.json"))
    assert isinstance(err, MalformedRecordError) and "JSON strings" in str(err), err
    assert peak < len(keys) + 8 * MIB
    header = b'{"format":"deltarefit.shard_part","tensors":[' + b'"abcd",' * (2 << 20) + b'"a"]}'
    blob = sp._PREFIX.pack(sp.MAGIC, sp.FORMAT_VERSION, 0, len(header)) + header
    err, peak = traced(lambda: sp.read_part(blob, "part r0"))
    assert isinstance(err, LimitError) and "JSON strings" in str(err), err
    assert peak < len(blob) + 8 * MIB


def test_the_costliest_text_the_bounds_admit_stays_under_256_mib():
    """Regression (issue 46 item 7): a part header was admitted up to 256 MiB, about 1.1 GB parsed. At
    the caps (a part header of 16 MiB, a commit record of 4 MiB), the densest lists and strings each
    bound admits parse in under 256 MiB; a part header past the cap is refused by its writer and by
    every reader, from its length alone."""
    from deltarefit.shard import part as sp
    from deltarefit.stream.records import MAX_RECORD_BYTES, record_json

    def fill(head: bytes, unit: bytes, size: int, tail: bytes) -> bytes:
        return head + unit * ((size - len(head) - len(tail)) // len(unit)) + tail

    head = b'{"format":"deltarefit.shard_part","tensors":['
    for unit in (b"[0,0,0],        ", b'"abcdefghijklm",'):  # a list, a string per 16 bytes: the densest admitted
        body = fill(head, unit, sp.MAX_HEADER, b"[]]}")
        blob = sp._PREFIX.pack(sp.MAGIC, sp.FORMAT_VERSION, 0, len(body)) + body
        err, peak = traced(lambda b=blob: sp.read_part(b, "part r0"))
        assert "holds" not in str(err)[:300], str(err)[:300]  # admitted by the shape pass (then refused as no real header)
        assert peak < 256 * MIB, (unit, peak / MIB)
    rec = fill(b'{"format":"deltarefit.commit","x":[', b'"abcdefghijklmnopqrstu",', MAX_RECORD_BYTES, b'"a"]}')
    err, peak = traced(lambda: record_json(rec, "commit.json"))
    assert isinstance(err, dict) and peak < 256 * MIB, (str(err)[:200], peak / MIB)
    big = sp._PREFIX.pack(sp.MAGIC, sp.FORMAT_VERSION, 0, sp.MAX_HEADER + 1) + b" " * (sp.MAX_HEADER + 1)
    err, peak = traced(lambda: sp.read_part(big, "part r0"))
    assert isinstance(err, LimitError) and "does not fit" in str(err) and peak < 4 * MIB
    with pytest.raises(LimitError, match="exceeds the 16 MiB limit"):
        sp.write_part({"pad": "x" * sp.MAX_HEADER}, b"")
