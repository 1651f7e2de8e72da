"""Format 2 on the device (``deltarefit.gpu.ulp2``: Triton rANS lanes for encodings 6 ``ulp2`` and 7
``ulp2_hist``). Without CUDA the kernels run through Triton's interpreter on CPU tensors (small chunks:
a few hundred to a few thousand elements); with CUDA (``-m gpu``) the same tests run compiled.

Checked: the device decoder gives the target bits of what the device encoder coded, for both
variants and both encodings; hostile payloads (every header refusal, and lane refusals: truncated,
trailing, corrupt streams, a wrong change count) are refused with a status per chunk, and only that
chunk in a batch; the bytes equal the host codec's (``codec.ulp2``) where it is present.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is in the test extra: pip install -e '.[test]' (make test installs it)")
pytest.importorskip("triton", reason="triton (x86_64) is in the test extra: pip install -e '.[test]' (make test installs it)")

from deltarefit.codec.history import History, moves_of_changes  # noqa: E402
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


def _decode(dt, b, ch, states=None):
    pl = ch.payload[16:] if ch.encoding == U.ULP2_HIST else ch.payload
    pos, val = U.decode_chunk(dt, b, pl, ch.n_changed, "chunk", states)
    img = b.clone()
    img[pos] = val
    return img.cpu()


@pytest.mark.parametrize("name,n,frac", [("BF16", 600, 0.05), ("F32", 400, 0.2), ("U8", 300, 0.1)])
def test_device_decode_inverts_the_device_encode(device, name, n, frac):
    dt, b, t = _chunk(name, n, frac, n)
    t[-1] = t[-1] ^ 0x7F00 if dt.itemsize > 1 else t[-1]  # one far move (a long mantissa)
    chg, m, cns = U.counts(dt, b.to(device), t.to(device), n, None)
    assert m.tolist() == [int((b != t).sum())]
    for variant in (0, 1):  # both variants code and decode the chunk
        pl = U.code_batch(dt, b.to(device), t.to(device), n, None, chg, m, cns, variant)[0]
        assert pl[0] == variant
        pos, val = U.decode_chunk(dt, b.to(device), pl, int(m[0]), "chunk")
        img = b.to(device).clone()
        img[pos] = val
        assert torch.equal(img.cpu(), t)


def test_a_batch_codes_each_chunk_as_alone(device):
    """Three chunks of one tensor in one launch (the last short, one unchanged): each payload is the
    one its chunk gets coded alone, and a batched decode gives the target."""
    dt, b, t = _chunk("BF16", 700, 0.04, 3)
    per = 256
    t[256:512] = b[256:512]
    got = U.encode_chunks(dt, b.to(device), t.to(device), per)
    assert got[1] is None
    for c in (0, 2):
        alone = U.encode_chunk(dt, b[c * per:(c + 1) * per].to(device), t[c * per:(c + 1) * per].to(device))
        assert got[c] == alone
    items = [(c * per, min(per, 700 - c * per), got[c].n_changed, got[c].payload) for c in (0, 2)]
    pos, val, offs, status = U.decode_chunks(dt, b.to(device), items)
    assert status.tolist() == [0, 0]
    img = b.clone().to(device)
    img[pos[offs[0]:offs[1]]] = val[offs[0]:offs[1]]
    img[2 * per + pos[offs[1]:offs[2]]] = val[offs[1]:offs[2]]
    assert torch.equal(img.cpu(), t)


def test_ulp2_hist_codes_repeated_moves_smaller_and_decodes(device):
    dt, b, t1 = _chunk("BF16", 600, 0.1, 5, steps=(-1, 1))
    hist = _history(dt, b, t1)
    t2 = t1 + (t1 - b)  # the same moves again: the history predicts where and which way
    ch = U.encode_chunk(dt, t1.to(device), t2.to(device), hist)
    plain = U.encode_chunk(dt, t1.to(device), t2.to(device))
    assert ch.encoding == U.ULP2_HIST and ch.payload[:16] == hist.id and len(ch.payload) < len(plain.payload)
    states = torch.from_numpy(hist.states().copy()).to(device)
    assert torch.equal(_decode(dt, t1.to(device), ch, states), t2)


def _hostile(pl: bytes, m: int):
    """(name, payload, n_changed) edits of a variant-0 ulp2 payload with one context."""
    W = 32
    head = 1 + 1 + 1 + 1  # variant, G, gap, p
    vt = head + 1 + (pl[head] - 1)  # K, then K-1 frequencies
    st = vt + 2 * W
    return [
        ("variant", bytes([2]) + pl[1:], m, -7),
        ("no contexts", pl[:1] + b"\0" + pl[2:], m, -8),
        ("context past the dtype's", pl[:2] + b"\5" + pl[3:], m, -8),
        ("p = 0", pl[:3] + b"\0" + pl[4:], m, -8),
        ("K = 0", pl[:head] + b"\0" + pl[head + 1:], m, -8),
        ("non-minimal varint", pl[:1] + b"\x81\x00" + pl[2:], m, -8),
        ("lane state below L", pl[:vt] + b"\x10\x00" + pl[vt + 2:], m, -9),
        ("tables past the payload", pl[:vt + 3], m, -1),
        ("stream cut", pl[:-1], m, None),
        ("trailing byte", pl + b"\0", m, -6),
        ("count one short", pl, m - 1, -4),
        ("count one over", pl, m + 1, -4),
        ("stream corrupt", pl[:st] + bytes([pl[st] ^ 0x55]) + pl[st + 1:], m, None),
    ]


def test_hostile_payloads_are_refused_by_status_and_only_their_chunk(device):
    dt, b, t = _chunk("I32", 400, 0.1, 9)
    n = b.numel()
    chg, mm, cns = U.counts(dt, b.to(device), t.to(device), n, None)
    pl = U.code_batch(dt, b.to(device), t.to(device), n, None, chg, mm, cns, 0)[0]
    m = int(mm[0])
    cases = _hostile(pl, m)
    base = b.repeat(len(cases) + 1).to(device)  # one batch: every hostile chunk and the good one last
    items = [(i * n, n, mm, p) for i, (_, p, mm, _) in enumerate(cases)] + [(len(cases) * n, n, m, pl)]
    before = base.clone()
    pos, val, offs, status = U.decode_chunks(dt, base, items)
    assert torch.equal(base, before)  # staging only
    for (what, _, _, want), got in zip(cases, status[:-1], strict=True):
        assert got != 0, what
        assert want is None or got == want, (what, got, want)
    assert status[-1] == 0
    img = b.clone().to(device)
    img[pos[offs[-2]:offs[-1]]] = val[offs[-2]:offs[-1]]
    assert torch.equal(img.cpu(), t)
    with pytest.raises(DecodeError, match=r"chunk: ulp2: unknown coder variant"):
        U.decode_chunk(dt, b.to(device), cases[0][1], m, "chunk")


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
