"""Tests of the engine benchmark's pure parts (deltarefit.apps.bench.engine); none needs vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from deltarefit.apps.bench import engine as eb
from deltarefit.apps.bench import engine_model as em
from deltarefit.encode import encode


def _mag_step(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (b & 0x7FFF).astype(np.int32) - (a & 0x7FFF).astype(np.int32)


@pytest.mark.parametrize("fraction", [0.005, 0.035, 0.5])
def test_perturb_bits_moves_exactly_that_many_elements_by_one_ulp(fraction: float) -> None:
    rng = np.random.default_rng(0)
    vals = rng.standard_normal(20_000).astype(np.float32) * 0.02
    bits = (vals.view(np.uint32) >> 16).astype(np.uint16)
    out = eb.perturb_bits(bits, fraction, np.random.default_rng(1))
    moved = np.flatnonzero(out != bits)
    assert moved.size == round(fraction * bits.size)
    assert np.all(np.abs(_mag_step(bits[moved], out[moved])) == 1)
    assert np.array_equal(out[moved] & 0x8000, bits[moved] & 0x8000)  # sign kept
    steps = _mag_step(bits[moved], out[moved])
    assert (steps > 0).any() and (steps < 0).any()  # both directions
    assert np.array_equal(eb.perturb_bits(bits, fraction, np.random.default_rng(1)), out)  # seeded
    assert bits.size == 20_000 and out.dtype == np.uint16


def test_perturb_bits_edges_stay_finite_and_non_finite_are_never_chosen() -> None:
    bits = np.array([0x0000, 0x8000, 0x7F7F, 0xFF7F] * 50 + [0x7F80, 0xFFC0] * 100, dtype=np.uint16)
    out = eb.perturb_bits(bits, 200 / bits.size, np.random.default_rng(3))
    assert np.array_equal(out[200:], bits[200:])  # inf and NaN untouched
    assert np.count_nonzero(out[:200] != bits[:200]) == 200  # every finite one moved
    assert np.all((out[:200] & 0x7FFF) < 0x7F80)  # none became inf or NaN
    assert set(out[0:200:4].tolist()) == {0x0001} and set(out[1:200:4].tolist()) == {0x8001}
    assert set(out[2:200:4].tolist()) == {0x7F7E} and set(out[3:200:4].tolist()) == {0xFF7E}
    with pytest.raises(ValueError, match="only 200 are finite"):
        eb.perturb_bits(bits, 0.9, np.random.default_rng(0))
    with pytest.raises(ValueError, match="uint16"):
        eb.perturb_bits(bits.astype(np.int32), 0.1, np.random.default_rng(0))


def test_perturb_checkpoint_changes_that_fraction_of_every_tensor(tmp_path: Path) -> None:
    src = tmp_path / "base"
    src.mkdir()
    torch.manual_seed(0)
    tensors = {"a.weight": torch.randn(64, 100).to(torch.bfloat16) * 0.02,
               "b.weight": torch.ones(300).to(torch.bfloat16), "c.bias": torch.zeros(7, 9).to(torch.bfloat16)}
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text("{}")
    dst = tmp_path / "target"
    eb.perturb_checkpoint(str(src), str(dst), 0.035, seed=5)
    assert (dst / "config.json").read_text() == "{}"
    got = load_file(str(dst / "model.safetensors"))
    total = 0
    for n, t in tensors.items():
        a = t.view(torch.int16).numpy().view(np.uint16)
        b = got[n].view(torch.int16).numpy().view(np.uint16)
        assert np.count_nonzero(a != b) == round(0.035 * a.size), n
        total += np.count_nonzero(a != b)
        assert np.all(np.isfinite(got[n].float().numpy()))
    rep = encode(str(src), str(dst), str(tmp_path / "d.delta"))
    assert rep.changed_fraction == pytest.approx(total / sum(t.numel() for t in tensors.values()))


def test_version_plan_returns_to_the_base_after_every_target() -> None:
    p = eb.version_plan([0.01, 0.02])
    assert p["checkpoints"] == ["base", "warm", "base", "r0", "base", "r1", "base"]
    assert p["forward"] == {"warm": [2], "r0": [4], "r1": [6]}
    assert p["back"] == {"warm": [3], "r0": [5], "r1": [7]}
    p = eb.version_plan([0.01, 0.02], repeat=2)
    assert p["checkpoints"] == ["base", "warm", "base"] + ["r0", "base"] * 2 + ["r1", "base"] * 2
    assert p["forward"]["r1"] == [8, 10] and p["back"]["r1"] == [9, 11] and p["forward"]["warm"] == [2]
    for n, vs in p["forward"].items():
        for v, b in zip(vs, p["back"][n], strict=True):
            assert p["checkpoints"][v - 1] == n and p["checkpoints"][v - 2] == "base"
            assert b == v + 1 and p["checkpoints"][b - 1] == "base"
    p2 = eb.version_plan([0.01, 0.02], repeat=2, passes=2)
    assert p2["checkpoints"] == p["checkpoints"] + p["checkpoints"][1:]
    assert p2["passes"][0]["forward"] == p["forward"] and p2["passes"][1]["forward"]["warm"] == [12]
    for ps in p2["passes"]:
        for n, vs in ps["forward"].items():
            assert all(p2["checkpoints"][v - 1] == n and p2["checkpoints"][b - 1] == "base"
                       for v, b in zip(vs, ps["back"][n], strict=True))
    with pytest.raises(ValueError):
        eb.version_plan([0.01], repeat=0)


def test_median_fit_and_summary() -> None:
    assert eb.median([3.0, 1.0, 2.0]) == 2.0 and eb.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    a, b = eb.fit_line([1e6, 2e6, 3e6], [1.5, 2.5, 3.5])
    assert a == pytest.approx(0.5) and b == pytest.approx(1e-6)
    with pytest.raises(ValueError):
        eb.fit_line([1.0, 1.0], [2.0, 3.0])
    samples = [{"seconds": s, "io": {"read_bytes": r, "write_bytes": 0}, "rss_peak_growth": g, "anon_peak_growth": 1,
                "split": {"plan": s / 2, "route": "chain", "check": ["held digests"] if s < 3 else ["segments"]}}
               for s, r, g in ((1.0, 10, 5), (3.0, 30, 9), (2.0, 20, 7))]
    s = eb.summarize(samples)
    assert (s["n"], s["seconds"], s["seconds_min"], s["seconds_max"]) == (3, 2.0, 1.0, 3.0)
    assert s["io"] == {"read_bytes": 20, "write_bytes": 0} and s["rss_peak_growth"] == 9
    assert s["split"] == {"plan": 1.0, "check": ["held digests", "segments"]}  # medians, and every check seen


def _fake_module(tmp_path: Path, name: str, body: str) -> None:
    parts = name.split(".")
    d = tmp_path
    for pkg in parts[:-1]:
        d = d / pkg
        d.mkdir(exist_ok=True)
        (d / "__init__.py").touch()
    (d / f"{parts[-1]}.py").write_text(body)


@pytest.mark.parametrize("prepack", [True, False])
def test_sitecustomize_patches_modules_when_they_are_imported(tmp_path: Path, prepack: bool) -> None:
    """A real interpreter started with the generated sitecustomize first on its path, and stand-ins for
    the two vLLM modules it patches: the patches land right after each module's own code ran."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(eb.sitecustomize_source(prepack))
    mods = tmp_path / "mods"
    mods.mkdir()
    _fake_module(mods, "vllm._custom_ops", "_supports_onednn = True\n")
    _fake_module(mods, "vllm.model_executor.layers.utils", "def check_cpu_sgl_kernel(n, k, dtype):\n    return True\n")
    _fake_module(mods, "vllm.model_executor.layers.fused_moe.experts.cpu_moe",
                 "def cpu_fused_moe(*a):\n    return 'packed'\n"
                 "class CPUUnquantizedExperts:\n    def process_weights_after_loading(self, layer):\n"
                 "        layer.packed = True\n")
    code = ("import sys, types; assert 'vllm' not in sys.modules; import torch, vllm._custom_ops as ops; "
            "from vllm.model_executor.layers.utils import check_cpu_sgl_kernel as c; "
            "import vllm.model_executor.layers.fused_moe.experts.cpu_moe as moe; "
            "layer = types.SimpleNamespace(packed=False); moe.CPUUnquantizedExperts().process_weights_after_loading(layer); "
            "print(torch.cpu._is_amx_tile_supported(), ops._supports_onednn, c(1, 2, None), layer.packed, "
            "moe.cpu_fused_moe.__name__)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(mods), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == (["False", "True", "True", "True", "cpu_fused_moe"] if prepack
                                  else ["False", "False", "False", "False", "_unpacked_moe"])


def test_io_delta_and_markdown_render_every_row() -> None:
    assert eb.io_delta({"read_bytes": 5, "write_bytes": 1}, {"read_bytes": 9, "write_bytes": 1}) == \
        {"read_bytes": 4, "write_bytes": 0}

    def run(s: float, w: int) -> dict:
        return {"seconds": s, "io": {"read_bytes": 2_000_000, "write_bytes": w}, "rss_peak_growth": 3_000_000,
                "anon_peak_growth": 1_000_000,
                "split": {k: 0.1 for k in ("total", "plan", "write", "digests", "reload", "stream", "decode",
                                           "read_segment", "write_segment")}}

    def disk(s: float) -> dict:
        return {**run(s, 5_000_000), "apply_s": 1.0, "reload_s": 3.0}

    rates = [{"rate": r, "changed": r, "delta_bytes": 1_000_000, "same_tokens": True,
              "summary": {"inplace": eb.summarize([run(1.0 + r, 0), run(1.0 + r, 0)]),
                          "planned": eb.summarize([{**run(0.5, 0), "split": {**run(0.5, 0)["split"],
                                                                             "gen_planning": 0.3, "gen_idle": 0.2}}]),
                          "disk": eb.summarize([disk(4.0), disk(4.0)]), "full": eb.summarize([run(6.0, 0)])}}
             for r in (0.005, 0.035)]
    lay = {"title": "T", "in_place": 10, "reload": 0, "host_bytes": 0, "seconds_init": 1.0, "seconds_start": 20.0,
           "rates": rates}
    res = {"command": "python -m deltarefit.apps.bench.engine", "machine": "m", "vllm": "0", "torch": "0",
           "model": {**eb.BENCH_CONFIG, "params": 1e8, "bytes": 2e8}, "layouts": [lay], "notes": [], "repeat": 1}
    res["findings"] = eb.findings(res)
    md = eb.markdown(res)
    assert ("| 3.50% | disk + reload (refit_engine) | 4.00 (4.00-4.00) | 3.86 | 2.0 | 5.0 | 3.0 | 1.0 | yes |"
            in md)
    assert "| 0.50% | in place (deltarefit backend) | 1.00 (1.00-1.00) | 1.00 |" in md
    assert "5.8x faster than the full reload" in md and "; it grows with the changed elements" in md
    assert "| 3.50% | in place, planned while serving: the pause | 0.50 (0.50-0.50) | 0.48 |" in md
    assert "the update's pause (what generation waits for) 0.50 s, 12.0x faster than the full reload" in md
    assert "took 0.30 s while the worker planned a 3.5% delta beside it (median over the refits) and 0.20 s" in md
    assert "a random-init Llama (100.0M parameters" in md and "MLP 2048" in md

    # the MoE model's report names its experts and the share of elements written in place
    moe = {**res, "model": {**eb.MODELS["qwen3-moe"][2], "params": 1e8, "bytes": 2e8, "family": "qwen3-moe"},
           "layouts": [{**lay, "in_place_elements": 0.987}]}
    md = eb.markdown({**moe, "findings": eb.findings(moe)})
    assert "a random-init Qwen3-MoE (100.0M parameters" in md and "16 experts of 512 in every layer" in md
    assert "10 checkpoint tensors written in place (98.7% of the elements), 0 through the reload path" in md


def test_prompts_are_the_tokenizers_ids_and_the_moe_base_has_expert_tensors(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_tiny_moe(tmp_path))
    assert eb.prompt_ids() == [[1, *tok(p, add_special_tokens=False)["input_ids"]] for p in eb.PROMPTS]
    assert all(3 not in ids for ids in eb.prompt_ids())  # every word is in the vocabulary


def _tiny_moe(tmp_path: Path) -> str:
    from safetensors import safe_open

    out = str(tmp_path / "moe")
    n = eb.build_base(out, dict(eb.MODELS["qwen3-moe"][3], hidden_size=64, moe_intermediate_size=32, head_dim=16,
                                num_experts=4), model="qwen3-moe")
    with safe_open(f"{out}/model.safetensors", framework="np") as f:
        keys = list(f.keys())
        assert n == sum(int(np.prod(f.get_slice(k).get_shape())) for k in keys)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in keys and "model.layers.0.mlp.gate.weight" in keys
    return out


def test_main_without_vllm_fails_with_one_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert eb.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vLLM is not installed" in err


def test_main_refuses_rates_outside_zero_one_and_unknown_targets(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        eb.main(["--rates", "0.035", "2"])
    assert e.value.code == 2 and "--rates must be fractions in (0, 1)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        eb.main(["--targets", "random"])


def test_live_tp_bench_runs_two_real_workers_and_reports_each_split_chunk_decoded_once(tmp_path: Path) -> None:
    import json

    from deltarefit.apps.bench import live_tp

    out = tmp_path / "tp.json"
    md = tmp_path / "TP.md"
    assert live_tp.main(["--hidden", "256", "--mlp", "1024", "--layers", "1", "--repeat", "1", "--rates", "0.035",
                         "--json", str(out), "--markdown", str(md)]) == 0
    res = json.loads(out.read_text())["results"]
    assert [r["world"] for r in res] == [1, 2]
    one, two = res[0]["rates"][0], res[1]["rates"][0]
    assert one["split_chunks"] == 0 and one["held"] == 5  # 5 tensors, each checked by its held digest
    # each of the 4 matrices is one segment (at most 256 Ki elements) holding both workers' slices: split,
    # and each decoded by one worker
    assert two["split_chunks"] == 4 and two["split_decoded"] == 2
    assert one["held_ok"] and two["held_ok"]
    assert one["ahead"] > 0 and two["ahead"] is None  # planned ahead: one worker only
    assert "| 2 | " in md.read_text() and "planned ahead" in md.read_text()


# ------------------------------------------------------------------------------------ RL-like targets

TINY = dict(eb.QUICK_CONFIG, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1)


def _tiny_stepper(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from deltarefit.apps.bench.engine_steps import Stepper

    torch.manual_seed(seed)
    return Stepper(LlamaForCausalLM(LlamaConfig(**TINY)), seed=seed)


def _same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def test_adamw_target_is_torchs_step_at_the_lr_that_changes_the_rate_deterministically() -> None:
    from deltarefit.apps.bench.engine_steps import changed, served_bits

    st = _tiny_stepper()
    lr, f = st.lr_for(0.035)
    assert 1e-7 < lr < 1e-4 and abs(f - 0.035) <= 0.02 * 0.035  # measured on every element: the model is small
    target = st.step(lr)
    n, ch, one = changed(st.base, target)
    assert 0.01 <= ch / n <= 0.05 and ch / n == f
    assert one / ch > 0.75  # an RL-like step: most changes are one ulp
    st.opt.param_groups[0]["lr"] = lr  # the whole model's own AdamW step gives the same bits
    st.opt.step()
    assert _same_bits(served_bits(st.model), target)
    again = _tiny_stepper()  # same seed, same torch build: the same base and target
    assert _same_bits(again.base, st.base) and _same_bits(again.step(lr), target)


def test_prepare_defaults_to_adamw_targets_and_the_report_names_their_lr(tmp_path: Path) -> None:
    prep = eb.prepare(str(tmp_path), TINY, (0.015, 0.035), log=lambda s: None)
    assert prep["targets"]["kind"] == "adamw"
    steps = prep["targets"]["steps"]
    for name, rate in (("warm", em.WARM_RATE), ("r0", 0.015), ("r1", 0.035)):
        assert abs(steps[name]["changed"] - rate) <= 0.02 * rate, (name, steps[name])
        assert prep["changed"][name] == pytest.approx(steps[name]["changed"], rel=1e-12)  # encode's count
    assert steps["r0"]["lr"] < steps["r1"]["lr"]
    res = {"command": "c", "machine": "m", "vllm": "0", "torch": "0", "repeat": 1, "notes": [], "layouts": [],
           "model": {**TINY, "params": prep["params"], "bytes": prep["bytes"]},
           "targets": {**prep["targets"], "warmup": 8, "warmup_lr": 1e-5}}
    md = eb.markdown({**res, "findings": []})
    assert "initialized at random (std 0.02) in fp32 and trained 8 AdamW steps" in md
    assert f"lr {steps['r1']['lr']:.2e} changed {steps['r1']['changed']:.2%}" in md


def test_ray_example_defaults_to_an_rl_like_step_and_keeps_the_toy_step(tmp_path: Path) -> None:
    import importlib

    from deltarefit.apps.bench.engine_steps import checkpoint_changed

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        ray_refit = importlib.import_module("ray_refit")
    finally:
        sys.path.pop(0)
    a = ray_refit.parse_args([])
    assert (a.lr, a.warmup_steps) == (1e-5, 8)
    toy = ray_refit.parse_args(["--toy-step"])
    assert (toy.lr, toy.warmup_steps) == (1e-4, 0)
    cfg = ray_refit.model_config(128, 1)

    def run(root: Path, args) -> list[float]:
        """The trainer actor's own steps (TinyTrainer.train, no Ray), and what each changed."""
        base = ray_refit.build_base(str(root / "base"), config=cfg, warmup=args.warmup_steps, lr=args.lr,
                                    state=str(root / "steps" / "step0" / "train.pt"))
        tr = object.__new__(ray_refit.TinyTrainer)
        tr.root, tr.base, tr.lr, tr.config = str(root), base, args.lr, cfg
        out, prev = [], base
        for k in (1, 2):
            cur = tr.train(k)
            n, ch, _ = checkpoint_changed(prev, cur)
            out.append(ch / n)
            prev = cur
        return out

    got = run(tmp_path / "a", a)
    assert all(0.01 <= f <= 0.05 for f in got), got
    assert run(tmp_path / "b", a) == got  # deterministic
    assert (tmp_path / "a/steps/step2/served/model.safetensors").read_bytes() == \
        (tmp_path / "b/steps/step2/served/model.safetensors").read_bytes()
    assert all(f > 0.1 for f in run(tmp_path / "toy", toy))  # the toy step: far more than an RL step
