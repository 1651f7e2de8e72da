"""Every skip tells what it needs: the default run lists skips with their reasons (``-rs`` in pyproject's
addopts), and a missing package's reason says what to install or which make target runs the test."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _calls(name: str):
    """(file, line, call) for each ``pytest.<name>(...)`` in the tests."""
    for f in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "pytest"):
                yield f.name, node.lineno, node


def test_the_default_run_prints_the_reason_of_each_skip():
    opts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-rs" in opts.split()


def test_a_missing_package_says_what_to_install_or_which_make_target_runs_it():
    """Regression (issue 47): ``pytest.importorskip("peft")`` and the like skipped with "could not import
    'peft'" and nothing on where it comes from."""
    bad = []
    for f, line, call in _calls("importorskip"):
        reason = next((k.value for k in call.keywords if k.arg == "reason"), None)
        text = ast.unparse(reason) if reason is not None else ""
        if not any(w in text for w in ("pip install", "make ")):
            bad.append(f"{f}:{line}: {text or 'no reason'}")
    assert not bad, bad


def test_every_skip_gives_a_reason():
    bad = [f"{f}:{line}" for f, line, call in _calls("skip") if not call.args and not call.keywords]
    assert not bad, bad


def test_no_skip_is_a_combination_that_can_never_run():
    """A combination no machine can run (a capability its store lacks, a lie a target never reads) is
    parametrized away, not collected and skipped: a skip names what is missing here and would run it."""
    bad = [f"{f}:{line}" for f, line, call in _calls("skip")
           if any("not applicable" in ast.unparse(a) for a in [*call.args, *(k.value for k in call.keywords)])]
    assert not bad, bad
