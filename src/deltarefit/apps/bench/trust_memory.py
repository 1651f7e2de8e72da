"""Memory before trust, by input shape: what each untrusted input costs the Python heap before it is
trusted or refused, next to its size (``bench.hostile`` prints these rows; ``tests/test_trust_memory.py``
asserts the bounds with the same builders).

Each row is one input at its cap, in the costliest shape its checks admit (or the bomb they refuse):

* a commit record in a signed stream, unsigned or with a forged signature (refused over its raw bytes
  before it is parsed: ``signing.check_stored_signature``);
* a commit record in an unsigned stream (parsed, its shape bounded: ``records.record_json``);
* a sharded part header, and a version manifest (their shapes bounded; the manifest capped before it
  is read), and either in a signed stream (checked against the size and BLAKE3 the record names);
* a key file (``/dev/zero``, a large file) and a local JSON state file (deep brackets, many strings).

``python -m deltarefit.apps.bench.trust_memory`` prints this section alone. The peak is tracemalloc's (the
Python heap; the interpreter's own baseline not counted). The target
(issue 46): under 256 MiB for every input, and under twice its size plus ``FIXED`` (32 MiB).
"""

from __future__ import annotations

import json
import os
import tempfile
import tracemalloc
from collections.abc import Callable

MIB = 1 << 20
FIXED = 32 * MIB


def traced(f: Callable[[], object]) -> tuple[int, str]:
    """Peak traced heap of ``f()`` and its refusal (``Type: message``; "" when it returned)."""
    from ...errors import DeltaRefitError

    tracemalloc.start()
    tracemalloc.reset_peak()
    err = ""
    try:
        f()
    except (DeltaRefitError, ValueError) as e:
        err = f"{type(e).__name__}: {str(e)[:110]}"
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, err


def fill(head: bytes, unit: bytes, size: int, tail: bytes) -> bytes:
    return head + unit * ((size - len(head) - len(tail)) // len(unit)) + tail


def keys_record(size: int, unit: bytes = b'"k%017d":1.5,') -> bytes:
    """A commit record of ``size`` bytes that is one object of distinct keys (the costliest text the
    record's bounds admit: a key per 24 bytes, a float value)."""
    head = b'{"format":"deltarefit.commit","x":{'
    n = (size - len(head) - 16) // len(unit % 0)
    return head + b"".join(unit % i for i in range(n)) + b'"z":0}}'


def forged(record: bytes) -> bytes:
    """``record`` with a signature member in the stored form, whose signature is not the signer's."""
    from ...signing import SIGNATURE_ALG

    member = (b',\n "signature": {\n  "alg": "%s",\n  "key_id": "%s",\n  "sig": "%s"\n }'
              % (SIGNATURE_ALG.encode(), b"0" * 16, b"ab" * 64))
    return record[:-2] + member + record[-2:]


def part_blob(body: bytes) -> bytes:
    from ...shard import part as sp

    return sp._PREFIX.pack(sp.MAGIC, sp.FORMAT_VERSION, 0, len(body)) + body


PART_HEAD = b'{"format":"deltarefit.shard_part","tensors":['

# A 1T-parameter MoE (61 layers of 384 experts of 3 matrices, 13 dense tensors a layer) over 256 ranks:
# experts spread by expert parallelism, each dense tensor cut along dim 0 over groups of 8 ranks.
_DENSE = {"self_attn.q_a_proj.weight": [1536, 7168], "self_attn.q_b_proj.weight": [24576, 1536],
          "self_attn.kv_a_proj_with_mqa.weight": [576, 7168], "self_attn.kv_b_proj.weight": [32768, 512],
          "self_attn.o_proj.weight": [7168, 16384], "self_attn.q_a_layernorm.weight": [1536],
          "self_attn.kv_a_layernorm.weight": [512], "input_layernorm.weight": [7168],
          "post_attention_layernorm.weight": [7168], "mlp.gate.weight": [384, 7168],
          "mlp.shared_experts.gate_proj.weight": [2048, 7168], "mlp.shared_experts.up_proj.weight": [2048, 7168],
          "mlp.shared_experts.down_proj.weight": [7168, 2048]}


def version_manifest(shapes: dict[str, list[int]], covers: list[dict[str, list[list[int]]]],
                     keyframe: bool = False, seed: int = 0) -> dict:
    """A version manifest (``part.join``'s form) of tensors ``shapes`` (BF16, random digests) and one
    part per entry of ``covers``."""
    import random

    rnd = random.Random(seed)
    tensors = {n: {"dtype": "BF16", "shape": list(s), "base": None if keyframe else f"{rnd.getrandbits(128):032x}",
                   "target": f"{rnd.getrandbits(128):032x}"} for n, s in sorted(shapes.items())}
    return {"format": "deltarefit.shard_version", "format_version": 1, "version": 7, "keyframe": keyframe,
            "world": len(covers), "changed": 1 << 30, "elements": 1 << 40, "tensors": tensors,
            "parts": [{"rank": r, "bytes": 1 << 30, "blake3": f"{rnd.getrandbits(256):064x}", "covers": c}
                      for r, c in enumerate(covers)]}


def moe_manifest(world: int = 256, layers: int = 61, experts: int = 384) -> dict:
    """The version manifest of the 1T MoE above (29 MiB stored at 256 ranks)."""
    shapes: dict[str, list[int]] = {}
    covers: list[dict[str, list[list[int]]]] = [{} for _ in range(world)]
    for lay in range(layers):
        for k, s in _DENSE.items():
            shapes[n := f"model.layers.{lay}.{k}"] = s
            for r in range(world):
                covers[r][n] = [[s[0] * (r % 8) // 8, s[0] * (r % 8 + 1) // 8]] + [[0, d] for d in s[1:]]
        for e in range(experts):
            for m, s in (("gate_proj", [2048, 7168]), ("up_proj", [2048, 7168]), ("down_proj", [7168, 2048])):
                shapes[n := f"model.layers.{lay}.mlp.experts.{e}.{m}.weight"] = s
                covers[(lay * experts + e) % world][n] = [[0, d] for d in s]
    for n, s in (("model.embed_tokens.weight", [129280, 7168]), ("lm_head.weight", [129280, 7168]),
                 ("model.norm.weight", [7168])):
        shapes[n] = s
        for r in range(world):
            covers[r][n] = [[s[0] * r // world, s[0] * (r + 1) // world]] + [[0, d] for d in s[1:]]
    return version_manifest(shapes, [dict(sorted(c.items())) for c in covers])


def dense_manifest(kind: str, size: int) -> dict:
    """The densest manifest of ``kind`` the grammar admits, of at most ``size`` stored bytes: "tensors"
    (scalar tensors of 7-digit names, null bases: 73 bytes each), "parts" (parts that cover nothing:
    about 100 bytes each) or "covers" (parts covering each of 1,000 1-element tensors: 15 bytes a cover)."""
    names = [f"{i:04d}" for i in range(1000)]
    build = {"tensors": lambda n: version_manifest({f"{i:07d}": [] for i in range(n)}, [{}], keyframe=True),
             "parts": lambda n: version_manifest({"w": [1]}, [{}] * n),
             "covers": lambda n: version_manifest({k: [1] for k in names}, [{k: [[0, 1]] for k in names}] * n)}[kind]
    def length(n: int) -> int:
        return len(json.dumps(build(n), sort_keys=True, separators=(",", ":")))

    unit = length(2) - length(1)
    n = (size - length(1)) // unit + 1
    while (over := length(n) - size) > 0:  # (ranks grow by a digit now and then)
        n -= over // unit + 1
    return build(n)


def stored_manifest(man: dict, store, parent: str | None = None):
    """Put ``man``'s stored bytes in ``store`` and return (bytes, the commit record naming them)."""
    import blake3

    from ...shard.part import manifest_bytes
    from ...shard.records import ShardCommit, state_fingerprint
    from ...stream.records import Part

    data = manifest_bytes(man)
    key = f"v/{man['version']:012d}/0123456789abcdef/manifest.json"
    store.put(key, data)
    parts = tuple(Part(f"v/{man['version']:012d}/0123456789abcdef/parts/rank-{p['rank']}", p["bytes"], p["blake3"])
                  for p in man["parts"])
    base = None if man["keyframe"] else state_fingerprint(man["tensors"], "base")
    return data, ShardCommit(man["version"], base, state_fingerprint(man["tensors"]), man["keyframe"], man["world"],
                             Part(key, len(data), blake3.blake3(data).hexdigest()), parts)


def rows() -> list[tuple[str, int, int, str]]:
    """(input, size, traced peak, refusal) for every shape above."""
    import blake3

    from ...shard import part as sp
    from ...shard.records import ShardCommit, load_manifest
    from ...signing import Signer, keygen
    from ...storage.local import LocalStore
    from ...storage.memory import MemoryStore
    from ...stream.records import MAX_RECORD_BYTES, Part, commit_key, held_state, load_commit, record_json

    out = []

    def row(what: str, size: int, f: Callable[[], object]) -> None:
        peak, err = traced(f)
        out.append((what, size, peak, err))

    with tempfile.TemporaryDirectory(prefix="deltarefit-trust-memory-") as tmp:
        key = os.path.join(tmp, "k.pem")
        keygen(key)
        verifier = Signer(key).verifier()
        store = MemoryStore("trust-memory")
        rec = keys_record(MAX_RECORD_BYTES - 256)
        for what, data in (("commit record, signed stream, unsigned", rec),
                           ("commit record, signed stream, forged", forged(rec))):
            store.put(commit_key(1), data)
            row(what, len(data), lambda: load_commit(store, 1, verifier))
        row("commit record, unsigned stream (keys)", len(rec), lambda d=rec: record_json(d, "commit.json"))
        strings = fill(b'{"format":"deltarefit.commit","x":[', b'"abcdefghijklmnopqrstu",', MAX_RECORD_BYTES, b'"a"]}')
        row("commit record, unsigned stream (strings)", len(strings), lambda d=strings: record_json(d, "commit.json"))
        del rec, strings
        for what, unit, tail in (("part header, 3-lists per 16 B (refused)", b"[999,999,999],  ", b"[]]}"),
                                 ("part header, objects per 16 B (refused)", b'{"abcdefghij":0},', b"{}]}"),
                                 ("part header, strings per 16 B (refused)", b'"abcdefghijklm",', b'"a"]}'),
                                 ("part header, 3-lists per 104 B", b"[999,999,999]," + b" " * 90, b"[]]}"),
                                 ("part header, strings per 104 B", b'"' + b"a" * 100 + b'",', b'"a"]}'),
                                 ("part header, lists per 8 B (refused)", b"[0,0,0],", b"[]]}")):
            blob = part_blob(fill(PART_HEAD, unit, sp.MAX_HEADER, tail))
            row(what, len(blob), lambda b=blob: sp.read_part(b))
        over = part_blob(b" " * (sp.MAX_HEADER + 1))
        row("part header over the cap", len(over), lambda b=over: sp.read_part(b))
        del blob, over
        mkey = "v/000000000001/0123456789abcdef/manifest.json"
        for what, unit, tail in (("manifest, 3-lists per 16 B (refused)", b"[999,999,999],  ", b"[]]}"),
                                 ("manifest, strings per 24 B (refused)", b'"abcdefghijklmnopqrstu",', b'"a"]}')):
            data = fill(b'{"format":"deltarefit.shard_version","x":[', unit, sp.MAX_MANIFEST_BYTES, tail)
            store.put(mkey, data)
            ref = Part(mkey, len(data), blake3.blake3(data).hexdigest())
            srec = ShardCommit(1, None, "00" * 32, True, 1, ref, ())
            row(what, len(data), lambda r=srec: load_manifest(store, r))
        for what, man in (("manifest, a 1T MoE over 256 ranks", moe_manifest()),
                          ("manifest, densest tensors", dense_manifest("tensors", sp.MAX_MANIFEST_BYTES)),
                          ("manifest, densest parts", dense_manifest("parts", sp.MAX_MANIFEST_BYTES)),
                          ("manifest, densest covers", dense_manifest("covers", sp.MAX_MANIFEST_BYTES))):
            mstore = LocalStore(os.path.join(tmp, f"manifest-{len(out)}"))  # read from disk: the bytes count
            mdata, mrec = stored_manifest(man, mstore)
            del man
            row(what, len(mdata), lambda s=mstore, r=mrec: load_manifest(s, r))
            del mstore, mdata
        # In a signed stream the record names the manifest's (and each part's) size and BLAKE3: an object
        # that is not the one signed is refused by its hash, before it is parsed.
        other = ShardCommit(1, None, "00" * 32, True, 1, Part(mkey, len(data), "00" * 32), ())
        row("manifest/part, signed stream, other bytes", len(data), lambda: load_manifest(store, other))
        big = ShardCommit(1, None, "00" * 32, True, 1, Part(mkey, 1 << 34, "00" * 32), ())
        row("manifest a record says is 16 GiB", 1 << 34, lambda: load_manifest(store, big))
        del data  # (the store keeps the last one)
        from ...signing import Verifier

        row("key file /dev/zero", 0, lambda: Verifier("/dev/zero"))
        big_key = os.path.join(tmp, "big.pub")
        with open(big_key, "wb") as f:
            f.truncate(64 * MIB)
        row("key file of 64 MiB", 64 * MIB, lambda: Verifier(big_key))
        state = os.path.join(tmp, "state.json")
        for what, text in (("local state, 500,000 nested brackets", b"[" * 500_000 + b"]" * 500_000),
                           ("local state, 60 MiB of strings", b'["' + b"a" * (60 * MIB) + b'"]')):
            with open(state, "wb") as f:
                f.write(text)
            row(what, len(text), lambda: held_state(state))
    return out


def section() -> None:
    """Print the rows: input, size, traced peak, peak / size, whether within the target, refusal."""
    print(f"\nmemory before trust, by input shape (traced Python heap; target: < 256 MiB and < 2 x size + "
          f"{FIXED >> 20} MiB)")
    print(f"{'input':<42} {'size':>9} {'peak':>9} {'ratio':>6} {'target':>6}  refusal")
    for what, size, peak, err in rows():
        ok = peak < 256 * MIB and peak < 2 * size + FIXED
        ratio = f"{peak / size:.2f}" if size else "-"
        print(f"{what:<42} {size / MIB:>5.1f} MiB {peak / MIB:>5.1f} MiB {ratio:>6} {'yes' if ok else 'NO':>6}  "
              f"{err[:100]}", flush=True)


def manifest_times() -> None:
    """Print how long ``load_manifest`` takes (untraced, best of 3) for the manifests of the rows, next to
    the ``json.loads`` of the same bytes and the old state fingerprint's list, which it replaces."""
    import time

    from ...shard.records import load_manifest, state_fingerprint
    from ...storage.local import LocalStore

    print("\nversion manifest load time (untraced, best of 3; json: json.loads and the fingerprints over it)")
    with tempfile.TemporaryDirectory(prefix="deltarefit-manifest-time-") as tmp:
        for what, build in (("a 1T MoE over 256 ranks", moe_manifest),
                            ("densest tensors", lambda: dense_manifest("tensors", 32 * MIB)),
                            ("densest parts", lambda: dense_manifest("parts", 32 * MIB)),
                            ("densest covers", lambda: dense_manifest("covers", 32 * MIB))):
            store = LocalStore(os.path.join(tmp, what.replace(" ", "-")))
            data, rec = stored_manifest(build(), store)
            ours = theirs = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                load_manifest(store, rec)
                t1 = time.perf_counter()
                man = json.loads(store.get(rec.manifest.key))
                state_fingerprint(man["tensors"], "base"), state_fingerprint(man["tensors"])
                t2 = time.perf_counter()
                ours, theirs = min(ours, t1 - t0), min(theirs, t2 - t1)
                del man
            print(f"{what:<42} {len(data) / MIB:>5.1f} MiB {ours:>6.2f} s   json {theirs:>6.2f} s", flush=True)


if __name__ == "__main__":  # python -m deltarefit.apps.bench.trust_memory: this section of bench.hostile alone
    section()
    manifest_times()
