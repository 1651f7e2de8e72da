"""`deltarefit inspect` in 80 columns: every line fits, the figures whole on one line, a long tensor name
broken after its dots and kept in full across its lines. (`simulate`'s tables: tests/test_simulate.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

import deltarefit
from deltarefit.cli.core import _break_name

NAMES = ["model.layers.31.self_attn.q_proj.weight", "model.layers.11.post_attention_layernorm.weight",
         "model.layers.7.mlp.experts.127.down_proj.weight_scale_inv", "lm_head.weight", "model.norm.weight"]


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DELTAREFIT_NO_PROGRESS="1", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "deltarefit", *args], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.fixture(scope="module")
def delta(tmp_path_factory):
    d = tmp_path_factory.mktemp("width")
    rng = np.random.default_rng(3)
    base = {n: rng.standard_normal((64, 300)).astype(np.float32) for n in NAMES}
    target = {n: v.copy() for n, v in base.items()}
    for n in NAMES[:3]:
        target[n].reshape(-1)[::9] += 1.0
    target[NAMES[2]][:] = rng.standard_normal((64, 300))  # all changed: another encoding
    save_file(base, str(d / "a.safetensors"))
    save_file(target, str(d / "b.safetensors"))
    deltarefit.encode(str(d / "a.safetensors"), str(d / "b.safetensors"), str(d / "x.delta"))
    return str(d / "x.delta")


def _first_cells(out: str) -> list[str]:
    return [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]


@pytest.mark.parametrize("show_all", [False, True])
def test_inspect_fits_80_columns_and_keeps_every_name_and_figure_whole(delta, show_all):
    r = run("inspect", delta, *(["--all"] if show_all else []))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80, max(lines, key=len)
    assert "…" not in r.stdout
    info = deltarefit.inspect(delta)  # what --json prints
    shown = [t for t in info["tensors"] if show_all or t["op"] != "same"]
    assert len(shown) == (5 if show_all else 3)
    assert "".join(_first_cells(r.stdout)) == "".join(t["name"] for t in shown)  # names whole, in order
    starts = [line for line in lines if line.startswith("│") and line.split("│")[4].strip()]
    assert len(starts) == len(shown)
    for t, row in zip(shown, starts, strict=True):  # each tensor's figures whole, on the line its name starts on
        cells = [c.strip() for c in row.split("│")[1:-1]]
        assert t["name"].startswith(cells[0]), (t["name"], row)
        assert cells[1:6] == [t["op"], t["dtype"], f"{t['elements']:,}", f"{100 * t['changed_fraction']:.3f}%",
                              f"{t['bytes']:,}"], row
    assert any(line.startswith("total: ") for line in lines) and any(line.startswith("target ") for line in lines)


def test_a_long_tensor_name_breaks_after_its_dots():
    assert _break_name("model.layers.31.self_attn.q_proj.weight", 20) == "model.layers.31.\nself_attn.q_proj.\nweight"
    assert _break_name("lm_head.weight", 20) == "lm_head.weight"
    assert _break_name("a_very_long_part_without_dots.x", 10) == "a_very_long_part_without_dots.\nx"
