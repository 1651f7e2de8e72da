"""Format 2 on the device (``deltarefit.gpu.ulp2``: Triton rANS lanes for encodings 6 ``ulp2`` and 7
``ulp2_hist``). Without CUDA the kernels run through Triton's interpreter on CPU tensors (small chunks:
a few hundred to a few thousand elements); with CUDA (``-m gpu``) the same tests run compiled.

Held to the host codec (``codec.ulp2``, numba's kernels: the reference): the device encoder writes
its bytes in both coder variants and both encodings and keeps the same candidate; the device decoder
gives its positions and target bits; every hostile payload (header edits, cuts, trailing bytes, wrong
counts, every single-byte flip) gets the host decoder's status, per chunk of one batch, with nothing
written outside fresh staging arrays.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is in the test extra: pip install -e '.[test]' (make test installs it)")
pytest.importorskip("triton", reason="triton (x86_64) is in the test extra: pip install -e '.[test]' (make test installs it)")

from deltarefit.codec import ulp2_kernels as NK  # noqa: E402
from deltarefit.codec.encodings import _ctx, _kind  # noqa: E402
from deltarefit.codec.history import History, moves_of_changes  # noqa: E402
from deltarefit.codec.ulp2 import decode_ulp2, encode_ulp2, encode_variant  # noqa: E402
from deltarefit.dtypes import dtype  # noqa: E402
from deltarefit.errors import DecodeError  # noqa: E402
from deltarefit.gpu import ulp2 as U  # noqa: E402
from deltarefit.gpu import ulp2_tables as T  # noqa: E402

CUDA = torch.cuda.is_available()
_saved = os.environ.get("TRITON_INTERPRET")
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    _kernels = U._kernels()
finally:
    if _saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved
INTERPRETED = _kernels is not None and U._interpreted(_kernels)
_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@pytest.fixture(params=["interpreter", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch):
    if request.param == "cuda":
        if not (CUDA and U.available(torch.device("cuda"))):
            pytest.skip("needs CUDA and compiled Triton kernels (a CUDA machine: pytest -m gpu)")
        return "cuda"
    if not INTERPRETED:
        pytest.skip("CUDA is available: the kernels are compiled (run -m gpu)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert U.available(torch.device("cpu"))
    return "cpu"


def _chunk(name: str, n: int, frac: float, seed: int, steps=(-2, -1, 1, 3)):
    """A base chunk (same-width integer view) and a target with a fraction of it moved by ``steps``."""
    dt = dtype(name)
    tdt = {"BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32, "U8": torch.uint8}[name]
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    if tdt.is_floating_point:
        b = (torch.randn(n, generator=g) * 0.02).to(tdt).view(_WIDTH[dt.itemsize])
    else:
        b = torch.randint(0, 200, (n,), generator=g).to(tdt).view(_WIDTH[dt.itemsize])
    t = b.clone()
    idx = torch.from_numpy(rng.choice(n, max(1, int(n * frac)), replace=False))
    t[idx] = t[idx] + torch.from_numpy(rng.choice(steps, idx.numel())).to(t.dtype)
    return dt, b, t


def _history(dt, b, t) -> History:
    """The history of a chunk whose last version made the moves base -> target."""
    bu, tu = b.numpy().view(dt.uint), t.numpy().view(dt.uint)
    pos = np.flatnonzero(bu != tu)
    return History.from_moves(b.numel(), [moves_of_changes(dt, b.numel(), pos, bu[pos], tu[pos])])


def _u(dt, x: torch.Tensor) -> np.ndarray:
    return x.cpu().numpy().view(dt.uint)


def _host_status(dt, base: np.ndarray, payload: bytes, m: int, states=None) -> tuple[int, np.ndarray, np.ndarray]:
    """The numba decoder's (status, positions, target bits) of a payload (without a history id)."""
    shift, mask, n_exp = _ctx(dt)
    pos, val = np.zeros(max(m, 0), np.int64), np.zeros(max(m, 0), dt.uint)
    st = NK.ulp2_decode(base, np.zeros(0, np.uint8) if states is None else states, np.frombuffer(payload, np.uint8),
                        m, dt.bits, _kind(dt), shift, mask, n_exp, int(states is not None), pos, val)
    return st, pos, val


@pytest.mark.parametrize("name,n,frac", [("BF16", 600, 0.05), ("F32", 400, 0.2), ("U8", 300, 0.1)])
def test_device_coding_is_the_host_codecs_bytes_and_decodes_as_it_does(device, name, n, frac):
    dt, b, t = _chunk(name, n, frac, n)
    if dt.itemsize > 1:
        t[-1] = t[-1] ^ 0x7F00  # one far move (a long mantissa)
    bu, tu = _u(dt, b), _u(dt, t)
    bd, td = b.to(device), t.to(device)
    chg, m, cns = U.counts(dt, bd, td, n, None)
    assert m.tolist() == [int((b != t).sum())]
    for variant in (0, 1):
        pl = U.code_batch(dt, bd, td, n, None, chg, m, cns, variant)[0]
        hm, host = encode_variant(dt, bu, tu, None, variant)
        assert pl == host and hm == m[0], variant
        pos, val = U.decode_chunk(dt, bd, pl, int(m[0]), "chunk")
        ref = decode_ulp2(dt, bu, U.ULP2, host, int(m[0]), "chunk")
        assert np.array_equal(pos.cpu().numpy(), ref.positions) and np.array_equal(_u(dt, val), ref.values)
        img = bd.clone()
        img[pos] = val
        assert torch.equal(img.cpu(), t)


def test_a_batch_codes_each_chunk_as_the_host_does(device):
    """Three chunks of one tensor in one launch (the last short, one unchanged): each is the host
    encoder's choice for it, and a batched decode gives the target."""
    dt, b, t = _chunk("BF16", 700, 0.04, 3)
    per = 256
    t[256:512] = b[256:512]
    got = U.encode_chunks(dt, b.to(device), t.to(device), per)
    assert got[1] is None
    for c in (0, 2):
        assert got[c] == encode_ulp2(dt, _u(dt, b)[c * per:(c + 1) * per], _u(dt, t)[c * per:(c + 1) * per])
    items = [(c * per, min(per, 700 - c * per), got[c].n_changed, got[c].payload) for c in (0, 2)]
    pos, val, offs, status = U.decode_chunks(dt, b.to(device), items)
    assert status.tolist() == [0, 0]
    img = b.clone().to(device)
    img[pos[offs[0]:offs[1]]] = val[offs[0]:offs[1]]
    img[2 * per + pos[offs[1]:offs[2]]] = val[offs[1]:offs[2]]
    assert torch.equal(img.cpu(), t)


def test_ulp2_hist_is_the_host_codecs_choice_and_decodes(device):
    dt, b, t1 = _chunk("BF16", 600, 0.1, 5, steps=(-1, 1))
    hist = _history(dt, b, t1)
    t2 = t1 + (t1 - b)  # the same moves again: the history predicts where and which way
    t2[:40] = t1[:40] - (t1[:40] - b[:40])  # and some the other way (flipped signs)
    ch = U.encode_chunk(dt, t1.to(device), t2.to(device), hist)
    assert ch == encode_ulp2(dt, _u(dt, t1), _u(dt, t2), hist)
    assert ch.encoding == U.ULP2_HIST and ch.payload[:16] == hist.id
    states = torch.from_numpy(hist.states().copy()).to(device)
    pos, val = U.decode_chunk(dt, t1.to(device), ch.payload[16:], ch.n_changed, "chunk", states)
    st, hpos, hval = _host_status(dt, _u(dt, t1), ch.payload[16:], ch.n_changed, hist.states())
    assert st == 0 and np.array_equal(pos.cpu().numpy(), hpos) and np.array_equal(_u(dt, val), hval)
    img = t1.clone().to(device)
    img[pos] = val
    assert torch.equal(img.cpu(), t2)


def _hostile(pl: bytes, m: int):
    """(name, payload, n_changed) edits of a variant-0 ulp2 payload with one context."""
    W = 32
    head = 1 + 1 + 1 + 1  # variant, G, gap, p
    vt = head + 1 + (pl[head] - 1)  # K, then K-1 frequencies
    return [
        ("variant", bytes([2]) + pl[1:], m),
        ("no contexts", pl[:1] + b"\0" + pl[2:], m),
        ("context past the dtype's", pl[:2] + b"\5" + pl[3:], m),
        ("p = 0", pl[:3] + b"\0" + pl[4:], m),
        ("K = 0", pl[:head] + b"\0" + pl[head + 1:], m),
        ("non-minimal varint", pl[:1] + b"\x81\x00" + pl[2:], m),
        ("lane state below L", pl[:vt] + b"\x10\x00" + pl[vt + 2:], m),
        ("tables past the payload", pl[:vt + 3], m),
        ("stream cut", pl[:-1], m),
        ("trailing byte", pl + b"\0", m),
        ("count one short", pl, m - 1),
        ("count one over", pl, m + 1),
        ("no change", pl, 0),
    ] + [(f"flip of byte {i}", pl[:i] + bytes([pl[i] ^ (1 << (i % 8))]) + pl[i + 1:], m)
         for i in range(vt, len(pl))] + [("lane state", pl[:vt + 2 * W - 1] + b"\xff" + pl[vt + 2 * W:], m)]


def test_hostile_payloads_get_the_host_decoders_status_and_only_their_chunk(device):
    dt, b, t = _chunk("I32", 96, 0.1, 9)
    n = b.numel()
    chg, mm, cns = U.counts(dt, b.to(device), t.to(device), n, None)
    pl = U.code_batch(dt, b.to(device), t.to(device), n, None, chg, mm, cns, 0)[0]
    m = int(mm[0])
    cases = _hostile(pl, m)
    base = b.repeat(len(cases) + 1).to(device)  # one batch: every hostile chunk and the good one last
    items = [(i * n, n, mm_, p) for i, (_, p, mm_) in enumerate(cases)] + [(len(cases) * n, n, m, pl)]
    before = base.clone()
    pos, val, offs, status = U.decode_chunks(dt, base, items)
    assert torch.equal(base, before)  # staging only
    refused = 0
    for c, (what, p, mc) in enumerate(cases):
        st, hpos, hval = _host_status(dt, _u(dt, b), p, mc)
        assert status[c] == st, (what, status[c], st)
        if st == 0:  # a flip that still decodes: to the host decoder's bits
            assert np.array_equal(pos[offs[c]:offs[c + 1]].cpu().numpy(), hpos), what
            assert np.array_equal(_u(dt, val[offs[c]:offs[c + 1]]), hval), what
        refused += st != 0
    assert refused > len(cases) // 2 and status[-1] == 0
    img = b.clone().to(device)
    img[pos[offs[-2]:offs[-1]]] = val[offs[-2]:offs[-1]]
    assert torch.equal(img.cpu(), t)
    with pytest.raises(DecodeError, match=r"chunk: ulp2: unknown coder variant"):
        U.decode_chunk(dt, b.to(device), cases[0][1], m, "chunk")
    with pytest.raises(DecodeError, match=r"chunk: change counts do not add up"):  # no staging of 2^32 changes
        U.decode_chunk(dt, b.to(device), pl, (1 << 32) - 1, "chunk")


def test_header_refusals_are_the_formats():
    """The host half of the decoder (the tables) refuses what FORMAT.md lists, by its status."""
    with pytest.raises(T.TableError) as e:
        T.parse(b"", 16, 256, False)
    assert e.value.status == -1
    for bad in (b"\x00\x01\x00\x00", b"\x00\x01\x00\xff\x00", b"\x00\x01\x00\x80\x03\x80\x80"):
        with pytest.raises(T.TableError) as e:  # p = 0; K = 0; stated frequencies summing to 2^M
            T.parse(bad + bytes(64), 16, 256, False)
        assert e.value.status == -8, bad
    with pytest.raises(T.TableError) as e:  # a varint of six bytes
        T.parse(b"\x00\x80\x80\x80\x80\x80\x01", 16, 256, False)
    assert e.value.status == -8
