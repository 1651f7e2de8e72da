"""The LoRA benchmark's core on a tiny LLaMA: one full and one LoRA step, their figures checked against
deltarefit's own encode of the kept versions, and the merged weights against the LoRA formula."""

from __future__ import annotations

import json
import os

import pytest
import torch

from deltarefit import apply, encode
from deltarefit.apps.bench import lora
from deltarefit.apps.bench.chains import RLSetup

pytest.importorskip("peft", reason="peft is in the test extra: pip install -e '.[test]' (make test installs it)")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecations, inside PEFT

TINY = RLSetup(vocab_size=128, lang_vocab=16, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
               sft_steps=2, sft_batch=4, sft_len=8, prompts=2, group_size=4, prompt_len=4, completion_len=4)
RANK = 4


@pytest.fixture(scope="module")
def trainer():
    torch.manual_seed(0)
    return lora.tiny_trainer(TINY)


def test_changed_counts_bits_not_values():
    a = torch.tensor([0.0, 1.0, float("nan"), 2.0]).bfloat16()
    b = torch.tensor([-0.0, 1.0, float("nan"), 2.015625]).bfloat16()  # -0.0 != +0.0 as bits; NaN == NaN
    assert lora.n_changed(a, b) == 2
    assert lora.n_changed(a.float(), b.float()) == 2


def test_merged_weights_are_peft_lora_formula_and_keep_the_plain_names(trainer):
    plain = trainer.build()
    names = lora.adapted_names(plain, trainer.targets)
    assert len(names) == 7 * TINY.num_layers  # q, k, v, o, gate, up, down per layer
    s = lora.Setting(1e-3, RANK)
    model = lora.with_lora(trainer.build(), s, trainer.targets)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=s.lr)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # after the first step B is nonzero; after the second A has moved too
        trainer.step(model, opt, gen)
    want = {}
    for n, mod in model.named_modules():
        if hasattr(mod, "lora_A"):
            name = n.removeprefix("base_model.model.") + ".weight"
            d = (mod.lora_B["default"].weight @ mod.lora_A["default"].weight) * (s.alpha / s.rank)
            assert d.abs().max() > 0
            want[name] = mod.get_base_layer().weight.detach() + d.detach()
    merged = lora.served_fp32(model)
    assert merged.keys() == plain.state_dict().keys()  # TRL's names: PEFT prefixes stripped, no lora_ tensors
    assert sorted(want) == sorted(names)
    for k in names:
        assert torch.equal(merged[k].view(torch.int32), want[k].view(torch.int32)), k
    assert not any(getattr(m, "merged", False) for m in model.modules())  # unmerged again after the read


def _check_against_encode(res: lora.Result, keep: str, tmp_path) -> None:
    for what, delta, full in [("served", "delta_bytes", "full_bytes")] + (
            [("adapter", "adapter_delta_bytes", "adapter_bytes")] if res.setting.rank else []):
        rep = encode(os.path.join(keep, f"{what}-0.safetensors"), os.path.join(keep, f"{what}-1.safetensors"),
                     str(tmp_path / f"{what}.delta"), threads=1)
        fig = res.steps[0]
        assert (getattr(fig, delta), getattr(fig, full)) == (rep.delta_bytes, rep.full_bytes), what
        assert rep.delta_bytes == os.path.getsize(tmp_path / f"{what}.delta")
        if what == "served":
            assert fig.ratio == rep.full_bytes / rep.delta_bytes
            assert fig.changed == rep.changed_elements and fig.elements == rep.total_elements
        else:
            assert fig.adapter_changed == rep.changed_elements
        apply(str(tmp_path / f"{what}.delta"), os.path.join(keep, f"{what}-0.safetensors"))
        with open(os.path.join(keep, f"{what}-0.safetensors"), "rb") as a, \
                open(os.path.join(keep, f"{what}-1.safetensors"), "rb") as b:
            assert a.read() == b.read()


def test_one_full_and_one_lora_step_give_sane_figures(trainer, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    full = lora.run_setting(trainer, lora.Setting(1e-3), 1, str(work), 1, keep=str(tmp_path / "full"),
                            log=lambda _: None)
    lo = lora.run_setting(trainer, lora.Setting(1e-3, RANK), 1, str(work), 1, warmup=1,
                          keep=str(tmp_path / "lora"), log=lambda _: None)
    for r in (full, lo):
        (f,) = r.steps
        for x in (f.changed_fraction, f.adapted_fraction, f.fp32_adapted_fraction):
            assert 0.0 <= x <= 1.0
        assert f.bit_exact and f.adapter_bit_exact
        assert 0 < f.delta_bytes < f.full_bytes
    n_params = sum(p.numel() for p in trainer.build().parameters())
    assert full.trainable == n_params and full.steps[0].changed > 0
    f = lo.steps[0]
    # LoRA: only the adapted matrices change, in fp32 nearly all of their elements; in bf16 some
    assert f.changed == f.adapted_changed > 0
    assert f.fp32_adapted_fraction > 0.9
    d, i = TINY.hidden_size, TINY.intermediate_size
    per_layer = 4 * RANK * (d + d) + 2 * RANK * (d + i) + RANK * (i + d)
    assert lo.trainable == TINY.num_layers * per_layer
    assert f.adapter_bytes == 2 * lo.trainable and f.adapter_delta_bytes > 0 and 0 < f.adapter_fraction <= 1
    _check_against_encode(full, str(tmp_path / "full"), tmp_path)
    _check_against_encode(lo, str(tmp_path / "lora"), tmp_path)
    md = lora.table([full, lo])
    assert md.count("\n") == 3 and "LoRA r=4, alpha=8" in md and "| yes |" in md
    text = lora.page([full, lo], "python -m deltarefit.apps.bench.lora", "a test machine", 1.0)
    assert text.startswith("# LoRA") and md in text and "0 bf16 elements changed in all LoRA steps" in text
    assert f"{f.fp32_adapted_fraction:.2%}" in text and "load_lora_adapter" in text
    assert lora.page(lora.from_json(json.loads(json.dumps(lora.to_json([full, lo])))), "python -m deltarefit.apps.bench.lora",
                     "a test machine", 1.0) == text  # --render gives the page the run gave
