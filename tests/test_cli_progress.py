"""Progress bars as a person at a terminal sees them: real CLI processes with stderr on a pseudo-terminal.

A bar shows the bytes done, a rate and the time left; it is on stderr only, so stdout and every file
written are what they are without it; off with ``--quiet`` and when stderr is not a terminal; and
without a bar rich is never imported.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from test_cli import _tty_run

RATE = re.compile(r"\d+(\.\d+)? [kMG]?B/s")
ETA = re.compile(r"\d+:\d\d:\d\d")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
TIMES = re.compile(r"\d+\.\d+ s\b")  # a run's own seconds, the one thing two runs' outputs may differ in


def plain(term: str) -> str:
    return ANSI.sub("", term)


def piped(*args: str, cwd) -> subprocess.CompletedProcess:
    """Stderr a pipe (not a terminal), progress not turned off by the environment."""
    env = {k: v for k, v in os.environ.items() if k != "DELTAREFIT_NO_PROGRESS"}
    return subprocess.run([sys.executable, "-m", "deltarefit", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env, check=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """8 MiB of bf16 weights and the same with every 13th element moved by one ulp."""
    d = tmp_path_factory.mktemp("progress")
    g = torch.Generator().manual_seed(0)
    base = {f"l{i}.w": (torch.randn(512, 2048, generator=g) * 0.02).to(torch.bfloat16) for i in range(4)}
    save_file(base, str(d / "base.safetensors"))
    for t in base.values():
        t.view(torch.int16)[::13] += 1
    save_file(base, str(d / "target.safetensors"))
    return d


def _bar(term: str, label: str) -> None:
    text = plain(term)
    assert label in text, text
    tail = text[text.index(label):]
    assert RATE.search(tail) and ETA.search(tail), text  # a rate and a time left, on that bar


def test_encode_and_apply_show_a_rate_and_leave_stdout_and_files_as_without(pair, tmp_path):
    b, t = str(pair / "base.safetensors"), str(pair / "target.safetensors")
    rc, out, term = _tty_run("encode", b, t, "-o", str(tmp_path / "bar.delta"))
    assert rc == 0, term
    _bar(term, "encode")
    q = piped("encode", b, t, "-o", str(tmp_path / "quiet.delta"), cwd=tmp_path)
    assert q.returncode == 0 and q.stderr == "", q.stderr
    assert (tmp_path / "bar.delta").read_bytes() == (tmp_path / "quiet.delta").read_bytes()
    assert TIMES.sub("", out.replace("bar.delta", "X")) == TIMES.sub("", q.stdout.replace("quiet.delta", "X"))
    assert "\x1b" not in out and "B/s" not in out
    for name in ("w1", "w2"):
        shutil.copyfile(b, tmp_path / f"{name}.safetensors")
    rc, out, term = _tty_run("apply", str(tmp_path / "bar.delta"), str(tmp_path / "w1.safetensors"))
    assert rc == 0, term
    _bar(term, "apply")
    q = piped("apply", str(tmp_path / "bar.delta"), str(tmp_path / "w2.safetensors"), cwd=tmp_path)
    assert q.returncode == 0 and q.stderr == ""
    assert TIMES.sub("", out.replace("w1", "w")) == TIMES.sub("", q.stdout.replace("w2", "w"))
    assert (tmp_path / "w1.safetensors").read_bytes() == (tmp_path / "w2.safetensors").read_bytes() == \
        (pair / "target.safetensors").read_bytes()


def test_publish_and_sync_show_each_phase_with_a_rate(pair, tmp_path):
    store = str(tmp_path / "s")
    rc, out, term = _tty_run("publish", store, str(pair / "base.safetensors"))
    assert rc == 0 and "version 1" in out, term
    _bar(term, "publish: upload keyframe")
    assert "publish: fingerprint" in plain(term) and "publish: hash keyframe" in plain(term), term
    rc, out, term = _tty_run("publish", store, str(pair / "target.safetensors"))
    assert rc == 0 and "version 2" in out, term
    _bar(term, "publish: encode")
    assert "publish: upload delta" in plain(term)  # 0.2 MB in one step: no rate to show
    r = str(tmp_path / "r.safetensors")
    rc, out, term = _tty_run("sync", store, r, "--to", "1")
    assert rc == 0 and "0 -> 1 via keyframe" in out, term
    _bar(term, "sync: fetch keyframe")  # the keyframe's download
    rc, out, term = _tty_run("sync", store, r)
    assert rc == 0 and "1 -> 2" in out and "\x1b" not in out, term
    _bar(term, "sync: apply v2")
    assert open(r, "rb").read() == (pair / "target.safetensors").read_bytes()
    rc, out, term = _tty_run("sync", store, r)  # a no-op: nothing long, no bar
    assert rc == 0 and "nothing to do" in out and plain(term).strip() == "", term


def test_fingerprint_shows_a_bar_and_prints_what_it_prints_without(pair, tmp_path):
    b = str(pair / "base.safetensors")
    rc, out, term = _tty_run("fingerprint", b)
    assert rc == 0 and "fingerprint" in plain(term).replace(out.strip(), ""), term
    q = piped("fingerprint", b, cwd=tmp_path)
    assert q.returncode == 0 and q.stderr == "" and q.stdout.strip() == out.strip() and len(out.strip()) == 64


@pytest.mark.parametrize("cmd", ["encode", "apply", "publish", "sync", "fingerprint"])
def test_quiet_and_not_a_terminal_print_no_progress(pair, tmp_path, cmd):
    b, t = str(pair / "base.safetensors"), str(pair / "target.safetensors")
    shutil.copyfile(b, tmp_path / "w.safetensors")
    assert piped("encode", b, t, "-o", str(tmp_path / "d.delta"), cwd=tmp_path).returncode == 0
    assert piped("publish", "s0", b, cwd=tmp_path).returncode == 0
    argv = {"encode": ["encode", b, t, "-o", str(tmp_path / "e.delta")],
            "apply": ["apply", str(tmp_path / "d.delta"), str(tmp_path / "w.safetensors")],
            "publish": ["publish", str(tmp_path / "s"), b],
            "sync": ["sync", str(tmp_path / "s0"), str(tmp_path / "r.safetensors")],
            "fingerprint": ["fingerprint", b]}[cmd]
    rc, out, term = _tty_run(*argv, "--quiet")
    assert rc == 0 and out and term == "", term
    if cmd in ("publish", "sync"):  # again, into a fresh store and checkpoint
        argv = [a.replace(f"{os.sep}s", f"{os.sep}t").replace("r.safetensors", "q.safetensors") for a in argv]
        if cmd == "sync":
            assert piped("publish", str(tmp_path / "t0"), b, cwd=tmp_path).returncode == 0
    else:
        argv = [a.replace("e.delta", "f.delta") for a in argv]
        shutil.copyfile(b, tmp_path / "w.safetensors")
    r = piped(*argv, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout and r.stderr == "", r.stderr


@pytest.mark.parametrize("quiet", [True, False])
def test_without_a_bar_rich_is_never_imported(pair, tmp_path, quiet):
    """Stderr not a terminal, or --quiet: the bars' module never loads rich (start-up cost)."""
    b, t = str(pair / "base.safetensors"), str(pair / "target.safetensors")
    code = ("import sys; from deltarefit.cli import main\n"
            "sys.argv = ['deltarefit', *sys.argv[1:]]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('rich' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "DELTAREFIT_NO_PROGRESS"}
    q = ["-q"] if quiet else []
    for argv in (["encode", b, t, "-o", str(tmp_path / "d.delta"), *q], ["publish", str(tmp_path / "s"), b, *q],
                 ["sync", str(tmp_path / "s"), str(tmp_path / "r.safetensors"), *q]):
        r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines()[-1] == "False", (argv, r.stdout)


def test_the_stream_s_phases_add_up_to_their_totals(pair, tmp_path):
    """What a publish and a sync tell their ``progress`` opener: each phase's counts add up to its total
    (every tensor of the pair changes, so an apply goes through all of the checkpoint's bytes)."""
    from deltarefit.stream import Publisher, Subscriber

    seen: list[list] = []

    def opener(label: str, total: int):
        seen.append([label, total, 0])
        return lambda n: seen[-1].__setitem__(2, seen[-1][2] + n)

    size = os.path.getsize(pair / "target.safetensors")
    pub = Publisher(str(tmp_path / "s"), str(tmp_path / "state"))
    pub.progress = opener
    pub.publish(str(pair / "base.safetensors"))
    pub.publish(str(pair / "target.safetensors"))
    fresh = Subscriber(str(tmp_path / "s"), str(tmp_path / "r.safetensors"))
    fresh.progress = opener
    fresh.sync()  # a keyframe's download, then version 2's apply (staged)
    old = Subscriber(str(tmp_path / "s"), str(tmp_path / "o.safetensors"))
    old.sync(to_version=1)
    old.progress = opener
    old.sync()  # version 2's apply, planned while its part arrives
    labels = [s[0] for s in seen]
    assert labels == ["publish: hash keyframe", "publish: fingerprint", "publish: upload keyframe", "publish: encode",
                      "publish: upload delta", "sync: fetch keyframe", "sync: apply v2", "sync: apply v2"], labels
    for label, total, done in seen:
        assert done == total, (label, total, done)
    tensors = seen[3][1]
    assert seen[0][1] == size and seen[1][1] == tensors  # the keyframe's file, then its tensors hashed
    assert 0 < size - tensors < 1024 and seen[6][1] == seen[7][1] == tensors  # the checkpoint's tensor bytes
