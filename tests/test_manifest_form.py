"""A version manifest is read in the one form the committer writes (``part.manifest_bytes``: sorted
keys, compact, ASCII) and kept as offsets into its bytes (``shard/manifest.py``). Whatever it reads is
what json.loads reads; whatever departs from the form is refused in one line naming the byte."""

from __future__ import annotations

import json
import random

import pytest

from deltarefit.apps.bench.trust_memory import version_manifest
from deltarefit.errors import FormatError
from deltarefit.shard.manifest import VersionManifest
from deltarefit.shard.part import manifest_bytes
from deltarefit.shard.records import state_fingerprint

NAMES = sorted(["w", "x.y", "a\u00e9", 'q"z', "b\\", "", "n\nl", "s/\x7f", "\U0001f600"])


def _manifest(rnd: random.Random) -> dict:
    shapes = {n: [rnd.randint(0, 9) for _ in range(rnd.randint(0, 3))] for n in NAMES}
    covers = [{n: [[0, d] for d in shapes[n]] for n in NAMES if rnd.random() < 0.6} for _ in range(3)]
    man = version_manifest(shapes, covers, keyframe=rnd.random() < 0.5, seed=rnd.getrandbits(32))
    for n in NAMES:
        man["tensors"][n]["dtype"] = rnd.choice(["BF16", "F32", "U8"])
    return man


def test_what_is_read_is_what_json_reads_and_the_rest_is_refused_in_one_line():
    """1,500 manifests of awkward names, each with 1-3 random byte edits: every edited manifest is
    either refused (``FormatError``, one line naming a byte) or is itself the committer's form and
    reads exactly as json.loads reads it, fingerprints included."""
    rnd = random.Random(46)
    refused = read = 0
    for _ in range(1500):
        man = _manifest(rnd)
        data = manifest_bytes(man)
        got = VersionManifest(data)
        assert got == man and state_fingerprint(got["tensors"]) == state_fingerprint(man["tensors"])
        assert state_fingerprint(got["tensors"], "base") == state_fingerprint(man["tensors"], "base")
        b = bytearray(data)
        for _ in range(rnd.randint(1, 3)):
            k, op = rnd.randrange(len(b)), rnd.random()
            if op < 0.4:
                b[k] = rnd.choice(b'{}[]",:0123456789abcdefnul \\tx')
            elif op < 0.7:
                del b[k]
            else:
                b.insert(k, rnd.choice(b'{}[]",:019af \\'))
        try:
            got = VersionManifest(bytes(b))
        except FormatError as e:
            assert str(e).startswith("byte ") and "\n" not in str(e), str(e)
            refused += 1
            continue
        j = json.loads(bytes(b))
        assert got == j and manifest_bytes(j) == bytes(b)
        assert state_fingerprint(got["tensors"]) == state_fingerprint(j["tensors"])
        read += 1
    assert refused > 1000 and read > 20, (refused, read)


def _edit(man: dict, f) -> bytes:
    f(man)
    return json.dumps(man, sort_keys=True, separators=(",", ":")).encode()


def _base() -> dict:
    return version_manifest({"a": [4, 2], "b": [3]}, [{"a": [[0, 2], [0, 2]]}, {"a": [[2, 4], [0, 2]], "b": [[0, 3]]}])


@pytest.mark.parametrize(("edit", "why"), [
    (lambda m: m.update(format_version=2), "format_version 2; this reader knows 1"),
    (lambda m: m["tensors"]["a"].update(dtype="F128"), "unknown dtype 'F128'"),
    (lambda m: m["tensors"]["a"].update(shape=[4, 2.5]), "expected \"name\":{\"base\""),
    (lambda m: m["tensors"]["a"].update(shape=[1 << 63]), "dimension 9223372036854775808 is past 2**63"),
    (lambda m: m["parts"][1]["covers"].update(c=[[0, 1]]), "a part's cover of 'c', [[0, 1]], is not a tensor"),
    (lambda m: m["parts"][1]["covers"].update(b=[[0, 4]]), "[[0, 4]], does not fit its shape [3]"),
    (lambda m: m["parts"][1]["covers"].update(b=[[2, 1]]), "[[2, 1]], does not fit its shape [3]"),
    (lambda m: m["parts"][1]["covers"].update(b=[[0, 1], [0, 1]]), "does not fit its shape [3]"),
    (lambda m: m["parts"][1].update(rank=0), "part of rank 0 where rank 1 belongs"),
    (lambda m: m["parts"][0].update(bytes=-1), "expected a part"),
    (lambda m: m.update(extra=1), "expected the head"),
    (lambda m: m.update(zzz=1), "expected },\"version\":N,\"world\":N} and the end"),
    (lambda m: m["tensors"]["a"].update(target="AB" * 16), "expected \"name\":{\"base\""),
])
def test_each_departure_is_refused_naming_its_byte(edit, why):
    data = _edit(_base(), edit)
    with pytest.raises(FormatError) as e:
        VersionManifest(data)
    assert str(e.value).startswith("byte ") and why in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize(("text", "why"), [
    (lambda d: d.replace(b'"b":{', b'"0":{'), "is not after 'a' (names are sorted, each once)"),
    (lambda d: d.replace(b'"b":{', b'"a":{'), "is not after 'a' (names are sorted, each once)"),
    (lambda d: d.replace(b'"covers":{"a":[[2,4],[0,2]],"b":[[0,3]]}', b'"covers":{"b":[[0,3]],"a":[[2,4],[0,2]]}'),
     "a part covers 'a' after 'b'"),
    (lambda d: d.replace(b",", b", "), "expected the head"),
    (lambda d: d + b"\n", "expected },\"version\":N"),
    (lambda d: json.dumps(json.loads(d), indent=1).encode(), "expected the head"),
    (lambda d: d.replace(b'"keyframe":false', b'"keyframe":0'), "expected the head"),
    (lambda d: d.replace(b'"rank":1}', b'"rank":1,"x":2}'), "expected },\"rank\":R}"),
    (lambda d: d[:-40], "expected \"name\":{\"base\""),
])
def test_text_outside_the_form_is_refused_naming_its_byte(text, why):
    data = text(manifest_bytes(_base()))
    with pytest.raises(FormatError) as e:
        VersionManifest(data)
    assert why in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_names_are_looked_up_decoded_and_iterated_in_order():
    man = version_manifest({n: [2] for n in NAMES}, [{n: [[0, 2]] for n in NAMES[::2]}])
    got = VersionManifest(manifest_bytes(man))
    assert list(got["tensors"]) == NAMES and len(got["tensors"]) == len(NAMES)
    for n in NAMES:
        assert n in got["tensors"] and got["tensors"][n] == man["tensors"][n]
    assert "nope" not in got["tensors"] and 3 not in got["tensors"]
    with pytest.raises(KeyError):
        got["tensors"]["nope"]
    covers = got["parts"][0]["covers"]
    assert list(covers) == NAMES[::2] and dict(covers.items()) == man["parts"][0]["covers"]
    assert covers['q"z'] == [[0, 2]] if 'q"z' in NAMES[::2] else True
    assert got["parts"][0]["blake3"] == man["parts"][0]["blake3"] and got["parts"][0]["rank"] == 0
    assert dict(got) == {**man, "parts": got["parts"], "tensors": got["tensors"]}


def test_a_cover_of_millions_of_dims_is_refused_in_kib():
    """A cover's bounds are parsed whole, so the form allows at most 64 dims (a tensor's most): 30 MiB of
    "[0,0]," in one cover (10 M integers, some 400 MB as Python ints) is refused where it passes 64."""
    import tracemalloc

    data = manifest_bytes(version_manifest({"a": [4]}, [{"a": [[0, 4]]}]))
    bomb = data.replace(b'"a":[[0,4]]', b'"a":[' + b"[0,0]," * (5 << 20) + b"[0,4]]")
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match=r'^byte \d+: expected a cover "name":\[\[lo,hi\],..\]'):
            VersionManifest(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
