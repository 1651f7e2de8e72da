"""The command line's app commands: ``deltarefit demo``, ``simulate`` and ``bench`` (registered on
``cli.main``; their modules are imported only when the command runs)."""

from __future__ import annotations

import os
import sys

import click

from .common import _run, main


@main.command()
@click.option("--out", default="out/demo", show_default=True, type=click.Path(), help="Working directory.")
@click.option("--steps", default=8, show_default=True, type=click.IntRange(min=1), help="Optimizer steps.")
@click.option("--lr", default=1e-5, show_default=True, type=float, help="AdamW learning rate.")
@click.option("--rollouts", default=2, show_default=True, type=click.IntRange(min=1),
              help="Rollout processes syncing from the version stream.")
@click.option("--transport", default="local", show_default=True, type=click.Choice(["local", "s3", "relay"]),
              help="local: a directory store; s3: S3 (--s3-url, else a SeaweedFS on loopback); relay: the "
                   "local store through a relay tree, a node per rollout.")
@click.option("--s3-url", default=None, help="s3://bucket/prefix for --transport s3 (AWS environment for the "
              "endpoint and credentials); without it a local SeaweedFS server is started for the run.")
@click.option("--json", "as_json", is_flag=True, help="Print only OUT/steps.json (the summary and a row per "
              "version) on standard output; failures still go to standard error.")
def demo(out: str, steps: int, lr: float, rollouts: int, transport: str, s3_url: str | None, as_json: bool) -> None:
    """RL refit over a version stream: a trainer process publishes each step, rollout processes sync,
    verify bit for bit, and generate stamped rollouts; a table and OUT/refit.png at the end."""

    def go() -> None:
        from ..apps.demo import run_demo

        if not run_demo(out, steps=steps, lr=lr, rollouts=rollouts, transport=transport, s3_url=s3_url,
                        quiet=as_json):
            sys.exit(6)
        if as_json:
            with open(os.path.join(out, "steps.json"), encoding="utf-8") as f:
                sys.stdout.write(f.read() + "\n")

    _run(go)


@main.command()
@click.option("--params", "params", multiple=True,
              help="Model parameters, e.g. 8B, 70B, 1T (repeatable; default: 8B 70B 235B 1T).")
@click.option("--change-pct", default=3.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Percent of bf16 elements changed per step.")
@click.option("--ratio", default=None, type=click.FloatRange(min=1),
              help="Compression ratio at that change rate (default: the codec's measured curve).")
@click.option("--codec", default="ours", show_default=True, type=click.Choice(["ours", "nemo", "trl"]),
              help="Whose measured ratio curve to use (docs/BENCHMARKS.md).")
@click.option("--link-gbps", default=25.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Bandwidth between the trainer's and the rollouts' clusters, Gbit/s.")
@click.option("--store-gbps", default=400.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Object storage aggregate throughput, Gbit/s.")
@click.option("--fabric-gbps", default=400.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Each rollout node's link inside its cluster, Gbit/s.")
@click.option("--nodes", default=16, show_default=True, type=click.IntRange(min=1), help="Rollout nodes.")
@click.option("--fanout", default=2, show_default=True, type=click.IntRange(min=1), help="Relay tree fan-out.")
@click.option("--shards", default=64, show_default=True, type=click.IntRange(min=1),
              help="Trainer shards encoding in parallel (rollout replicas are sharded alike for apply).")
@click.option("--encode-cores", default=8.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Cores encoding per shard.")
@click.option("--apply-cores", default=8.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Cores applying per shard.")
@click.option("--encode-gbps-core", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Encode GB/s per core (default: measured, docs/BENCHMARKS.md).")
@click.option("--apply-gbps-core", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Apply GB/s per core (default: measured, docs/BENCHMARKS.md).")
@click.option("--chunk-mb", default=512.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Transfer chunk in MiB (pipelining granularity).")
@click.option("--rollout", default="engine", show_default=True, type=click.Choice(["engine", "file"]),
              help="Apply into live engines (docs/ENGINES.md) or into checkpoint files (docs/BENCHMARKS.md).")
@click.option("--calibrate", is_flag=True, help="Measure encode/apply GB/s per core now on a synthetic pair.")
@click.option("--references", is_flag=True, help="Reproduce the published refit figures and exit.")
@click.option("--out", "out_dir", default="out/simulate", show_default=True, type=click.Path(file_okay=False),
              help="Directory for the plot (created if missing): OUT/simulate.png.")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="PNG to write instead of OUT/simulate.png (empty: no plot).")
def simulate(params, change_pct, ratio, codec, link_gbps, store_gbps, fabric_gbps, nodes, fanout, shards,
             encode_cores, apply_cores, encode_gbps_core, apply_gbps_core, chunk_mb, rollout, calibrate, references,
             out_dir, plot_path) -> None:
    """Model refit time at scale: full checkpoint vs delta, via object storage or a relay tree. The plot
    goes to OUT/simulate.png (its path is printed last)."""

    def go() -> None:
        from ..apps import simulate as sim
        from ..errors import UsageError

        try:
            sizes = [sim.parse_params(p) for p in params] or [8e9, 70e9, 235e9, 1e12]
        except ValueError as e:
            raise UsageError(f"--params: {e}") from None
        base = sim.Setup(change=change_pct / 100, ratio=ratio, codec=codec, link_gbps=link_gbps,
                         store_gbps=store_gbps, fabric_gbps=fabric_gbps, nodes=nodes, fanout=fanout, shards=shards,
                         encode_cores=encode_cores, apply_cores=apply_cores,
                         encode_gbps_core=encode_gbps_core or sim.ENCODE_GBPS_PER_CORE,
                         apply_gbps_core=apply_gbps_core or sim.APPLY_GBPS_PER_CORE, chunk_bytes=chunk_mb * (1 << 20),
                         rollout=rollout)
        png = os.path.join(out_dir, "simulate.png") if plot_path is None else plot_path
        if png and not png.lower().endswith(".png"):  # refused before the run (matplotlib would after it)
            raise UsageError(f"--plot {png}: the plot is written as PNG; name a .png file (empty: no plot)")
        sim.run(base, sizes, do_calibrate=calibrate, show_references=references, plot_path=png or None)

    _run(go)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True}, add_help_option=False)
@click.pass_context
def bench(ctx: click.Context) -> None:
    """Codec benchmark against peers and the entropy bound (--quick, --out, --markdown; --help for all)."""

    def go() -> None:
        from ..apps.bench.report import main as bench_main

        sys.exit(bench_main(list(ctx.args)) or 0)

    _run(go)
