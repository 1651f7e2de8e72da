"""The refit-time model: published figures reproduced, monotone in change and bandwidth, a crossover."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from itertools import pairwise

import pytest
from click.testing import CliRunner

from deltarefit.apps import simulate as sim
from deltarefit.cli import main

NEMO_S3_3 = sim.NEMO_RL_S3_S[0]


@pytest.fixture(scope="module")
def refs():
    return sim.references()


def test_every_published_reference_is_reproduced_within_25_percent(refs):
    rows, _ = refs
    assert len(rows) == 6
    for r in rows:
        assert abs(r.error) <= 0.25, (r.name, r.published_s, r.model_s())


def test_the_predicted_rows_are_not_fitted_and_still_close(refs):
    rows, _ = refs
    predicted = [r for r in rows if r.how == "predicted"]
    assert len(predicted) == 3  # NeMo-DCR's delta and both NeMo-RL relay figures
    for r in predicted:
        assert abs(r.error) <= 0.2, r.name


def test_what_the_figures_imply(refs):
    rows, d = refs
    # 2 TB in 87.5 min: about 3 Gbit/s, as the paper's setup implies.
    assert d.dcr_link_gbps == pytest.approx(3.05, abs=0.01)
    # NeMo-RL's relay figures on their own imply the same root link (a cross-check the model does not use).
    assert d.relay_implied_gbps == pytest.approx(d.dcr_link_gbps, rel=0.05)
    assert 4 < d.s3_link_gbps < 10  # below the CRT client's 10 Gbit/s target
    assert 0 < d.s3_fixed_s < NEMO_S3_3 and d.cores_per_producer > 0
    # Their codec's ratios from their measured wire bytes: ~42x at 3%, ~25x at 5%; ours is higher at both.
    r3, r5 = d.nemo_ratios["s3"]
    assert 40 < r3 < 45 and 24 < r5 < 27
    for r in rows:
        if r.ours_ratio is not None:
            assert r.ours_ratio > r.setup.compression
            assert r.ours_s() < r.model_s()


def test_ratio_curve_goes_through_the_measured_points_and_falls_with_change():
    for codec, pts in sim.BENCH_RATIOS.items():
        for c, r in pts:
            assert sim.interp_ratio(c, codec) == pytest.approx(r, rel=1e-9)
    xs = [10 ** (-3 + i / 10) for i in range(25)]
    for codec in sim.BENCH_RATIOS:
        ys = [sim.interp_ratio(c, codec) for c in xs]
        assert all(a > b for a, b in pairwise(ys)), codec
    assert sim.interp_ratio(0.03) > sim.interp_ratio(0.03, "nemo") > sim.interp_ratio(0.03, "trl")


@pytest.mark.parametrize("params", [8e9, 70e9, 1e12])
@pytest.mark.parametrize("codec", ["ours", "nemo"])
def test_more_change_means_a_slower_delta_refit(params, codec):
    changes = [0.002, 0.006, 0.01, 0.02, 0.03, 0.05, 0.08]
    es = [sim.estimate(sim.Setup(params=params, change=c, codec=codec)) for c in changes]
    for a, b in pairwise(es):
        assert b.delta_store_s > a.delta_store_s and b.delta_relay_s > a.delta_relay_s
        assert b.delta_bytes > a.delta_bytes
        assert b.full_store_s == a.full_store_s  # the full checkpoint does not care


@pytest.mark.parametrize("params", [8e9, 1e12])
def test_more_bandwidth_means_a_faster_refit(params):
    gbps = [1, 3, 10, 25, 100, 400, 1600]
    for field in ("link_gbps", "fabric_gbps", "store_gbps"):
        es = [sim.estimate(replace(sim.Setup(params=params), **{field: g})) for g in gbps]
        for a, b in pairwise(es):
            for attr in ("full_store_s", "full_relay_s", "delta_store_s", "delta_relay_s"):
                assert getattr(b, attr) <= getattr(a, attr), (field, attr)
    es = [sim.estimate(sim.flat(sim.Setup(params=params), g)) for g in gbps]
    for a, b in pairwise(es):
        assert b.delta_relay_s < a.delta_relay_s and b.full_relay_s < a.full_relay_s


def test_more_encode_and_apply_cores_mean_a_faster_delta_refit():
    a = sim.estimate(sim.Setup(shards=32))
    b = sim.estimate(sim.Setup(shards=64))
    assert b.encode_s == pytest.approx(a.encode_s / 2) and b.delta_relay_s < a.delta_relay_s


def test_the_crossover_exists_and_separates_the_regimes():
    s = sim.Setup(params=1e12, change=0.03)
    x = sim.crossover_gbps(s)
    assert x is not None and 100 < x < 10_000
    below, at, above = (sim.estimate(sim.flat(s, g)) for g in (x / 4, x, x * 4))
    assert below.delta_relay_s < below.full_relay_s  # slow links: the delta wins
    assert above.full_relay_s < above.delta_relay_s  # fast fabrics: the full weights win
    assert at.delta_relay_s == pytest.approx(at.full_relay_s, rel=1e-3)
    # It sits where S/B meets the encode + apply floor: B* ~ (S - D) / (encode + apply).
    e = sim.estimate(s)
    assert x == pytest.approx((e.full_bytes - e.delta_bytes) * 8 / 1e9 / (e.encode_s + e.apply_s), rel=0.05)
    # Across clusters the delta wins by far for 1T at 3%.
    for g, speedup in ((3, 30), (25, 10), (100, 3)):
        e = sim.estimate(sim.flat(s, g))
        assert e.full_relay_s / e.delta_relay_s > speedup, g


def test_checkpoint_engine_full_broadcast_lands_in_its_reported_range():
    # 1T full weights in 16-20 s: the model's full-weight broadcast at 800-1000 Gbit/s effective.
    s = sim.Setup(params=sim.CKPT_ENGINE_PARAMS, nodes=8)
    for g, want in ((800, 20.0), (1000, 16.0)):
        assert sim.estimate(sim.flat(s, g)).full_relay_s == pytest.approx(want, rel=0.05)


def test_tree_depth():
    assert [sim.tree_depth(n, 2) for n in (1, 2, 3, 4, 7, 8, 15, 16)] == [0, 1, 1, 2, 2, 3, 3, 4]
    assert sim.tree_depth(5, 1) == 4 and sim.tree_depth(9, 8) == 1


def test_parse_params():
    assert sim.parse_params("8B") == 8e9 and sim.parse_params("1T") == 1e12 and sim.parse_params("70e9") == 70e9
    with pytest.raises(ValueError):
        sim.parse_params("-3B")


def test_calibrate_measures_positive_per_core_rates():
    enc, app, ratio = sim.calibrate(elements=1 << 20)
    assert enc > 0 and app > 0 and ratio > 5


def test_cli_references_prints_the_reproduction_table():
    res = CliRunner().invoke(main, ["simulate", "--references"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for name in ("NeMo-DCR 1T delta refit at 3%", "NeMo-RL 247.2 GB at 5%, S3", "NeMo-RL 247.2 GB at 3%, relay tree"):
        assert name in res.output
    assert "87.5 min" in res.output and "3.05 Gbit/s" in res.output and "checkpoint-engine" in res.output


def test_cli_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs the bench extra (pip install -e '.[bench]')")
    png = tmp_path / "sim.png"
    res = CliRunner().invoke(main, ["simulate", "--params", "8B", "--params", "1T", "--link-gbps", "3",
                                    "--plot", str(png)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "crossover for 1T" in res.output and "8B" in res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = CliRunner().invoke(main, ["simulate", "--params", "lots"])
    assert res.exit_code == 2 and "--params" in res.output


def test_the_plot_goes_under_the_output_directory_and_its_path_is_printed(tmp_path, monkeypatch):
    """Regression (issue 47): the PNG landed where the command ran, unannounced."""
    pytest.importorskip("matplotlib", reason="the plot needs the bench extra (pip install -e '.[bench]')")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["simulate", "--params", "8B"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    png = os.path.join("out", "simulate", "simulate.png")
    assert f"plot: {png}" in res.output and sorted(os.listdir(tmp_path)) == ["out"]
    assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = CliRunner().invoke(main, ["simulate", "--params", "8B", "--out", "elsewhere"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and os.path.isfile(tmp_path / "elsewhere" / "simulate.png"), res.output
    assert f"plot: {os.path.join('elsewhere', 'simulate.png')}" in res.output


def test_estimates_are_finite_over_the_whole_range():
    for p in (8e9, 1e12):
        for c in (0.001, 0.03, 0.2):
            e = sim.estimate(sim.Setup(params=p, change=c))
            assert all(math.isfinite(v) and v > 0 for v in (e.delta_store_s, e.delta_relay_s, e.full_store_s))


def test_the_engine_update_step_follows_the_engine_benchmark():
    """``rollout="engine"`` models the update step as docs/ENGINES.md measured it: a cost per element (the
    decoder's pass over the base) and one per changed element, so it grows with the change rate, and it
    is not the file apply's rate."""
    from dataclasses import replace

    from deltarefit.apps import simulate as sim

    s = sim.Setup(params=1e12, change=0.03, shards=64, apply_cores=8)
    e = sim.estimate(s).apply_s
    want = 1e12 * (sim.ENGINE_ELEMENT_NS_CORE + 0.03 * sim.ENGINE_CHANGE_NS_CORE) * 1e-9 / (64 * 8)
    assert e == pytest.approx(want)
    assert sim.estimate(replace(s, change=0.01)).apply_s < e
    assert sim.estimate(replace(s, rollout="file")).apply_s == pytest.approx(2e12 / (64 * 8 * sim.APPLY_GBPS_PER_CORE * 1e9))


BOX = "┏┃┡│└"  # the first character of every line of a rich table in its default box


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line[:1] in BOX]


@pytest.mark.parametrize("args", [["--params", "8B", "--params", "70B", "--params", "235B", "--params", "1T"],
                                  ["--params", "1.5T", "--link-gbps", "1", "--store-gbps", "3"], ["--references"]])
def test_every_line_simulate_prints_fits_80_columns_with_no_cell_cut(args):
    res = CliRunner().invoke(main, ["simulate", *args, "--plot", ""], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert len(_table_lines(res.output)) >= 10
    assert max(len(line.rstrip()) for line in lines) <= 80, max(lines, key=len)
    assert not any("…" in line for line in _table_lines(res.output))  # a cell truncated to fit


def test_the_tables_are_at_most_80_columns_wide_on_a_wider_terminal(monkeypatch, capsys):
    """Not squeezed into 80 by the console: rendered 300 wide, they are still at most 80."""
    monkeypatch.setattr(sim, "WIDTH", 300)
    sim.run(sim.Setup(), [8e9, 1e12], plot_path=None)
    sim.run(sim.Setup(), [], show_references=True)
    tables = _table_lines(capsys.readouterr().out)
    assert len(tables) >= 30
    assert max(len(line) for line in tables) <= 80, max(tables, key=len)
