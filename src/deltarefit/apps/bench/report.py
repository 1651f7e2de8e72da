"""The benchmark driver: pairs -> ours, peers, entropy bound, speeds -> table, JSON and BENCHMARKS.md.

Contract:

* :func:`run_bench` builds the pairs (three real AdamW pairs at lr 1e-6/3e-6/1e-5 and one synthetic
  pair per entry of ``synthetic_params``, calibrated on the lr 3e-6 pair at its own change rate; with
  ``quick=True`` one AdamW pair at lr 3e-6 and one 1e6-parameter synthetic pair), and for each pair
  measures: ours through ``deltarefit.encode`` / ``deltarefit.apply`` (apply runs on a copy of the base,
  and the result must equal the target tensor for tensor, bit for bit, or the run fails), the peers of
  :mod:`.peers` (the sparse patches decoded back and checked), the entropy bound of :mod:`.entropy`,
  and speeds in GB/s (1e9 bytes/s of raw checkpoint tensor bytes): our encode and apply (the codec's
  own ``seconds``, after one untimed warm-up encode/apply on a tiny pair so JIT compilation is not
  timed), zstd -1 of the full checkpoint, and ``shutil.copyfile`` of the checkpoint file as the
  baseline for apply. Files are in the page cache when timed (they were just written).
  When ``deltarefit.encode`` is not importable, "ours" is reported as unavailable and the rest runs.
* Every ratio is ``raw target tensor bytes / shipped bytes`` (higher is better).
* One JSON-serializable dict per pair is returned and written to ``out_dir/results.json``.
* :func:`write_markdown` writes the table, the machine and the exact command to a Markdown file
  (it and the other presentation, :mod:`.report_render`, are re-exported here).
* :func:`main` is the ``python -m deltarefit.apps.bench`` entry point.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from . import peers as _peers
from ._st import same_tensors
from .entropy import entropy_bound
from .pairs import Calibration, Pair, calibrate, make_adamw_pairs, make_synthetic_pair
from .report_render import (  # noqa: F401 (the presentation's names, re-exported)
    COLUMN_TITLES,
    COLUMNS,
    machine_info,
    table_lines,
    write_markdown,
    write_plot,
)

log = logging.getLogger(__name__)

ADAMW_LRS: tuple[float, ...] = (1e-6, 3e-6, 8.5e-6, 1e-5)  # 8.5e-6: about 3.5% changed, the reference pair
QUICK_LR = 3e-6
CALIBRATION_LR = 3e-6


def load_codec() -> tuple[ModuleType | None, str]:
    """``(deltarefit, "")`` when ``deltarefit.encode``/``apply`` exist, else ``(None, reason)``."""
    try:
        import deltarefit
    except Exception as e:
        return None, f"import deltarefit failed: {type(e).__name__}: {e}"
    missing = [n for n in ("encode", "apply") if not callable(getattr(deltarefit, n, None))]
    if missing:
        return None, f"deltarefit has no {' / '.join(missing)} yet"
    return deltarefit, ""


def _gbps(nbytes: float, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds and seconds > 0 else None


def _copy_gbps(path: str, work: Path) -> float | None:
    if not os.path.isfile(path):
        return None
    dst = work / "copy.safetensors"
    dt = float("inf")
    for _ in range(_peers.REPEATS):
        t0 = time.perf_counter()
        shutil.copyfile(path, dst)
        dt = min(dt, time.perf_counter() - t0)
        dst.unlink()
    return _gbps(os.path.getsize(path), dt)


def _files_equal(a: Path, b: Path, block: int = 1 << 24) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(block), fb.read(block)
            if x != y:
                return False
            if not x:
                return True


def run_ours(codec: ModuleType, pair: Pair, work: Path, threads: int) -> dict[str, Any]:
    """Encode, apply to a copy of the base, verify bit-exactness (encode timed as the best of
    ``REPEATS`` runs, each right after a run of ``zstd -1`` on the same checkpoint, so that both meet the
    same moments of a shared machine; apply as the best of ``REPEATS``). Raises when the result differs."""
    delta, sdelta = work / "ours.delta", work / "ours-stream.delta"
    # In a stream the base of each encode is the target of the one before, whose segment hashes the
    # publisher keeps (KnownHashes): taken here, untimed, as the previous publish would have.
    known = codec.known_hashes(pair.base, threads=threads) if hasattr(codec, "known_hashes") else None
    erep, srep, zbest = None, None, float("inf")
    for _ in range(_peers.REPEATS):
        zbest = min(zbest, _peers.zstd_full(pair.target, threads, repeats=1).seconds)
        # Each encode writes a new file, as a publish does: renaming over the last run's file would
        # time the removal of its blocks too.
        delta.unlink(missing_ok=True)
        rep = codec.encode(pair.base, pair.target, str(delta), threads=threads)
        erep = rep if erep is None or rep.seconds < erep.seconds else erep
        if known is not None:
            sdelta.unlink(missing_ok=True)
            rep = codec.encode(pair.base, pair.target, str(sdelta), threads=threads, known_base=known,
                               durable=False)
            if not rep.base_hashes_known:
                raise AssertionError(f"{pair.name}: the stream encode did not use the known base hashes")
            srep = rep if srep is None or rep.seconds < srep.seconds else srep
    if srep is not None:
        if not _files_equal(sdelta, delta):
            raise AssertionError(f"{pair.name}: the stream encode wrote other bytes than the cold one")
        sdelta.unlink()
    scratch = work / "apply"  # the codec may leave a journal beside the checkpoint: all goes at the end
    arep = None
    for _ in range(_peers.REPEATS):
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        if os.path.isdir(pair.base):
            ckpt = scratch / "checkpoint"
            shutil.copytree(pair.base, ckpt)
        else:
            ckpt = scratch / os.path.basename(pair.base)
            shutil.copyfile(pair.base, ckpt)
        rep = codec.apply(str(delta), str(ckpt), threads=threads)
        arep = rep if arep is None or rep.seconds < arep.seconds else arep
    if not same_tensors(str(ckpt), pair.target):
        raise AssertionError(f"{pair.name}: deltarefit.apply did not reproduce the target bit for bit")
    files_equal = ckpt.is_file() and _files_equal(ckpt, Path(pair.target))
    nbytes = os.path.getsize(delta)
    if int(erep.delta_bytes) != nbytes:
        log.warning(
            "%s: rep.delta_bytes %d != file size %d; using the file size", pair.name, erep.delta_bytes, nbytes
        )
    shutil.rmtree(scratch)
    delta.unlink()
    return {
        "nbytes": nbytes,
        "full_bytes": int(erep.full_bytes),
        "changed_elements": int(erep.changed_elements),
        "total_elements": int(erep.total_elements),
        "encode_seconds": float(erep.seconds),
        "encode_stream_seconds": float(srep.seconds) if srep is not None else None,
        "zstd_full_seconds_beside": zbest,
        "apply_seconds": float(arep.seconds),
        "apply_written_bytes": int(arep.written_bytes),
        "verified": True,
        "file_identical": bool(files_equal),
    }


def _warm_up(codec: ModuleType, work: Path, cal: Calibration, threads: int) -> None:
    """One untimed encode/apply on a tiny pair, so one-time costs (JIT compilation) are not timed."""
    pair = make_synthetic_pair(work, 2e5, change_rate=None, calibration=cal, seed=99, cols=1024)
    run_ours(codec, pair, work, threads)
    shutil.rmtree(work)


def bench_pair(
    pair: Pair, work: Path, threads: int, codec: ModuleType | None, codec_reason: str
) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    log.info("benchmarking %s", pair.name)
    row: dict[str, Any] = {"pair": pair.to_dict(), "threads": threads, "notes": []}
    pr = _peers.run_peers(pair.base, pair.target, str(work), threads)
    full = pr["full"].nbytes or 0
    row["full_bytes"] = full
    row["peers"] = {k: v.to_dict() for k, v in pr.items()}
    nbytes: dict[str, float | None] = {k: v.nbytes for k, v in pr.items() if k != "full"}
    seconds: dict[str, float | None] = {k: v.seconds for k, v in pr.items() if k != "full"}
    for k, v in pr.items():
        if v.verified is False:
            row["notes"].append(f"{k}: {v.note}")
        elif not v.available:
            row["notes"].append(f"{k} unavailable: {v.note}")
    eb = entropy_bound(pair.base, pair.target)
    row["bound"] = eb.to_dict()
    nbytes["bound"] = eb.bound_bytes
    if codec is not None:
        ours = run_ours(codec, pair, work, threads)
        row["ours"] = ours
        nbytes["ours"] = ours["nbytes"]
        seconds["ours"] = ours["encode_seconds"]
        # zstd -1's speed beside ours: the best of its runs alternating with our encodes, and of its own.
        seconds["zstd_full"] = min(seconds["zstd_full"] or float("inf"), ours["zstd_full_seconds_beside"])
    else:
        row["ours"] = None
        nbytes["ours"] = None
        row["notes"].append(f"ours unavailable: {codec_reason}")
    row["bytes"] = nbytes
    row["seconds"] = seconds
    row["ratio"] = {k: (full / v if v else None) for k, v in nbytes.items()}
    row["gbps"] = {
        "ours_encode": _gbps(full, row["ours"]["encode_seconds"]) if row["ours"] else None,
        "ours_encode_stream": _gbps(full, row["ours"].get("encode_stream_seconds")) if row["ours"] else None,
        "ours_apply": _gbps(full, row["ours"]["apply_seconds"]) if row["ours"] else None,
        "zstd_full": _gbps(full, seconds["zstd_full"]),
        "copy": _copy_gbps(pair.target, work),
    }
    return row


def _build_pairs(
    out: Path, quick: bool, synthetic_params: Sequence[float], synthetic_rates: Sequence[float | None]
) -> tuple[list[Pair], Calibration]:
    lrs = (QUICK_LR,) if quick else ADAMW_LRS
    pairs = make_adamw_pairs(out / "adamw", lrs)
    cal_pair = next((p for p in pairs if p.name == f"adamw-lr{CALIBRATION_LR:g}"), pairs[0])
    cal = calibrate(cal_pair.base, cal_pair.target)
    cal.save(out / "calibration.json")
    sizes = (1e6,) if quick else tuple(synthetic_params)
    for i, n in enumerate(sizes):
        for j, rate in enumerate(synthetic_rates):
            pairs.append(make_synthetic_pair(out / "synthetic", n, change_rate=rate, calibration=cal,
                                             seed=i + 1000 * j))
    return pairs, cal


def run_bench(
    out_dir: str | os.PathLike[str],
    *,
    quick: bool = False,
    synthetic_params: Sequence[float] = (1e8,),
    threads: int | None = None,
    synthetic_change_rate: float | Sequence[float | None] | None = None,
    keep_pairs: bool = True,
) -> list[dict[str, Any]]:
    """Run the whole benchmark; see the module docstring. Returns one dict per pair.
    ``synthetic_change_rate``: one rate or several (None: the calibration pair's), a pair per size and rate."""
    threads = threads or os.cpu_count() or 1
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    codec, reason = load_codec()
    if codec is None:
        log.warning("our codec is not benchmarked: %s", reason)
    rates = list(synthetic_change_rate) if isinstance(synthetic_change_rate, (list, tuple)) \
        else [synthetic_change_rate]
    pairs, cal = _build_pairs(out, quick, synthetic_params, rates)
    if codec is not None:
        _warm_up(codec, out / "warmup", cal, threads)
    results = []
    for p in pairs:
        row = bench_pair(p, out / "work" / p.name, threads, codec, reason)
        if p.name.startswith("synthetic"):
            row["notes"].append(f"calibrated on {cal.source} ({100 * cal.change_rate:.2f}% changed)")
        results.append(row)
        if not keep_pairs and p.name.startswith("synthetic"):
            for f in (p.base, p.target):
                os.remove(f)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return results


def _parse_count(s: str) -> float:
    v = float(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"not a parameter count: {s}")
    return v


def _parse_rate(s: str) -> float | None:
    if s == "cal":
        return None
    r = float(s)
    if not 0 < r < 1:
        raise argparse.ArgumentTypeError(f"change rate {s!r} is not a fraction in (0, 1) or 'cal'")
    return r


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.bench", description="deltarefit benchmark")
    ap.add_argument("--quick", action="store_true", help="one AdamW pair + one 1e6 synthetic pair (CI)")
    ap.add_argument("--out", default="out/bench", help="work directory (default: out/bench)")
    ap.add_argument(
        "--synthetic-params",
        type=_parse_count,
        nargs="+",
        default=[1e8],
        help="synthetic sizes, e.g. 1e8 1e9",
    )
    ap.add_argument(
        "--synthetic-change-rate", type=_parse_rate, nargs="+", default=[None],
        help="fractions changed, e.g. cal 0.035; cal (the default) = that of the calibration pair",
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="threads for ours, zstd and ZipNN (default: all cores)"
    )
    ap.add_argument(
        "--markdown", default=None, help="also write this Markdown file (e.g. docs/BENCHMARKS.md)"
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    threads = args.threads or os.cpu_count() or 1
    results = run_bench(
        args.out,
        quick=args.quick,
        synthetic_params=args.synthetic_params,
        threads=threads,
        synthetic_change_rate=args.synthetic_change_rate,
    )
    print("\n".join(table_lines(results)))
    for n in sorted({n for r in results for n in r["notes"]}):
        print(f"note: {n}")
    if args.markdown:
        cmd = shlex.join(["python", "-m", "deltarefit.apps.bench", *argv])
        png = str(Path(args.markdown).with_suffix(".png"))
        plotted = write_plot(results, png)
        write_markdown(results, args.markdown, cmd, machine_info(threads), plot=os.path.basename(png) if plotted else None)
        print(f"wrote {args.markdown}" + (f" and {png}" if plotted else ""))
    return 0
