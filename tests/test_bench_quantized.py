"""The quantized-rollout benchmark's pieces: vLLM's per-channel quantization, the change counts, the deltas."""

from __future__ import annotations

import pytest
import torch

from deltarefit.apps.bench import quantized as q


def _sd(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embeddings.word_embeddings.weight": torch.randn(64, 32, generator=g).bfloat16(),
            "encoder.layer.0.dense.weight": (torch.randn(48, 32, generator=g) * 0.02).bfloat16(),
            "encoder.layer.0.dense.bias": torch.zeros(48).bfloat16(),
            "encoder.layer.0.zero.weight": torch.zeros(8, 32).bfloat16()}


def test_fp8_and_int8_codes_and_scales_follow_the_per_channel_formulas():
    w = _sd(0)["encoder.layer.0.dense.weight"]
    codes, scale = q.quantize_fp8(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (48, 1) and scale.dtype == torch.float32
    assert torch.equal(scale, w.float().abs().amax(dim=1, keepdim=True) / 448.0)
    assert codes.float().abs().amax() == 448.0  # every row's largest element lands on the fp8 maximum
    assert torch.allclose(codes.float() * scale, w.float(), rtol=0.07, atol=0)
    codes, scale = q.quantize_int8(w)
    assert codes.dtype == torch.int8 and int(codes.abs().amax()) == 127
    assert torch.allclose(codes.float() * scale, w.float(), atol=float(scale.max()) / 2 + 1e-9)
    z, zs = q.quantize_fp8(torch.zeros(2, 4).bfloat16())  # an all-zero row: the floor, no division by zero
    assert torch.equal(zs, torch.full((2, 1), 1 / (448.0 * 512))) and not z.float().any()
    zi, zis = q.quantize_int8(torch.zeros(2, 4).bfloat16())
    assert not zi.any() and torch.equal(zis, torch.ones(2, 1))


def test_served_forms_quantize_linear_weights_only():
    sd = _sd(0)
    assert q.quantized_names(sd) == ["encoder.layer.0.dense.weight", "encoder.layer.0.zero.weight"]
    s = q.served(sd, "fp8")
    assert s["encoder.layer.0.dense.weight"].dtype == torch.float8_e4m3fn
    assert s["encoder.layer.0.dense.weight_scale"].shape == (48, 1)
    assert s["embeddings.word_embeddings.weight"] is sd["embeddings.word_embeddings.weight"]
    assert set(q.served(sd, "bf16")) == set(sd)


def test_measure_counts_changed_codes_and_applies_every_delta_bit_exact(tmp_path):
    base = _sd(0)
    target = dict(base)
    w = base["encoder.layer.0.dense.weight"].clone()
    w.view(torch.int16)[0, :4] += 1  # four elements one ulp up: bf16 changes, their codes may not
    w.view(torch.int16)[5] += 40  # a whole row moved far: its codes and scale change
    target["encoder.layer.0.dense.weight"] = w
    r = q.measure(base, target, str(tmp_path), threads=1)
    n = 48 * 32 + 8 * 32
    assert r["quantized_elements"] == n
    assert r["bf16"]["codes_changed"] == pytest.approx(36 / n)
    for form in ("fp8", "int8"):
        assert 0 < r[form]["codes_changed"] <= 36 / n
        assert r[form]["rows_rescaled"] >= 1 / 56
        assert r[form]["bit_exact"] and r[form]["delta_bytes"] > 0
    assert r["bf16"]["bit_exact"]
    same = q.measure(base, dict(base), str(tmp_path / "same"), threads=1)
    assert all(same[f]["codes_changed"] == 0 for f in ("bf16", "fp8", "int8"))
    assert same["fp8"]["rows_rescaled"] == 0
