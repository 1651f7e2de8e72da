"""Manifest bombs: small delta files whose JSON manifest would make a reader build a large object tree.

``python -m deltarefit.apps.bench.bombs [--sizes 14,74,1024] [--in-process]`` crafts, for each target file
size (KiB), one delta per kind below (every header field and hash right, so only the manifest can be
refused), runs ``deltarefit inspect`` on it in a child process and prints the file size, the manifest's
expanded size, the exit code, the child's peak RSS above an idle ``deltarefit --version`` and the
refusal. ``--in-process`` measures ``DeltaReader(path)`` with tracemalloc instead (the Python heap only,
no interpreter baseline). ``--other`` measures, instead, the other JSON read from untrusted bytes
(``other_json``: shard part headers, version manifests, commit records). Figures are printed, never asserted; ``tests/test_manifest_memory.py`` asserts
the bounds with the same files.

Kinds (``KINDS``):

* ``same-entry``: one minimal tensor entry repeated (one name: the duplicate is only seen after parsing);
* ``unique``: distinct short names sharing one dtype, shape and digest, with the fingerprints right (a
  valid delta, the densest a real one can be);
* ``unique-digests``: distinct names and digests that differ in a few digits (compressible, unshared);
* ``long-string``: one ``stats`` string filling the expansion allowance;
* ``deep``: ``stats`` a list of 6-deep nests padded to the container bound (8 levels in all);
* ``tiny-containers``: ``stats`` a list of 3-key objects at one container per 16 bytes;
* ``many-keys``: top-level keys readers do not know, each a small 6-deep nest.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import tracemalloc

from .hostile import MIB, _zstd_stream, measure, write_delta_with_manifest

ZERO = "0" * 64
_META = '{"digest":"%s","dtype":"U8","shape":[1]}'
_HEAD = '{"base_fingerprint":"%s","format":"deltarefit.delta","hash":"blake3-128","segment_bytes":1048576,'


def _entry(name: str, digest: str = ZERO) -> str:
    meta = _META % digest
    return f'{{"base":{meta},"changed":0,"count":0,"first":0,"name":"{name}","op":"same","target":{meta}}}'


_PAD = [b""]  # random hex in a key readers ignore: buys the expansion allowance (see ``_fit``)


def _manifest(tensors, stats: str = "{}", fp: str = ZERO):
    """The manifest's pieces (an iterable of bytes): the head, ``tensors`` (an iterable of entry texts),
    the tail."""
    pads = [_PAD[0][i:i + (200 << 10)] for i in range(0, len(_PAD[0]), 200 << 10)]  # values under 256 KiB
    yield (_HEAD % fp).encode() + b"".join(b'"pad%06d":"%s",' % (i, x) for i, x in enumerate(pads))
    yield b'"stats":' + stats.encode()
    yield f',"target_fingerprint":"{fp}","tensors":['.encode()
    first = True
    for t in tensors:
        yield t.encode() if first else b"," + t.encode()
        first = False
    yield b'],"version":1}'


def _frame(pieces) -> bytes:
    data = list(pieces)
    return _zstd_stream(data, sum(map(len, data)), level=3)


def _names(n: int) -> list[str]:
    return [f"t{i:08d}" for i in range(n)]


def _fit(build, target: int, pad: bool) -> bytes:
    """The frame ``build(n)`` of the largest ``n`` that stays within ``target`` bytes and within the
    expansion readers allow for its size (``format.manifest_limit``). With ``pad``, random hex in a key
    readers ignore takes most of ``target`` and buys the allowance (a doubling search, then bisection)."""
    import zstandard

    from ...format import manifest_limit

    _PAD[0] = os.urandom(max(0, target - 2048) * 9 // 10).hex().encode() if pad else b""

    def ok(n: int) -> bytes | None:
        frame = build(n)
        content = zstandard.get_frame_parameters(frame).content_size
        return frame if len(frame) <= target and content <= manifest_limit(len(frame)) else None

    lo, hi = 1, 2
    while ok(hi) is not None:
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 32):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) is not None else (lo, mid)
    frame = ok(lo) or build(lo)
    _PAD[0] = b""
    return frame


def same_entry(n: int) -> bytes:
    return _frame(_manifest([_entry("a")] * n))


def unique(n: int) -> bytes:
    from ...integrity import fingerprint_from_digests

    names = _names(n)
    fp = fingerprint_from_digests(dict.fromkeys(names, bytes(32)))
    return _frame(_manifest((_entry(x) for x in names), fp=fp))


def unique_digests(n: int) -> bytes:
    return _frame(_manifest(_entry(x, f"{i:064x}") for i, x in enumerate(_names(n))))


def long_string(n: int) -> bytes:
    return _frame(_manifest([], stats='{"x":"' + "a" * (n * 64) + '"}'))


def deep(n: int) -> bytes:
    unit = "[[[[[[" + '"' + "b" * 84 + '"' + "]]]]]]"  # 6 containers in 98 bytes
    return _frame(_manifest([], stats="[" + ",".join([unit] * n) + "]"))


def many_keys(n: int) -> bytes:
    """Top-level keys a reader does not know, each a small 6-deep nest (within every per-value bound)."""
    unit = "[[[[[[" + '"' + "b" * 84 + '"' + "]]]]]]"
    return _frame(_manifest([], stats="{}," + ",".join(f'"k{i:08d}":{unit}' for i in range(n))))


def tiny_containers(n: int) -> bytes:
    return _frame(_manifest([], stats="[" + ",".join(['{"a":0,"b":0,"c":0}'] * n) + "]"))


KINDS = {"same-entry": same_entry, "unique": unique, "unique-digests": unique_digests,
         "long-string": long_string, "deep": deep, "tiny-containers": tiny_containers, "many-keys": many_keys}


def write_bomb(path: str, kind: str, file_bytes: int) -> tuple[int, int]:
    """Write a ``kind`` bomb of at most ``file_bytes`` to ``path``: (file size, expanded manifest size)."""
    import zstandard

    frame = _fit(KINDS[kind], file_bytes - 96, pad=not kind.startswith("unique"))
    return write_delta_with_manifest(path, frame), zstandard.get_frame_parameters(frame).content_size


def read_in_process(path: str) -> tuple[int, str]:
    """Peak traced Python-heap bytes of ``DeltaReader(path)`` (closed at once), and its error (or "")."""
    from ...errors import DeltaRefitError
    from ...format import DeltaReader

    tracemalloc.start()
    tracemalloc.reset_peak()
    err = ""
    try:
        DeltaReader(path).close()
    except DeltaRefitError as e:
        err = f"{type(e).__name__}: {e}"
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, err


def other_json() -> list[tuple[str, int, int, str]]:
    """The other JSON read from untrusted bytes, each at its size limit with the costliest text its
    shape checks admit (or, where they refuse it, the bomb they refuse): (what, input bytes, traced
    peak of parsing it, the refusal or "")."""
    import blake3

    from ...errors import DeltaRefitError
    from ...shard import part as sp
    from ...shard.records import ShardCommit, load_manifest
    from ...storage.memory import MemoryStore
    from ...stream.records import MAX_RECORD_BYTES, Part, record_json

    def run(what: str, data: bytes, f) -> tuple[str, int, int, str]:
        tracemalloc.start()
        tracemalloc.reset_peak()
        err = ""
        try:
            f()
        except DeltaRefitError as e:
            err = f"{type(e).__name__}: {str(e)[:100]}"
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return what, len(data), peak, err

    def fill(head: bytes, unit: bytes, size: int, tail: bytes) -> bytes:
        return head + unit * ((size - len(head) - len(tail)) // len(unit)) + tail

    out = []
    cap = sp.MAX_HEADER
    head = b'{"format":"deltarefit.shard_part","tensors":['

    def part(body: bytes) -> bytes:
        return sp._PREFIX.pack(sp.MAGIC, sp.FORMAT_VERSION, 0, len(body)) + body

    # At the header's cap: the costliest text each bound admits (a string per 8 bytes, a container per
    # 8), and the bombs those bounds refuse.
    for label, unit, tail in ((f"shard part header, {cap >> 20} MiB of [[],...]", b"[],", b"[]]}"),
                              (f"shard part header, {cap >> 20} MiB of [0,0],...", b"[0,0],", b"[]]}"),
                              (f"shard part header, {cap >> 20} MiB of [0,0,0],...", b"[0,0,0],", b"[]]}"),
                              (f"shard part header, {cap >> 20} MiB of short strings", b'"abcd",', b'"a"]}'),
                              (f"shard part header, {cap >> 20} MiB, a string per 8 B", b'"abcde",', b'"a"]}')):
        blob = part(fill(head, unit, cap, tail))
        out.append(run(label, blob, lambda b=blob: sp.read_part(b)))
    nests = fill(head, b"[],", 64 * MIB, b"[]]}")
    strings = fill(head, b'"abcd",', 64 * MIB, b'"a"]}')
    store = MemoryStore()
    for label, data in (("version manifest, 64 MiB of [[],...]", nests), ("version manifest, 64 MiB of strings", strings)):
        key = "v/000000000001/0123456789abcdef/manifest.json"
        store.put(key, data)
        rec = ShardCommit(1, None, "00" * 32, True, 1, Part(key, len(data), blake3.blake3(data).hexdigest()), ())
        out.append(run(label, data, lambda r=rec: load_manifest(store, r)))
    rhead = b'{"format":"deltarefit.commit","x":'
    for label, unit, open_, tail in (
            ("commit record at the cap, short strings", b'"abcd",', b"[", b'"a"]}'),
            ("commit record at the cap, short keys", b'"k%07d":0,', b"{", b'"z":0}}'),
            ("commit record at the cap, a string per 12 B", b'"abcdefghi",', b"[", b'"a"]}'),
            ("commit record at the cap, a key per 14 B", b'"k%09d":0,', b"{", b'"z":0}}')):
        if b"%" in unit:
            n = (MAX_RECORD_BYTES - len(rhead) - 8) // len(unit % 0)
            data = rhead + open_ + b"".join(unit % i for i in range(n)) + tail
        else:
            data = fill(rhead + open_, unit, MAX_RECORD_BYTES, tail)
        data = data[:MAX_RECORD_BYTES] if len(data) > MAX_RECORD_BYTES else data
        out.append(run(label, data, lambda d=data: record_json(d, "commit.json")))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="14,74,1024", help="file sizes in KiB, comma-separated")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--in-process", action="store_true", help="tracemalloc DeltaReader instead of a child")
    ap.add_argument("--other", action="store_true", help="only the other JSON read from untrusted bytes")
    a = ap.parse_args(argv)
    if a.other:
        for what, size, peak, err in other_json():
            print(f"{what:<44} {size / MIB:>6.0f} MiB  traced peak {peak / MIB:>7.1f} MiB  {err}", flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="deltarefit-bombs-") as tmp:
        base = 0 if a.in_process else measure(["--version"]).peak_rss
        what = "traced peak" if a.in_process else "peak RSS - idle"
        print(f"{'kind':<16} {'file':>9} {'expands to':>11} {'rc':>3} {what:>16}  refusal")
        for kb in (int(x) for x in a.sizes.split(",")):
            for kind in a.kinds.split(","):
                path = os.path.join(tmp, f"{kind}.delta")
                size, expanded = write_bomb(path, kind, kb << 10)
                if a.in_process:
                    peak, last = read_in_process(path)
                    rc = 1 if last else 0
                else:
                    r = measure(["inspect", path])
                    rc, peak, last = r.rc, max(0, r.peak_rss - base), r.last_line
                os.unlink(path)
                print(f"{kind:<16} {size / 1024:>6.0f} KB {expanded / MIB:>7.1f} MiB {rc:>3} "
                      f"{peak / MIB:>12.1f} MiB  {last.replace(tmp, '')[:110]}", flush=True)
        print(f"python {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
