"""Relay tree fan-out on loopback: time for 1 node against N nodes to receive and apply a version.

``python -m deltarefit.apps.bench.relay [--mib 32] [--nodes 16] [--fanout 4] [--rate 200Mbit]`` starts a
root on an empty stream and the nodes (real ``deltarefit relay`` processes, every connection paced to
``--rate``), waits until the tree has formed, then publishes one version (a keyframe of a synthetic
bf16 checkpoint of ``--mib`` MiB) and measures, from its commit, the time until every node has it
in its mirror (received, BLAKE3-checked) and until every node's checkpoint is installed and verified.
Cut-through forwarding should make N nodes take little longer than one; the ratio is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from ...io.procs import stop

ENV = dict(os.environ, DELTAREFIT_NO_PROGRESS="1")


def write_checkpoint(path: str, mib: float, seed: int = 0, *, mutate_from: str | None = None,
                     fraction: float = 0.05) -> None:
    """A single-tensor bf16 safetensors file of ``mib`` MiB of random weights (no torch needed); with
    ``mutate_from``, that file's tensor with ``fraction`` of its elements moved by one ulp."""
    rng = np.random.default_rng(seed)
    n = int(mib * (1 << 20)) // 2
    if mutate_from is None:
        w = (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32)
        bits = (w >> 16).astype(np.uint16)
    else:
        with open(mutate_from, "rb") as f:
            hlen = int.from_bytes(f.read(8), "little")
            f.seek(8 + hlen)
            bits = np.frombuffer(f.read(), dtype=np.uint16).copy()
        idx = np.flatnonzero(rng.random(bits.size) < fraction)
        bits[idx] = (bits[idx].astype(np.int64) + rng.choice([-1, 1], idx.size)).astype(np.uint16)
    header = json.dumps({"weight": {"dtype": "BF16", "shape": [bits.size], "data_offsets": [0, bits.nbytes]}})
    hb = header.encode() + b" " * (-len(header) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(hb).to_bytes(8, "little") + hb)
        f.write(bits.tobytes())
    os.replace(tmp, path)


def listening(log_path: str, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> str:
    """The address a relay started with ``--listen HOST:0`` listens on (the last one its log names)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(log_path, errors="replace") as f:
                found = re.findall(r"listening on (\S+)", f.read())
        except FileNotFoundError:
            found = []
        if found:
            return found[-1]
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"relay exited {proc.returncode} before listening; see {log_path}")
        time.sleep(0.02)
    raise RuntimeError(f"no 'listening on' in {log_path}")


def relay_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "deltarefit", "-v", "relay", *args]


def start(args: list[str], log_path: str) -> subprocess.Popen:
    with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(relay_cmd(*args), stdout=log, stderr=subprocess.STDOUT, env=ENV)


def count_in(path: str, needle: str) -> int:
    try:
        with open(path, errors="replace") as f:
            return f.read().count(needle)
    except FileNotFoundError:
        return 0


def trial(work: str, ckpt: str, nodes: int, fanout: int, rate: str,
          timeout: float = 300.0) -> tuple[float, float, float]:
    """One run: (seconds until every node received the version, seconds until every node applied it,
    CPU seconds the relay processes used meanwhile)."""
    from deltarefit.relay.protocol import write_key
    from deltarefit.stream import Publisher

    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    store, key = os.path.join(work, "store"), os.path.join(work, "key")
    write_key(key)
    procs = [start(["root", store, "--listen", "127.0.0.1:0", "--key", key, "--fanout", str(fanout), "--rate", rate,
                    "--mirror", os.path.join(work, "root-mirror"), "--poll", "0.05"], os.path.join(work, "root.log"))]
    try:
        root = listening(os.path.join(work, "root.log"), procs[0])
        cks = [os.path.join(work, f"n{i}", "model.safetensors") for i in range(nodes)]
        for i, ck in enumerate(cks):
            os.makedirs(os.path.dirname(ck))
            procs.append(start(["node", ck, "--join", root, "--listen", "127.0.0.1:0", "--key", key,
                                "--fanout", str(fanout), "--rate", rate, "--id", f"n{i}", "--until-version", "1"],
                               os.path.join(work, f"n{i}.log")))
        t_end = time.monotonic() + timeout
        logs = [os.path.join(work, f"n{i}.log") for i in range(nodes)]
        while sum(count_in(p, "attached to") > 0 for p in logs) < nodes:  # the tree has formed
            if time.monotonic() > t_end or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the tree did not form; see the logs in {work}")
            time.sleep(0.05)
        time.sleep(0.5)
        # Time from the commit point (the publisher goes on advancing its baseline after it).
        commit = os.path.join("v", f"{1:012d}", "commit.json")
        pub = threading.Thread(target=Publisher(store, os.path.join(work, "pub")).publish, args=(ckpt,), daemon=True)
        pub.start()
        while not os.path.exists(os.path.join(store, commit)):
            if time.monotonic() > t_end:
                raise RuntimeError("the publisher did not commit")
            time.sleep(0.002)
        t0 = time.monotonic()
        cpu0 = {p.pid: _cpu_seconds(p.pid) for p in procs}
        cpu1 = dict(cpu0)  # last reading of each process (one that exits keeps its last one)
        got: dict[int, float] = {}
        done: dict[int, float] = {}
        while len(done) < nodes:
            now = time.monotonic()
            if now > t_end:
                raise RuntimeError(f"timed out; see the logs in {work}")
            for p in procs:
                cpu1[p.pid] = _cpu_seconds(p.pid) or cpu1[p.pid]
            for i, ck in enumerate(cks):
                if i not in got and os.path.exists(os.path.join(ck + ".relay-mirror", commit)):
                    got[i] = now - t0
                if i not in done and os.path.exists(ck + ".deltarefit-version.json"):
                    done[i] = now - t0
                    got.setdefault(i, done[i])
            time.sleep(0.02)
        cpu = sum(cpu1.values()) - sum(cpu0.values())
        pub.join()
        return max(got.values()), max(done.values()), cpu
    finally:
        stop(procs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.bench.relay", description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=32, help="checkpoint (version) size in MiB (default 32)")
    ap.add_argument("--nodes", type=int, default=16, help="nodes in the large tree (default 16)")
    ap.add_argument("--fanout", type=int, default=4, help="children per relay (default 4)")
    ap.add_argument("--rate", default="200Mbit", help="pace of every connection (default 200Mbit)")
    ap.add_argument("--out", default=None, help="work directory (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    work = args.out or tempfile.mkdtemp(prefix="deltarefit-relay-bench-")
    os.makedirs(work, exist_ok=True)
    try:
        ckpt = os.path.join(work, "model.safetensors")
        write_checkpoint(ckpt, args.mib)
        size = os.path.getsize(ckpt)
        print(f"version: keyframe of {size / 1e6:.1f} MB; every connection paced to {args.rate}; "
              f"fan-out {args.fanout}")
        res = {}
        for n in (1, args.nodes):
            recv, applied, cpu = trial(os.path.join(work, f"tree{n}"), ckpt, n, args.fanout, args.rate)
            res[n] = (recv, applied)
            print(f"{n:3d} node(s): all received {recv:6.2f} s, all applied and verified {applied:6.2f} s "
                  f"({cpu:.2f} CPU s in the relays; load average {os.getloadavg()[0]:.1f} on "
                  f"{os.cpu_count()} cores)")
        (r1, a1), (rn, an) = res[1], res[args.nodes]
        print(f"ratio {args.nodes} nodes / 1 node: received {rn / r1:.2f}x, applied {an / a1:.2f}x "
              f"(one link alone: {size / 1e6 / (_rate_bytes(args.rate) / 1e6):.2f} s)")
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a running process (Linux ``/proc``; 0 elsewhere or once it exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _rate_bytes(rate: str) -> float:
    from deltarefit.transport import parse_rate

    return parse_rate(rate) or float("inf")


if __name__ == "__main__":
    sys.exit(main())
