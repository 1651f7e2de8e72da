"""Every apply target runs the one apply protocol: the same hostile deltas and wrong bases are refused with
the same errors, and a refused apply writes nothing, on each of them.

Targets: a safetensors checkpoint file and a sharded directory with an index (``deltarefit.apply``),
CPU tensors (``apply.tensors.apply_to_tensors``), a module (``apply.tensors.apply_to_module``), device tensors
(``gpu.apply.apply_to_device_tensors`` on CPU tensors through the device code path; on CUDA with
``-m gpu``) and a live engine (``engines.live.LiveTarget`` over the parameters of a small engine whose
loader fuses checkpoint tensors into parameters with ``narrow(...).copy_``, stores one transposed and
pads one, placed by ``engines.capture.capture_layout``).

The corpus is ``_hostile.CASES``: a representative subset of ``test_hostile.py`` (which runs all of it,
and the CLI, against a checkpoint file): target digest and fingerprint lies, truncations, bit flips,
crafted chunks of each encoding, and wrong bases (other pair, one element off in each kind of place,
missing or extra tensor, other dtype or shape). "Nothing written" is every byte of every tensor (or
parameter, or file, and the directory listing) equal before and after.

Each in-memory target also survives an exception raised by its ``write_segment`` after some segments
were written: a rerun of the same call completes it, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import threading

import pytest
import safetensors.torch
import torch
from _hostile import CASES, Case, make_pair
from _pairs import Delta, sha, write_tensors

import deltarefit
from deltarefit.errors import DeltaRefitError

TARGETS = ["file", "dir", "tensors", "module", "device", pytest.param("device-cuda", marks=pytest.mark.gpu), "live",
           "live-held"]
IN_MEMORY = ["tensors", "module", "device", pytest.param("device-cuda", marks=pytest.mark.gpu), "live", "live-held"]
_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bytes_of(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _st(t: torch.Tensor) -> str:
    from deltarefit.apply.tensors import safetensors_dtype

    return safetensors_dtype(t.dtype)


# --------------------------------------------------------------------------------------------- targets


class _Files:
    """A checkpoint on disk: one file, or two shards and an index."""

    def __init__(self, root, tensors: dict[str, torch.Tensor], sharded: bool) -> None:
        self.root = root
        root.mkdir()
        if not sharded:
            self.path = write_tensors(root / "model.safetensors", tensors)
            return
        names = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for f, ns in shards.items():
            write_tensors(root / f, {n: tensors[n] for n in ns})
        index = {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
        self.path = str(root)

    def apply(self, delta: str):
        return deltarefit.apply(delta, self.path)

    def snapshot(self):
        files = sorted(os.listdir(self.root))  # a journal or temp file left behind shows here
        return files, {f: sha(self.root / f) for f in files}

    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for f in sorted(os.listdir(self.root)):
            if f.endswith(".safetensors"):
                out.update(safetensors.torch.load_file(str(self.root / f)))
        return out


class _Dict:
    """A dict of tensors applied into by ``apply_to_tensors`` or ``apply_to_device_tensors``."""

    def __init__(self, tensors: dict[str, torch.Tensor], how: str) -> None:
        dev = "cuda" if how == "device-cuda" else "cpu"
        self.how = how
        self.d = {k: v.clone().to(dev).contiguous() for k, v in tensors.items()}

    def apply(self, delta: str):
        if self.how == "tensors":
            from deltarefit.apply.tensors import apply_to_tensors

            return apply_to_tensors(delta, self.d)
        from deltarefit.gpu.apply import apply_to_device_tensors

        return apply_to_device_tensors(delta, self.d)

    def snapshot(self):
        return {k: (str(v.dtype), tuple(v.shape), _bytes_of(v)) for k, v in self.d.items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in self.d.items()}


class _Module:
    """An ``nn.Module`` whose state dict names are the checkpoint's (submodules along the dots)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.m = torch.nn.Module()
        for name, t in tensors.items():
            *path, leaf = name.split(".")
            mod = self.m
            for part in path:
                if part not in mod._modules:
                    mod.add_module(part, torch.nn.Module())
                mod = mod._modules[part]
            mod.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))

    def apply(self, delta: str):
        from deltarefit.apply.tensors import apply_to_module

        return apply_to_module(delta, self.m)

    def snapshot(self):
        return {k: (str(v.dtype), tuple(v.shape), _bytes_of(v)) for k, v in self.m.state_dict().items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.m.state_dict())


FUSED = re.compile(r"layers\.\d+\.weight|big\.weight")


class ToyEngine(torch.nn.Module):
    """A small inference engine's weights: 2-D tensors matching ``FUSED`` of one dtype and width are rows
    of one fused parameter, ``proj.f16`` is stored transposed, ``embed.weight`` padded with 64 zero rows,
    the rest as they are. ``load_weights`` copies checkpoint tensors in like a vLLM loader does."""

    PAD = 64

    def __init__(self, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        super().__init__()
        self.where: dict[str, tuple[str, str, int]] = {}  # checkpoint name -> (parameter, how, row offset)
        groups: dict[tuple, list[str]] = {}
        for n, (dt, shape) in specs.items():
            if FUSED.fullmatch(n) and len(shape) == 2:
                groups.setdefault((dt, shape[1]), []).append(n)
        for i, ((dt, cols), names) in enumerate(groups.items()):
            off = 0
            for n in names:
                self.where[n] = (f"fused{i}", "rows", off)
                off += specs[n][1][0]
            self._param(f"fused{i}", dt, (off, cols))
        for n, (dt, shape) in specs.items():
            if n in self.where:
                continue
            p = n.replace(".", "_")
            if n == "proj.f16" and len(shape) == 2:
                self.where[n] = (p, "t", 0)
                self._param(p, dt, (shape[1], shape[0]))
            elif n == "embed.weight" and len(shape) == 2:
                self.where[n] = (p, "pad", 0)
                self._param(p, dt, (shape[0] + self.PAD, shape[1]))
            else:
                self.where[n] = (p, "copy", 0)
                self._param(p, dt, shape)

    def _param(self, name: str, dt: torch.dtype, shape) -> None:
        width = torch.empty(0, dtype=dt).element_size()
        self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=_WIDTH[width]).view(dt),
                                                         requires_grad=False))

    def load_weights(self, weights) -> None:
        for name, w in weights:
            pname, how, off = self.where[name]
            p = getattr(self, pname)
            if how == "rows":
                p.narrow(0, off, w.shape[0]).copy_(w)
            elif how == "t":
                p.copy_(w.t())
            elif how == "pad":
                p.narrow(0, 0, w.shape[0]).copy_(w)
                p.narrow(0, w.shape[0], self.PAD).zero_()
            else:
                p.copy_(w)


class _Live:
    """A ``LiveTarget`` over a ``ToyEngine`` loaded with the tensors, placed by ``capture_layout``."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        from deltarefit.engines.capture import capture_layout

        self.specs = {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}
        self.engine = ToyEngine(self.specs)
        params = dict(self.engine.named_parameters())
        layout = capture_layout(self.engine.load_weights, params, self.specs)
        assert layout.reload == {} and set(layout.placements) == set(tensors)
        self.layout = layout.placements
        with torch.no_grad():
            self.engine.load_weights(tensors.items())
        self.target = self._target()

    def _target(self):
        from deltarefit.engines.live import LiveTarget

        return LiveTarget(dict(self.engine.named_parameters()), self.layout,
                          {n: (_st(torch.empty(0, dtype=dt)), s) for n, (dt, s) in self.specs.items()})

    def apply(self, delta: str):
        from deltarefit.engines.live import apply_live

        return apply_live(delta, self.target)

    def snapshot(self):
        return {k: _bytes_of(v) for k, v in self.engine.named_parameters()}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors as the engine holds them, gathered through a fresh target."""
        from deltarefit.integrity import n_segments

        t = self._target()
        out = {}
        for n, (dt, shape) in self.specs.items():
            raw = b"".join(bytes(t.read_segment(n, ci)) for ci in range(n_segments(t.tensors[n].nbytes)))
            out[n] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape)
        return out


class _LiveHeld(_Live):
    """``_Live`` applied with held digests (``run_apply(held=)``), as ``LiveEngine`` does: taken from the
    parameters when built, moved by each apply; after a failed apply the next one checks by segments."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        from deltarefit.engines.live import state_through

        super().__init__(tensors)
        self.held: dict[str, bytes] | None = {n: state_through(self.target, n)[1] for n in self.target.tensors}

    def apply(self, delta: str):
        from deltarefit.apply import run_apply
        from deltarefit.format import DeltaReader

        with DeltaReader(delta) as d:
            try:
                rep = run_apply(d, self.target, journal=None, held=self.held)
            except BaseException:
                self.held = None
                raise
        if self.held is not None:
            assert rep.held == len(self.target.tensors), "every tensor checked through its held digest"
            self.held.update(rep.sums)
        return rep


def make_target(how: str, tensors: dict[str, torch.Tensor], tmp_path):
    if how == "device-cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device (runs on a CUDA machine)")
    if how in ("file", "dir"):
        return _Files(tmp_path / "ck", tensors, sharded=how == "dir")
    if how in ("tensors", "device", "device-cuda"):
        return _Dict(tensors, how)
    if how == "module":
        return _Module(tensors)
    return _LiveHeld(tensors) if how == "live-held" else _Live(tensors)


def assert_same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert (got[k].dtype, tuple(got[k].shape)) == (want[k].dtype, tuple(want[k].shape)), k
        assert _bytes_of(got[k]) == _bytes_of(want[k]), f"{k} differs"


# ------------------------------------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture
def ddir(tmp_path):
    d = tmp_path / "deltas"
    d.mkdir()
    return d


@pytest.mark.parametrize("how", TARGETS)
def test_good_delta_applies_bit_exact_then_is_a_no_op(pair, tmp_path, how):
    """Positive control for the refusals below: the unedited delta applies on this target."""
    t = make_target(how, pair["tensors"], tmp_path)
    rep = t.apply(pair["delta"])
    assert rep.target_fingerprint == deltarefit.fingerprint(pair["target"])
    assert (rep.chunks_applied, rep.chunks_skipped) == (len(Delta.parse(pair["data"]).records), 0)
    assert_same_bits(t.tensors(), pair["target_tensors"])
    snap = t.snapshot()
    again = t.apply(pair["delta"])
    assert (again.chunks_applied, again.chunks_skipped, again.written_bytes) == (0, rep.chunks_applied, 0)
    assert t.snapshot() == snap
    if how.startswith("live"):  # the parameters are exactly what the engine's loader makes of the target
        want = ToyEngine(t.specs)
        with torch.no_grad():
            want.load_weights(pair["target_tensors"].items())
        assert t.snapshot() == {k: _bytes_of(v) for k, v in want.named_parameters()}


# Lies about BLAKE3 digests only, in a manifest that agrees with itself (its index hash recomputed): a
# held-digest apply checks bits against the additive digests and does not hash segments, so it applies
# these to the bits the additive digests name (FORMAT.md, "Held digests"); test_held_digests_* below.
HELD_UNCHECKED = {"lying-target-digest", "record-post-is-pre", "manifest-base-digest"}


# Each case on each target, but a lie about BLAKE3 digests only on a held-digest target, which never
# reads them: test_held_digests_apply_the_additive_digests_bits covers those.
@pytest.mark.parametrize(("case", "how"), [
    pytest.param(c, how, id=f"{c.id}-{how}") for c in CASES for how in TARGETS
    if not (how == "live-held" and c.id in HELD_UNCHECKED)])
def test_refused_and_nothing_written(pair, tmp_path, ddir, how, case: Case):
    base = {k: v.clone() for k, v in pair["tensors"].items()}
    if case.edit:
        case.edit(base, pair)
    delta = case.delta(pair, ddir)
    t = make_target(how, base, tmp_path)
    before = t.snapshot()
    with pytest.raises(DeltaRefitError) as ei:
        t.apply(delta)
    err = ei.value
    assert t.snapshot() == before, f"{how}: bytes changed although apply raised {type(err).__name__}: {err}"
    assert isinstance(err, case.exc), f"raised {type(err).__name__}: {err}"
    for p in case.regexes(delta):
        assert re.search(p, str(err)), f"message {str(err)!r} does not match {p!r}"
    assert "\n" not in str(err)


@pytest.mark.parametrize("case", [c for c in CASES if c.id in HELD_UNCHECKED], ids=lambda c: c.id)
def test_held_digests_apply_the_additive_digests_bits(pair, tmp_path, ddir, case: Case):
    """What a held-digest apply does with a BLAKE3-only lie: the bits written are the target's (the
    additive digests and payloads are honest), the fingerprint reported is the delta's claim, and a
    full re-hash (``LiveEngine.verify``) tells the two apart where the claim is a lie."""
    from deltarefit.engines.live import digest_through
    from deltarefit.format import DeltaReader
    from deltarefit.integrity import fingerprint_from_digests

    delta = case.delta(pair, ddir)
    t = make_target("live-held", pair["tensors"], tmp_path)
    rep = t.apply(delta)
    assert_same_bits(t.tensors(), pair["target_tensors"])
    with DeltaReader(delta) as d:
        assert rep.target_fingerprint == d.target_fingerprint
    rehashed = fingerprint_from_digests({n: digest_through(t.target, n) for n in t.target.tensors})
    assert rehashed == deltarefit.fingerprint(pair["target"])
    # only the tensor digest lie reaches the fingerprint (the others are a base digest and a record's hash)
    assert (rehashed != rep.target_fingerprint) == (case.id == "lying-target-digest")


_WRITERS = {
    "tensors": ("deltarefit.apply", "RawSegments"),
    "module": ("deltarefit.apply", "RawSegments"),
    "device": ("deltarefit.gpu.apply", "DeviceTensors"),
    "device-cuda": ("deltarefit.gpu.apply", "DeviceTensors"),
    "live": ("deltarefit.engines.live", "LiveTarget"),
    "live-held": ("deltarefit.engines.live", "LiveTarget"),
}


class Injected(Exception):
    pass


@pytest.mark.parametrize("how", IN_MEMORY)
def test_exception_mid_write_then_rerun_completes(pair, tmp_path, monkeypatch, how):
    """``write_segment`` raises after 3 segments were written (a fault in the engine, a device error):
    the apply raises it, and the same call again skips those 3 chunks, writes the rest and ends at
    the target, bit for bit."""
    import importlib

    mod, cls_name = _WRITERS[how]
    cls = getattr(importlib.import_module(mod), cls_name)
    real = cls.write_segment
    k, done, lock = 3, [0], threading.Lock()

    def failing(self, *args, **kwargs):
        with lock:
            if done[0] >= k:
                raise Injected(f"injected after {k} segments")
            done[0] += 1
        return real(self, *args, **kwargs)

    t = make_target(how, pair["tensors"], tmp_path)
    base_snap = t.snapshot()
    monkeypatch.setattr(cls, "write_segment", failing)
    with pytest.raises(Injected):
        t.apply(pair["delta"])
    monkeypatch.setattr(cls, "write_segment", real)
    assert done[0] == k
    half = t.snapshot()
    assert half != base_snap
    rep = t.apply(pair["delta"])
    assert rep.chunks_skipped == k and rep.chunks_applied > 0
    assert rep.target_fingerprint == deltarefit.fingerprint(pair["target"])
    assert_same_bits(t.tensors(), pair["target_tensors"])


def test_capabilities_are_found_once_and_what_needs_host_regions_is_refused(pair, tmp_path):
    """``targets.capabilities``, what the applier reads instead of asking its target: a checkpoint writes
    whole post-images through its file, torch tensors are host regions patched in place, device tensors
    have their region hooks and decode against a history book only where given one. On device tensors a
    journal, held digests and a history book they were not given are refused (``UsageError``), nothing
    written; the same apply with the book given to them goes through."""
    from deltarefit.apply.host import HOST_REGIONS
    from deltarefit.apply.journal import Journal
    from deltarefit.apply.protocol import run_apply
    from deltarefit.apply.targets import capabilities, segments_of
    from deltarefit.apply.tensors import _TorchTarget
    from deltarefit.checkpoint.read import open_checkpoint
    from deltarefit.errors import UsageError
    from deltarefit.format import DeltaReader
    from deltarefit.gpu.apply import DeviceTensors
    from deltarefit.history_book import HistoryBook, MovesRecorder

    with open_checkpoint(pair["base"]) as ck:
        caps = capabilities(segments_of(ck), HOST_REGIONS)
        assert (caps.host, caps.writes_images, caps.collective, caps.hash_segments) == (True, True, False, None)
    caps = capabilities(segments_of(_TorchTarget(pair["tensors"])), HOST_REGIONS)
    assert (caps.host, caps.writes_images, caps.decodes_history, caps.chunk_roles) == (True, False, False, None)
    live = {n: t.clone() for n, t in pair["tensors"].items()}
    before = {n: _bytes_of(t) for n, t in live.items()}
    caps = capabilities(DeviceTensors(live), HOST_REGIONS)
    assert not caps.host and caps.hash_segments is not None and not caps.decodes_history
    book = HistoryBook(str(tmp_path / "book"))
    with DeltaReader(pair["delta"]) as d:
        held = {e.name: e.base.sum for e in d.tensors if e.base is not None}
        for kw, what in ((dict(journal=Journal(str(tmp_path / "j"), d.target_fingerprint)), "a journal"),
                         (dict(journal=None, held=held), "held digests"),
                         (dict(journal=None, history=book), "a history book")):
            with pytest.raises(UsageError, match=f"^{what} needs? a target with host regions"):
                run_apply(d, DeviceTensors(live), **kw)
        assert {n: _bytes_of(t) for n, t in live.items()} == before
        assert not os.path.lexists(tmp_path / "j")
        moves = MovesRecorder()
        rep = run_apply(d, DeviceTensors(live, history=book, moves=moves), journal=None, moves=moves)
        assert rep.target_fingerprint == d.target_fingerprint
    assert {n: _bytes_of(t) for n, t in live.items()} == {n: _bytes_of(t) for n, t in pair["target_tensors"].items()}
