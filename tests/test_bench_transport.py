"""The transport benchmark end to end on a tiny pair: local and S3 stores at an emulated link, gloo
broadcast, S3 throughput; the report and plot it writes. Figures are printed, never asserted on."""

from __future__ import annotations

import json
import os

import pytest

from deltarefit.apps.bench import seaweed
from deltarefit.apps.bench.transport import main


@pytest.mark.slow  # 28 s of the default suite for a benchmark's report: make test-slow runs it
def test_transport_bench_tiny_pair(tmp_path, capsys):
    s3 = seaweed.missing_reason() is None
    if not s3 and os.environ.get("CI"):
        raise RuntimeError(f"the S3 part cannot run in CI: {seaweed.missing_reason()}")
    md, js = tmp_path / "T.md", tmp_path / "t.json"
    args = ["--mib", "4", "--links", "200Mbit", "--markdown", str(md), "--json", str(js), "--out", str(tmp_path / "w")]
    assert main(args + ([] if s3 else ["--no-s3"])) == 0
    res = json.loads(js.read_text())
    kinds = [r["transport"] for r in res["store"]]
    assert kinds == (["local", "s3"] if s3 else ["local"])
    for r in res["store"]:
        assert r["delta_bytes"] < r["full_bytes"] / 5
        assert r["full"] > 0 and r["delta"] > 0 and r["delta_publish"] > 0 and r["delta_sync"] > 0
        assert r["link"] == "200Mbit"
    assert res["dist"]["delta_bytes"] < res["dist"]["full_bytes"] / 5
    if s3:
        assert res["s3"]["bytes"] == res["store"][0]["full_bytes"] and res["s3"]["up_ratio"] > 0
    text = md.read_text()
    assert "## Refit through a store at an emulated link" in text and "## Where the delta's time goes" in text
    try:
        import matplotlib  # noqa: F401  (the plot needs the bench extra)
    except ImportError:
        assert "![refit times]" not in text and not (tmp_path / "T.png").exists()
    else:
        assert "![refit times](T.png)" in text and (tmp_path / "T.png").read_bytes()[:4] == b"\x89PNG"
    assert "faster" in capsys.readouterr().out


def test_report_keeps_its_hand_written_part(tmp_path):
    from deltarefit.apps.bench.transport import KEEP_MARKER, _kept_part

    md = tmp_path / "T.md"
    assert _kept_part(str(md)) == ""  # no report yet
    md.write_text("# generated\n\n| a |\n")
    assert _kept_part(str(md)) == ""
    md.write_text(f"# generated\n\n{KEEP_MARKER} ... -->\n\n## Notes\n\nkept\n")
    assert _kept_part(str(md)) == f"\n{KEEP_MARKER} ... -->\n\n## Notes\n\nkept\n"
