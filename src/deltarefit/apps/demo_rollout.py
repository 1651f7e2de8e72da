"""The demo's rollout side: the rollout process (``python -m deltarefit.apps.demo rollout``), which syncs
its bf16 copy from the version stream (or waits for its relay node to), checks every fingerprint, loads
the weights into its live module, samples answers and stamps them with the version it holds; and
:class:`Rollouts`, the trainer's handle on those processes, one JSON line in and one JSON line out each.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

from .demo_task import (
    SAMPLES,
    answer_probs,
    flip_one_byte,
    make_task,
    model_dir,
    out_hash,
    quiet_transformers,
    served_forward,
)

if TYPE_CHECKING:
    from .demo_transports import RelayTree

REPLY_TIMEOUT_S = 300.0


def rollout_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.demo rollout")
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault", default="", help="KIND:STEP, see the module docstring")
    ap.add_argument("--follow-relay", action="store_true",
                    help="a relay node keeps the checkpoint in sync (STORE is its mirror): wait for it")
    a = ap.parse_args(argv)
    # stdout carries the protocol (one JSON object per line); anything else printed goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(msg: dict) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    import torch

    torch.set_num_threads(1)
    transformers = quiet_transformers()
    from ..stream.subscriber import Subscriber

    config = transformers.AutoConfig.from_pretrained(model_dir())
    # The architecture only: every weight this process ever uses comes from the version stream.
    model = transformers.AutoModel.from_config(config).to(torch.bfloat16).eval()
    ids, head, target = make_task(a.seed, config.vocab_size, config.hidden_size)
    sub = Subscriber(a.store, a.checkpoint, subscriber_id=f"rollout-{a.index}", threads=1)
    fault_kind, fault_step = (a.fault.split(":")[0], int(a.fault.split(":")[1])) if a.fault else ("", -1)
    kernels_s = None if a.follow_relay else warm_kernels(os.path.dirname(os.path.abspath(a.checkpoint)))
    send({"ready": True, "rollout": a.index, "pid": os.getpid(), "kernels_s": kernels_s})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("cmd") == "stop":
            break
        step = int(msg["step"])
        fault = fault_kind if step == fault_step else ""
        try:
            reply = _rollout_step(a, msg, sub, model, ids, head, target, fault)
        except Exception as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        reply.update(rollout=a.index, step=step)
        send(reply)
        if fault == "file" and reply.get("ok"):
            flip_one_byte(a.checkpoint)  # between steps: the next sync must refuse this copy
    return 0


def warm_kernels(work: str) -> float:
    """Encode and apply a small bf16 pair (one-ulp, scattered and dense changes) in a temp directory
    under ``work``, so the codec's numba kernels are loaded in this process before the first sync is
    timed; returns the seconds it took. numba compiles them on the first run after an install (a few
    seconds; it keeps them in its cache, ``__pycache__`` or ``NUMBA_CACHE_DIR``) and loads them from
    that cache after, in a fraction of a second. The demo reports this time on its own line."""
    import tempfile

    import numpy as np

    from ..apply.files import apply
    from ..checkpoint.header import TensorSource
    from ..checkpoint.write import write_safetensors
    from ..encode import encode

    t0 = time.perf_counter()
    d = tempfile.mkdtemp(prefix=".kernels-", dir=work)
    try:
        rng = np.random.default_rng(0)
        n = 1 << 19  # one segment of bf16
        base = {k: (rng.standard_normal(n, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
                for k in ("ulp", "sparse", "dense")}
        new = {k: v.copy() for k, v in base.items()}
        new["ulp"][::50] += 1
        new["sparse"][::20] ^= rng.integers(1, 1 << 15, n // 20 + 1, dtype=np.uint16)
        new["dense"] ^= rng.integers(1, 1 << 15, n, dtype=np.uint16)
        paths = []
        for label, tensors in (("base", base), ("new", new)):
            path = os.path.join(d, f"{label}.safetensors")
            write_safetensors(path, [TensorSource(k, "BF16", (n,), 2 * n, lambda v=v: [v]) for k, v in tensors.items()])
            paths.append(path)
        # Both format versions: a format 2 stream codes its sparsest chunks with format 1's coder where smaller.
        for fv in (2, 1):
            work_copy = os.path.join(d, f"w{fv}.safetensors")
            shutil.copyfile(paths[0], work_copy)
            encode(paths[0], paths[1], os.path.join(d, f"w{fv}.delta"), threads=1, format_version=fv)
            apply(os.path.join(d, f"w{fv}.delta"), work_copy, threads=1)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return time.perf_counter() - t0


def _wait_for_relay(sub, version: int, timeout: float = 90.0):
    """With --transport relay the rollout's relay node syncs the checkpoint (same subscriber, same
    checks, same recorded state); the rollout waits until the node has recorded ``version``."""
    from ..stream.subscriber import SyncReport

    end = time.monotonic() + timeout
    while True:
        cur = sub.current()
        if cur is not None and cur[0] >= version:
            return SyncReport(version, cur[0], cur[1], "relay", 0, [cur[0]])
        if time.monotonic() > end:
            raise TimeoutError(f"the relay node did not bring the checkpoint to version {version} in {timeout:.0f} s"
                               f" (it holds {cur[0] if cur else 'nothing'})")
        time.sleep(0.005)


def _rollout_step(a, msg: dict, sub, model, ids, head, target, fault: str) -> dict:
    import torch
    from safetensors.torch import load_file

    from ..api import fingerprint
    from ..apply.tensors import state_dict_fingerprint
    from ..stream.records import load_commit

    want_version, want_fp = int(msg["version"]), str(msg["fingerprint"])
    t0 = time.perf_counter()
    # Download, check the parts against the commit record, apply in place, verify (or let the relay
    # node do exactly that, and wait for it).
    rep = _wait_for_relay(sub, want_version) if a.follow_relay else sub.sync()
    sync_s = time.perf_counter() - t0
    if fault == "applied":
        flip_one_byte(a.checkpoint)
    cur = sub.current()
    if cur is None:
        return {"ok": False, "error": "no version recorded after sync"}
    version, fp = cur
    if version != want_version:
        return {"ok": False, "error": f"synced to version {version}, the trainer published {want_version}"}
    rec_fp = load_commit(sub.store, version).fingerprint
    file_fp = fingerprint(a.checkpoint, threads=1)
    if not (fp == rec_fp == file_fp == want_fp):
        return {"ok": False, "error": f"fingerprint mismatch at version {version}: checkpoint {file_fp[:16]}…, "
                                      f"recorded {fp[:16]}…, commit record {rec_fp[:16]}…, trainer's export "
                                      f"{want_fp[:16]}…"}
    model.load_state_dict(load_file(a.checkpoint), strict=True)
    if fault == "memory":
        with torch.no_grad():
            w = model.get_input_embeddings().weight
            w.view(-1).view(torch.int16)[12345] += 1
    live_fp = state_dict_fingerprint(model.state_dict(), threads=1)
    if live_fp != want_fp:
        return {"ok": False, "error": f"fingerprint mismatch at version {version}: the live module's weights "
                                      f"are {live_fp[:16]}…, the trainer's export {want_fp[:16]}…"}
    refit_s = time.perf_counter() - t0
    # Generate the next rollouts with the bf16 weights this process holds, stamped with their version.
    hidden = served_forward(model, ids)
    probs = answer_probs(hidden, head)
    gen = torch.Generator().manual_seed(1_000_003 * a.seed + 1009 * int(msg["step"]) + a.index)
    actions = torch.multinomial(probs, SAMPLES, replacement=True, generator=gen)  # [PROMPTS, SAMPLES]
    stamp = sub.current()[0]
    if fault == "stamp":
        stamp -= 1
    return {"ok": True, "policy_version": stamp, "fingerprint": file_fp, "live_fingerprint": live_fp,
            "out_hash": out_hash(hidden), "actions": actions.tolist(),
            "reward": float((actions == target[:, None]).float().mean()), "route": rep.route,
            "bytes_fetched": rep.bytes_fetched, "sync_s": sync_s, "refit_s": refit_s}


class Rollouts:
    """The rollout subprocesses: one JSON line in (a command), one JSON line out (its reply)."""

    def __init__(self, n: int, store: str, out: str, seed: int, fault: tuple[str, int, int] | None,
                 relay: RelayTree | None = None) -> None:
        self.replies: queue.Queue[tuple[int, dict | None]] = queue.Queue()
        self.procs: list[subprocess.Popen] = []
        self.paths: list[str] = []
        for i in range(n):
            d = os.path.join(out, f"rollout-{i}")
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, "model.safetensors")
            self.paths.append(path)
            src = store if relay is None else relay.add_node(i, path, d)
            cmd = [sys.executable, "-m", "deltarefit.apps.demo", "rollout", "--index", str(i), "--store", src,
                   "--checkpoint", path, "--seed", str(seed)] + (["--follow-relay"] if relay else [])
            if fault and fault[1] == i:
                cmd += ["--fault", f"{fault[0]}:{fault[2]}"]
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            self.procs.append(p)
            threading.Thread(target=self._read, args=(i, p), daemon=True).start()

    def _read(self, i: int, p: subprocess.Popen) -> None:
        for line in p.stdout:
            try:
                self.replies.put((i, json.loads(line)))
            except ValueError:
                self.replies.put((i, {"ok": False, "error": f"unreadable reply {line[:80]!r}"}))
        self.replies.put((i, None))

    def send(self, msg: dict) -> None:
        for p in self.procs:
            p.stdin.write(json.dumps(msg) + "\n")
            p.stdin.flush()

    def collect(self, timeout: float = REPLY_TIMEOUT_S) -> dict[int, dict]:
        """One reply per rollout; a rollout that exits or stays silent gives an error reply."""
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(self.procs):
            try:
                i, msg = self.replies.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                for j in range(len(self.procs)):
                    got.setdefault(j, {"ok": False, "error": f"no reply within {timeout:.0f} s"})
                break
            if msg is None:
                msg = {"ok": False, "error": f"the process exited (code {self.procs[i].wait()})"}
            got.setdefault(i, msg)
        return got

    def close(self) -> None:
        for p in self.procs:
            try:
                if p.poll() is None:
                    p.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
                    p.stdin.flush()
                p.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
