"""Counts for the classes of defects already fixed (issue 46), from the test cases that pin them: run in a
checkout (where ``tests/`` lies beside ``src/``), each file in a child ``pytest`` with a time limit, and
counted from its JUnit report. Not duplicated here: a case is the test's, and so is its verdict.

* ``tests/test_exit_codes.py``: every exit code of docs/COMMAND-LINE.md's table, one case each (a
  failure is an exit that disagrees with the table, or more than one line, or a traceback);
* ``tests/test_fs_planted.py``: symlinks, files and FIFOs planted at the staging and keyframe
  temporaries (a failure is a write through them, or a false "verified");
* ``tests/test_engine_trust.py``: the engine's pinned key, streams and roots, and its argument types
  (a failure is a stream, key or path taken that is not pinned, or a bare exception).

A file that runs past its limit counts as a hang.

The classes of issue 54 (``KINDS``) are counted by what a failing case would be: a false "verified", data
lost (a version committed that no subscriber can apply), a traceback (a crash in native code included),
a memory blow-up or a trust bypass, from the case's name:

* ``tests/test_publish_changing.py``: input written by a thread or a process during a publish;
* ``tests/test_hostile_surfaces.py``: sharded part binding, version record fields, manifests read as
  bytes, publish_tensors' refusals, ``status``, ``simulate --plot``, ``encode`` of no tensors.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

FILES = (("exits vs docs/COMMAND-LINE.md", "tests/test_exit_codes.py"),
         ("planted symlinks, files, FIFOs", "tests/test_fs_planted.py"),
         ("engine trust and argument types", "tests/test_engine_trust.py"))


# (label, file, [(a word of the case's name, what its failure is)], what any other failure is)
KINDS = (("input changed during a publish", "tests/test_publish_changing.py",
          [("kernels_survive", "tracebacks")], "lost"),
         ("hostile surfaces (issue 54)", "tests/test_hostile_surfaces.py",
          [("descriptor", "trust bypasses"), ("verify_key", "trust bypasses"), ("single_rank", "false verified"),
           ("budget", "memory")], "tracebacks"))
KIND_NAMES = ("false verified", "lost", "tracebacks", "memory", "trust bypasses")


def _checkout() -> str | None:
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 4))
    return root if os.path.isdir(os.path.join(root, "tests")) else None


def count(path: str, root: str, timeout: float, kinds: tuple | None = None) -> dict[str, int]:
    """Cases, failures (errors included), skips, tracebacks reported in failures, and hangs (1 when the
    file ran past ``timeout``) of one test file; with ``kinds`` (``KINDS``' last two), each failure
    counted under what it is too."""
    with tempfile.TemporaryDirectory(prefix="deltarefit-classes-") as d:
        xml = os.path.join(d, "r.xml")
        env = dict(os.environ, PYTHONPATH=os.path.join(root, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", xml, path],
                           cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout,
                           check=False)
        except subprocess.TimeoutExpired:
            return {"cases": 0, "failed": 0, "skipped": 0, "tracebacks": 0, "hangs": 1} | dict.fromkeys(KIND_NAMES, 0)
        if not os.path.exists(xml):
            return {"cases": 0, "failed": 0, "skipped": 0, "tracebacks": 0, "hangs": 0} | dict.fromkeys(KIND_NAMES, 0)
        cases = list(ET.parse(xml).getroot().iter("testcase"))
    bad = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    text = [(x.text or "") + (x.get("message") or "") for c in bad for x in c if x.tag in ("failure", "error")]
    out = {"cases": len(cases), "failed": len(bad), "skipped": sum(c.find("skipped") is not None for c in cases),
           "tracebacks": sum("Traceback" in t for t in text), "hangs": 0} | dict.fromkeys(KIND_NAMES[:2], 0)
    out.update(memory=0, **{"trust bypasses": 0})
    if kinds is not None:
        words, other = kinds
        for c in bad:
            kind = next((k for w, k in words if w in (c.get("name") or "")), other)
            out[kind] += kind != "tracebacks" or not any("Traceback" in ((x.text or "") + (x.get("message") or ""))
                                                          for x in c)
    return out


def section(timeout: float = 300.0) -> None:
    root = _checkout()
    print("\nclasses already fixed, counted by the tests that pin them:")
    if root is None:
        print("  (no tests/ beside the sources: run from a checkout)")
        return
    for label, path in FILES:
        c = count(path, root, timeout)
        print(f"  {label:<34} {path:<28} {c['cases']:>3} cases, {c['failed']} failed, {c['skipped']} skipped, "
              f"{c['tracebacks']} with a traceback, {c['hangs']} hangs (limit {timeout:.0f} s)", flush=True)
    for label, path, words, other in KINDS:
        c = count(path, root, timeout, (words, other))
        print(f"  {label:<34} {path:<28} {c['cases']:>3} cases, " + ", ".join(f"{c[k]} {k}" for k in KIND_NAMES[:3])
              + f", {c['hangs']} hangs, {c['memory']} memory, {c['trust bypasses']} trust bypasses "
              f"({c['failed']} failed, {c['skipped']} skipped)", flush=True)


if __name__ == "__main__":  # python -m deltarefit.apps.bench.classes: this section of bench.hostile alone
    section()
