"""Filesystem faults end as one line, and a rerun with the fault lifted ends bit-exact.

Real faults, real processes: each case mounts a tmpfs (root only; skipped with the reason elsewhere)
and fills it to leave a given number of bytes free, or remounts it read-only, or takes the write bit
away (the child ``python -m deltarefit`` then runs without ``CAP_DAC_OVERRIDE``, so root is refused
too; as another user it is refused anyway). The harness is ``deltarefit.apps.bench.fs_faults``, which
the hostile bench's "filesystem faults" section runs too. Each case asserts:

* a failed run exits non-zero with exactly one line on stderr, naming a path, no traceback;
* nothing is called "verified" that is not the version;
* no committed version of the store misses a part;
* the same command rerun with the fault lifted ends with the bytes of the version (the checkpoint, the
  delta applied, or what a new subscriber syncs from the store).

The default cases are the ones that ended in a traceback (or a wrong diagnosis, or a failed publish
that had committed) before; the whole sweep (every command, fault and fill level) is ``slow``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deltarefit.apps.bench import fs_faults as F

MOUNT = F.mount_refusal()
needs_mount = pytest.mark.skipif(MOUNT is not None, reason=f"needs a real tmpfs: {MOUNT}")


def _deny_refusal() -> str | None:
    """None where a child can be refused a write: any user but root; root that can drop its DAC
    capabilities in the child."""
    if os.geteuid() != 0:
        return None
    argv, pre = F.unprivileged_argv([sys.executable, "-c", "pass"])
    try:
        subprocess.run(argv, preexec_fn=pre, check=True, capture_output=True)
        return None
    except (subprocess.SubprocessError, OSError) as e:
        return f"root cannot drop CAP_DAC_OVERRIDE in a child here ({e})"


DENY = _deny_refusal()
needs_deny = pytest.mark.skipif(DENY is not None, reason=f"permission denied for this test: {DENY}")


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> F.Fixture:
    return F.make_fixture(str(tmp_path_factory.mktemp("fs-faults-fixture")))


def check(o: F.Outcome) -> None:
    """The assertions every case makes (module docstring)."""
    assert not o.traceback, f"{o.case.name}: traceback:\n{o.stderr}"
    if o.rc != 0:
        lines = o.stderr.splitlines()
        assert len(lines) == 1 and "/" in lines[0], f"{o.case.name}: exit {o.rc}, stderr not one line naming a " \
                                                    f"path:\n{o.stderr}"
        assert lines[0].startswith("deltarefit: error: "), o.stderr
    assert not o.false_verified, f"{o.case.name}: said verified, the bytes are not the version"
    assert o.missing_parts == 0, f"{o.case.name}: {o.missing_parts} parts of committed versions missing"
    assert not o.unfinished, f"{o.case.name}: {o.unfinished}"


def run(fx: F.Fixture, tmp_path, command: str, fault: str, level: float | None = None) -> F.Outcome:
    o = F.run_case(fx, F.Case(command, fault, level), str(tmp_path))
    check(o)
    return o


# ------------------------------------------------------------------------------------ disk full


@needs_mount
@pytest.mark.parametrize(("command", "level"), [
    ("apply", 0.0),     # the journal's write: a traceback without a path
    ("encode", 0.0),    # the delta writer's abort hid the error behind its own close
    ("sync", 0.0),      # the staged part's write
    ("sync-new", 1.5),  # the keyframe copied beside the checkpoint
    ("publish", 0.0),   # the staged delta
])
def test_disk_full_is_one_line_and_a_rerun_finishes(fx, tmp_path, command, level):
    o = run(fx, tmp_path, command, "full", level)
    assert o.rc != 0 and "No space left on device" in o.stderr, o.stderr


@needs_mount
def test_a_disk_full_before_the_first_write_names_the_journal_and_writes_nothing(fx, tmp_path):
    # The journal is allocated before the checkpoint's first byte changes: a full disk fails there.
    o = run(fx, tmp_path, "apply", "full", 0.0)
    assert o.rc == 12, o.stderr  # FileSystemError
    assert o.stderr.startswith("deltarefit: error: ") and "ckpt.safetensors.deltarefit-journal" in o.stderr, o.stderr
    assert "nothing written to the checkpoint" in o.stderr and "No space left on device" in o.stderr, o.stderr


@needs_mount
def test_a_short_write_of_a_staged_part_is_a_full_disk_not_a_corrupt_delta(fx, tmp_path):
    # 20 KB free for a 45 KB part: the kernel takes part of a write and reports no error; the bytes
    # not written read back as zeros, which was reported as "payload hash mismatch (corrupt delta)".
    o = run(fx, tmp_path, "sync", "full", 0.01)
    assert o.rc == 12 and "No space left on device" in o.stderr and "corrupt" not in o.stderr, o.stderr
    assert "deltarefit-staging" in o.stderr and ".arriving" in o.stderr, o.stderr  # names the staged part


@needs_mount
@pytest.mark.parametrize("level", [0.5, 1.0])
def test_a_committed_publish_whose_state_cannot_follow_exits_0_with_one_warning(fx, tmp_path, level):
    # Room for the parts and the commit, not for the baseline's copy: the version is out (a new
    # subscriber syncs it, checked by run()), so the publish succeeded; the state follows next run.
    o = run(fx, tmp_path, "publish", "full", level)
    assert o.rc == 0, o.stderr
    lines = o.stderr.splitlines()
    assert len(lines) == 1 and "version 3 is committed" in lines[0] and "No space left" in lines[0], o.stderr


@needs_mount
def test_a_key_that_does_not_fit_is_not_left_half_written(tmp_path):
    # The key file was created, then its write failed: an empty key that every rerun refused as existing.
    fs = str(tmp_path / "fs")
    with F.tmpfs(fs, 1 << 20):
        filler = F.fill(fs, 0)
        keys = [(["keygen", f"{fs}/key"], f"{fs}/key"), (["relay", "keygen", f"{fs}/rkey"], f"{fs}/rkey")]
        for args, key in keys:
            r = F.cli(args)
            lines = r.stderr.splitlines()
            assert r.rc == 12 and len(lines) == 1 and key in lines[0] and "No space left" in lines[0], r.stderr
            assert not os.path.exists(key) and not os.path.exists(key + ".pub")
        os.unlink(filler)
        for args, key in keys:
            assert F.cli(args).rc == 0 and os.path.getsize(key) > 0


@needs_mount
def test_a_file_written_whole_names_itself_when_it_does_not_fit(fx, tmp_path):
    # A sync at the head rewrites its version record; the write failed with no path, at the close.
    fs = str(tmp_path / "fs")
    with F.tmpfs(fs, 8 * fx.size):
        from deltarefit.stream.subscriber import sync

        ck = f"{fs}/ckpt.safetensors"
        sync(fx.store, ck)
        filler = F.fill(fs, 0)
        r = F.cli(["sync", fx.store, ck])
        assert r.rc != 0 and r.stderr == f"deltarefit: error: {ck}.deltarefit-version.json: cannot write (No space " \
                                          "left on device)\n", r.stderr
        os.unlink(filler)
        r = F.cli(["sync", fx.store, ck])
        assert r.rc == 0 and F.sha(ck) == F.sha(fx.steps[2]), r.stderr


# ------------------------------------------------------------------------------------ read-only


@needs_mount
@pytest.mark.parametrize("command", ["encode", "retain", "apply", "sync", "publish"])
def test_read_only_filesystem_is_one_line_and_a_rerun_finishes(fx, tmp_path, command):
    o = run(fx, tmp_path, command, "read-only")
    assert o.rc != 0 and "Read-only file system" in o.stderr, o.stderr


# ------------------------------------------------------------------------------------ permission denied


@needs_deny
@pytest.mark.parametrize("command", ["encode", "retain", "apply", "sync", "publish"])
def test_permission_denied_is_one_line_and_a_rerun_finishes(fx, tmp_path, command):
    o = run(fx, tmp_path, command, "denied")
    assert o.rc != 0 and "Permission denied" in o.stderr, o.stderr


@needs_deny
def test_a_checkpoint_without_write_permission_is_refused_in_one_line(fx, tmp_path):
    o = run(fx, tmp_path, "apply", "file-denied")
    assert o.rc != 0 and "Permission denied" in o.stderr and "ckpt.safetensors" in o.stderr, o.stderr


@needs_deny
def test_a_history_book_that_cannot_be_written_is_one_line_and_a_rerun_finishes(fx, tmp_path):
    o = run(fx, tmp_path, "sync-history", "book-denied")
    assert o.rc == 0 or ("deltarefit-history" in o.stderr and "Permission denied" in o.stderr), o.stderr


@needs_deny
def test_a_history_book_that_cannot_be_written_does_not_fail_a_verified_sync(fx, tmp_path):
    o = F.run_case(fx, F.Case("sync-history", "book-denied"), str(tmp_path))
    assert o.rc == 0 and not o.failed_at_target, o.stderr


# ------------------------------------------------------------------------------------ paths that are not what they must be


def test_paths_that_cannot_be_written_are_one_line(fx, tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_bytes(b"")
    os.symlink("loop", tmp_path / "loop")
    v1, v2 = fx.steps[1], fx.steps[2]
    cases = [
        (["encode", v1, v2, "-o", str(tmp_path / "adir")], "adir is a directory"),  # refused before the encode
        (["compose", fx.delta, "--base", v1, "-o", str(tmp_path / "adir")], "adir is a directory"),
        (["publish", str(tmp_path / "store"), v2, "--state", str(tmp_path / "afile")], "is not a directory"),
        (["keygen", str(tmp_path / "afile" / "k")], "Not a directory"),
        (["apply", fx.delta, str(tmp_path / "missing" / "ck")], "does not exist"),
        (["sync", fx.store, str(tmp_path / "afile" / "ck")], "Not a directory"),
    ]
    for args, why in cases:
        r = F.cli(args)
        lines = r.stderr.splitlines()
        assert r.rc != 0 and len(lines) == 1 and why in lines[0] and "Traceback" not in r.stderr, (args, r.stderr)
    assert os.path.isdir(tmp_path / "adir") and not os.listdir(tmp_path / "adir")


# ------------------------------------------------------------------------------------ the sweep


@pytest.mark.slow
@needs_mount
@needs_deny
def test_every_command_fault_and_fill_level(fx, tmp_path):
    outs = []
    for case in F.cases():
        d = tmp_path / case.name
        d.mkdir()
        outs.append(F.run_case(fx, case, str(d)))
    bad = [(o.case.name, o.stderr[-300:], o.unfinished) for o in outs if not o.ok]
    assert not bad, bad
    s = F.summary(outs)
    assert s["cases"] == len(F.cases()) and s["tracebacks"] == 0 and s["false verified"] == 0
    assert s["peak RSS (MiB)"] < 256


def test_a_reader_that_closed_stdout_is_one_line(fx):
    # `deltarefit log STORE | head -1`: the write to the closed pipe was a BrokenPipeError traceback.
    p = subprocess.Popen([sys.executable, "-m", "deltarefit", "log", fx.store, "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=F.ENV)
    p.stdout.close()  # long before the child has imported anything
    err = p.stderr.read().decode()
    assert p.wait(60) == 12 and err == "deltarefit: error: log: stdout (Broken pipe)\n", err


# ------------------------------------------------------------------------------------ names that are not UTF-8


def _cli_bytes(*args: bytes) -> tuple[int, list[str], str]:
    p = subprocess.run([sys.executable, b"-m", b"deltarefit", *args], capture_output=True, env=F.ENV, check=False,
                       timeout=120)
    return p.returncode, p.stderr.decode(errors="replace").strip().splitlines(), p.stdout.decode(errors="replace")


def test_paths_that_are_not_utf8_work(fx, tmp_path):
    # os.fsencode names: the bytes \xff, \xfe are no UTF-8; Python carries them as surrogates, which
    # str.encode() refuses (the subscriber's default id hashed its path so, and every sync crashed).
    d = os.fsencode(tmp_path) + b"/d\xff"
    os.mkdir(d)
    ck, store, sub = d + b"/c\xfe.safetensors", d + b"/store\xfd", d + b"/s\xfc.safetensors"
    with open(fx.steps[1], "rb") as f, open(ck, "wb") as g:
        g.write(f.read())
    v1, v2 = os.fsencode(fx.steps[1]), os.fsencode(fx.steps[2])
    for args in ([b"encode", ck, v2, b"-o", d + b"/x\xfb.delta"], [b"apply", d + b"/x\xfb.delta", ck],
                 [b"publish", store, v1], [b"publish", store, ck], [b"sync", store, sub], [b"log", store],
                 [b"retain", store]):
        rc, err, _ = _cli_bytes(*args)
        assert rc == 0 and not err, (args, err)
    assert F.sha(ck) == F.sha(fx.steps[2]) and F.sha(sub) == F.sha(fx.steps[2])


def _safetensors_with_names(path: str, names: list[bytes]) -> None:
    """One BF16 tensor of 8 elements per raw JSON name (quotes included), the header written by hand."""
    entries = [n + b':{"dtype":"BF16","shape":[8],"data_offsets":[%d,%d]}' % (16 * i, 16 * i + 16)
               for i, n in enumerate(names)]
    h = b"{" + b",".join(entries) + b"}"
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + bytes(16 * len(names)))


@pytest.mark.parametrize(("name", "says"), [
    (b'"w\xff"', "not UTF-8 text (byte 0xff at offset"),
    (b'"w\\ud800"', "'w\\ud800' is not Unicode text (an unpaired surrogate escape)"),
    (b'"\\udc80"', "'\\udc80' is not Unicode text"),
])
def test_tensor_names_that_are_not_text_are_one_line(tmp_path, name, says):
    bad, good = str(tmp_path / "bad.safetensors"), str(tmp_path / "good.safetensors")
    _safetensors_with_names(bad, [name, b'"b"'])
    _safetensors_with_names(good, [b'"w"', b'"b"'])
    for args in (["fingerprint", bad], ["encode", good, bad, "-o", str(tmp_path / "x.delta")],
                 ["publish", str(tmp_path / "store"), bad]):
        r = F.cli(args)
        lines = r.stderr.splitlines()
        assert r.rc == 4 and len(lines) == 1 and says in lines[0] and bad in lines[0], (args, r.stderr)
    assert not os.path.exists(tmp_path / "x.delta")


def test_a_delta_naming_a_tensor_with_an_unpaired_surrogate_is_one_line(tmp_path):
    from _pairs import Delta, write_pair

    base, target = write_pair(tmp_path, n_tensors=1, shape=(64, 256))
    good, bad = str(tmp_path / "good.delta"), str(tmp_path / "bad.delta")
    assert F.cli(["encode", base, target, "-o", good]).rc == 0
    d = Delta.load(good)
    next(t for t in d.manifest["tensors"] if t["name"] == "frozen.bias")["name"] = "frozen.bias\ud800"
    d.write(bad)  # every hash consistent: only the name is wrong
    before = F.sha(base)
    for args in (["inspect", bad], ["apply", bad, base]):
        r = F.cli(args)
        lines = r.stderr.splitlines()
        assert r.rc == 3 and len(lines) == 1 and "is not Unicode text" in lines[0], (args, r.stderr)
    assert F.sha(base) == before


def test_the_bench_section_counts_each_figure_from_the_outcomes():
    def out(command, fault, **kw):
        return F.Outcome(F.Case(command, fault), kw.pop("rc", 1), "x", kw.pop("peak", 1 << 20), **kw)

    outs = [out("apply", "denied"), out("apply", "denied", traceback=True, not_one_line=True),
            out("sync", "denied", rc=0, false_verified=True), out("publish", "denied", missing_parts=2),
            out("sync", "denied", unfinished="after the rerun the checkpoint is not the target", peak=300 << 20),
            out("sync", "book-denied", failed_at_target=True)]
    s = F.summary(outs)
    assert s == {"cases": 6, "failed runs": 5, "failed with the target reached": 1, "false verified": 1,
                 "committed versions with missing parts": 1, "tracebacks": 1, "errors not one line": 0,
                 "half-written, rerun cannot finish": 1, "peak RSS (MiB)": 300}
    rows = F.table(outs)
    assert rows[-1].split() == ["all", "6", "5", "1", "1", "1", "1", "0", "1", "300"]
    assert rows[1].split() == ["apply", "denied", "2", "2", "0", "0", "0", "1", "0", "0", "1"]
