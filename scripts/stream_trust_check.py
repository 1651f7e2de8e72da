#!/usr/bin/env python3
"""Stream trust check: how many hostile or careless states a rollout's ``sync`` reports as verified or
accepts. Prints the counts (the targets are zero); exit status 1 if any is not zero.

Run from the repository root:  ``python scripts/stream_trust_check.py [--edits 40] [--mib 8]``

On a synthetic bf16 chain (random tensors, a few elements moved per step) in a temporary directory:

1. ``--edits`` single-byte edits of a checkpoint synced to the head (random tensor and offset), each
   checked by a sync at the head three ways: right after the sync (identity "racy"), as if recorded
   long before (identity aged), and with the edit's mtime set back to the old one (ctime moves).
   Counted: syncs that report "verified", and syncs that accept the checkpoint at all. A control:
   the unedited checkpoint is accepted (hashed when racy, "up to date" without a hash when aged).
2. Records of another stream: a store wiped and republished with the same checkpoints; a checkpoint
   synced from another store at the same version; a version copied from another stream signed by the
   same key on the same base (old and new subscribers); a record stripped of its identity. Counted:
   syncs that accept.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile

import numpy as np


def _chain(d: str, n: int, mib: int) -> list[str]:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    per = mib * (1 << 20) // 2 // 4
    ws = {f"layer{i}.weight": rng.integers(0, 1 << 16, per, dtype=np.uint16) for i in range(4)}
    out = []
    for s in range(n):
        if s:
            for w in ws.values():
                idx = rng.integers(0, w.size, w.size // 50)
                w[idx] ^= 1
        p = os.path.join(d, f"step{s}.safetensors")
        save_file({k: v.view(np.float16) for k, v in ws.items()}, p)  # 2-byte elements; the codec sees bytes
        out.append(p)
    return out


def _flip(path: str, rnd: random.Random, keep_mtime: bool) -> None:
    st = os.stat(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    name = rnd.choice(sorted(k for k in header if k != "__metadata__"))
    a, b = header[name]["data_offsets"]
    pos = 8 + n + rnd.randrange(a, b)
    with open(path, "r+b") as f:
        f.seek(pos)
        x = f.read(1)
        f.seek(pos)
        f.write(bytes([x[0] ^ (1 << rnd.randrange(8))]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edits", type=int, default=40)
    ap.add_argument("--mib", type=int, default=8)
    a = ap.parse_args(argv)
    from deltarefit.api import fingerprint
    from deltarefit.errors import DeltaRefitError
    from deltarefit.signing import keygen
    from deltarefit.storage import LocalStore
    from deltarefit.stream import Publisher, Subscriber
    from deltarefit.stream import records as R
    from deltarefit.stream.subscriber import state_path

    d = tempfile.mkdtemp(prefix="trust-")
    try:
        chain = _chain(d, 6, a.mib)
        key = os.path.join(d, "k.pem")
        keygen(key)

        def stream(name: str, steps, **kw) -> str:
            store = os.path.join(d, name)
            pub = Publisher(store, store + "-pub", keyframe_every=100, **kw)
            for s in steps:
                pub.publish(chain[s])
            return store

        def accepted(store: str, ck: str, **kw):
            try:
                return Subscriber(store, ck, **kw).sync()
            except DeltaRefitError:
                return None

        # 1. edits at the head
        store = stream("s", [1, 2])
        ck = os.path.join(d, "r.safetensors")
        Subscriber(store, ck).sync()
        good = ck + ".good"
        shutil.copyfile(ck, good)
        shutil.copyfile(state_path(ck), good + ".state")
        rnd = random.Random(1)
        counts = {}
        for mode in ("racy", "aged", "mtime kept"):
            verified = acc = 0
            for _ in range(a.edits):
                shutil.copyfile(good, ck)
                Subscriber(store, ck).sync(verify=True)  # records this copy's identity
                if mode != "racy":
                    p = state_path(ck)
                    with open(p) as f:
                        st = json.load(f)
                    st["identity_at_ns"] += 10 * R.RACY_NS  # as if verified long after its last write
                    with open(p, "w") as f:
                        json.dump(st, f)
                _flip(ck, rnd, keep_mtime=mode == "mtime kept")
                if fingerprint(ck) == R.held_version(state_path(ck))[1]:
                    continue  # cannot happen for a one-bit flip; kept honest
                rep = accepted(store, ck)
                acc += rep is not None
                verified += rep is not None and rep.verified
            counts[mode] = (verified, acc)
            print(f"edited at the head ({mode}): {a.edits} edits, {verified} reported verified, {acc} accepted")
        # the control: an unedited checkpoint is accepted (up to date without a hash once aged)
        shutil.copyfile(good, ck)
        Subscriber(store, ck).sync(verify=True)
        fast = accepted(store, ck)
        print(f"control, unedited: accepted {fast is not None}, verified by a hash {fast.verified if fast else None}"
              f" (racy); ", end="")
        p = state_path(ck)
        with open(p) as f:
            st = json.load(f)
        st["identity_at_ns"] += 10 * R.RACY_NS
        with open(p, "w") as f:
            json.dump(st, f)
        fast = accepted(store, ck)
        print(f"accepted {fast is not None}, verified by a hash {fast.verified if fast else None} (aged: up to date)")
        if fast is None or fast.verified:
            return 1
        # 2. other streams
        other = 0
        r = os.path.join(d, "w.safetensors")
        Subscriber(store, r).sync()
        shutil.rmtree(store)
        shutil.rmtree(store + "-pub")
        stream("s", [1, 2])
        x = accepted(store, r) is not None
        print(f"store wiped and republished with the same checkpoints: {'accepted' if x else 'refused'}")
        other += x
        b = stream("b", [3, 4])
        c = os.path.join(d, "c.safetensors")
        Subscriber(store, c).sync()
        x = accepted(b, c) is not None
        print(f"checkpoint synced from another stream at the same version: {'accepted' if x else 'refused'}")
        other += x
        sa, sb = stream("sa", [1, 2], signing_key=key), stream("sb", [1, 2, 5], signing_key=key)
        old = os.path.join(d, "old.safetensors")
        Subscriber(sa, old, public_key=key + ".pub").sync()
        shutil.copytree(os.path.join(sb, "v", "000000000003"), os.path.join(sa, "v", "000000000003"))
        for who, ck2 in (("old", old), ("new", os.path.join(d, "new.safetensors"))):
            x = accepted(sa, ck2, public_key=key + ".pub") is not None
            print(f"signed version copied from another stream, same key and base ({who} subscriber): "
                  f"{'accepted' if x else 'refused'}")
            other += x
        st = LocalStore(b)
        rec = json.loads(st.get(R.commit_key(2)))
        del rec["stream"]
        st.put(R.commit_key(2), json.dumps(rec).encode())
        s1 = os.path.join(d, "s1.safetensors")
        Subscriber(b, s1).sync(to_version=1)
        x = accepted(b, s1) is not None
        print(f"record stripped of its stream identity: {'accepted' if x else 'refused'}")
        other += x
        bad = sum(v for v, _ in counts.values()) + other
        print(f"total: {sum(v for v, _ in counts.values())} verified reports for edited checkpoints "
              f"({sum(x for _, x in counts.values())} accepted), {other} accepted from another stream")
        return 1 if bad or any(x for _, x in counts.values()) else 0
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
