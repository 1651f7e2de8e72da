"""Filesystem faults: ``apply``, ``encode``, ``sync``, ``publish`` and ``retain`` on a full disk, a
read-only filesystem and a directory they may not write, each run as a real ``python -m deltarefit``
child.

Each case puts what the command writes (the checkpoint, the delta, the store) on a tmpfs mounted for
the case (root only), fills it with a filler file to leave ``level`` bytes free (a sweep of levels
makes ENOSPC strike at different points of the command), or remounts it read-only, or takes away the
write permission (of the directory, of the files only, or of the history book only) (the child then runs without ``CAP_DAC_OVERRIDE``, so root obeys it too). After
the faulted run the fault is lifted and the same command runs again. A case is judged on real
outcomes:

* ``traceback``: the faulted run's stderr holds a Python traceback;
* ``not_one_line``: a failed run whose stderr is not exactly one line (naming a path);
* ``false_verified``: a run that printed "verified" while the bytes it names are not the version;
* ``missing_parts``: a committed version of the store whose parts (from the newest keyframe on) are
  missing or short;
* ``unfinished``: the rerun with the fault lifted does not end bit-exact (a half-written file it
  cannot finish);
* ``failed_at_target``: an apply or sync that exited non-zero although the checkpoint holds its
  target, verified (a step after the apply failed: the history book, the version record);
* ``peak_rss``: the faulted child's peak resident memory (its VmHWM).

Used by ``bench.hostile`` (the "filesystem faults" section) and by ``tests/test_fs_faults.py``. The
machinery (the tmpfs, the faults, the measured child) is ``bench.fs_machinery``; here are the cases.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .fs_machinery import (  # (also importable from here, their earlier home)
    MIB,
    Run,
    cli,
    deny,
    fill,
    mount_refusal,
    remount,
    sha,
    sha_or_none,
    tmpfs,
)
from .fs_machinery import unprivileged_argv as unprivileged_argv
from .relay import ENV as ENV  # the children's environment (tests run theirs with it)
from .relay import write_checkpoint

CKPT_MIB = 2.0  # two 1 MiB chunks: an apply writes in more than one place
# "sync" follows a delta from the version before the head; "sync-new" installs a keyframe, then a delta;
# "sync-history" follows a delta coded with history, its book beside the checkpoint.
COMMANDS = ("apply", "encode", "sync", "sync-new", "sync-history", "publish", "retain")
FAULTS = ("full", "read-only", "denied", "file-denied", "book-denied")  # book-denied: sync-history only
# Free bytes left on the tmpfs, as fractions of a checkpoint: from nothing to enough for most steps.
LEVELS = (0.0, 0.01, 0.05, 0.25, 0.5, 1.0, 1.5, 2.5)

# ------------------------------------------------------------------------------------ the fixture


@dataclass
class Fixture:
    """Three checkpoints (v0, v1, v2), the delta v1 -> v2, and two stores on plain disk holding them
    as versions 1, 2, 3: ``store`` as a keyframe, a keyframe and a delta, ``history_store`` as a
    keyframe and two deltas coded with history."""

    root: str
    steps: list[str]
    delta: str
    store: str
    history_store: str

    @property
    def size(self) -> int:
        return os.path.getsize(self.steps[0])


def make_fixture(root: str) -> Fixture:
    from ...encode import encode
    from ...stream.publisher import Publisher

    os.makedirs(root, exist_ok=True)
    steps = [os.path.join(root, f"v{i}.safetensors") for i in range(3)]
    write_checkpoint(steps[0], CKPT_MIB, seed=1)
    for i in (1, 2):
        write_checkpoint(steps[i], CKPT_MIB, seed=1 + i, mutate_from=steps[i - 1])
    for p in steps:
        os.chmod(p, 0o644)
    delta = os.path.join(root, "v1-v2.delta")
    encode(steps[1], steps[2], delta)
    store = os.path.join(root, "store")
    pub = Publisher(store, os.path.join(root, "publisher"), keyframe_every=2)
    for p in steps:
        pub.publish(p)
    history_store = os.path.join(root, "store-history")
    pub = Publisher(history_store, os.path.join(root, "publisher-history"), history=True)
    for p in steps:
        pub.publish(p)
    return Fixture(root, steps, delta, store, history_store)


# ------------------------------------------------------------------------------------ the cases


@dataclass
class Case:
    command: str
    fault: str  # one of FAULTS
    level: float | None = None  # for "full": free bytes as a fraction of a checkpoint

    @property
    def name(self) -> str:
        return f"{self.command}-{self.fault}" + (f"-{self.level:g}" if self.level is not None else "")


@dataclass
class Outcome:
    case: Case
    rc: int
    stderr: str
    peak_rss: int
    traceback: bool = False
    not_one_line: bool = False
    false_verified: bool = False
    missing_parts: int = 0
    unfinished: str = ""  # why the rerun did not end bit-exact, or ""
    failed_at_target: bool = False  # exited non-zero with the checkpoint verified at its target
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.traceback or self.not_one_line or self.false_verified or self.missing_parts
                    or self.unfinished)


def missing_parts(store: str) -> int:
    """Parts of committed versions, from the newest keyframe on, that are missing or short."""
    from ...storage.base import open_store
    from ...stream.records import MalformedRecordError, list_versions, load_commit

    st = open_store(store, create=False)
    recs = []
    for v in list_versions(st):
        with contextlib.suppress(MalformedRecordError):
            recs.append(load_commit(st, v))
    kf = max((r.version for r in recs if r.kind == "keyframe"), default=0)
    bad = 0
    for r in recs:
        if r.version < kf:
            continue
        parts = ([r.delta] if r.delta and r.version > kf else []) + (
            [p for _, p in r.keyframe] if r.version == kf else [])
        for p in parts:
            path = os.path.join(store, p.key)
            if not os.path.isfile(path) or os.path.getsize(path) != p.bytes:
                bad += 1
    return bad


class _Plan:
    """One command's case: ``setup(fs)`` prepares the faulted directory, ``args(fs)`` is the command
    line, ``check(fs)`` says why the result is not the version ("" when it is)."""

    def __init__(self, fx: Fixture, command: str, work: str) -> None:
        self.fx, self.command, self.work = fx, command, work
        self.want = sha(fx.steps[2])

    def setup(self, fs: str) -> None:
        fx = self.fx
        if self.command == "apply":
            shutil.copyfile(fx.steps[1], os.path.join(fs, "ckpt.safetensors"))
        elif self.command == "sync":
            # A subscriber at version 2 (a keyframe), one delta behind the head.
            from ...stream.subscriber import sync

            sync(fx.store, os.path.join(fs, "ckpt.safetensors"), to_version=2)
        elif self.command == "sync-history":
            from ...stream.subscriber import sync

            sync(fx.history_store, os.path.join(fs, "ckpt.safetensors"), to_version=2)
        elif self.command == "publish":
            from ...stream.publisher import Publisher

            pub = Publisher(os.path.join(fs, "store"), os.path.join(fs, "store", ".publisher"))
            for p in fx.steps[:2]:
                pub.publish(p)
        elif self.command == "retain":
            shutil.copytree(fx.store, os.path.join(fs, "store"))
        elif self.command not in ("encode", "sync-new"):
            raise ValueError(self.command)

    def args(self, fs: str) -> list[str]:
        fx, ck = self.fx, os.path.join(fs, "ckpt.safetensors")
        return {
            "apply": ["apply", fx.delta, ck],
            "encode": ["encode", fx.steps[1], fx.steps[2], "-o", os.path.join(fs, "out.delta")],
            "sync": ["sync", fx.store, ck],
            "sync-new": ["sync", fx.store, ck],
            "sync-history": ["sync", fx.history_store, ck],
            "publish": ["publish", os.path.join(fs, "store"), fx.steps[2]],
            "retain": ["retain", os.path.join(fs, "store"), "--orphan-grace", "0", "--unsafe-short-grace"],
        }[self.command]

    def check(self, fs: str, *, rerun: bool = True) -> str:
        """Why what the command wrote is not the version ("" when it is). The publisher's own state is
        judged after the rerun only: a publish that committed may leave it to the next run."""
        fx = self.fx
        if self.command.startswith(("apply", "sync")):
            got = sha_or_none(os.path.join(fs, "ckpt.safetensors"))
            return "" if got == self.want else "the checkpoint is not the target"
        if self.command == "encode":
            out = os.path.join(fs, "out.delta")
            if not os.path.exists(out):
                return "no delta written"
            from ...apply.files import apply

            ck = os.path.join(self.work, "encode-check.safetensors")
            shutil.copyfile(fx.steps[1], ck)
            try:
                apply(out, ck)
                return "" if sha(ck) == self.want else "the delta does not make the target"
            except Exception as e:
                return f"the delta does not apply: {e}"
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(ck)
                    os.unlink(ck + ".deltarefit-lock")
        store = os.path.join(fs, "store")
        if missing_parts(store):
            return "a committed version has missing parts"
        if self.command == "publish" and rerun:  # the publisher's state followed (the next publish builds on it)
            state = os.path.join(store, ".publisher")
            try:
                with open(os.path.join(state, "publisher.json")) as f:
                    version = json.load(f)["version"]
            except (OSError, ValueError, KeyError) as e:
                return f"no publisher state ({e})"
            if version != 3 or sha_or_none(os.path.join(state, "baseline.safetensors")) != self.want:
                return f"the publisher's state is at version {version}, its baseline not the version"
        # What a new subscriber gets from the store is the version (publish: v2's bytes; retain: the head).
        sub = os.path.join(self.work, f"check-{self.command}.safetensors")
        from ...stream.subscriber import sync

        try:
            sync(store, sub)
            return "" if sha(sub) == self.want else "a new subscriber does not get the version"
        except Exception as e:
            return f"a new subscriber cannot sync: {e}"
        finally:
            for p in os.listdir(self.work):
                if p.startswith(f"check-{self.command}"):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.work, p))

    def verified_claim_false(self, run: Run, fs: str) -> bool:
        """The run said "verified" while the bytes it names are not the version."""
        return "verified" in run.stdout and self.command.startswith(("apply", "sync")) and self.check(fs) != ""


def _one_line(run: Run) -> bool:
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    return len(lines) == 1 and "/" in lines[0]


def run_case(fx: Fixture, case: Case, work: str, *, budget: int | None = None) -> Outcome:
    """Run one case in ``work`` (a tmpfs is mounted at ``work/fs`` for "full" and "read-only"; "denied"
    and "file-denied" use a plain directory). ``budget``: the tmpfs size (default: the checkpoint's size times 8)."""
    plan = _Plan(fx, case.command, work)
    fs = os.path.join(work, "fs")
    mounted = case.fault in ("full", "read-only")
    size = budget or 8 * fx.size
    with contextlib.ExitStack() as stack:
        if mounted:
            stack.enter_context(tmpfs(fs, size))
        else:
            os.makedirs(fs, exist_ok=True)
        plan.setup(fs)
        filler, modes = None, []
        if case.fault == "full":
            filler = fill(fs, int((case.level or 0.0) * fx.size))
        elif case.fault == "read-only":
            remount(fs, "ro")
        elif case.fault == "book-denied":  # only the history book beside the checkpoint
            modes = deny(os.path.join(fs, "ckpt.safetensors.deltarefit-history"))
        else:
            modes = deny(fs, files_only=case.fault == "file-denied")
        run = cli(plan.args(fs), unprivileged=case.fault.endswith("denied"))
        out = Outcome(case, run.rc, run.stderr.strip(), run.peak_rss)
        out.traceback = "Traceback" in run.stderr
        if run.rc != 0:
            out.not_one_line = not _one_line(run)
        # Judged while the fault holds: what the run claimed, and what the store holds.
        if case.fault == "read-only":
            remount(fs, "rw")
        out.false_verified = plan.verified_claim_false(run, fs)
        out.failed_at_target = run.rc != 0 and case.command.startswith(("apply", "sync")) and plan.check(fs) == ""
        if case.command in ("publish", "retain"):
            out.missing_parts = missing_parts(os.path.join(fs, "store"))
        if run.rc == 0:
            why = plan.check(fs, rerun=False)
            if why:
                out.unfinished = f"exit 0, but {why}"
        # The fault lifted: a rerun must finish the job.
        if filler:
            os.unlink(filler)
        for p, m in reversed(modes):
            with contextlib.suppress(FileNotFoundError):  # deleted or replaced by the run
                os.chmod(p, m)
        again = cli(plan.args(fs))
        if again.rc != 0:
            out.unfinished = out.unfinished or f"the rerun failed: {again.stderr.strip()[-300:]}"
        else:
            why = plan.check(fs)
            if why:
                out.unfinished = out.unfinished or f"after the rerun {why}"
    if not mounted:
        shutil.rmtree(fs, ignore_errors=True)
    return out


def cases(commands=COMMANDS, faults=FAULTS, levels=LEVELS) -> list[Case]:
    out = []
    for c in commands:
        for f in faults:
            if f == "book-denied" and c != "sync-history":
                continue
            for lv in (levels if f == "full" else (None,)):
                out.append(Case(c, f, lv))
    return out


def sweep(work: str, todo: list[Case], progress: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Run every case of ``todo`` in ``work`` (the fixture built once); their outcomes."""
    fx = make_fixture(os.path.join(work, "fixture"))
    outs = []
    for case in todo:
        d = os.path.join(work, case.name)
        os.makedirs(d, exist_ok=True)
        o = run_case(fx, case, d)
        shutil.rmtree(d, ignore_errors=True)
        outs.append(o)
        if progress:
            progress(o)
    return outs


def summary(outs: list[Outcome]) -> dict[str, int]:
    """The figures of the hostile bench's section, counted over ``outs``."""
    return {
        "cases": len(outs),
        "failed runs": sum(o.rc != 0 for o in outs),
        "failed with the target reached": sum(o.failed_at_target for o in outs),
        "false verified": sum(o.false_verified for o in outs),
        "committed versions with missing parts": sum(o.missing_parts > 0 for o in outs),
        "tracebacks": sum(o.traceback for o in outs),
        "errors not one line": sum(o.not_one_line and not o.traceback for o in outs),
        "half-written, rerun cannot finish": sum(bool(o.unfinished) for o in outs),
        "peak RSS (MiB)": max((o.peak_rss for o in outs), default=0) // MIB,
    }


# ------------------------------------------------------------------------------------ the bench section


def table(outs: list[Outcome]) -> list[str]:
    """The section's rows: one per command and fault (the fill levels of "full" counted together),
    then the totals; every figure counted from ``outs``."""
    cols = ("cases", "failed runs", "failed with the target reached", "false verified", "committed versions with missing parts", "tracebacks",
            "errors not one line", "half-written, rerun cannot finish", "peak RSS (MiB)")
    short = ("cases", "failed", "at target", "false verified", "missing parts", "tracebacks", "not 1 line", "unfinished",
             "peak MiB")
    lines = [f"{'command':<13} {'fault':<12} " + " ".join(f"{h:>{max(len(h), 5)}}" for h in short)]
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for o in outs:
        groups.setdefault((o.case.command, o.case.fault), []).append(o)
    for (cmd, fault), got in [*groups.items(), (("all", ""), outs)]:
        s = summary(got)
        lines.append(f"{cmd:<13} {fault:<12} " + " ".join(f"{s[c]:>{max(len(h), 5)}}" for c, h in zip(cols, short,
                                                                                                  strict=True)))
    return lines


def section(levels=LEVELS) -> None:
    """Print the hostile bench's "filesystem faults" section: the sweep, counted by command and fault,
    and the cases that went wrong (each with its last stderr line)."""
    refused = mount_refusal()
    faults = FAULTS if refused is None else tuple(f for f in FAULTS if f not in ("full", "read-only"))
    print(f"\nfilesystem faults: {', '.join(COMMANDS)} as python -m deltarefit children; a tmpfs "
          f"{'filled to leave ' + ', '.join(f'{lv:g}' for lv in levels) + ' checkpoints free, remounted read-only, ' if refused is None else ''}"
          f"write permission taken away (no DAC capabilities); then the fault lifted and the command rerun"
          + (f" (no tmpfs cases: {refused})" if refused else ""))
    with tempfile.TemporaryDirectory(prefix="deltarefit-fs-faults-") as work:
        t0 = time.perf_counter()
        outs = sweep(work, cases(faults=faults, levels=levels))
        seconds = time.perf_counter() - t0
    for line in table(outs):
        print(line)
    for o in outs:
        if not o.ok:
            last = (o.stderr.splitlines() or [""])[-1]
            print(f"  {o.case.name}: exit {o.rc}; {o.unfinished or 'see stderr'}: {last[:160]}")
    print(f"({len(outs)} cases, a {CKPT_MIB:g} MiB checkpoint, {seconds:.0f} s; peak RSS is the faulted child's "
          "VmHWM, all of it before and after trust)")


def main(argv: list[str] | None = None) -> None:
    """``python -m deltarefit.apps.bench.fs_faults [--room] [--mib N]``: the filesystem-faults section, or
    (``--room``) the disk room a fresh sync needs (``apps.bench.sync_room``)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.bench.fs_faults")
    ap.add_argument("--room", action="store_true", help="measure the room a fresh sync needs")
    ap.add_argument("--mib", type=float, default=16.0, help="checkpoint size for --room (MiB)")
    a = ap.parse_args(argv)
    if not a.room:
        section()
        return
    from .sync_room import report

    report(a.mib)


if __name__ == "__main__":
    main()
