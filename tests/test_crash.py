"""Crash safety with real processes and real signals: `deltarefit apply` and `deltarefit encode` are
SIGKILLed at random moments (seeded; the draws are printed), then rerun to completion.

After every kill and rerun the working checkpoint must be the target byte for byte, its fingerprint must
verify, and no journal may remain. A killed encode must never leave a file at the output path.
Kill times are drawn in [0, 1.1 x the measured duration]; because the write phase is a small part of an
apply (the plan hashes everything first), half of the kills are instead timed from the moment the journal
appears (the write phase has begun), so that mid-write kills, torn chunks included, are actually exercised.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
from _pairs import journal_of, sha, write_big_pair

import deltarefit
from deltarefit.errors import FormatError
from deltarefit.format import DeltaReader

SEED = 20240611
BIG_MIB = 96
ITERATIONS = 8
TIMEOUT = 120  # seconds, for any one subprocess
ENV = dict(os.environ, DELTAREFIT_NO_PROGRESS="1")


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "deltarefit", *args]


def run_ok(*args: str) -> subprocess.CompletedProcess:
    r = subprocess.run(_cmd(*args), capture_output=True, text=True, timeout=TIMEOUT, env=ENV, check=False)
    assert r.returncode == 0, f"deltarefit {' '.join(args)} exited {r.returncode}: {r.stderr}"
    return r


def apply_json(delta: str, ckpt: str) -> dict:
    return json.loads(run_ok("apply", delta, ckpt, "-q", "--json").stdout)


def kill_at(args: list[str], *, delay: float | None = None, after_file: str | None = None,
            after_delay: float = 0.0) -> tuple[int, float]:
    """Start ``deltarefit *args``; SIGKILL it ``delay`` s after the start, or ``after_delay`` s after
    ``after_file`` appears. Returns (exit status, seconds from start to the kill)."""
    p = subprocess.Popen(_cmd(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    t0 = time.monotonic()
    try:
        if after_file is None:
            time.sleep(delay)
        else:
            while not os.path.exists(after_file) and p.poll() is None and time.monotonic() - t0 < TIMEOUT:
                time.sleep(0.0002)
            time.sleep(after_delay)
        t_kill = time.monotonic() - t0
        p.send_signal(signal.SIGKILL)  # a no-op (ESRCH is swallowed) if it already exited
        _, err = p.communicate(timeout=TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=TIMEOUT)
    assert p.returncode in (0, -signal.SIGKILL), f"exit {p.returncode}: {err.decode(errors='replace')}"
    return p.returncode, t_kill


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    d = tmp_path_factory.mktemp("big")
    base, target = write_big_pair(d, mib=BIG_MIB)
    delta = str(d / "big.delta")
    rep = deltarefit.encode(base, target, delta)
    return {"dir": d, "base": base, "target": target, "delta": delta, "target_sha": sha(target),
            "fp": rep.target_fingerprint, "records": len(DeltaReader(delta).records)}


def _calibrate(big, work: str) -> tuple[float, float, float]:
    """(seconds one CLI apply takes, seconds until its journal appears, seconds the journal lives: the
    write phase, its verification and the final flush)."""
    best = None
    for _ in range(2):  # the first run may pay for a JIT cache refresh; keep the faster
        shutil.copyfile(big["base"], work)
        p = subprocess.Popen(_cmd("apply", big["delta"], work, "-q"), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, env=ENV)
        t0 = time.monotonic()
        seen = gone = None
        while p.poll() is None and time.monotonic() - t0 < TIMEOUT:
            exists = os.path.exists(journal_of(work))
            if seen is None and exists:
                seen = time.monotonic() - t0
            if seen is not None and gone is None and not exists:
                gone = time.monotonic() - t0
            time.sleep(0.0002)
        p.wait(timeout=TIMEOUT)
        total = time.monotonic() - t0
        assert p.returncode == 0, p.stderr.read()
        assert sha(work) == big["target_sha"]
        seen = total if seen is None else seen
        cand = (total, seen, (total if gone is None else gone) - seen)
        best = cand if best is None or cand[0] < best[0] else best
    return best


def test_kill_apply_then_rerun(big, tmp_path):
    work = str(tmp_path / "work.safetensors")
    total, t_journal, write_span = _calibrate(big, work)
    print(f"\napply: {total:.3f} s per run, journal from {t_journal:.3f} s for {write_span:.3f} s; "
          f"{big['records']} chunk records; seed {SEED}")
    rng = random.Random(SEED)
    mid_write = 0
    for i in range(ITERATIONS):
        shutil.copyfile(big["base"], work)
        if i == 0:
            plan = ("time", 0.0)  # before the interpreter is even up
        elif i == 1:
            plan = ("time", 1.1 * total)  # probably after it finished
        elif i % 2:
            plan = ("time", rng.uniform(0, 1.1 * total))
        else:
            plan = ("journal", rng.uniform(0, 1.2 * write_span))
        args = ["apply", big["delta"], work, "-q"]
        if plan[0] == "time":
            rc, t_kill = kill_at(args, delay=plan[1])
        else:
            rc, t_kill = kill_at(args, after_file=journal_of(work), after_delay=plan[1])
        had_journal = os.path.exists(journal_of(work))
        state = "unchanged" if sha(work) == sha(big["base"]) else "target" if sha(work) == big["target_sha"] \
            else "partial"
        second = ""
        if i % 3 == 2 and had_journal:  # kill the recovery run too, once it is writing
            d2 = rng.uniform(0, 1.2 * write_span)
            rc2, _ = kill_at(args, after_file=journal_of(work), after_delay=d2)
            second = f"; recovery run killed {d2:.4f} s into its write phase (exit {rc2})"
        rep = apply_json(big["delta"], work)
        print(f"  #{i}: kill {plan[0]}={plan[1]:.4f} s (at {t_kill:.3f} s, exit {rc}), checkpoint {state}, "
              f"journal {'left' if had_journal else 'none'}{second}; rerun applied {rep['chunks_applied']}, "
              f"skipped {rep['chunks_skipped']}, recovered {rep['chunks_recovered']}")
        mid_write += had_journal
        assert rep["chunks_applied"] + rep["chunks_skipped"] + rep["chunks_recovered"] == big["records"]
        assert sha(work) == big["target_sha"], f"iteration {i}: checkpoint is not the target after the rerun"
        assert deltarefit.verify(work, big["fp"]) == big["fp"]
        assert not os.path.exists(journal_of(work)), f"iteration {i}: journal left after a successful rerun"
        assert glob.glob(str(tmp_path / "*.tmp-*")) == []
    assert mid_write >= 1, "no kill landed in the write phase: the test exercised nothing interesting"


def test_apply_twice_is_noop(big, tmp_path):
    work = str(tmp_path / "work.safetensors")
    shutil.copyfile(big["base"], work)
    first = apply_json(big["delta"], work)
    assert first["chunks_applied"] == big["records"] and first["chunks_skipped"] == 0
    digest, mtime = sha(work), os.stat(work).st_mtime_ns
    again = apply_json(big["delta"], work)
    assert again["chunks_applied"] == 0
    assert again["chunks_skipped"] == big["records"]
    assert again["chunks_recovered"] == 0 and again["written_bytes"] == 0
    assert again["target_fingerprint"] == big["fp"]
    assert sha(work) == digest == big["target_sha"]
    assert os.stat(work).st_mtime_ns == mtime, "a no-op apply modified the file"
    assert not os.path.exists(journal_of(work))


def _tmp_of(out: str) -> list[str]:
    return glob.glob(out + ".tmp-*")


def test_kill_encode_leaves_no_delta(big, tmp_path):
    out = str(tmp_path / "out.delta")
    args = ["encode", big["base"], big["target"], "-o", out, "-q"]
    # Calibrate: total time, and when the temp file appears and is renamed onto the output.
    p = subprocess.Popen(_cmd(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    t0 = time.monotonic()
    seen = renamed = None
    while p.poll() is None and time.monotonic() - t0 < TIMEOUT:
        if seen is None and _tmp_of(out):
            seen = time.monotonic() - t0
        if renamed is None and os.path.exists(out):
            renamed = time.monotonic() - t0
        time.sleep(0.0005)
    p.wait(timeout=TIMEOUT)
    total = time.monotonic() - t0
    assert p.returncode == 0, p.stderr.read()
    assert sha(out) == sha(big["delta"]), "encode is not deterministic: CLI and library runs differ"
    os.unlink(out)
    seen = total if seen is None else seen
    span = (total if renamed is None else renamed) - seen
    rng = random.Random(SEED + 1)
    draws = [("time", 0.0), ("time", rng.uniform(0, 0.9 * total)), ("time", rng.uniform(0, 0.9 * total)),
             ("tmp", rng.uniform(0, 0.9 * span)), ("tmp", rng.uniform(0, 0.9 * span))]
    print(f"\nencode: {total:.3f} s per run, temp file from {seen:.3f} s for {span:.3f} s; seed {SEED + 1}")
    partial = 0
    for mode, delay in draws:
        before = set(_tmp_of(out))
        if mode == "time":
            rc, t_kill = kill_at(args, delay=delay)
        else:
            # any temp file of *this* run: poll for a new one
            p = subprocess.Popen(_cmd(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
            mine = f"{out}.tmp-{p.pid}"
            t0 = time.monotonic()
            while not os.path.exists(mine) and p.poll() is None and time.monotonic() - t0 < TIMEOUT:
                time.sleep(0.0005)
            time.sleep(delay)
            t_kill = time.monotonic() - t0
            p.send_signal(signal.SIGKILL)
            p.communicate(timeout=TIMEOUT)
            rc = p.returncode
        new = sorted(set(_tmp_of(out)) - before)
        state = "complete" if os.path.exists(out) else "absent"
        print(f"  kill {mode}={delay:.4f} s (at {t_kill:.3f} s): exit {rc}, output {state}, "
              f"new temp files {[os.path.basename(t) for t in new]}")
        if os.path.exists(out):  # renamed into place before the kill: must be the whole delta
            assert sha(out) == sha(big["delta"]), f"killed at {t_kill:.4f} s, encode left a partial delta at {out}"
            os.unlink(out)
            continue
        assert rc == -signal.SIGKILL
        for t in new:  # a partial temp file is not a delta (its header is written last)
            try:
                DeltaReader(t).close()
            except FormatError:
                partial += 1
            else:
                assert sha(t) == sha(big["delta"]), f"{t} reads as a delta but is not the complete one"
    assert partial >= 1, "no kill landed while the delta was being written"
    run_ok(*args)
    assert sha(out) == sha(big["delta"]), "rerunning encode after kills gives other bytes"


# A real SIGKILL at an exact point: the child patches two seams (Checkpoint.write_raw, through which the
# apply writes each chunk's post-image into the file, and Journal.write) to kill itself there, then runs
# the real CLI. MODE "tear": the K-th chunk written is half written, then the process dies (a torn chunk,
# its journal record in slot 0). MODE "reuse": while replaying a torn chunk, wait until another writer
# thread has journaled its next chunk, then die.
_INJECT = r"""
import importlib, os, signal, sys, threading
from deltarefit.checkpoint import Checkpoint
Journal = importlib.import_module("deltarefit.apply").Journal
mode, k_target, delta, ckpt, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
orig_raw, orig_write = Checkpoint.write_raw, Journal.write
tls, wrote_any, count = threading.local(), threading.Event(), [0]

def jwrite(self, *a):
    orig_write(self, *a)
    tls.journaled = True
    wrote_any.set()

def write_raw(self, name, offset, data):
    assert threading.current_thread().name.startswith("apply"), "a write outside the write phase"
    journaled, tls.journaled = getattr(tls, "journaled", False), False
    count[0] += 1
    if mode == "tear" and count[0] == k_target:
        orig_raw(self, name, offset, data[:data.size // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "reuse" and not journaled:  # a torn chunk replayed from the journal
        wrote_any.wait(20)
        os.kill(os.getpid(), signal.SIGKILL)
    return orig_raw(self, name, offset, data)

Checkpoint.write_raw, Journal.write = write_raw, jwrite
sys.argv = ["deltarefit", "apply", delta, ckpt, "-q", "--threads", threads]
from deltarefit.cli import main
main()
"""


def _inject(mode: str, k: int, delta: str, ckpt: str, threads: int) -> int:
    r = subprocess.run([sys.executable, "-c", _INJECT, mode, str(k), delta, ckpt, str(threads)],
                       capture_output=True, text=True, timeout=TIMEOUT, env=ENV, check=False)
    return r.returncode


def test_torn_chunk_recovered(big, tmp_path):
    """A chunk half written when the process dies is restored from the journal by the next run."""
    work = str(tmp_path / "work.safetensors")
    shutil.copyfile(big["base"], work)
    assert _inject("tear", 3, big["delta"], work, 1) == -signal.SIGKILL
    assert os.path.exists(journal_of(work))
    rep = apply_json(big["delta"], work)
    assert rep["chunks_recovered"] == 1 and rep["chunks_skipped"] == 2
    assert sha(work) == big["target_sha"]
    assert not os.path.exists(journal_of(work))


def test_torn_chunk_survives_a_kill_during_its_replay(big, tmp_path):
    work = str(tmp_path / "work.safetensors")
    shutil.copyfile(big["base"], work)
    assert _inject("tear", 3, big["delta"], work, 1) == -signal.SIGKILL  # chunk 2 torn, record in slot 0
    assert _inject("reuse", 0, big["delta"], work, 2) == -signal.SIGKILL  # killed while replaying chunk 2
    r = subprocess.run(_cmd("apply", big["delta"], work, "-q"), capture_output=True, text=True,
                       timeout=TIMEOUT, env=ENV, check=False)
    assert r.returncode == 0, r.stderr
    assert sha(work) == big["target_sha"]
