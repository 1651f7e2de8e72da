"""The CLI benchmark on a small synthetic pair: `cp`, the CLI (bytecode cached and as given) and the
library's warm call each timed on a fresh copy, the encode from the shell and warm, and the bounds and
stages (``bench.cli_stages``), every result checked against the target fingerprint by the benchmark
itself. Figures are printed, never asserted on."""

from __future__ import annotations

import os

from deltarefit.apps.bench import cli as bench_cli
from deltarefit.apps.bench.stream import _chain


def test_cli_bench_measures_each_path_and_reports_them(tmp_path):
    steps = _chain(str(tmp_path), 32, 2, 0.03, 0)
    r = bench_cli.measure_pair("tiny", steps[0], steps[1], str(tmp_path), 1, stages=True)
    for k in ("cp", "cli_cached", "cli_env", "library", "cli_encode", "library_encode"):
        assert 0 < r[k]["min"] <= r[k]["median"] <= r[k]["max"], k
    for k in ("cp", "blake3_1", "blake3_pool", "blake3_whole"):
        assert r["baselines"][k]["median"] > 0, k
    assert set(r["apply_stages"]) >= {"hash", "plan", "write", "flush", "decode"}
    assert set(r["encode_stages"]) >= {"hash", "nondurable", "durable", "scan_code", "fsync"}
    assert 0.025 < r["changed"] < 0.035 and r["delta_bytes"] < r["bytes"] / 10
    assert r["fixed_cached"] == r["cli_cached"]["median"] - r["library"]["median"]
    fx = r["fixed"]
    assert fx["python"]["median"] > 0 and fx["start"]["median"] > 0
    assert fx["start_less_python"] == fx["start"]["median"] - fx["python"]["median"]
    assert os.path.isdir(tmp_path / "pycache")  # the cached run's bytecode went to the work dir
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".delta") or "work" in f]  # nothing left
    res = {"machine": "m", "environment": {"dontwritebytecode": True, "package_dir": "src"}, "pairs": [r]}
    md = bench_cli.markdown(res, "python -m deltarefit.apps.bench.cli")
    assert "| tiny | 34 |" in md and "bytecode cached" in md and "`PYTHONDONTWRITEBYTECODE` set" in md
    assert "### tiny: bounds and stages" in md and "apply: flush (msync + fsync)" in md
    assert "`deltarefit fingerprint` of a 4-element checkpoint" in md


def test_fixed_only_measures_each_source_tree(capsys):
    """``--fixed-only SRC...``: the fixed costs of each tree, named; none: this process's deltarefit."""
    import deltarefit

    src = os.path.dirname(os.path.dirname(os.path.abspath(deltarefit.__file__)))
    assert bench_cli.main(["--fixed-only", src, "--repeat", "1"]) == 0
    assert bench_cli.main(["--fixed-only", "--repeat", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{src}: python -c pass ") and "deltarefit fingerprint of a 4-element" in out[0]
    assert out[1].startswith("this deltarefit: python -c pass ")


def test_stream_bench_runs_on_a_short_chain_and_refuses_a_shorter_one(tmp_path, capsys):
    """``bench.stream --versions 4`` reports only the distances the chain has (it used to ask for version 6)."""
    import pytest

    from deltarefit.apps.bench import stream as bench_stream

    assert bench_stream.main(["--versions", "4", "--mib", "4", "--out", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    assert "2 versions behind the keyframe" in out and "3 versions behind the keyframe" in out
    assert "5 versions behind" not in out
    with pytest.raises(SystemExit) as e:
        bench_stream.main(["--versions", "2"])
    assert e.value.code == 2
