"""Apply into live torch modules and dicts of tensors: bit for bit, refusals write nothing, ties verified."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from safetensors.torch import load_file, save_file

import deltarefit
import deltarefit.format
from deltarefit.apply.tensors import (
    TORCH_DTYPES,
    apply_to_module,
    apply_to_tensors,
    safetensors_dtype,
    state_dict_fingerprint,
    torch_dtype,
)
from deltarefit.errors import BaseMismatchError, UsageError

CFG = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128,
       "vocab_size": 1000}
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern as integers of its width (so NaN payloads and -0.0 compare exactly)."""
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t.view(BITS[t.element_size()])


def assert_same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
        assert torch.equal(bits(got[k]), bits(w)), f"{k} differs"


def clones(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sd.items()}


def export(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The served bf16 state: every tensor of the fp32 master rounded to bf16, own memory per name."""
    return {k: v.detach().to(torch.bfloat16).contiguous().clone() for k, v in model.state_dict().items()}


def adamw_step(master: torch.nn.Module, *, lr: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG["vocab_size"], (4, 16), generator=g)
    opt = torch.optim.AdamW(master.parameters(), lr=lr)
    out = master(input_ids=ids)
    logits = out.logits if hasattr(out, "logits") else out.last_hidden_state
    loss = logits.float().pow(2).mean()
    loss.backward()
    opt.step()


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A tiny BERT: fp32 master, base/target bf16 files one real AdamW step apart, and their delta."""
    d = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    master = transformers.BertModel(transformers.BertConfig(**CFG)).eval()
    base, target, delta = str(d / "base.safetensors"), str(d / "target.safetensors"), str(d / "step.delta")
    save_file(export(master), base)
    adamw_step(master, lr=1e-4, seed=1)
    save_file(export(master), target)
    rep = deltarefit.encode(base, target, delta)
    assert 0 < rep.changed_elements < rep.total_elements
    return {"base": base, "target": target, "delta": delta, "master": master}


def served(path: str) -> torch.nn.Module:
    """A bf16 BertModel holding the bytes of a checkpoint file."""
    m = transformers.BertModel(transformers.BertConfig(**CFG)).to(torch.bfloat16).eval()
    m.load_state_dict(load_file(path))
    return m


def forward(m: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, CFG["vocab_size"], (3, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return m(input_ids=ids).last_hidden_state


# ------------------------------------------------------------------------------------------- modules


def test_apply_to_live_module_is_bit_exact(bert):
    live = served(bert["base"])
    before = forward(live)
    rep = apply_to_module(bert["delta"], live)
    assert rep.chunks_applied > 0 and rep.structural == []
    assert rep.target_fingerprint == deltarefit.fingerprint(bert["target"])
    assert_same_bits(live.state_dict(), load_file(bert["target"]))
    assert state_dict_fingerprint(live.state_dict()) == deltarefit.fingerprint(bert["target"])
    out = forward(live)
    assert torch.equal(bits(out), bits(forward(served(bert["target"]))))
    assert not torch.equal(bits(out), bits(before))
    # Parameters are still the module's own (no copy swapped in), and autograd still works on them.
    assert all(isinstance(p, torch.nn.Parameter) for p in live.parameters())


def test_second_apply_changes_nothing(bert):
    live = served(bert["base"])
    apply_to_module(bert["delta"], live)
    snap = clones(live.state_dict())
    rep = apply_to_module(bert["delta"], live)
    assert rep.chunks_applied == 0 and rep.chunks_skipped > 0 and rep.written_bytes == 0
    assert_same_bits(live.state_dict(), snap)


def test_wrong_base_refused_and_nothing_written(bert):
    live = served(bert["base"])
    # Only the tensor sorting last differs: every earlier tensor would be patched first if apply wrote early.
    last = max(live.state_dict())
    with torch.no_grad():
        live.state_dict()[last].view(-1)[0] += 1
    snap = clones(live.state_dict())
    with pytest.raises(BaseMismatchError, match="wrong base"):
        apply_to_module(bert["delta"], live)
    assert_same_bits(live.state_dict(), snap)
    # The target is not a base either (a delta only applies forwards).
    tgt = served(bert["target"])
    other = transformers.BertModel(transformers.BertConfig(**CFG)).to(torch.bfloat16)
    snap = clones(other.state_dict())
    with pytest.raises(BaseMismatchError):
        apply_to_module(bert["delta"], other)
    assert_same_bits(other.state_dict(), snap)
    assert apply_to_module(bert["delta"], tgt).chunks_applied == 0


def test_module_refuses_structural_changes(tmp_path):
    a = {"w": torch.arange(8, dtype=torch.float32), "b": torch.zeros(3)}
    b = {"w": torch.arange(8, dtype=torch.float32) + 1, "extra": torch.ones(2)}
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    deltarefit.encode(str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), str(tmp_path / "d"))
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(a["w"].clone())
    m.register_buffer("b", a["b"].clone())
    with pytest.raises(UsageError, match="in place in a module"):
        apply_to_module(str(tmp_path / "d"), m)
    assert torch.equal(m.w.data, a["w"]) and torch.equal(m.b, a["b"])


# ---------------------------------------------------------------------------------------- dicts


def test_apply_to_dict(bert):
    sd = load_file(bert["base"])
    ids = {k: id(v) for k, v in sd.items()}
    rep = apply_to_tensors(bert["delta"], sd)
    assert rep.chunks_applied > 0
    assert_same_bits(sd, load_file(bert["target"]))
    assert {k: id(v) for k, v in sd.items()} == ids  # in place: same tensor objects


def test_non_contiguous_and_non_cpu_refused(bert):
    sd = load_file(bert["base"])
    snap = clones(sd)
    name = "encoder.layer.0.attention.self.query.weight"
    sd[name] = sd[name].t().contiguous().t()  # same values, column-major
    with pytest.raises(UsageError, match=f"{name!r} is not contiguous"):
        apply_to_tensors(bert["delta"], sd)
    sd[name] = snap[name].clone()
    sd["on_meta"] = torch.empty(64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(UsageError, match="'on_meta' is on meta"):
        apply_to_tensors(bert["delta"], sd)
    del sd["on_meta"]
    assert_same_bits(sd, snap)
    sd["x"] = torch.zeros(2, dtype=torch.complex64)
    with pytest.raises(UsageError, match="'x'"):
        apply_to_tensors(bert["delta"], sd)


def special_bits(dt: str, n: int, rng: np.random.Generator) -> torch.Tensor:
    """Random bit patterns of dtype ``dt`` with NaN payloads, +-0, +-inf and subnormals mixed in."""
    td = torch_dtype(dt)
    size = torch.empty(0, dtype=td).element_size()
    if td == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, n).astype(np.bool_))
    raw = torch.from_numpy(rng.integers(0, 256, n * size, dtype=np.uint8)).view(td).clone()
    if td.is_floating_point:
        specials = {
            "BF16": [0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x807F, 0x7FFF],
            "F16": [0x7E01, 0xFC01, 0x7C00, 0xFC00, 0x8000, 0x0000, 0x0001, 0x83FF, 0x7FFF],
            "F32": [0x7FC00001, 0xFF800001, 0x7F800000, 0xFF800000, 0x80000000, 0, 1, 0x807FFFFF, 0x7FFFFFFF],
            "F64": [0x7FF8000000000001, 0xFFF0000000000001, 0x7FF0000000000000, 0xFFF0000000000000,
                    0x8000000000000000, 0, 1, 0x000FFFFFFFFFFFFF],
            "F8_E4M3": [0x7F, 0xFF, 0x80, 0x00, 0x01, 0x87],
            "F8_E5M2": [0x7D, 0xFE, 0x7C, 0xFC, 0x80, 0x00, 0x01, 0x83],
        }[dt]
        ib = bits(raw)
        np_bits = np.uint8 if size == 1 else np.dtype(f"<i{size}")
        sp = torch.from_numpy(np.array(specials, dtype=np.dtype(f"<u{size}")).view(np_bits))
        idx = torch.from_numpy(rng.choice(n, size=min(n, 4 * len(specials)), replace=False))
        ib[idx] = sp[torch.arange(idx.numel()) % sp.numel()]
    return raw


@pytest.mark.parametrize("dt", sorted(TORCH_DTYPES))
def test_special_values_round_trip(tmp_path, dt):
    rng = np.random.default_rng(sorted(TORCH_DTYPES).index(dt))
    n = (1 << 20) // torch.empty(0, dtype=torch_dtype(dt)).element_size() + 1000  # two chunks
    base = {"t": special_bits(dt, n, rng), "scalar": special_bits(dt, 1, rng).reshape(())}
    target = {k: v.clone() for k, v in base.items()}
    # Change a sparse set of elements to other specials, and a dense run to fresh random bits.
    sb = bits(target["t"])
    sb[::97] = bits(special_bits(dt, sb[::97].numel(), rng))
    sb[5000:9000] = bits(special_bits(dt, 4000, rng))
    bits(target["scalar"]).copy_(bits(special_bits(dt, 1, rng)).reshape(()))
    save_file(base, tmp_path / "a.safetensors")
    save_file(target, tmp_path / "b.safetensors")
    delta = str(tmp_path / "d")
    deltarefit.encode(str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), delta)
    live = {k: v.clone() for k, v in base.items()}
    rep = apply_to_tensors(delta, live)
    assert_same_bits(live, target)
    assert rep.target_fingerprint == deltarefit.fingerprint(str(tmp_path / "b.safetensors"))
    assert state_dict_fingerprint(live) == rep.target_fingerprint
    assert apply_to_tensors(delta, live).chunks_applied == 0


def test_dict_structural_changes(tmp_path):
    rng = np.random.default_rng(3)
    base = {"keep": torch.from_numpy(rng.standard_normal(1000).astype(np.float32)),
            "gone": torch.ones(7, dtype=torch.int32),
            "retyped": torch.from_numpy(rng.standard_normal((4, 5)).astype(np.float32))}
    target = {"keep": base["keep"] * 1.0001, "new": torch.arange(300_000, dtype=torch.bfloat16),
              "retyped": base["retyped"].to(torch.bfloat16)}
    save_file(base, tmp_path / "a.safetensors")
    save_file(target, tmp_path / "b.safetensors")
    delta = str(tmp_path / "d")
    deltarefit.encode(str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), delta)
    live = clones(base)
    keep = live["keep"]
    rep = apply_to_tensors(delta, live)
    assert sorted(rep.structural) == ["gone", "new", "retyped"]
    assert_same_bits(live, target)
    assert live["keep"] is keep
    rep = apply_to_tensors(delta, live)  # rerun: everything already done
    assert rep.chunks_applied == 0 and rep.structural == []
    assert_same_bits(live, target)
    # A wrong base with structural ops is refused before anything changes.
    wrong = clones(base)
    wrong["gone"][0] = 5
    snap = clones(wrong)
    with pytest.raises(BaseMismatchError):
        apply_to_tensors(delta, wrong)
    assert_same_bits(wrong, snap)


# ------------------------------------------------------------------------------------------- ties


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """BertForMaskedLM (decoder tied to the word embeddings, two tie groups): base/target/delta."""
    d = tmp_path_factory.mktemp("tied")
    torch.manual_seed(1)
    master = transformers.BertForMaskedLM(transformers.BertConfig(**CFG)).eval()
    paths = {k: str(d / f"{k}.safetensors") for k in ("base", "target", "base1", "target1")}
    save_file(export(master), paths["base"])  # both names stored (cloned)
    safetensors.torch.save_model(copy.deepcopy(master).to(torch.bfloat16), paths["base1"])  # one name/storage
    adamw_step(master, lr=1e-3, seed=2)
    save_file(export(master), paths["target"])
    bf = copy.deepcopy(master).to(torch.bfloat16)
    safetensors.torch.save_model(bf, paths["target1"])
    deltarefit.encode(paths["base"], paths["target"], str(d / "both.delta"))
    deltarefit.encode(paths["base1"], paths["target1"], str(d / "one.delta"))
    return {**paths, "both": str(d / "both.delta"), "one": str(d / "one.delta"), "dir": d}


def served_mlm(path: str) -> torch.nn.Module:
    m = transformers.BertForMaskedLM(transformers.BertConfig(**CFG)).to(torch.bfloat16).eval()
    safetensors.torch.load_model(m, path, strict=False)
    return m


def tie_groups(m: torch.nn.Module) -> list[list[str]]:
    g: dict[int, list[str]] = {}
    for k, v in m.state_dict().items():
        g.setdefault(v.data_ptr(), []).append(k)
    return sorted(v for v in g.values() if len(v) > 1)


def test_tied_weights_both_names_in_delta(tied):
    live = served_mlm(tied["base"])
    groups = tie_groups(live)
    assert len(groups) == 2
    rep = apply_to_module(tied["both"], live)
    assert tie_groups(live) == groups  # still tied: written through the shared storage
    assert rep.target_fingerprint == deltarefit.fingerprint(tied["target"])
    assert_same_bits(live.state_dict(), load_file(tied["target"]))
    assert state_dict_fingerprint(live.state_dict()) == rep.target_fingerprint
    ids = torch.randint(0, CFG["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(bits(live(input_ids=ids).logits), bits(served_mlm(tied["target"])(input_ids=ids).logits))
    assert apply_to_module(tied["both"], live).chunks_applied == 0


def delta_names(path: str) -> set[str]:
    with deltarefit.format.DeltaReader(path) as d:
        return {e.name for e in d.tensors}


def test_tied_weights_one_name_in_delta(tied):
    tie = {"bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"}
    assert len(delta_names(tied["one"]) & tie) == 1 and tie <= delta_names(tied["both"])
    live = served_mlm(tied["base1"])
    rep = apply_to_module(tied["one"], live)
    assert rep.target_fingerprint == deltarefit.fingerprint(tied["target1"])
    want = load_file(tied["target"])
    assert_same_bits(live.state_dict(), want)


def test_tied_weights_disagreeing_delta_refused(tied):
    d = tied["dir"]
    tgt = load_file(tied["target"])
    name = "cls.predictions.decoder.weight"
    tgt[name] = tgt[name].clone()
    tgt[name][0, 0] = tgt[name][0, 0] * 2 + 1  # untied in the target file
    save_file(tgt, d / "untied.safetensors")
    delta = str(d / "untied.delta")
    deltarefit.encode(tied["base"], str(d / "untied.safetensors"), delta)
    live = served_mlm(tied["base"])
    snap = clones(live.state_dict())
    with pytest.raises(UsageError, match="share one storage"):
        apply_to_module(delta, live)
    assert_same_bits(live.state_dict(), snap)
    # A dict without the tie applies it fine.
    sd = load_file(tied["base"])
    apply_to_tensors(delta, sd)
    assert_same_bits(sd, tgt)


def test_partial_overlap_refused(tmp_path):
    buf = torch.zeros(10)
    save_file({"a": torch.zeros(6), "b": torch.zeros(6)}, tmp_path / "a.safetensors")
    save_file({"a": torch.ones(6), "b": torch.ones(6)}, tmp_path / "b.safetensors")
    deltarefit.encode(str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), str(tmp_path / "d"))
    with pytest.raises(UsageError, match="share memory"):
        apply_to_tensors(str(tmp_path / "d"), {"a": buf[:6], "b": buf[4:]})
    assert torch.equal(buf, torch.zeros(10))


# ------------------------------------------------------------------------------------ fingerprints


def test_state_dict_fingerprint_matches_file(tmp_path):
    rng = np.random.default_rng(5)
    sd = {f"t{i}.{dt}": special_bits(dt, int(rng.integers(0, 3000)), rng) for i, dt in enumerate(TORCH_DTYPES)}
    sd["scalar"] = torch.tensor(3.5)
    sd["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    sd["big"] = torch.from_numpy(rng.standard_normal((1000, 700)).astype(np.float32))
    save_file(sd, tmp_path / "x.safetensors")
    fp = deltarefit.fingerprint(str(tmp_path / "x.safetensors"))
    assert state_dict_fingerprint(sd) == fp
    sd["big"] = sd["big"].t().contiguous().t()  # non-contiguous: hashed from a copy
    assert not sd["big"].is_contiguous()
    assert state_dict_fingerprint(sd) == fp


def test_dtype_names():
    for name, td in TORCH_DTYPES.items():
        assert safetensors_dtype(td) == name and torch_dtype(name) == td
    assert {"BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2", "I8", "I16", "I32", "I64", "U8", "BOOL"} <= set(
        TORCH_DTYPES)
    with pytest.raises(UsageError):
        safetensors_dtype(torch.complex64)


def test_delta_file_untouched(bert):
    before = os.path.getsize(bert["delta"])
    apply_to_tensors(bert["delta"], load_file(bert["base"]))
    assert os.path.getsize(bert["delta"]) == before


def test_tensors_follow_a_chain_coded_with_history_and_refuse_the_wrong_book(tmp_path):
    """``apply_to_tensors(..., history=book)``: deltas coded with history (encoding 5, a momentum-like
    chain) decode against the tensors' book, which each verified apply advances as the trainer's
    advanced; a book that is not the one a delta was coded against is refused by name, nothing written."""
    from _chains import follow_with_book, write_chain

    paths = write_chain(str(tmp_path / "chain"), 4, n=(1 << 19) + 3000, seed=6, rate=0.05, prefix="c")
    tensors = load_file(paths[0])
    follow_with_book(paths, str(tmp_path), lambda out, book: apply_to_tensors(out, tensors, history=book),
                     lambda: {n: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n, t in tensors.items()})


@pytest.mark.parametrize("planted", ["file", "dangling-symlink"])
def test_a_book_that_cannot_be_written_is_started_over_and_the_verified_apply_stands(tmp_path, planted):
    """A verified ``apply_to_tensors(..., history=book)`` whose book cannot be written (a file, or a
    dangling symlink, planted where its directory goes) ends verified with the tensors at the target:
    the book is started over (what was planted removed, never written through), not the apply failed."""
    from _chains import checkpoint_bits, deltas_with_history, write_chain

    from deltarefit.history_book import HistoryBook

    paths = write_chain(str(tmp_path / "chain"), 1, n=(1 << 19) + 3000, seed=6, rate=0.05, prefix="c")
    tensors = load_file(paths[0])
    (out, enc, _), = deltas_with_history(paths, str(tmp_path))
    at = tmp_path / "book"
    book = HistoryBook(str(at))
    if planted == "file":
        at.write_bytes(b"not a book")
    else:
        os.symlink(tmp_path / "nowhere", at)
    rep = apply_to_tensors(out, tensors, history=book)
    assert rep.target_fingerprint == enc.target_fingerprint == state_dict_fingerprint(tensors)
    assert {n: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n, t in tensors.items()} == \
        checkpoint_bits(paths[1])
    assert not os.path.lexists(at) and not os.path.lexists(tmp_path / "nowhere")
