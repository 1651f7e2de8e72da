"""End-to-end refit through each transport at emulated link speeds: the full checkpoint vs the delta.

``python -m deltarefit.apps.bench.transport [--mib 256] [--rate 0.03] [--links 1Gbit,10Gbit] [--no-s3]
[--markdown docs/TRANSPORTS.md]`` makes a bf16 pair (``--rate`` of the elements moved by +-1 ulp) and
measures, in one run:

* **store refit** (local directory and, when ``weed`` is installed, a SeaweedFS S3 server on loopback),
  every transfer paced by a token bucket to the link rate (``LocalStore(rate=)``, ``S3Store(rate=)``):
  - *full*: the trainer uploads the checkpoint, the rollout downloads it and verifies its fingerprint;
  - *delta*: the trainer publishes the next version (encode against its baseline, upload, commit), the
    rollout syncs (download, check, apply in place, verify its fingerprint);
* **torch.distributed** (gloo, 2 processes on loopback, no pacing: an in-cluster fabric): a rank that
  holds nothing receives the keyframe (full) vs a rank one version behind receives the delta;
* **S3 throughput**: the same object through our S3 store and through boto3's transfer manager with
  its defaults (what ``aws s3 cp`` runs: 8 MiB parts, 10 threads), up and down, best of 3.

Everything runs on this machine, so the trainer's and the rollout's work share its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

MiB = 1 << 20


def _fmt_s(x: float) -> str:
    return f"{x:.2f} s" if x >= 0.1 else f"{1000 * x:.0f} ms"


def warm_up(work: str) -> None:
    """Load the codec's compiled kernels (numba) in this process, so no timing includes it."""
    from deltarefit.apply import apply
    from deltarefit.apps.bench.stream import _chain
    from deltarefit.encode import encode

    d = os.path.join(work, f"warm-{os.getpid()}")
    os.makedirs(d, exist_ok=True)
    a, b = _chain(d, 1, 2, 0.05, 1)
    encode(a, b, os.path.join(d, "w.delta"))
    apply(os.path.join(d, "w.delta"), a)
    shutil.rmtree(d, ignore_errors=True)


def store_refit(url_of, steps: list[str], work: str, rate: float | None, label: str) -> dict[str, Any]:
    """Full vs delta refit through one store kind at one link rate. ``url_of(name)`` gives a fresh store URL."""
    import deltarefit
    from deltarefit.storage.base import open_store
    from deltarefit.stream import Publisher, Subscriber

    full_bytes = os.path.getsize(steps[1])
    # Full: upload, download, verify (the minimum any full-checkpoint refit does through this store).
    st = open_store(url_of("full"), rate=rate)
    got = os.path.join(work, f"full-{label}.safetensors")
    t = time.perf_counter()
    st.put_file("ckpt/model.safetensors", steps[1])
    t_up = time.perf_counter() - t
    t = time.perf_counter()
    st.get_to("ckpt/model.safetensors", got)
    t_down = time.perf_counter() - t
    t = time.perf_counter()
    fp = deltarefit.fingerprint(got)
    t_ver = time.perf_counter() - t
    if fp != deltarefit.fingerprint(steps[1]):
        raise RuntimeError("full refit: fingerprint mismatch")
    os.unlink(got)
    # Delta: a stream whose version 1 is steps[0]; the rollout holds it; publish and sync version 2.
    url = url_of("stream")
    state = os.path.join(work, f"pub-{label}-{os.path.basename(url.rstrip('/'))}")  # one per stream
    pub = Publisher(url, state, keyframe_every=10**6, keyframe_ratio=1e9)
    pub.publish(steps[0], step=0)
    ck = os.path.join(work, f"rollout-{label}-{os.path.basename(url.rstrip('/'))}.safetensors")
    sub = Subscriber(url, ck, subscriber_id="bench")
    sub.sync()
    pub = Publisher(open_store(url, rate=rate), state, keyframe_every=10**6, keyframe_ratio=1e9)
    sub = Subscriber(open_store(url, rate=rate), ck, subscriber_id="bench")
    # Trainer and rollout are different machines in production; here they share two cores. So the
    # critical path is measured piecewise: publish until its commit record is created (noted by the
    # store the publisher writes through), then the rollout's sync, run after the publisher has also
    # advanced its own baseline (off the critical path: the rollout need not wait for it).
    committed: list[float] = []

    class _Noting:
        def __init__(self, inner) -> None:
            self._inner = inner
            self.url = inner.url

        def __getattr__(self, name: str):
            return getattr(self._inner, name)

        def create(self, key: str, data: bytes) -> bool:
            ok = self._inner.create(key, data)
            if ok and key.endswith("/commit.json"):
                committed.append(time.perf_counter())
            return ok

    pub.store = _Noting(pub.store)
    t0 = time.perf_counter()
    rec = pub.publish(steps[1], step=1)
    t_pub_all = time.perf_counter() - t0
    t_pub = committed[0] - t0  # encode, upload, commit
    t = time.perf_counter()
    rep = sub.sync()
    t_sync = time.perf_counter() - t
    if rep.fingerprint != fp or rep.versions_applied != [2]:
        raise RuntimeError("delta refit did not reach the target")
    os.unlink(ck)
    full = t_up + t_down + t_ver
    delta = t_pub + t_sync
    return {"transport": label, "full_bytes": full_bytes, "delta_bytes": rec.delta.bytes,
            "full_up": t_up, "full_down": t_down, "full_verify": t_ver, "full": full,
            "delta_publish": t_pub, "delta_sync": t_sync, "delta": delta, "speedup": full / delta,
            "publish_total": t_pub_all,
            "rollout_speedup": (t_down + t_ver) / t_sync}


# ------------------------------------------------------------------------------------------ torch.distributed


def _dist_worker(arg: str) -> int:
    import datetime

    import torch.distributed as dist

    from deltarefit.transport.torchdist import broadcast_sync

    a = json.loads(arg)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a['port']}", rank=a["rank"], world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    warm_up(os.path.dirname(a["mirror"]))
    dist.barrier()
    t = time.perf_counter()
    rep = broadcast_sync(None, src=0, store=a.get("store"), checkpoint=a["checkpoint"], mirror=a["mirror"],
                         to_version=a["to"])
    took = time.perf_counter() - t
    print(json.dumps({"seconds": took, "bytes": rep.bytes_received, "version": rep.version}), flush=True)
    dist.destroy_process_group()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_round(store: str, ck0: str, ck1: str, work: str, to: int) -> dict[str, Any]:
    port = _free_port()
    args = [{"rank": 0, "port": port, "store": store, "checkpoint": ck0, "mirror": os.path.join(work, "m0"), "to": to},
            {"rank": 1, "port": port, "checkpoint": ck1, "mirror": os.path.join(work, "m1"), "to": to}]
    procs = [subprocess.Popen([sys.executable, "-m", "deltarefit.apps.bench.transport", "--dist-worker", json.dumps(a)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in args]
    outs = []
    for p in procs:
        so, se = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(f"dist worker failed: {se[-1500:]}")
        outs.append(json.loads(so.strip().splitlines()[-1]))
    return outs[1]


def dist_refit(steps: list[str], work: str) -> dict[str, Any]:
    from deltarefit.stream import Publisher, Subscriber

    store = os.path.join(work, "dist-store")
    pub = Publisher(store, os.path.join(work, "dist-pub"), keyframe_every=10**6, keyframe_ratio=1e9)
    pub.publish(steps[0], step=0)
    pub.publish(steps[1], step=1)
    ck0 = os.path.join(work, "dist0.safetensors")
    Subscriber(store, ck0).sync(to_version=1)
    ck1 = os.path.join(work, "dist1.safetensors")
    full = _dist_round(store, ck0, ck1, work, 1)  # rank 1 holds nothing: the keyframe crosses
    delta = _dist_round(store, ck0, ck1, work, 2)  # rank 1 holds version 1: the delta crosses
    return {"transport": "torch.distributed (gloo, loopback)", "full_bytes": full["bytes"],
            "delta_bytes": delta["bytes"], "full": full["seconds"], "delta": delta["seconds"],
            "speedup": full["seconds"] / delta["seconds"]}


# ------------------------------------------------------------------------------------------ S3 throughput


def s3_throughput(srv, src: str, work: str, repeats: int = 5) -> dict[str, Any]:
    """Our S3 store vs boto3's transfer manager with its defaults, same object, same server; best of
    ``repeats``, the two taking turns going first (a small server on shared cores is noisy)."""
    from boto3.s3.transfer import TransferConfig

    from deltarefit.storage.s3 import S3Store

    size = os.path.getsize(src)
    ours = S3Store(srv.url("tp-ours"))
    cli = srv.client()
    cfg = TransferConfig()  # aws s3 cp's defaults: 8 MiB threshold and parts, 10 threads
    obj = srv.url("tp-plain").split("/", 3)[3] + "/obj"
    back = os.path.join(work, "s3-back")
    res: dict[str, list[float]] = {k: [] for k in ("ours_up", "ours_down", "plain_up", "plain_down")}
    for i in range(repeats):
        ups = [("ours_up", lambda: ours.put_file("obj", src)),
               ("plain_up", lambda: cli.upload_file(src, srv.bucket, obj, Config=cfg))]
        downs = [("ours_down", lambda: ours.get_to("obj", back)),
                 ("plain_down", lambda: cli.download_file(srv.bucket, obj, back, Config=cfg))]
        if i % 2:
            ups.reverse()
            downs.reverse()
        for k, fn in ups + downs:
            t = time.perf_counter()
            fn()
            res[k].append(time.perf_counter() - t)
            if k.endswith("down") and os.path.getsize(back) != size:
                raise RuntimeError("S3 download returned the wrong size")
    best = {k: size / min(v) / 1e6 for k, v in res.items()}
    return {"bytes": size, **{f"{k}_MBps": v for k, v in best.items()},
            "up_ratio": best["ours_up"] / best["plain_up"], "down_ratio": best["ours_down"] / best["plain_down"]}


# ------------------------------------------------------------------------------------------ driver


def run(mib: int, rate: float, links: list[str], s3: bool, work: str) -> dict[str, Any]:
    from deltarefit.apps.bench.stream import _chain
    from deltarefit.transport import parse_rate

    steps = _chain(work, mib, 2, rate, 0)
    warm_up(work)
    out: dict[str, Any] = {"mib": mib, "change_rate": rate, "store": [], "dist": None, "s3": None}
    n = [0]

    def local_url(name: str) -> str:
        n[0] += 1
        return os.path.join(work, f"store-{name}-{n[0]}")

    srv_ctx = None
    if s3:
        from deltarefit.apps.bench import seaweed

        if seaweed.missing_reason():
            print(f"S3 skipped: {seaweed.missing_reason()}", file=sys.stderr)
        else:
            srv_ctx = seaweed.running(os.path.join(work, "seaweed"))
    try:
        srv = srv_ctx.__enter__() if srv_ctx else None
        if srv is not None:
            os.environ.update(srv.env)
        for link in links:
            r = parse_rate(link)
            out["store"].append(dict(store_refit(local_url, steps, work, r, "local"), link=link))
            print(_row(out["store"][-1]), flush=True)
            if srv is not None:
                out["store"].append(dict(store_refit(srv.url, steps, work, r, "s3"), link=link))
                print(_row(out["store"][-1]), flush=True)
        out["dist"] = dist_refit(steps, work)
        print(_row(dict(out["dist"], link="loopback")), flush=True)
        if srv is not None:
            out["s3"] = s3_throughput(srv, steps[1], work)
            s = out["s3"]
            print(f"S3 throughput, {s['bytes'] / 1e6:.0f} MB object: ours up {s['ours_up_MBps']:.0f} MB/s, down "
                  f"{s['ours_down_MBps']:.0f} MB/s; boto3 defaults (aws s3 cp) up {s['plain_up_MBps']:.0f} MB/s, "
                  f"down {s['plain_down_MBps']:.0f} MB/s; ours/plain up {s['up_ratio']:.2f}, "
                  f"down {s['down_ratio']:.2f}", flush=True)
    finally:
        if srv_ctx is not None:
            srv_ctx.__exit__(None, None, None)
    return out


def _row(r: dict[str, Any]) -> str:
    return (f"{r['transport']:<36} {r['link']:>8}: full {_fmt_s(r['full'])} ({r['full_bytes'] / 1e6:.0f} MB), "
            f"delta {_fmt_s(r['delta'])} ({r['delta_bytes'] / 1e6:.2f} MB), {r['speedup']:.1f}x faster")


def write_plot(res: dict[str, Any], path: str) -> bool:
    """Refit time, full checkpoint vs delta, per transport and link (bars, log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [(f"{r['transport']}\n{r['link']}", r["full"], r["delta"]) for r in res["store"]]
    if res["dist"]:
        rows.append(("torch.distributed\ngloo loopback", res["dist"]["full"], res["dist"]["delta"]))
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 3, 4.2))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r[1] for r in rows], 0.4, label="full checkpoint")
    ax.bar([x + 0.2 for x in xs], [r[2] for r in rows], 0.4, label="delta (publish + sync)")
    for x, (_, f, d) in zip(xs, rows, strict=True):
        ax.annotate(f"{f / d:.1f}x", (x, max(f, d)), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [r[0] for r in rows], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("seconds")
    ax.set_title(f"refit time, {res['mib']} MiB bf16, {res['change_rate']:.0%} changed")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _where_time_goes(res: dict[str, Any]) -> list[str]:
    """Split the delta refit into link time and processing, and say what a 25x speed-up would need."""
    from deltarefit.transport import parse_rate

    rows = [r for r in res["store"] if r["transport"] == "local"]
    if not rows:
        return []
    r = min(rows, key=lambda x: parse_rate(x["link"]))
    rate = parse_rate(r["link"])
    link_s = 2 * r["delta_bytes"] / rate  # up to the store and down again
    proc_s = max(r["delta"] - link_s, 1e-9)
    p = r["full_bytes"] / proc_s  # bytes of checkpoint per second through encode + apply
    full_link = 2 * r["full_bytes"] / rate
    need_p = r["full_bytes"] / (full_link / 25 - link_s) if full_link / 25 > link_s else float("inf")
    need_link = 2 * r["full_bytes"] / (25 * (proc_s + link_s)) * 8 / 1e9
    return ["## Where the delta's time goes", "",
            f"At {r['link']} the delta crosses the link in {link_s:.3f} s (up and down); the other "
            f"{proc_s:.2f} s are processing: encoding against the trainer's baseline and applying in place, "
            f"with every segment's base and post-image hashed and what was written compared with the "
            f"post-image, on this machine's cores ({p / 1e9:.2f} GB/s of checkpoint through both). The speed-up is bounded by processing, not by the link: a 25x speed-up "
            f"over the full checkpoint at {r['link']} needs {need_p / 1e9:.1f} GB/s of processing, or, at this "
            f"machine's rate, a link slower than {need_link:.2f} Gbit/s.", ""]


def markdown(res: dict[str, Any], cmd: str, plot: str | None = None) -> str:
    from deltarefit.apps.bench.report import machine_info

    lines = ["# Transport benchmark", "", "Produced by:", "", "```", cmd, "```", "",
             f"A bf16 checkpoint of {res['mib']} MiB, {res['change_rate']:.0%} of its elements moved by +-1 ulp "
             "between the two versions. Times are wall seconds on this machine (trainer and rollout share it).",
             "", *([f"![refit times]({plot})", ""] if plot else []), "## Refit through a store at an emulated link", "",
             "| transport | link | full bytes | delta bytes | full: up | down | verify | **full** | delta: to commit "
             "| sync | **delta** | speed-up | rollout-side speed-up |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["store"]:
        lines.append(f"| {r['transport']} | {r['link']} | {r['full_bytes']:,} | {r['delta_bytes']:,} | "
                     f"{r['full_up']:.2f} | {r['full_down']:.2f} | {r['full_verify']:.2f} | **{r['full']:.2f}** | "
                     f"{r['delta_publish']:.2f} | {r['delta_sync']:.2f} | **{r['delta']:.2f}** | "
                     f"{r['speedup']:.1f}x | {r['rollout_speedup']:.1f}x |")
    lines += ["", "* *full*: upload the checkpoint through the link, download it, verify its fingerprint.",
              "* *delta*: `Publisher.publish` until its commit record exists (encode against the trainer's "
              "baseline, upload, commit), then the rollout's `Subscriber.sync` (download, check, apply in place, "
              "verify). The publisher's last step, advancing its own baseline, is off this critical path (a "
              "rollout need not wait for it) and is not counted; it is run before the sync, not beside it, "
              "because trainer and rollout share this machine's two cores.",
              "* *rollout-side speed-up*: (download + verify) / sync, what a rollout node waits for once the "
              "version is in the store.", ""]
    lines += _where_time_goes(res)
    d = res["dist"]
    if d:
        lines += ["## Inside a cluster: torch.distributed broadcast", "",
                  "| transport | full bytes | delta bytes | full | delta | speed-up |", "|---|---:|---:|---:|---:|---:|",
                  f"| {d['transport']} | {d['full_bytes']:,} | {d['delta_bytes']:,} | {d['full']:.2f} s | "
                  f"{d['delta']:.2f} s | {d['speedup']:.1f}x |", "",
                  "Full: a rank holding nothing gets the keyframe (broadcast, write, verify); delta: a rank one "
                  "version behind gets the delta (broadcast, apply, verify). No pacing: loopback gloo.", ""]
    s = res["s3"]
    if s:
        lines += ["## S3 throughput against a plain multipart transfer", "",
                  "| object | ours up | plain up | ours down | plain down | up ratio | down ratio |",
                  "|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {s['bytes'] / 1e6:.0f} MB | {s['ours_up_MBps']:.0f} MB/s | {s['plain_up_MBps']:.0f} MB/s | "
                  f"{s['ours_down_MBps']:.0f} MB/s | {s['plain_down_MBps']:.0f} MB/s | {s['up_ratio']:.2f} | "
                  f"{s['down_ratio']:.2f} |", "",
                  "Same SeaweedFS server on loopback, same object, best of 5 taking turns. *Plain*: boto3 `upload_file` / "
                  "`download_file` with the default `TransferConfig` (8 MiB parts, 10 threads), as `aws s3 cp`.", ""]
    lines += ["## Machine", ""] + [f"* {k}: {v}" for k, v in machine_info().items()] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.bench.transport", description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="checkpoint size in MiB (default 256)")
    ap.add_argument("--rate", type=float, default=0.03, help="fraction of elements changed (default 0.03)")
    ap.add_argument("--links", default="1Gbit,10Gbit", help="emulated link rates, comma-separated")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 (SeaweedFS) runs")
    ap.add_argument("--out", default=None, help="work directory (default: a temp dir, removed)")
    ap.add_argument("--markdown", default=None, help="write the report to this Markdown file")
    ap.add_argument("--json", default=None, help="write the raw figures to this JSON file")
    ap.add_argument("--dist-worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.dist_worker:
        return _dist_worker(a.dist_worker)
    work = a.out or tempfile.mkdtemp(prefix="deltarefit-transport-bench-")
    os.makedirs(work, exist_ok=True)
    try:
        res = run(a.mib, a.rate, [x for x in a.links.split(",") if x], not a.no_s3, work)
    finally:
        if a.out is None:
            shutil.rmtree(work, ignore_errors=True)
    cmd = "python -m deltarefit.apps.bench.transport " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.markdown:
        png = os.path.splitext(a.markdown)[0] + ".png"
        plotted = write_plot(res, png)
        text = markdown(res, cmd.strip(), os.path.basename(png) if plotted else None)
        with open(a.markdown, "w") as f:
            f.write(text + _kept_part(a.markdown))
    return 0


KEEP_MARKER = "<!-- Hand-written from here on"


def _kept_part(path: str) -> str:
    """The hand-written end of an existing report (from ``KEEP_MARKER`` on), to write back after the
    generated part; empty if there is none."""
    try:
        with open(path) as f:
            old = f.read()
    except OSError:
        return ""
    at = old.find(KEEP_MARKER)
    return "\n" + old[at:] if at >= 0 else ""


if __name__ == "__main__":
    sys.exit(main())
