"""Sync overhead and catch-up bytes of the version stream, measured on synthetic bf16 chains.

``python -m deltarefit.apps.bench.stream [--mib 256] [--versions 12] [--out DIR]`` prints:

* sync overhead: the time of ``Subscriber.sync`` for one version against a plain ``apply`` of the same
  delta to the same checkpoint (the difference is fetching, hashing parts, reading records and
  recording the version), best of 3;
* catch-up: for a subscriber ``k`` versions behind a keyframe, the bytes of the chain, of the
  publisher's catch-up delta, and of one delta;
* publish: ``Publisher.publish`` of one delta version (encode, upload, commit, advance the baseline),
  the baseline advanced by a verified copy (the default) and by applying the delta in place, the two
  interleaved, best of 3 each; and, within it, the decode check before the commit (the staged delta
  decoded against the baseline: ``stream.unchanged``), best of the same runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np


def _write(path: str, arrays: dict[str, np.ndarray]) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({k: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) for k, v in arrays.items()}, path)


def _chain(d: str, mib: int, versions: int, rate: float, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    n_t = max(1, mib // 32)
    w = {f"layer{i}.weight": (rng.standard_normal(16 << 20, dtype=np.float32) * 0.02) for i in range(n_t)}
    cur = {k: (v.view(np.uint32) >> 16).astype(np.uint16) for k, v in w.items()}
    paths = []
    for s in range(versions):
        p = os.path.join(d, f"step{s:03d}.safetensors")
        _write(p, cur)
        paths.append(p)
        for v in cur.values():
            idx = np.flatnonzero(rng.random(v.size) < rate)
            v[idx] = (v[idx].astype(np.int64) + rng.choice([-1, 1], idx.size)).astype(np.uint16)
    return paths


def _publish_times(work: str, steps: list[str]) -> None:
    from deltarefit.stream import Publisher
    from deltarefit.stream import publisher as publisher_mod

    checks: list[float] = []
    real_check = publisher_mod.check_decodes

    def timed_check(*a, **k):  # the check each publish makes before its upload, timed where it runs
        t = time.perf_counter()
        real_check(*a, **k)
        checks.append(time.perf_counter() - t)

    publisher_mod.check_decodes = timed_check

    pubs = {a: Publisher(os.path.join(work, f"store-{a}"), os.path.join(work, f"pub-{a}"), keyframe_every=10**6,
                         keyframe_ratio=1e9, advance=a) for a in ("copy", "apply")}
    times: dict[str, list[float]] = {a: [] for a in pubs}
    for pub in pubs.values():
        pub.publish(steps[0])  # the keyframe
    for k in range(1, min(4, len(steps))):
        for a, pub in pubs.items():
            t = time.perf_counter()
            pub.publish(steps[k])
            times[a].append(time.perf_counter() - t)
    publisher_mod.check_decodes = real_check
    tc, tp = min(times["copy"]), min(times["apply"])
    print(f"publish of one delta version: {tc:.3f} s advancing the baseline by a verified copy, {tp:.3f} s by "
          f"applying the delta in place ({tp / tc:.2f}x; best of {len(times['copy'])})")
    if checks:
        print(f"publish: decode check (the delta decoded against the baseline before the commit): "
              f"{min(checks):.3f} s, {min(checks) / tc:.0%} of the publish by copy (best of {len(checks)})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.bench.stream", description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="checkpoint size in MiB (default 256)")
    ap.add_argument("--versions", type=int, default=12, help="versions in the chain (default 12)")
    ap.add_argument("--rate", type=float, default=0.03, help="fraction of elements changed per step")
    ap.add_argument("--out", default=None, help="work directory (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    if args.versions < 3:
        ap.error(f"--versions must be at least 3 (a keyframe and two deltas), not {args.versions}")
    import deltarefit
    from deltarefit.stream import Publisher, Subscriber

    work = args.out or tempfile.mkdtemp(prefix="deltarefit-stream-bench-")
    os.makedirs(work, exist_ok=True)
    try:
        steps = _chain(work, args.mib, args.versions, args.rate, 0)
        store = os.path.join(work, "store")
        pub = Publisher(store, os.path.join(work, "pub"), keyframe_every=10**6, keyframe_ratio=1e9, catchup=True)
        for i, p in enumerate(steps):
            pub.publish(p, step=i)
        from deltarefit.storage import LocalStore
        from deltarefit.stream.records import load_commit

        st = LocalStore(store)
        # Sync overhead on the last version.
        last = len(steps)
        delta = os.path.join(work, "last.delta")
        st.get_to(load_commit(st, last).delta.key, delta)
        rows = []
        for _ in range(3):
            w = os.path.join(work, "w.safetensors")
            shutil.copyfile(steps[-2], w)
            t = time.perf_counter()
            deltarefit.apply(delta, w)
            ta = time.perf_counter() - t
            sub_ck = os.path.join(work, "sub.safetensors")
            shutil.copyfile(steps[-2], sub_ck)
            with open(sub_ck + ".deltarefit-version.json", "w") as f:
                json.dump({"version": last - 1, "fingerprint": load_commit(st, last - 1).fingerprint}, f)
            t = time.perf_counter()
            Subscriber(store, sub_ck, subscriber_id="bench").sync()
            ts = time.perf_counter() - t
            rows.append((ta, ts))
        ta, ts = min(r[0] for r in rows), min(r[1] for r in rows)
        size = os.path.getsize(steps[-1])
        print(f"checkpoint {size / 1e6:.0f} MB, {args.rate:.1%} of elements changed per step")
        print(f"apply of one version: {ta:.3f} s ({size / ta / 1e9:.2f} GB/s); sync of the same version: {ts:.3f} s; "
              f"sync overhead {100 * (ts - ta) / ta:+.1f}% of apply (best of 3)")
        one = load_commit(st, last).delta.bytes
        for k in sorted({k for k in (2, 5, last - 1) if 1 <= k < last}):  # versions the chain has
            chain = sum(load_commit(st, v).delta.bytes for v in range(2, k + 2))
            cu = load_commit(st, k + 1).catchup
            cub = cu.bytes if cu else one
            print(f"{k:3d} versions behind the keyframe: chain {chain:,} B, catch-up {cub:,} B "
                  f"({cub / chain:.2f} of the chain, {cub / one:.1f}x one delta)")
        _publish_times(work, steps)
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
