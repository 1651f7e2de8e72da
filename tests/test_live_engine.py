"""In-place refit of live parameters through layouts captured from a model's own loader (no vLLM needed).

The model here is a real torch module with a loader in vLLM's style: q/k/v rows copied into one fused
parameter through ``narrow(...).copy_``, a weight stored transposed, an embedding padded to a multiple of
8 rows (the padding filled), a norm copied whole. Checkpoints are real safetensors files; deltas are real
encodes of a base and a target that differ by one ulp at about 3% of the elements.
"""

from __future__ import annotations

import os
from typing import ClassVar

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from deltarefit.encode import encode
from deltarefit.engines.capture import capture_layout
from deltarefit.engines.live import LiveTarget, Placement, apply_live, row_local, row_runs
from deltarefit.engines.vllm.worker import LiveEngine
from deltarefit.errors import BaseMismatchError, DeltaRefitError
from deltarefit.geometry.projection import Axis, Piece

H, V, F = 64, 50, 96  # hidden, vocab (padded to 56), ffn

SHAPES = {"embed.weight": (V, H), "layers.0.q_proj.weight": (H, H), "layers.0.k_proj.weight": (32, H),
          "layers.0.v_proj.weight": (32, H), "layers.0.down_proj.weight": (H, F), "layers.0.norm.weight": (H,)}


class Model(torch.nn.Module):
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self) -> None:
        super().__init__()
        z = lambda *s: torch.nn.Parameter(torch.zeros(*s, dtype=torch.bfloat16), requires_grad=False)  # noqa: E731
        self.embed = torch.nn.Module()
        self.embed.weight = z(56, H)
        layer = torch.nn.Module()
        layer.qkv_proj = torch.nn.Module()
        layer.qkv_proj.weight = z(H + 64, H)
        layer.down_proj = torch.nn.Module()
        layer.down_proj.weight = z(F, H)  # stored transposed
        layer.norm = torch.nn.Module()
        layer.norm.weight = z(H)
        self.layers = torch.nn.ModuleList([layer])

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        for name, w in weights:
            for part, off in (("q_proj", 0), ("k_proj", H), ("v_proj", H + 32)):
                if f".{part}." in name:
                    p = params[name.replace(part, "qkv_proj")]
                    p.data.narrow(0, off, w.shape[0]).copy_(w)
                    break
            else:
                if "down_proj" in name:
                    params[name].data.copy_(w.t())
                elif name == "embed.weight":
                    params[name].data[: w.shape[0]].copy_(w)
                    params[name].data[w.shape[0]:].fill_(0)
                else:
                    params[name].data.copy_(w)
        return set()


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for n, s in SHAPES.items()}


def _step(ts: dict[str, torch.Tensor], seed: int, frac: float = 0.03) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    out = {}
    for n, t in ts.items():
        bits = t.clone().view(torch.int16).view(-1).numpy()
        idx = rng.choice(bits.size, max(1, int(bits.size * frac)), replace=False)
        bits[idx] += rng.choice(np.array([-1, 1], np.int16), idx.size)
        out[n] = torch.from_numpy(bits).view(torch.bfloat16).view(t.shape)
    return out


def _save(ts: dict[str, torch.Tensor], d: str) -> str:
    os.makedirs(d, exist_ok=True)
    save_file(ts, os.path.join(d, "model.safetensors"))
    return d


def _bits(m: torch.nn.Module) -> dict[str, bytes]:
    return {n: p.detach().contiguous().view(torch.uint8).numpy().tobytes() for n, p in m.named_parameters()}


def _loaded(ts: dict[str, torch.Tensor]) -> Model:
    m = Model()
    with torch.no_grad():
        m.load_weights(ts.items())
    return m


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    base = _tensors(0)
    target = _step(base, 1)
    other = _tensors(7)
    dirs = {k: _save(v, str(root / k)) for k, v in (("base", base), ("target", target), ("other", other))}
    target2 = _step(target, 2)
    dirs["target2"] = _save(target2, str(root / "target2"))
    deltas = {"step": str(root / "step.delta"), "wrong": str(root / "wrong.delta"),
              "step-sums": str(root / "step-sums.delta"), "step2-sums": str(root / "step2-sums.delta")}
    encode(dirs["base"], dirs["target"], deltas["step"])
    encode(dirs["other"], dirs["target"], deltas["wrong"])
    encode(dirs["base"], dirs["target"], deltas["step-sums"], sums=True)
    encode(dirs["target"], dirs["target2"], deltas["step2-sums"], sums=True)
    return {"base": base, "target": target, "target2": target2, "dirs": dirs, "deltas": deltas, "root": root}


def test_capture_records_fused_transposed_and_padded_copies_and_writes_nothing(chain):
    m = _loaded(chain["base"])
    before = _bits(m)
    params = dict(m.named_parameters())
    lay = capture_layout(m.load_weights, params, {n: (torch.bfloat16, s) for n, s in SHAPES.items()})
    assert lay.reload == {}
    assert _bits(m) == before  # the probes' copies and fills were recorded, not executed
    (k,) = lay.placements["layers.0.k_proj.weight"]
    assert k.param == "layers.0.qkv_proj.weight" and k.piece.axes[0].src_off == H
    (down,) = lay.placements["layers.0.down_proj.weight"]
    assert [a.dst_dim for a in down.piece.axes] == [1, 0]  # transposed
    live = LiveTarget(params, lay.placements, {n: ("BF16", s) for n, s in SHAPES.items()})
    for n, t in chain["base"].items():
        assert live.read_segment(n, 0).tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes(), n


def test_capture_marks_non_copy_loads_for_reload():
    class Odd(Model):
        def load_weights(self, weights):
            params = dict(self.named_parameters())
            for name, w in weights:
                if name == "embed.weight":
                    params[name].data[: w.shape[0]].copy_(w.float().to(torch.bfloat16) * 2)  # computed
                elif name == "layers.0.norm.weight":
                    params[name].data.add_(w)  # not a copy
                else:
                    raise ValueError("no such parameter")

    m = Odd()
    lay = capture_layout(m.load_weights, dict(m.named_parameters()),
                         {n: (torch.bfloat16, s) for n, s in SHAPES.items()})
    assert lay.placements == {}
    assert "computed" in lay.reload["embed.weight"]
    assert "add_" in lay.reload["layers.0.norm.weight"]
    assert "ValueError" in lay.reload["layers.0.q_proj.weight"]


def test_live_engine_refits_in_place_bit_exact_and_refuses_wrong_bases(chain):
    m = _loaded(chain["base"])
    eng = LiveEngine(m, None, chain["dirs"]["base"])
    assert eng.reload_reasons == {} and len(eng.placements) == len(SHAPES)
    before = _bits(m)
    for bad, exc in ((chain["deltas"]["wrong"], BaseMismatchError),):
        with pytest.raises(exc):
            eng.apply(bad)
        assert _bits(m) == before
    # a truncated delta and one with a flipped payload byte: refused, nothing written
    data = open(chain["deltas"]["step"], "rb").read()
    for i, blob in enumerate((data[: len(data) // 2], data[:-200] + bytes([data[-200] ^ 0x10]) + data[-199:])):
        p = str(chain["root"] / f"bad{i}.delta")
        open(p, "wb").write(blob)
        with pytest.raises(DeltaRefitError):
            eng.apply(p)
        assert _bits(m) == before
    rep = eng.apply(chain["deltas"]["step"])
    assert rep.chunks_applied > 0 and rep.tensors_in_place == len(SHAPES) and rep.tensors_reloaded == 0
    assert _bits(m) == _bits(_loaded(chain["target"]))
    assert eng.verify() == eng.fingerprint
    again = eng.apply(chain["deltas"]["step"])  # a rerun is a no-op
    assert again.chunks_applied == 0 and _bits(m) == _bits(_loaded(chain["target"]))


def _tear_third_write(monkeypatch) -> object:
    """``LiveTarget.write_segment`` failing at its third call, after half of that chunk's changes landed (a
    torn chunk); returns the real method, to put back."""
    real = LiveTarget.write_segment
    calls = {"n": 0}

    def flaky(self, name, ci, region, view, patch):
        calls["n"] += 1
        if calls["n"] == 3:
            half = type(patch)(patch.positions[: patch.positions.size // 2], patch.values[: patch.values.size // 2],
                               None) if patch.dense is None else patch
            real(self, name, ci, region, view, half)
            raise OSError("injected failure mid-write")
        return real(self, name, ci, region, view, patch)

    monkeypatch.setattr(LiveTarget, "write_segment", flaky)
    return real


def test_a_write_that_fails_midway_is_completed_by_the_next_apply(chain, monkeypatch):
    m = _loaded(chain["base"])
    eng = LiveEngine(m, None, chain["dirs"]["base"], threads=1)
    real = _tear_third_write(monkeypatch)
    with pytest.raises(OSError):
        eng.apply(chain["deltas"]["step"])
    assert _bits(m) != _bits(_loaded(chain["target"]))
    monkeypatch.setattr(LiveTarget, "write_segment", real)
    rep = eng.apply(chain["deltas"]["step"])
    assert rep.chunks_recovered == 1
    assert _bits(m) == _bits(_loaded(chain["target"]))


def test_a_wrong_map_is_refused_before_any_write(chain):
    m = _loaded(chain["base"])
    params = dict(m.named_parameters())
    lay = capture_layout(m.load_weights, params, {n: (torch.bfloat16, s) for n, s in SHAPES.items()})
    # q_proj placed one row too low in the fused parameter: the rows it reads are not q_proj's
    lay.placements["layers.0.q_proj.weight"] = [Placement("layers.0.qkv_proj.weight", Piece(
        "layers.0.q_proj.weight", (H, H), (H + 64, H), (Axis(1, H, 0, 0), Axis(0, H, 1, 0))))]
    live = LiveTarget(params, lay.placements, {n: ("BF16", s) for n, s in SHAPES.items()})
    before = _bits(m)
    with pytest.raises(BaseMismatchError, match="q_proj"):
        apply_live(chain["deltas"]["step"], live)
    assert _bits(m) == before


def test_live_engine_refuses_a_captured_map_that_misses_the_checkpoints_digest(chain, monkeypatch):
    import deltarefit.engines.vllm.worker as vl

    real = vl.capture_layout

    def shifted(load, params, specs):
        lay = real(load, params, specs)
        lay.placements["layers.0.q_proj.weight"] = [Placement("layers.0.qkv_proj.weight", Piece(
            "layers.0.q_proj.weight", (H, H), (H + 64, H), (Axis(1, H, 0, 0), Axis(0, H, 1, 0))))]
        return lay

    monkeypatch.setattr(vl, "capture_layout", shifted)
    eng = LiveEngine(_loaded(chain["base"]), None, chain["dirs"]["base"])
    assert "digest" in eng.reload_reasons["layers.0.q_proj.weight"]
    # its fused siblings go with it: the layer is reloaded whole, never written in place
    assert {"layers.0.k_proj.weight", "layers.0.v_proj.weight"} <= set(eng.reload_reasons)
    assert "layers.0.q_proj.weight" not in eng.placements


# -------------------------------------------------------------------------------------- held digests


def _param_bits(m: torch.nn.Module, name: str) -> np.ndarray:
    return dict(m.named_parameters())[name].data.view(-1).view(torch.int16).numpy()


def test_deltas_with_additive_digests_are_checked_through_held_digests(chain):
    m = _loaded(chain["base"])
    eng = LiveEngine(m, None, chain["dirs"]["base"])
    rep = eng.apply(chain["deltas"]["step-sums"])
    assert rep.check == "held digests" and rep.chunks_applied > 0
    assert _bits(m) == _bits(_loaded(chain["target"]))
    assert eng.verify() == eng.fingerprint  # the held digests were moved right: verify compares them too
    rep2 = eng.apply(chain["deltas"]["step2-sums"])
    assert rep2.check == "held digests" and _bits(m) == _bits(_loaded(chain["target2"]))
    assert eng.verify() == eng.fingerprint
    # a delta without them is checked by segments, and the digests of what it wrote are taken again
    eng2 = LiveEngine(_loaded(chain["base"]), None, chain["dirs"]["base"])
    assert eng2.apply(chain["deltas"]["step"]).check == "segments"
    assert eng2.apply(chain["deltas"]["step2-sums"]).check == "held digests"
    assert eng2.verify() == eng2.fingerprint


def test_held_digests_refuse_a_changed_element_that_was_modified_behind_the_engine(chain):
    """An element the delta changes, modified in the engine's memory since the held digest was taken:
    the moved digest misses the delta's target, so the apply is refused with nothing written."""
    from deltarefit.errors import VerificationError

    m = _loaded(chain["base"])
    eng = LiveEngine(m, None, chain["dirs"]["base"])
    base_bits = chain["base"]["layers.0.norm.weight"].view(torch.int16).numpy()
    changed = np.flatnonzero(chain["target"]["layers.0.norm.weight"].view(torch.int16).numpy() != base_bits)
    assert changed.size  # the step changes some elements of the norm
    _param_bits(m, "layers.0.norm.weight")[changed[0]] ^= 1  # behind the engine's back
    before = _bits(m)
    with pytest.raises(VerificationError, match=r"layers\.0\.norm\.weight"):
        eng.apply(chain["deltas"]["step-sums"])
    assert _bits(m) == before


def test_held_digests_do_not_reread_unchanged_elements_and_verify_does(chain):
    """The documented limit of a held-digest check: an element the delta does not change, modified
    behind the engine (a mantissa bit, so no element changes context), is not re-read by the apply;
    ``verify`` re-reads everything and refuses."""
    from deltarefit.errors import VerificationError

    m = _loaded(chain["base"])
    eng = LiveEngine(m, None, chain["dirs"]["base"])
    base_bits = chain["base"]["layers.0.norm.weight"].view(torch.int16).numpy()
    same = np.flatnonzero(chain["target"]["layers.0.norm.weight"].view(torch.int16).numpy() == base_bits)
    _param_bits(m, "layers.0.norm.weight")[same[0]] ^= 1
    assert eng.apply(chain["deltas"]["step-sums"]).check == "held digests"
    with pytest.raises(VerificationError):
        eng.verify()


def test_a_failed_held_apply_is_completed_by_segments_and_held_digests_resume(chain, monkeypatch):
    m = _loaded(chain["base"])
    eng = LiveEngine(m, None, chain["dirs"]["base"], threads=1)
    real = LiveTarget.write_segment
    calls = {"n": 0}

    def flaky(self, name, ci, region, view, patch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("injected failure mid-write")
        return real(self, name, ci, region, view, patch)

    monkeypatch.setattr(LiveTarget, "write_segment", flaky)
    with pytest.raises(OSError):
        eng.apply(chain["deltas"]["step-sums"])
    monkeypatch.setattr(LiveTarget, "write_segment", real)
    rep = eng.apply(chain["deltas"]["step-sums"])
    assert rep.check == "segments" and rep.chunks_skipped >= 1  # chunks written before the failure
    assert _bits(m) == _bits(_loaded(chain["target"]))
    assert eng.apply(chain["deltas"]["step2-sums"]).check == "held digests"
    assert _bits(m) == _bits(_loaded(chain["target2"])) and eng.verify() == eng.fingerprint


def test_a_union_with_a_collective_part_is_collective():
    """The applier drives a collective target in one order on one thread; a union holding one (a live
    engine's placements beside its host copies) must say so, or the group's collectives interleave."""
    from deltarefit.apply.tensors import _TorchTarget
    from deltarefit.engines.live import TargetUnion

    class Group:
        collective = True
        tensors: ClassVar[dict] = {}

        def agree(self, ok):
            return False

        def read_segment(self, name, ci):
            raise AssertionError("not read")

        def write_segment(self, name, ci, region, view, patch):
            raise AssertionError("not written")

    u = TargetUnion(Group(), _TorchTarget({}))
    assert u.collective and u.agree(True) is False
    plain = TargetUnion(_TorchTarget({}))
    assert not plain.collective and plain.agree(True) is True


class _Whole(torch.nn.Module):
    """A model holding each checkpoint tensor whole under its own name (``load_weights`` copies it)."""

    def __init__(self, ckpt: str) -> None:
        super().__init__()
        from safetensors.torch import load_file

        self.ts = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.zeros_like(t), requires_grad=False)
                                          for n, t in load_file(ckpt).items()})
        self.load_weights(load_file(ckpt).items())

    def load_weights(self, weights) -> set[str]:
        for name, w in weights:
            self.ts[name].data.copy_(w)
        return set()


def test_a_live_engine_decodes_a_chain_coded_with_history_and_refuses_the_wrong_book(tmp_path):
    """The live engine keeps a history book: deltas coded with history (encoding 5, momentum-like chain)
    decode against it through the held-digest plan, each apply advances it as the trainer's advanced, and
    a book that is not the one a delta was coded against is refused by name with nothing written."""
    from _chains import deltas_with_history, write_chain

    from deltarefit.errors import DecodeError
    from deltarefit.history_book import HistoryBook

    paths = write_chain(str(tmp_path / "chain"), 5, n=(1 << 19) + 3000, seed=4, rate=0.05, prefix="c")
    model = _Whole(paths[0])
    live = LiveEngine(model, None, paths[0], threads=2)
    assert live.keeps_history
    book = HistoryBook(str(tmp_path / "ebook"))
    hist_chunks = 0
    for i, (out, rep, n5) in enumerate(deltas_with_history(paths, str(tmp_path)), 1):
        hist_chunks += n5
        if n5:  # a book that is not the one the delta was coded against: refused, nothing written
            before = _bits(model)
            with pytest.raises(DecodeError, match="history"):
                live.apply(out, history=HistoryBook(str(tmp_path / f"empty{i}")))
            assert _bits(model) == before and live.verify() == rep.base_fingerprint
        got = live.apply(out, history=book)
        assert got.check == "held digests" and got.target_fingerprint == rep.target_fingerprint
        assert live.verify() == rep.target_fingerprint == book.tip
    assert hist_chunks > 0


def test_a_book_that_cannot_advance_is_started_over_and_the_refit_stands(tmp_path, monkeypatch):
    """A verified apply whose book cannot be written (a full tmpfs) keeps its weights at the target and
    its version: the book is emptied instead (the next delta coded with history then takes a keyframe
    route), so a worker of a group never stays a version behind the others over its book."""
    from _chains import deltas_with_history, write_chain

    from deltarefit.history_book import HistoryBook

    paths = write_chain(str(tmp_path / "chain"), 2, n=(1 << 19) + 3000, seed=4, rate=0.05, prefix="c")
    model = _Whole(paths[0])
    live = LiveEngine(model, None, paths[0], threads=2)
    book = HistoryBook(str(tmp_path / "ebook"))
    (out1, rep1, _), (out2, rep2, _) = deltas_with_history(paths, str(tmp_path))
    live.apply(out1, history=book)
    assert book.tip == rep1.target_fingerprint

    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(HistoryBook, "commit", full)
    got = live.apply(out2, history=book)
    assert got.target_fingerprint == rep2.target_fingerprint == live.verify() == live.fingerprint
    assert HistoryBook(book.path).versions() == []


def test_a_plan_prepared_against_the_same_history_book_is_written_and_another_books_is_not(tmp_path):
    """``prepare`` with a history book, then ``apply`` with the book in the same state (another object of
    the same directory): the plan is written. A plan made against a copy of the book elsewhere is dropped
    and the delta planned again against the book given to the apply. Bit-exact either way."""
    import shutil

    from _chains import deltas_with_history, write_chain

    from deltarefit.history_book import HistoryBook

    paths = write_chain(str(tmp_path / "chain"), 5, n=(1 << 19) + 3000, seed=4, rate=0.05, prefix="c")
    model = _Whole(paths[0])
    live = LiveEngine(model, None, paths[0], threads=2)
    book = HistoryBook(str(tmp_path / "ebook"))
    ways = []
    for i, (out, rep, n5) in enumerate(deltas_with_history(paths, str(tmp_path)), 1):
        if i % 2 and n5:  # a copy of the book (the same state, another directory): its plan is not used
            shutil.copytree(book.path, str(tmp_path / f"copy{i}"))
            prep = live.prepare(out, history=HistoryBook(str(tmp_path / f"copy{i}")))
            want = False
        else:
            prep = live.prepare(out, history=HistoryBook(book.path))
            want = True
        got = live.apply(out, history=book, prepared=prep)
        ways.append((got.prepared, want))
        assert got.prepared == want and got.target_fingerprint == rep.target_fingerprint
        assert live.verify() == rep.target_fingerprint == book.tip
    assert (True, True) in ways and (False, False) in ways, ways


def _random_piece(rng: np.random.Generator) -> Piece:
    """A piece whose last local axis runs along the checkpoint's last dimension with stride 1 (row runs
    apply), the other axes in any order, with any offsets and strides, inside a padded local tensor."""
    nd = int(rng.integers(2, 4))
    shape = tuple(int(x) for x in rng.integers(3, 40, nd))
    lengths = [int(rng.integers(1, n + 1)) for n in shape]
    dst_dims = [*rng.permutation(nd - 1).tolist(), nd - 1]
    axes, local = [], []
    for i, d in enumerate(dst_dims):
        ln = lengths[d]
        stride = 1 if i == nd - 1 else int(rng.integers(1, max(2, shape[d] // ln) + 1))
        while (ln - 1) * stride >= shape[d]:
            stride -= 1
        off = int(rng.integers(0, shape[d] - (ln - 1) * stride))
        src_stride = 1 if i == nd - 1 else int(rng.integers(1, 3))
        src_off = int(rng.integers(0, 3))
        axes.append(Axis(src_off, ln, d, off, stride, src_stride))
        local.append(src_off + src_stride * (ln - 1) + 1 + int(rng.integers(0, 3)))
    return Piece("w", shape, tuple(local), tuple(axes))


def test_row_runs_and_row_local_are_exactly_the_elements_to_local_maps():
    rng = np.random.default_rng(7)
    for _ in range(300):
        p = _random_piece(rng)
        total = int(np.prod(p.shape))
        a = int(rng.integers(0, total))
        b = int(rng.integers(a + 1, total + 1))
        ck = np.arange(a, b, dtype=np.int64)
        loc = p.to_local(ck)
        runs = row_runs(p, a, b)
        assert runs is not None
        got_ck = np.concatenate([np.arange(c, c + n) for c, _, n in zip(*runs, strict=True)] or [np.empty(0, int)])
        got_loc = np.concatenate([np.arange(lo, lo + n) for _, lo, n in zip(*runs, strict=True)] or [np.empty(0, int)])
        assert np.array_equal(got_ck, ck[loc >= 0])
        assert np.array_equal(got_loc, loc[loc >= 0])
        some = rng.choice(total, int(rng.integers(0, 60)))  # any positions, sorted or not, repeated or not
        if rng.random() < 0.5:
            some.sort()
        assert np.array_equal(row_local(p, some), p.to_local(some))


def test_row_runs_leave_other_pieces_to_the_index_map():
    transposed = Piece("w", (4, 6), (6, 4), (Axis(0, 6, 1, 0), Axis(0, 4, 0, 0)))
    strided = Piece("w", (4, 6), (4, 3), (Axis(0, 4, 0, 0), Axis(0, 3, 1, 0, 2)))
    assert row_runs(transposed, 0, 24) is None and row_runs(strided, 0, 24) is None
    assert row_local(transposed, np.arange(24)) is None and row_local(strided, np.arange(24)) is None


@pytest.mark.parametrize("held", [False, True], ids=["segments", "held-digests"])
def test_patches_beyond_the_memory_budget_are_decoded_again_when_written(chain, held):
    """With no memory budget for decoded patches (``cache_bytes=0``), every chunk is decoded again when
    written (held-digest plans: checked to move the digest exactly as its plan did), and the refit
    ends bit-exact as with the budget."""
    from deltarefit.apply.protocol import run_apply
    from deltarefit.engines.live import state_through
    from deltarefit.format import DeltaReader

    m = _loaded(chain["base"])
    params = dict(m.named_parameters())
    lay = capture_layout(m.load_weights, params, {n: (torch.bfloat16, s) for n, s in SHAPES.items()})
    live = LiveTarget(params, lay.placements, {n: ("BF16", s) for n, s in SHAPES.items()})
    sums = {n: state_through(live, n)[1] for n in SHAPES} if held else None
    with DeltaReader(chain["deltas"]["step-sums"]) as d:
        rep = run_apply(d, live, journal=None, threads=2, cache_bytes=0, held=sums)
    assert rep.held == (len(SHAPES) if held else 0) and rep.chunks_applied > 0
    assert _bits(m) == _bits(_loaded(chain["target"]))


def test_a_prepared_plan_writes_nothing_until_applied_and_then_only_writes(chain):
    """``prepare`` makes every check of the apply and writes nothing; ``apply(prepared=...)`` then writes that
    plan, bit-exact, and a plan is used once."""
    m = _loaded(chain["base"])
    eng = LiveEngine(m, None, chain["dirs"]["base"])
    fp0, before = eng.fingerprint, _bits(m)
    with pytest.raises(BaseMismatchError):
        eng.prepare(chain["deltas"]["wrong"])
    prep = eng.prepare(chain["deltas"]["step-sums"])
    assert _bits(m) == before and eng.fingerprint == fp0 and eng.verify() == fp0  # read-only
    rep = eng.apply(chain["deltas"]["step-sums"], prepared=prep)
    assert rep.prepared and rep.check == "held digests" and rep.chunks_applied > 0 and rep.seconds_prepared > 0
    assert _bits(m) == _bits(_loaded(chain["target"]))
    assert eng.verify() == eng.fingerprint != fp0
    rep = eng.apply(chain["deltas"]["step-sums"], prepared=prep)  # used already: planned again (done)
    assert not rep.prepared and rep.chunks_applied == 0
    prep2 = eng.prepare(chain["deltas"]["step2-sums"])  # the next step, planned against the weights now
    assert eng.apply(chain["deltas"]["step2-sums"], prepared=prep2).prepared
    assert _bits(m) == _bits(_loaded(chain["target2"])) and eng.verify() == eng.fingerprint


def test_a_prepared_plan_goes_stale_when_another_apply_begins_first(chain):
    """A plan prepared before another apply began is not written: the delta is planned again against the
    weights as they are then."""
    m = _loaded(chain["base"])
    eng = LiveEngine(m, None, chain["dirs"]["base"])
    prep = eng.prepare(chain["deltas"]["step-sums"])
    assert not eng.apply(chain["deltas"]["step-sums"]).prepared
    rep = eng.apply(chain["deltas"]["step-sums"], prepared=prep)  # stale: planned again (already done)
    assert not rep.prepared and rep.chunks_applied == 0
    prep = eng.prepare(chain["deltas"]["step2-sums"])
    rep = eng.apply(chain["deltas"]["step-sums"], prepared=prep)  # another delta's plan: dropped
    assert not rep.prepared and prep.reader._f.closed
    assert _bits(m) == _bits(_loaded(chain["target"])) and eng.verify() == eng.fingerprint


@pytest.mark.parametrize("by", ["bits", "digest"])
def test_a_prepared_plan_refuses_elements_modified_since_with_nothing_written(chain, by):
    """Between ``prepare`` and ``apply`` an element the delta changes is modified behind the engine: the
    apply reads the changed elements again before writing, and refuses with nothing written. ``bits``: the
    old bits the plan kept compared; ``digest``: a plan without them (``plan_apply`` not ``ahead``), the
    digest the elements move compared with the one planned."""
    from deltarefit.errors import VerificationError

    m = _loaded(chain["base"])
    eng = LiveEngine(m, None, chain["dirs"]["base"])
    prep = eng.prepare(chain["deltas"]["step-sums"])
    kept = [c for tp in prep.plan.plans for c in tp.chunks if c.old is not None]
    assert kept  # the plan made ahead kept the old bits of the chunks it kept
    if by == "digest":
        for c in kept:
            c.old = None
    base_bits = chain["base"]["layers.0.norm.weight"].view(torch.int16).numpy()
    changed = np.flatnonzero(chain["target"]["layers.0.norm.weight"].view(torch.int16).numpy() != base_bits)
    _param_bits(m, "layers.0.norm.weight")[changed[0]] ^= 1  # behind the engine's back
    before = _bits(m)
    with pytest.raises(VerificationError, match=r"layers\.0\.norm\.weight.*modified since"):
        eng.apply(chain["deltas"]["step-sums"], prepared=prep)
    assert _bits(m) == before


def test_a_prepared_apply_that_fails_midway_is_completed_by_the_same_call_again(chain, monkeypatch):
    """A write failing midway through a prepared plan: the same call again (the used plan dropped, the delta
    planned again from the journal's torn chunk) completes it, bit-exact."""
    m = _loaded(chain["base"])
    eng = LiveEngine(m, None, chain["dirs"]["base"], threads=1)
    prep = eng.prepare(chain["deltas"]["step-sums"])
    real = _tear_third_write(monkeypatch)
    with pytest.raises(OSError):
        eng.apply(chain["deltas"]["step-sums"], prepared=prep)
    assert _bits(m) != _bits(_loaded(chain["target"]))
    monkeypatch.setattr(LiveTarget, "write_segment", real)
    rep = eng.apply(chain["deltas"]["step-sums"], prepared=prep)
    assert not rep.prepared and rep.chunks_recovered == 1 and rep.check == "segments"
    assert _bits(m) == _bits(_loaded(chain["target"])) and eng.verify() == eng.fingerprint


# A fused MoE layer as vLLM's FusedMoE loads it: experts stacked in one parameter, each expert's gate and up
# rows copied into its slice of w13 (rows [0, I) and [I, 2I)), down_proj into its slice of w2; the router
# a plain weight. Checkpoint tensors are per expert, 2-D; the parameters are 3-D.
E, I_MOE = 4, 24
MOE_SHAPES = {**{f"mlp.experts.{e}.{p}.weight": ((I_MOE, H) if p != "down_proj" else (H, I_MOE))
                 for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")},
              "mlp.gate.weight": (E, H)}


class MoE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        z = lambda *s: torch.nn.Parameter(torch.zeros(*s, dtype=torch.bfloat16), requires_grad=False)  # noqa: E731
        self.mlp = torch.nn.Module()
        self.mlp.experts = torch.nn.Module()
        self.mlp.experts.w13_weight = z(E, 2 * I_MOE, H)
        self.mlp.experts.w2_weight = z(E, H, I_MOE)
        self.mlp.gate = torch.nn.Module()
        self.mlp.gate.weight = z(E, H)

    def load_weights(self, weights) -> set[str]:
        for name, w in weights:
            if ".experts." in name:
                e, proj = int(name.split(".")[2]), name.split(".")[3]
                if proj == "down_proj":
                    self.mlp.experts.w2_weight.data[e].copy_(w)
                else:
                    self.mlp.experts.w13_weight.data[e].narrow(0, 0 if proj == "gate_proj" else I_MOE, I_MOE).copy_(w)
            else:
                self.mlp.gate.weight.data.copy_(w)
        return set()


def test_fused_moe_experts_are_placed_slice_by_slice_and_refit_in_place(tmp_path):
    g = torch.Generator().manual_seed(3)
    base = {n: (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for n, s in MOE_SHAPES.items()}
    target = _step(base, 4)
    bd, td = _save(base, str(tmp_path / "base")), _save(target, str(tmp_path / "target"))
    delta = str(tmp_path / "step.delta")
    encode(bd, td, delta, sums=True)
    m = MoE()
    with torch.no_grad():
        m.load_weights(base.items())
    before = _bits(m)
    lay = capture_layout(m.load_weights, dict(m.named_parameters()), {n: (torch.bfloat16, s) for n, s in MOE_SHAPES.items()})
    assert lay.reload == {} and _bits(m) == before
    (up,) = lay.placements["mlp.experts.2.up_proj.weight"]
    assert up.param == "mlp.experts.w13_weight[2]" and up.piece.local_shape == (2 * I_MOE, H)
    assert up.piece.axes[0].src_off == I_MOE
    (down,) = lay.placements["mlp.experts.3.down_proj.weight"]
    assert down.param == "mlp.experts.w2_weight[3]"
    eng = LiveEngine(m, None, bd)
    assert eng.reload_reasons == {} and len(eng.placements) == len(MOE_SHAPES)
    rep = eng.apply(delta)
    assert rep.tensors_in_place == len(MOE_SHAPES) and rep.tensors_reloaded == 0 and rep.check == "held digests"
    want = MoE()
    with torch.no_grad():
        want.load_weights(target.items())
    assert _bits(m) == _bits(want)
    assert eng.verify() == eng.fingerprint


def test_an_update_whose_kernels_do_not_read_it_back_fails_and_the_same_call_completes_it(chain, monkeypatch):
    """The read-back through the engine's kernels after the writes (tied copies, reloaded layers) fails:
    the apply raises, the engine is not at the new version, and the same apply again completes it."""
    from deltarefit.errors import VerificationError

    m = _loaded(chain["base"])
    eng = LiveEngine(m, None, chain["dirs"]["base"])
    base_fp = eng.fingerprint
    real, calls = LiveEngine._check_derived, {"n": 0}

    def failing_once(self, names, at_init=False, rebuild=True):
        calls["n"] += 1
        if calls["n"] == 1:
            raise VerificationError("tensor 'embed.weight': injected: its kernel does not read it")
        return real(self, names, at_init, rebuild)

    monkeypatch.setattr(LiveEngine, "_check_derived", failing_once)
    with pytest.raises(VerificationError, match="injected"):
        eng.apply(chain["deltas"]["step-sums"])
    assert eng.fingerprint == base_fp  # not stamped: the engine is not at the target until shown so
    rep = eng.apply(chain["deltas"]["step-sums"])
    assert rep.target_fingerprint == eng.fingerprint != base_fp
    assert _bits(m) == _bits(_loaded(chain["target"]))
    assert eng.verify() == eng.fingerprint
    rep2 = eng.apply(chain["deltas"]["step2-sums"])  # and the next version goes on through held digests
    assert rep2.check == "held digests" and _bits(m) == _bits(_loaded(chain["target2"]))


def test_a_copy_that_crosses_slices_of_a_stacked_parameter_is_not_placed():
    """Only a box inside one slice ``param[e]`` is a piece of that slice; a copy spanning two experts'
    slices (rows of a flattened stack) goes to the reload set with its reason."""

    class Across(MoE):
        def load_weights(self, weights):
            for name, w in weights:
                if name == "mlp.gate.weight":
                    self.mlp.gate.weight.data.copy_(w)
                else:  # expert 0's gate rows written from the end of slice 0 into slice 1
                    flat = self.mlp.experts.w13_weight.data.view(E * 2 * I_MOE, H)
                    flat.narrow(0, 2 * I_MOE - 4, w.shape[0]).copy_(w)

    m = Across()
    lay = capture_layout(m.load_weights, dict(m.named_parameters()),
                         {"mlp.experts.0.gate_proj.weight": (torch.bfloat16, (I_MOE, H)),
                          "mlp.gate.weight": (torch.bfloat16, (E, H))})
    assert "not one affine box" in lay.reload["mlp.experts.0.gate_proj.weight"]
    assert [pl.param for pl in lay.placements["mlp.gate.weight"]] == ["mlp.gate.weight"]


def test_holders_list_a_tied_parameter_once_per_module_and_nearest_module_walks_up():
    from deltarefit.engines import kernels

    m = Model()
    m.head = torch.nn.Module()
    m.head.weight = m.embed.weight  # tied: one Parameter, two modules
    by = kernels.holders_of(dict(m.named_modules()))
    assert sorted(by[m.embed.weight.untyped_storage().data_ptr()]) == [("embed", "weight"), ("head", "weight")]
    assert len(dict(m.named_parameters())) == 4  # named_parameters lists the tied one once
    assert kernels.nearest_module(m, "layers.0.qkv_proj")[0] == "layers.0.qkv_proj"
    assert kernels.nearest_module(m, "layers.0.experts.3.gate_proj")[0] == "layers.0"


def test_kernel_read_back_takes_zero_for_a_subnormal_weight_and_nothing_else():
    from deltarefit.engines import kernels

    for dtype in (torch.bfloat16, torch.float16):
        sub = torch.tensor([torch.finfo(dtype).tiny / 4, -torch.finfo(dtype).tiny / 2], dtype=dtype)
        assert sub.abs().min() > 0  # representable, not flushed by the tensor itself
        assert kernels.same_values(torch.zeros(2, dtype=dtype), sub)  # a GEMM that treats subnormals as zero
        assert kernels.same_values(sub, sub)
        tiny = torch.tensor([torch.finfo(dtype).tiny, 1.0], dtype=dtype)
        assert not kernels.same_values(torch.zeros(2, dtype=dtype), tiny)  # the smallest normal is no zero
        assert not kernels.same_values(torch.zeros(2, dtype=dtype), torch.tensor([0.0, 1e-3], dtype=dtype))
        assert not kernels.same_values(sub[:1], sub)  # shapes differ
    nan = torch.tensor([float("nan"), -0.0])
    assert kernels.same_values(nan, torch.tensor([float("nan"), 0.0]))


def test_a_loud_move_changes_what_a_quantized_layout_keeps_and_goes_back():
    from deltarefit.apps.bench.quantized import quantize_fp8, quantize_int8
    from deltarefit.engines import kernels

    w = (torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    before = w.clone()
    one_ulp = w.clone()
    one_ulp.view(torch.int16)[0, 0] ^= 1  # what a one-ulp probe would feed: fp8 rounds it away here
    assert torch.equal(quantize_fp8(one_ulp)[0].view(torch.uint8), quantize_fp8(w)[0].view(torch.uint8))
    assert torch.equal(quantize_fp8(one_ulp)[1], quantize_fp8(w)[1])
    back = kernels.move_first_loudly(w)
    for q in (quantize_fp8, quantize_int8):
        (c0, s0), (c1, s1) = q(before), q(w)
        assert not torch.equal(s0[0], s1[0]) and not torch.equal(c0[0].view(torch.uint8), c1[0].view(torch.uint8))
    assert torch.isfinite(w).all() and w.view(-1)[0] < 0
    back()
    assert torch.equal(w.view(torch.int16), before.view(torch.int16))
    i = torch.arange(6, dtype=torch.int32)
    back = kernels.move_first_loudly(i)
    assert i.tolist() == [1, 1, 2, 3, 4, 5]
    back()
    assert i.tolist() == list(range(6))
    huge = torch.tensor([1.0, torch.finfo(torch.bfloat16).max], dtype=torch.bfloat16)
    kernels.move_first_loudly(huge)
    assert torch.isfinite(huge).all() and huge[0] < 0


def test_capture_never_writes_its_probe_into_a_strided_parameter():
    # An fp8 kernel keeps its weight as a transposed view (qweight.t()); a square one takes the checkpoint's
    # shape, so a loader's copy of the probe (uninitialized memory) would land in the live weight.
    class Transposed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(16, 16).to(torch.float8_e4m3fn).t(), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                self.weight.data.copy_(t)

    m = Transposed()
    before = m.weight.detach().clone()
    lay = capture_layout(m.load_weights, dict(m.named_parameters()), {"weight": (torch.float8_e4m3fn, (16, 16))})
    assert "strided view" in lay.reload["weight"] and "weight" not in lay.placements
    assert torch.equal(m.weight.view(torch.uint8), before.view(torch.uint8))
