"""A newcomer's mistakes, as real ``python -m deltarefit`` runs over one shared world (real checkpoints, deltas,
stores and keys, built once): each ends with its exit code, one line on stderr and no traceback; a refusal
names the path(s) involved, says what was written, and gives a fix (a command or a flag); a no-op says it
is one and exits 0; a suspicious success warns in one line. Nothing of the world changes under a refusal.

Each case is a row of ``CASES``; ``{s}`` in an argument is the case's own scratch directory (a path the
case may be told to write). The exit codes are those of docs/COMMAND-LINE.md (``test_exit_codes`` checks
one case per code; this checks the words).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
from safetensors.numpy import save_file

import deltarefit
from deltarefit.stream import Publisher, Subscriber

CLI = [sys.executable, "-m", "deltarefit"]
ENV = {**os.environ, "COLUMNS": "200", "DELTAREFIT_NO_PROGRESS": "1"}


@dataclass(frozen=True)
class Case:
    argv: str  # split on spaces; {s}: the case's scratch directory
    exit: int
    says: tuple[str, ...]  # in the one line (the error, the warning) or, for a no-op, in stdout
    fix: str | None = None  # a command or flag that is the way out, in the same line
    wrote: str | None = "nothing was written"  # what a refusal says it wrote (None: a read-only check)
    why_no_fix: str = ""  # where ``fix`` is None: why the line needs none


R = 5  # apply's wrong base
CASES: dict[str, Case] = {
    # -- a checkpoint that is not the delta's base
    "wrong base (a version ahead)": Case("apply d12.delta v3.safetensors", R,
                                         ("v3.safetensors", "d12.delta", "base fingerprint"), "deltarefit sync"),
    "checkpoint one version behind": Case("apply d23.delta v1.safetensors", R,
                                          ("v1.safetensors", "d23.delta", "another version of this model"),
                                          "deltarefit sync STORE v1.safetensors"),
    "a different model": Case("apply d12.delta other.safetensors", R, ("other.safetensors", "another model"),
                              "apply deltas encoded from this model's checkpoints"),
    "compose with a wrong --base": Case("compose d23.delta -o {s}/c.delta --base v1.safetensors", R,
                                        ("v1.safetensors", "d23.delta"), "--base"),
    # -- arguments swapped, or of the wrong kind
    "apply: swapped": Case("apply v1.safetensors d12.delta", 2, ("swapped", "v1.safetensors", "d12.delta"),
                           "deltarefit apply DELTA CHECKPOINT", "nothing was done"),
    "publish: swapped": Case("publish v1.safetensors s", 2, ("swapped", "v1.safetensors", "s is a store"),
                             "deltarefit publish STORE CHECKPOINT", "nothing was done"),
    "sync: swapped": Case("sync r.safetensors s", 2, ("swapped", "r.safetensors", "s is a store"),
                          "deltarefit sync STORE CHECKPOINT", "nothing was done"),
    "encode: a delta as the base": Case("encode d12.delta v2.safetensors -o {s}/x.delta", 4,
                                        ("d12.delta is a delta",), "deltarefit apply d12.delta", "nothing was done"),
    "encode: a delta as the target": Case("encode v1.safetensors d12.delta -o {s}/x.delta", 4,
                                          ("d12.delta is a delta",), "deltarefit encode BASE TARGET",
                                          "nothing was done"),
    "encode: a store as the base": Case("encode s v2.safetensors -o {s}/x.delta", 4, ("s is a version store",),
                                        "deltarefit sync s CHECKPOINT", "nothing was done"),
    "publish: a delta as the checkpoint": Case("publish s d12.delta", 4, ("d12.delta is a delta",),
                                               "deltarefit apply d12.delta", "nothing was done"),
    "sync: a delta as the checkpoint": Case("sync s d12.delta", 4, ("d12.delta is a delta",),
                                            "deltarefit apply d12.delta", "nothing was done"),
    "apply: a delta as the checkpoint": Case("apply d12.delta d23.delta", 4, ("d23.delta is a delta",),
                                             "deltarefit apply DELTA CHECKPOINT", "nothing was done"),
    "inspect: a checkpoint": Case("inspect v1.safetensors", 3, ("v1.safetensors is a checkpoint",),
                                  "deltarefit fingerprint v1.safetensors", "nothing was done"),
    "fingerprint: a delta": Case("fingerprint d12.delta", 4, ("d12.delta is a delta",),
                                 "deltarefit inspect d12.delta", "nothing was done"),
    "compose: deltas out of order": Case("compose d23.delta d12.delta -o {s}/c.delta --base v1.safetensors", 2,
                                         ("d12.delta", "d23.delta", "not a chain"), "oldest first"),
    # -- keys
    "sync: a wrong --verify-key": Case("sync ss {s}/r.safetensors --verify-key k2.pub", 8,
                                       ("ss version 1", "signature does not verify", "the record names key"),
                                       "give the public key of the pair it signs with"),
    "sync: a private key as --verify-key": Case("sync ss {s}/r.safetensors --verify-key k1", 2,
                                                ("k1", "it is a private key"), "k1.pub"),
    "publish: a public key as --sign": Case("publish ss v2.safetensors --sign k1.pub", 2,
                                            ("k1.pub", "it is a public key"), "sign with its private key k1"),
    "keygen over a key": Case("keygen k1", 2, ("k1 exists",), "name a new path"),
    "relay keygen over a key": Case("relay keygen k1", 2, ("k1 exists",), "name a new path"),
    # -- outputs
    "-o into a missing directory": Case("encode v1.safetensors v2.safetensors -o {s}/no/x.delta", 2,
                                        ("no/x.delta", "does not exist"), "mkdir -p"),
    "-o onto a directory": Case("encode v1.safetensors v2.safetensors -o emptydir", 2, ("emptydir is a directory",),
                                "-o emptydir/"),
    "-o onto an input": Case("encode v1.safetensors v2.safetensors -o v1.safetensors", 2,
                             ("v1.safetensors", "is the input"), "write the output elsewhere"),
    "compose -o into a missing directory": Case("compose d12.delta d23.delta -o {s}/no/c.delta --base v1.safetensors",
                                                2, ("no/c.delta", "does not exist"), "mkdir -p"),
    # -- stores: empty, missing, not one
    "sync before any publish": Case("sync empty-store {s}/r.safetensors", 9, ("empty-store", "no versions yet"),
                                    "deltarefit publish", "nothing written here"),
    "sync from a missing store": Case("sync nostore {s}/r.safetensors", 7, ("nostore", "no store here"),
                                      "deltarefit publish"),
    "log of a missing store": Case("log nostore", 7, ("nostore", "no store here"), "deltarefit publish"),
    "retain of a missing store": Case("retain nostore", 7, ("nostore", "no store here"), "deltarefit publish"),
    "publish into a file": Case("publish notes.txt v1.safetensors", 7, ("notes.txt", "not a store"),
                                "s3://bucket/prefix"),
    "sync --to past the head": Case("sync s r.safetensors --to 99", 9, ("version 99", "head is 2"),
                                    "deltarefit log"),
    "sync --stream-id of another stream": Case("sync s r.safetensors --stream-id abc", 9,
                                               ("r.safetensors", "not the requested abc"), "--stream-id"),
    "sync into a missing directory": Case("sync s {s}/no/r.safetensors", 12, ("no/r.safetensors", "does not exist"),
                                          "mkdir -p"),
    # -- missing files, directories where files go
    "apply a missing delta": Case("apply missing.delta v1.safetensors", 3, ("missing.delta", "No such file"),
                                  wrote=None, why_no_fix="a missing path: the path is the fix"),
    "apply onto a missing checkpoint": Case("apply d12.delta missing.safetensors", 4,
                                            ("missing.safetensors", "no such checkpoint"), wrote=None,
                                            why_no_fix="a missing path: the path is the fix"),
    "encode a missing base": Case("encode missing.safetensors v2.safetensors -o {s}/x.delta", 2,
                                  ("missing.safetensors", "does not exist"), "deltarefit encode --help", wrote=None),
    "fingerprint a missing file": Case("fingerprint missing.safetensors", 4, ("missing.safetensors",), wrote=None,
                                       why_no_fix="a missing path: the path is the fix"),
    "apply a directory as the delta": Case("apply emptydir v1.safetensors", 3, ("emptydir is a directory",),
                                           "deltarefit encode BASE TARGET -o FILE", "nothing was done"),
    "inspect a directory": Case("inspect emptydir", 3, ("emptydir is a directory",),
                                "deltarefit encode BASE TARGET -o FILE", "nothing was done"),
    "apply onto a directory of no weights": Case("apply d12.delta emptydir", 4, ("emptydir", "not a checkpoint"),
                                                 "a .safetensors file or a directory holding them"),
    "publish a directory of no weights": Case("publish {s}/st emptydir", 4, ("emptydir", "not a checkpoint"),
                                              "a .safetensors file or a directory holding them"),
    "apply a truncated delta": Case("apply bad.delta v1.safetensors", 3, ("bad.delta",), wrote=None,
                                    why_no_fix="a damaged file: nothing the command can change"),
    # -- usage
    "an unknown command": Case("pull s r.safetensors", 2, ("pull",), "deltarefit --help", wrote=None),
    "a bad option value": Case("sync s r.safetensors --to 0", 2, ("--to",), "deltarefit sync --help", wrote=None),
    "verify with a malformed fingerprint": Case("verify v1.safetensors abc", 2, ("abc",), "deltarefit fingerprint",
                                                wrote=None),
    "verify against another fingerprint": Case("verify v1.safetensors " + "0" * 64, 6, ("v1.safetensors",),
                                               wrote=None, why_no_fix="the answer of a check"),
    # -- suspicious successes warn (exit 0)
    "encode two unrelated checkpoints": Case("encode v1.safetensors unrelated.safetensors -o {s}/u.delta", 0,
                                             ("v1.safetensors", "unrelated.safetensors", "look unrelated"),
                                             "check the two paths", wrote=None),
    "encode a checkpoint against itself": Case("encode v1.safetensors v1.safetensors -o {s}/same.delta", 0,
                                               ("v1.safetensors", "same weights"), "check the two paths", wrote=None),
    # -- no-ops say so (exit 0, stdout)
    "publish the head again": Case("publish s v2.safetensors", 0, ("already version 2", "nothing published"),
                                   wrote=None, why_no_fix="a no-op"),
    "sync at the head": Case("sync s r.safetensors", 0, ("at version 2, nothing to do",), wrote=None,
                             why_no_fix="a no-op"),
    "sync the directory form at the head": Case("sync s rdir", 0, ("at version 2, nothing to do",), wrote=None,
                                                why_no_fix="a no-op"),
    "apply a delta twice": Case("apply d12.delta v2.safetensors", 0, ("already the target of d12.delta",
                                                                      "nothing to do"), wrote=None,
                                why_no_fix="a no-op"),
    "log of an empty store": Case("log empty-store", 0, ("no versions yet", "deltarefit publish empty-store"),
                                  wrote=None, why_no_fix="a no-op"),
    "prepare with nothing proposed": Case("sync s r.safetensors --prepare", 0, ("nothing to acknowledge",),
                                          wrote=None, why_no_fix="a no-op"),
}


def _ck(path: str, w: dict) -> None:
    save_file(w, path)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> str:
    """v1..v3 of one model, another model, an unrelated checkpoint of the same shapes; deltas v1->v2, v2->v3
    and a truncated one; a store ``s`` (versions 1, 2), a signed store ``ss`` (key k1; k2 another key),
    an empty store, a rollout ``r.safetensors`` and a one-file directory ``rdir`` at version 2."""
    root = str(tmp_path_factory.mktemp("mistakes"))
    rng = np.random.default_rng(0)
    w = {"w": rng.standard_normal((64, 64)).astype(np.float32), "b": rng.standard_normal(64).astype(np.float32)}
    for i in range(1, 4):
        w = {k: v.copy() for k, v in w.items()}
        w["w"][i::7, ::5] += 1e-3
        _ck(os.path.join(root, f"v{i}.safetensors"), w)
    _ck(os.path.join(root, "other.safetensors"), {"w": rng.standard_normal((32, 64)).astype(np.float32)})
    _ck(os.path.join(root, "unrelated.safetensors"), {k: rng.standard_normal(v.shape).astype(np.float32)
                                                       for k, v in w.items()})
    p = lambda *n: os.path.join(root, *n)  # noqa: E731
    deltarefit.encode(p("v1.safetensors"), p("v2.safetensors"), p("d12.delta"))
    deltarefit.encode(p("v2.safetensors"), p("v3.safetensors"), p("d23.delta"))
    with open(p("d12.delta"), "rb") as f, open(p("bad.delta"), "wb") as g:
        g.write(f.read()[:-64])
    for k in ("k1", "k2"):
        assert subprocess.run([*CLI, "keygen", p(k)], capture_output=True, env=ENV).returncode == 0
    pub = Publisher(p("s"), p("s", ".publisher"))  # the state a CLI publish into s finds
    pub.publish(p("v1.safetensors"))
    pub.publish(p("v2.safetensors"))
    Publisher(p("ss"), p("ss", ".publisher"), signing_key=p("k1")).publish(p("v1.safetensors"))
    os.makedirs(p("empty-store", "v"))
    os.makedirs(p("emptydir"))
    os.makedirs(p("rdir"))
    Subscriber(p("s"), p("r.safetensors")).sync()
    Subscriber(p("s"), p("rdir", "model.safetensors")).sync()
    with open(p("notes.txt"), "w") as f:
        f.write("not a store\n")
    os.makedirs(p("scratch"))
    return root


def snapshot(root: str) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` (lock files aside: a run creates its lock before it refuses) with its
    size and mtime."""
    out = {}
    for dp, _, fs in os.walk(root):
        for f in fs:
            if not f.endswith(".deltarefit-lock"):
                st = os.stat(os.path.join(dp, f))
                out[os.path.relpath(os.path.join(dp, f), root)] = (st.st_size, st.st_mtime_ns)
    return out


def test_the_table_holds_forty_cases_or_more():
    assert len(CASES) >= 40


@pytest.mark.parametrize("name", list(CASES))
def test_each_mistake_is_one_line_that_names_where_what_was_written_and_the_fix(world, name):
    c = CASES[name]
    scratch = os.path.join(world, "scratch", name.replace(" ", "_").replace("/", "_"))
    os.makedirs(scratch)
    argv = [a.replace("{s}", os.path.relpath(scratch, world)) for a in c.argv.split(" ")]
    before = snapshot(world)
    r = subprocess.run([*CLI, *argv], cwd=world, capture_output=True, text=True, timeout=120, env=ENV,
                       check=False)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == c.exit, f"{name}: exit {r.returncode}, expected {c.exit}\n{r.stdout}{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    if c.exit != 0:
        assert len(lines) == 1 and lines[0].startswith("deltarefit: error: "), r.stderr
        line = lines[0]
        assert snapshot(world) == before, f"{name}: a refusal changed files"
    elif c.why_no_fix == "a no-op":
        assert not lines, r.stderr
        line = r.stdout
    else:  # a success that warns
        assert len(lines) == 1 and lines[0].startswith("deltarefit: warning: "), r.stderr
        line = lines[0]
    for words in c.says:
        assert words in line, (name, words, line)
    if c.fix is not None:
        assert c.fix in line, (name, c.fix, line)
    else:
        assert c.why_no_fix, f"{name}: a case without a fix says why it needs none"
    if c.wrote is not None:
        assert c.wrote in line, (name, c.wrote, line)
