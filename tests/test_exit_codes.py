"""docs/COMMAND-LINE.md's exit-code table, case by case, from real ``python -m deltarefit`` runs.

Each case names the exit code it must end with and a phrase of that code's row in the table (so the
table lists the case); the run must end with that code and one line on stderr naming what and where.
``test_errors`` checks the table's classes against the hierarchy; this checks what the commands do.
The disk-full and read-only cases mount a tmpfs (root only), the permission-denied cases run the child
without ``CAP_DAC_OVERRIDE`` (``bench.fs_machinery``); each is skipped with its reason where it cannot run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from test_fs_faults import DENY, MOUNT
from test_fs_identity import ENV, versions

import deltarefit
from deltarefit.apps.bench import fs_machinery as M
from deltarefit.stream import Publisher, Subscriber

ROOT = Path(__file__).resolve().parents[1]


def table() -> dict[int, str]:
    """exit code -> its row's meaning, from docs/COMMAND-LINE.md."""
    rows = {}
    for line in (ROOT / "docs" / "COMMAND-LINE.md").read_text().splitlines():
        m = re.match(r"^\| (\d+) \| `(\w+)` \| (.+) \|$", line)
        if m:
            rows[int(m.group(1))] = m.group(3)
    return rows


@dataclass
class World:
    """What the cases run on: checkpoints v0..v3, a delta v0 -> v1, a store of versions 1..3 (1 the only
    keyframe), a key pair, and a scratch directory."""

    root: str
    vs: list[str]
    delta: str
    store: str
    key: str
    held: list[subprocess.Popen] = field(default_factory=list)

    def path(self, *names: str) -> str:
        return os.path.join(self.root, *names)

    def copy(self, src: str, name: str) -> str:
        shutil.copyfile(src, self.path(name))
        return self.path(name)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("exit-codes"))
    os.makedirs(os.path.join(root, "src"))
    vs = versions(os.path.join(root, "src"), 4)
    delta = os.path.join(root, "v0-v1.delta")
    deltarefit.encode(vs[0], vs[1], delta)
    store = os.path.join(root, "store")
    pub = Publisher(store, os.path.join(root, "pub"), keyframe_every=50, keyframe_ratio=1000.0)
    for v in vs[:3]:
        pub.publish(v)
    key = os.path.join(root, "key")
    assert subprocess.run([sys.executable, "-m", "deltarefit", "keygen", key], env=ENV,
                          capture_output=True).returncode == 0
    w = World(root, vs, delta, store, key)
    yield w
    for p in w.held:
        p.kill()
        p.wait()


@dataclass
class Case:
    exit: int
    phrase: str  # in the table's row of ``exit``
    argv: Callable[[World, str], list[str]]  # (world, the case's own directory) -> arguments
    says: str = ""  # in the error line
    needs: str = ""  # "mount" (a tmpfs), "deny" (a child without DAC capabilities)
    # (world, case dir) -> None, run before; may mount at ``case dir``/fs
    setup: Callable[[World, str], None] | None = None


def _fifo(w: World, d: str) -> None:
    os.mkfifo(os.path.join(d, "fifo.safetensors"))


def _missing_dir_ck(w: World, d: str) -> list[str]:
    return ["sync", w.store, os.path.join(d, "no", "such", "ck.safetensors")]


def _truncated_delta(w: World, d: str) -> None:
    with open(w.delta, "rb") as f, open(os.path.join(d, "bad.delta"), "wb") as g:
        g.write(f.read()[:-100])
    shutil.copyfile(w.vs[0], os.path.join(d, "ck.safetensors"))


def _base(w: World, d: str) -> None:
    shutil.copyfile(w.vs[0], os.path.join(d, "ck.safetensors"))


def _wrong_base(w: World, d: str) -> None:
    shutil.copyfile(w.vs[2], os.path.join(d, "ck.safetensors"))


def _planted_staging(w: World, d: str) -> None:
    os.makedirs(os.path.join(d, "victim"))
    os.symlink(os.path.join(d, "victim"), os.path.join(d, "ck.safetensors.deltarefit-staging"))


_HOLD = r"""
import sys, time
from deltarefit.apply import checkpoint_lock
with checkpoint_lock(sys.argv[1]):
    print("HOLDING", flush=True)
    time.sleep(120)
"""


def _held(w: World, d: str) -> None:
    ck = os.path.join(d, "ck.safetensors")
    shutil.copyfile(w.vs[0], ck)
    p = subprocess.Popen([sys.executable, "-c", _HOLD, ck], stdout=subprocess.PIPE, text=True, env=ENV)
    w.held.append(p)
    assert p.stdout.readline().strip() == "HOLDING"


def _unwritable_dir(w: World, d: str) -> None:
    shutil.copyfile(w.vs[0], os.path.join(d, "ck.safetensors"))
    os.chmod(d, 0o555)


def _unreadable_part(w: World, d: str) -> None:
    """A copy of the store whose version-3 delta (the one part a subscriber at 2 fetches) is unreadable."""
    st = os.path.join(d, "store")
    shutil.copytree(w.store, st)
    for dp, _, fs in os.walk(os.path.join(st, "v")):
        for f in fs:
            if "000000000003" in dp + f and f.endswith("delta"):
                os.chmod(os.path.join(dp, f), 0)
    Subscriber(st, os.path.join(d, "ck.safetensors")).sync(to_version=2)


def _full(w: World, d: str) -> None:
    """A tmpfs at d/fs with room for a quarter of the checkpoint: a fresh sync's keyframe does not fit."""
    fs = os.path.join(d, "fs")
    os.makedirs(fs)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", fs], check=True)
    M.fill(fs, os.path.getsize(w.vs[0]) // 4)


def _read_only(w: World, d: str) -> None:
    fs = os.path.join(d, "fs")
    os.makedirs(fs)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", fs], check=True)
    shutil.copyfile(w.vs[0], os.path.join(fs, "ck.safetensors"))
    M.remount(fs, "ro")


def _corrupt_record(w: World, d: str) -> None:
    shutil.copyfile(w.vs[0], os.path.join(d, "ck.safetensors"))
    with open(os.path.join(d, "ck.safetensors.deltarefit-version.json"), "w") as f:
        f.write("{not json")


def _not_the_demos(w: World, d: str) -> None:
    os.makedirs(os.path.join(d, "mine", "original"))


CASES: dict[str, Case] = {
    "usage: a demo --out directory the demo did not make": Case(
        2, "a `demo --out` directory that is not empty", lambda w, d: ["demo", "--out", os.path.join(d, "mine")],
        "not a directory the demo made", setup=_not_the_demos),
    "usage: a bad option value": Case(2, "usage", lambda w, d: ["sync", w.store, "c", "--to", "0"], "--to"),
    "usage: an output in a missing directory": Case(
        2, "an output whose directory does not exist",
        lambda w, d: ["encode", w.vs[0], w.vs[1], "-o", os.path.join(d, "no", "x.delta")], "does not exist"),
    "usage: an output that is an input": Case(
        2, "an output that is one of the inputs", lambda w, d: ["encode", w.vs[0], w.vs[1], "-o", w.vs[0]],
        "input"),
    "corrupt delta": Case(3, "corrupt delta",
                          lambda w, d: ["apply", os.path.join(d, "bad.delta"), os.path.join(d, "ck.safetensors")],
                          "bad.delta", setup=_truncated_delta),
    "missing checkpoint": Case(4, "missing", lambda w, d: ["fingerprint", os.path.join(d, "none.safetensors")],
                               "no such checkpoint"),
    "not a safetensors file": Case(4, "not a safetensors file", lambda w, d: ["fingerprint", w.delta],
                                   "not a safetensors file"),
    "status of a checkpoint that is not there": Case(
        4, "`status` of a checkpoint that is not there", lambda w, d: ["status", os.path.join(d, "none.safetensors")],
        "no such checkpoint"),
    "a FIFO to fingerprint": Case(4, "a FIFO", lambda w, d: ["fingerprint", os.path.join(d, "fifo.safetensors")],
                                  "a FIFO", setup=_fifo),
    "a FIFO to encode": Case(4, "a FIFO", lambda w, d: ["encode", os.path.join(d, "fifo.safetensors"), w.vs[1],
                                                         "-o", os.path.join(d, "x.delta")], "a FIFO", setup=_fifo),
    "a FIFO to publish": Case(4, "a FIFO", lambda w, d: ["publish", os.path.join(d, "st"),
                                                          os.path.join(d, "fifo.safetensors")], "a FIFO", setup=_fifo),
    "a link planted at the staging": Case(4, "the staging directory",
                                          lambda w, d: ["sync", w.store, os.path.join(d, "ck.safetensors")],
                                          "symbolic link", setup=_planted_staging),
    "wrong base": Case(5, "wrong base", lambda w, d: ["apply", w.delta, os.path.join(d, "ck.safetensors")],
                       "wrong base", setup=_wrong_base),
    "verification failed": Case(6, "a fingerprint that does not match",
                                lambda w, d: ["verify", w.vs[0], "0" * 64], "v0.safetensors"),
    "the store's own permissions": Case(7, "the store's own", lambda w, d: ["sync", os.path.join(d, "store"),
                                                                             os.path.join(d, "ck.safetensors")],
                                        "Permission denied", needs="deny", setup=_unreadable_part),
    "status against a store that is not there": Case(
        7, "a store that is not there", lambda w, d: ["status", w.vs[0], "--store", os.path.join(d, "nowhere")],
        "no store here"),
    "a missing signature": Case(8, "missing signature",
                                lambda w, d: ["sync", w.store, os.path.join(d, "ck.safetensors"), "--verify-key",
                                              w.key + ".pub"], "sign"),
    "a version that does not exist": Case(9, "a version that does not exist",
                                          lambda w, d: ["sync", w.store, os.path.join(d, "ck.safetensors"),
                                                        "--to", "99"], "99"),
    "status of a corrupt version record": Case(
        9, "a corrupt version record", lambda w, d: ["status", os.path.join(d, "ck.safetensors")],
        "'deltarefit sync --repair' rebuilds it", setup=_corrupt_record),
    "locked": Case(11, "locked", lambda w, d: ["apply", w.delta, os.path.join(d, "ck.safetensors")], "pid",
                   setup=_held),
    "a missing directory": Case(12, "a missing directory", _missing_dir_ck, "does not exist"),
    "permission denied on the lock file": Case(
        12, "permission denied", lambda w, d: ["apply", w.delta, os.path.join(d, "ck.safetensors")],
        "deltarefit-lock", needs="deny", setup=_unwritable_dir),
    "read-only on the lock file": Case(
        12, "read-only", lambda w, d: ["apply", w.delta, os.path.join(d, "fs", "ck.safetensors")],
        "deltarefit-lock", needs="mount", setup=_read_only),
    "disk full staging a keyframe": Case(
        12, "disk full", lambda w, d: ["sync", w.store, os.path.join(d, "fs", "ck.safetensors")],
        "No space left on device", needs="mount", setup=_full),
}


def test_every_exit_code_of_the_table_has_a_case():
    """Every row but 1 (unexpected) is exercised below (10, the relay's, by tests/test_relay.py)."""
    assert set(table()) - {c.exit for c in CASES.values()} == {1, 10}


@pytest.mark.parametrize("name", list(CASES))
def test_each_case_exits_as_the_table_says(world, tmp_path, name):
    """Regression (issue 46 item 10): the lock file read-only or denied exited 4, a disk full while staging
    a keyframe 7, a missing directory 4 (the table says 12), and a FIFO given to fingerprint, encode or
    publish was called "no such checkpoint file"."""
    c = CASES[name]
    assert c.phrase in table()[c.exit], f"{name}: the table's row {c.exit} does not list {c.phrase!r}"
    if c.needs == "mount" and MOUNT is not None:
        pytest.skip(f"needs a real tmpfs: {MOUNT}")
    if c.needs == "deny" and DENY is not None:
        pytest.skip(f"permission denied for this test: {DENY}")
    d = str(tmp_path / "case")
    os.makedirs(d)
    mounted = os.path.join(d, "fs")
    try:
        if c.setup is not None:
            c.setup(world, d)
        r = M.cli(c.argv(world, d), unprivileged=c.needs == "deny", timeout=60)
    finally:
        os.chmod(d, 0o755)
        if os.path.ismount(mounted):
            subprocess.run(["umount", "-l", mounted], check=False)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.rc == c.exit, f"{name}: exit {r.rc}, the table says {c.exit}:\n{r.stderr}"
    assert len(lines) == 1 and lines[0].startswith("deltarefit: error: ") and "Traceback" not in r.stderr, r.stderr
    assert c.says in lines[0], (c.says, lines[0])
