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


def _checkout() -> str | None:
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 4))
    return root if os.path.isdir(os.path.join(root, "tests")) else None


def count(path: str, root: str, timeout: float) -> dict[str, int]:
    """Cases, failures (errors included), skips, tracebacks reported in failures, and hangs (1 when the
    file ran past ``timeout``) of one test file."""
    with tempfile.TemporaryDirectory(prefix="deltarefit-classes-") as d:
        xml = os.path.join(d, "r.xml")
        env = dict(os.environ, PYTHONPATH=os.path.join(root, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", xml, path],
                           cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout,
                           check=False)
        except subprocess.TimeoutExpired:
            return {"cases": 0, "failed": 0, "skipped": 0, "tracebacks": 0, "hangs": 1}
        if not os.path.exists(xml):
            return {"cases": 0, "failed": 0, "skipped": 0, "tracebacks": 0, "hangs": 0}
        cases = list(ET.parse(xml).getroot().iter("testcase"))
    bad = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    text = [(x.text or "") + (x.get("message") or "") for c in bad for x in c if x.tag in ("failure", "error")]
    return {"cases": len(cases), "failed": len(bad), "skipped": sum(c.find("skipped") is not None for c in cases),
            "tracebacks": sum("Traceback" in t for t in text), "hangs": 0}


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


if __name__ == "__main__":  # python -m deltarefit.apps.bench.classes: this section of bench.hostile alone
    section()
