"""Encoding 5 (``ulp_hist``): chunks coded against the stream's history, and the history books a
trainer and a rollout keep beside their checkpoints.

Chains here are momentum-like: an element that moved in the last version moves again far more often
than others, mostly the same way (as AdamW's steps do), so that the history coding has something to
win; the codec must be exact on any chain, which the random-walk tests check.
"""

from __future__ import annotations

import itertools
import os
import shutil

import numpy as np
import pytest
from _chains import deltas_with_history, encodings, momentum_chain, write_chain
from _pairs import sha

from deltarefit import apply as apply_mod
from deltarefit import encode as encode_mod
from deltarefit.codec import chunk as C
from deltarefit.codec import history as H
from deltarefit.dtypes import DTYPES, dtype
from deltarefit.errors import DecodeError
from deltarefit.history_book import HistoryBook


def _moves(dt, a: np.ndarray, b: np.ndarray) -> H.Moves:
    return H.moves_of_images(dt, a, b)


@pytest.mark.parametrize("fmt", [1, 2])
@pytest.mark.parametrize("name,bits", [("BF16", 16), ("F16", 16)])
def test_chunks_round_trip_along_a_chain_and_never_cost_more_than_v1(name, bits, fmt):
    dt = dtype(name)
    vs = momentum_chain(40_000, 6, seed=1)
    recent: list[H.Moves] = []
    hist_used = 0
    for a, b in itertools.pairwise(vs):
        h = H.History.from_moves(a.size, recent) if recent else None
        v1 = C.encode_chunk(dt, a, b, fmt=fmt)
        got = C.encode_chunk(dt, a, b, h, fmt=fmt)
        assert got is not None and v1 is not None
        assert len(got.payload) <= len(v1.payload)
        if got.encoding == (C.ULP_HIST if fmt == 1 else C.ULP2_HIST):
            hist_used += 1
            assert got.payload[:H.HIST_ID_BYTES] == h.id
        p = C.decode_chunk(dt, a, got.encoding, got.payload, got.n_changed, got.decoded_len, "t", h)
        img = a.copy()
        p.apply_to(img)
        assert np.array_equal(img, b)
        recent = [_moves(dt, a, b), *recent][:H.DEPTH]
    # From the second step on the history wins on a momentum chain; in format 2 a chunk this small (40,000
    # elements) pays a table per history state and exponent, and the history wins from the third step on
    # about half of them (measured: 1-3% either way).
    assert hist_used >= (4 if fmt == 1 else 2)


def test_history_coding_is_smaller_on_a_momentum_chain():
    dt = dtype("BF16")
    vs = momentum_chain(200_000, 5, seed=2)
    recent: list[H.Moves] = []
    for a, b in itertools.pairwise(vs):
        h = H.History.from_moves(a.size, recent) if recent else None
        if h is not None and len(recent) == H.DEPTH:
            v1, got = C.encode_chunk(dt, a, b, fmt=1), C.encode_hist(dt, a, b, h)
            assert len(got.payload) < 0.95 * len(v1.payload), (len(got.payload), len(v1.payload))
            v2, got2 = C.encode_chunk(dt, a, b), C.encode_chunk(dt, a, b, h)
            assert got2.encoding == C.ULP2_HIST
            assert len(got2.payload) < 0.95 * len(v2.payload), (len(got2.payload), len(v2.payload))
        recent = [_moves(dt, a, b), *recent][:H.DEPTH]


def test_random_walks_of_every_width_round_trip():
    # No momentum, any dtype the ulp coding takes: exact whatever the history holds.
    rng = np.random.default_rng(3)
    for name in ("BF16", "F16", "F32", "F8_E4M3", "I16", "U8"):
        dt = dtype(name)
        n = 5000
        a = rng.integers(0, 1 << dt.bits, n, dtype=np.uint64).astype(dt.uint)
        recent = []
        for _ in range(4):
            b = a.copy()
            idx = rng.choice(n, 300, replace=False)
            b[idx] = (b[idx].astype(np.uint64) + rng.integers(1, 4, 300).astype(np.uint64)).astype(dt.uint) \
                & np.asarray((1 << dt.bits) - 1).astype(dt.uint)
            h = H.History.from_moves(n, recent) if recent else None
            got = C.encode_chunk(dt, a, b, h)
            if got is None:
                continue
            if h is not None:
                e5 = C.encode_hist(dt, a, b, h)
                p5 = C.decode_chunk(dt, a, e5.encoding, e5.payload, e5.n_changed, 0, "t", h)
                img = a.copy()
                p5.apply_to(img)
                assert np.array_equal(img, b), name
            recent = [_moves(dt, a, b), *recent][:H.DEPTH]
            a = b


def test_a_chunk_refuses_a_missing_or_different_history():
    dt = dtype("BF16")
    vs = momentum_chain(30_000, 3, seed=4)
    m1, m2 = _moves(dt, vs[0], vs[1]), _moves(dt, vs[1], vs[2])
    h = H.History.from_moves(vs[2].size, [m2, m1])
    enc = C.encode_hist(dt, vs[2], vs[3], h)
    with pytest.raises(DecodeError, match="none is held here"):
        C.decode_chunk(dt, vs[2], enc.encoding, enc.payload, enc.n_changed, 0, "x")
    other = H.History.from_moves(vs[2].size, [m2])  # one version short
    with pytest.raises(DecodeError, match="this decoder holds"):
        C.decode_chunk(dt, vs[2], enc.encoding, enc.payload, enc.n_changed, 0, "x", other)
    # one direction bit flipped
    flipped = H.Moves(m2.n, m2.pos, m2.down ^ (np.arange(m2.pos.size) == 7))
    with pytest.raises(DecodeError, match="this decoder holds"):
        C.decode_chunk(dt, vs[2], enc.encoding, enc.payload, enc.n_changed, 0, "x",
                       H.History.from_moves(vs[2].size, [flipped, m1]))
    # the id matches but the payload was cut: refused as any ulp payload is
    with pytest.raises(DecodeError):
        C.decode_chunk(dt, vs[2], enc.encoding, enc.payload[:-9], enc.n_changed, 0, "x", h)


def test_history_ids_depend_on_every_state():
    a = H.History(100, np.array([3, 50]), np.array([1, 129], np.uint8))
    assert H.History(100, np.array([3, 50]), np.array([1, 129], np.uint8)).id == a.id
    for b in (H.History(100, np.array([3, 51]), np.array([1, 129], np.uint8)),
              H.History(100, np.array([3, 50]), np.array([1, 1], np.uint8)),
              H.History(101, np.array([3, 50]), np.array([1, 129], np.uint8))):
        assert b.id != a.id
    with pytest.raises(ValueError):
        H.History(10, np.array([3, 3]), np.array([1, 1], np.uint8))
    with pytest.raises(ValueError):
        H.History(10, np.array([3]), np.array([7], np.uint8))


# ------------------------------------------------------------------------------ checkpoints and books


def _chain_files(d, steps: int = 5, seed: int = 5) -> list[str]:
    return write_chain(d, steps, n=3 * (1 << 19) + 1000, seed=seed)  # three full segments and a short one


def _random_moves(rng, n: int) -> H.Moves:
    m = int(rng.integers(0, min(n, 400)))
    pos = np.sort(rng.choice(n, m, replace=False)).astype(np.int64)
    return H.Moves(n, pos, rng.random(m) < 0.5)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_directions_are_those_of_the_keys(name):
    """A move's direction, taken in the bits' own width, is FORMAT.md's: the key decreased (NaN
    payloads, both zeros and the sign boundary included, for every dtype)."""
    dt = dtype(name)
    rng = np.random.default_rng(5)
    w = 8 * np.dtype(dt.uint).itemsize
    b = rng.integers(0, 2**63, 5000, dtype=np.uint64).astype(dt.uint)
    t = rng.integers(0, 2**63, 5000, dtype=np.uint64).astype(dt.uint)
    edge = np.array([0, 1, 2 ** (w - 1) - 1, 2 ** (w - 1), 2 ** (w - 1) + 1, 2**w - 1], np.uint64).astype(dt.uint)
    b = np.concatenate([b, np.repeat(edge, edge.size)])
    t = np.concatenate([t, np.tile(edge, edge.size)])
    want = H._key(dt, t) < H._key(dt, b)
    assert np.array_equal(H.directions(dt, b, t), want)
    assert np.array_equal(H.directions(dt, b.view(f"i{b.itemsize}"), t.view(f"i{t.itemsize}")), want)


def _dense_history(n: int, moves: list[H.Moves]) -> tuple[np.ndarray, np.ndarray]:
    """FORMAT.md's history bytes, element by element (the reference): (positions, bytes) of the
    elements whose state is not 0."""
    s = np.zeros((H.DEPTH, n), np.int64)
    for d, mv in enumerate(moves[:H.DEPTH]):
        s[d, mv.pos] = np.where(mv.down, -1, 1)
    b = H.STATE_TABLE[(s[0] + 1) * 9 + (s[1] + 1) * 3 + (s[2] + 1)]
    pos = np.flatnonzero(b & 127)
    return pos, b[pos]


def test_histories_from_stored_records_are_formats_element_by_element():
    """A book's lookups merge the stored records in one kernel; it gives FORMAT.md's history bytes,
    element by element, and its id, for any three change sets, fewer, or sets with no move
    (``from_moves`` takes the same path from ``Moves``)."""
    rng = np.random.default_rng(11)
    for trial in range(300):
        n = int(rng.integers(1, 5000))
        moves = [_random_moves(rng, n) for _ in range(int(rng.integers(1, 4)))]
        if trial % 7 == 0:
            moves[0] = H.Moves(n, np.empty(0, np.int64), np.empty(0, np.bool_))
        pos, b = _dense_history(n, moves)
        records = [mv.to_bytes() if mv.pos.size or trial % 2 else None for mv in moves]
        for got in (H.History.from_records(n, records, ["here"] * len(records)), H.History.from_moves(n, moves)):
            assert np.array_equal(got.pos, pos) and np.array_equal(got.state, b), trial
            assert got.pos.dtype == np.int64 and got.state.dtype == np.uint8
            assert got.id == H.History(n, pos, b).id  # the id of the checked constructor


@pytest.mark.parametrize("bad", ["other n", "short", "long", "count", "unsorted", "repeated", "beyond"])
def test_a_malformed_stored_record_is_refused_naming_its_entry(bad):
    n = 1000
    good = H.Moves(n, np.array([3, 10, 500], np.int64), np.array([True, False, True])).to_bytes()
    pos = lambda *p: np.array(p, "<u4").tobytes()  # noqa: E731
    head = lambda nn, m: nn.to_bytes(8, "little") + m.to_bytes(8, "little")  # noqa: E731
    rec = {"other n": head(999, 3) + good[16:], "short": good[:-1], "long": good + b"\0",
           "count": head(n, 4) + good[16:], "unsorted": head(n, 3) + pos(10, 3, 500) + good[-1:],
           "repeated": head(n, 3) + pos(3, 3, 500) + good[-1:], "beyond": head(n, 3) + pos(3, 10, 1000) + good[-1:]}[bad]
    with pytest.raises(DecodeError, match="entry 'w' chunk 2"):
        H.History.from_records(n, [good, rec], ["book: entry 'w' chunk 1", "book: entry 'w' chunk 2"])
    if bad != "other n":  # (a record of another chunk size: refused by the book's entry check)
        with pytest.raises(DecodeError):
            H.Moves.from_bytes(rec)  # what the book's other readers refuse too


def test_a_chain_through_books_stays_bit_exact_and_takes_the_history_coding(tmp_path):
    paths = _chain_files(tmp_path)
    trainer, rollout = HistoryBook(tmp_path / "tbook"), HistoryBook(tmp_path / "rbook")
    ckpt = str(tmp_path / "rollout.safetensors")
    shutil.copy(paths[0], ckpt)
    sizes = []
    for i in range(1, len(paths)):
        out = str(tmp_path / f"d{i}.delta")
        rep = encode_mod.encode(paths[i - 1], paths[i], out, history=trainer)
        trainer.commit(rep.target_fingerprint, rep.moves, parent=rep.base_fingerprint)
        plain = encode_mod.encode(paths[i - 1], paths[i], str(tmp_path / f"p{i}.delta"))
        sizes.append((rep.delta_bytes, plain.delta_bytes))
        got = apply_mod.apply(out, ckpt, history=rollout)
        assert sha(ckpt) == sha(paths[i])
        assert got.target_fingerprint == rep.target_fingerprint == rollout.tip == trainer.tip
        encs = encodings(out)
        if i >= 2:
            assert sum(encs.get(e, 0) for e in C.HIST_ENCODINGS) > 0, encs
        assert rep.delta_bytes <= plain.delta_bytes
    assert len(rollout.versions()) == H.DEPTH
    assert len([f for f in os.listdir(tmp_path / "rbook") if f.endswith(".moves")]) == H.DEPTH
    assert sizes[-1][0] < 0.95 * sizes[-1][1]


def test_a_rollout_without_the_history_refuses_and_writes_nothing(tmp_path):
    paths = _chain_files(tmp_path, steps=3)
    deltas = [out for out, _, _ in deltas_with_history(paths, str(tmp_path))]
    ckpt = str(tmp_path / "late.safetensors")
    shutil.copy(paths[2], ckpt)  # a late joiner at version 2, with no book
    before = sha(ckpt)
    with pytest.raises(DecodeError, match="none is held here"):
        apply_mod.apply(deltas[2], ckpt)
    assert sha(ckpt) == before
    # a book that followed only the last version (through a delta without history) holds another
    # history: refused too
    book = HistoryBook(tmp_path / "short")
    plain = encode_mod.encode(paths[1], paths[2], str(tmp_path / "plain.delta"))
    assert not set(C.HIST_ENCODINGS) & set(encodings(plain.path))
    apply_mod.apply(plain.path, str(shutil.copy(paths[1], tmp_path / "x.safetensors")), history=book)
    assert book.tip == plain.target_fingerprint
    with pytest.raises(DecodeError, match="this decoder holds"):
        apply_mod.apply(deltas[2], ckpt, history=book)
    assert sha(ckpt) == before


def test_a_rerun_of_a_finished_apply_starts_the_book_over(tmp_path):
    paths = _chain_files(tmp_path, steps=3)
    rollout = HistoryBook(tmp_path / "rbook")
    ckpt = str(shutil.copy(paths[0], tmp_path / "r.safetensors"))
    deltas = [out for out, _, _ in deltas_with_history(paths, str(tmp_path))]
    apply_mod.apply(deltas[0], ckpt, history=rollout)
    kept = shutil.copytree(tmp_path / "rbook", tmp_path / "kept")
    apply_mod.apply(deltas[1], ckpt, history=rollout)
    assert len(rollout.versions()) == 2
    # a rerun after the book's commit leaves it as it is (it holds this version's moves)
    apply_mod.apply(deltas[1], ckpt, history=rollout)
    assert len(rollout.versions()) == 2
    # as after a kill between the apply and the book's commit (the book still at the base): the
    # chunks are found applied, their moves are gone
    shutil.rmtree(tmp_path / "rbook")
    shutil.copytree(kept, tmp_path / "rbook")
    rollout = HistoryBook(tmp_path / "rbook")
    apply_mod.apply(deltas[1], ckpt, history=rollout)
    assert rollout.versions() == [rollout.tip]
    before = sha(ckpt)
    with pytest.raises(DecodeError):
        apply_mod.apply(deltas[2], ckpt, history=rollout)
    assert sha(ckpt) == before


def test_a_malformed_book_is_refused_by_name(tmp_path):
    paths = _chain_files(tmp_path, steps=1)
    book = HistoryBook(tmp_path / "b")
    rep = encode_mod.encode(paths[0], paths[1], str(tmp_path / "d.delta"), history=book)
    book.commit(rep.target_fingerprint, rep.moves, parent=rep.base_fingerprint)
    f = next(p for p in (tmp_path / "b").iterdir() if p.suffix == ".moves")
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(DecodeError, match=str(f.name)):  # the index is whole, an entry is cut: its digest
        HistoryBook(tmp_path / "b")
    f.write_bytes(b"garbage")
    with pytest.raises(DecodeError, match="not a moves file"):
        HistoryBook(tmp_path / "b")


def test_the_cli_keeps_books_on_both_sides(tmp_path):
    import subprocess
    import sys

    paths = _chain_files(tmp_path, steps=3)
    ckpt = str(shutil.copy(paths[0], tmp_path / "r.safetensors"))
    cli = [sys.executable, "-m", "deltarefit"]
    for i in range(1, len(paths)):
        out = str(tmp_path / f"d{i}.delta")
        subprocess.run([*cli, "encode", paths[i - 1], paths[i], "-o", out, "-q", "--history", str(tmp_path / "tb")],
                       check=True, capture_output=True)
        r = subprocess.run([*cli, "apply", out, ckpt, "-q", "--history", str(tmp_path / "rb")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert sha(ckpt) == sha(paths[i])
    assert set(C.HIST_ENCODINGS) & set(encodings(out))
    assert HistoryBook(tmp_path / "tb").versions() == HistoryBook(tmp_path / "rb").versions()
    # the same delta applied to a copy without the book: exit 3 (a malformed delta for this rollout), one line
    other = str(shutil.copy(paths[2], tmp_path / "o.safetensors"))
    r = subprocess.run([*cli, "apply", out, other, "-q"], capture_output=True, text=True)
    assert r.returncode == 3 and "none is held here" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sha(other) == sha(paths[2])


def test_the_chain_benchmark_measures_both_codings_on_a_real_chain_dir(tmp_path):
    from deltarefit.apps.bench import chain as bench_chain

    _chain_files(tmp_path, steps=4)
    res = bench_chain.run_chain(str(tmp_path), threads=1, log=lambda *_: None)
    assert [s.step for s in res.steps] == [1, 2, 3, 4]
    assert res.steps[0].hist_bytes == res.steps[0].v1_bytes  # no history yet: the same delta
    assert all(s.hist_bytes <= s.v1_bytes for s in res.steps)
    assert res.steps[-1].hist_chunks > 0 and res.steps[-1].smaller > 0.03
    assert all(0 < s.bound_hist_bytes <= s.bound_v1_bytes for s in res.steps[1:])
    md = bench_chain.markdown([res], "cmd", "here")
    assert "| 3+ (sum) |" in md


def test_a_moves_index_of_empty_lists_is_refused_before_it_is_built(tmp_path):
    """A moves file's index is checked for shape before ``json.loads`` builds it: 60 MiB of ``[],``
    (under the 64 MiB index limit, with a valid digest, as anyone who can write the book can make)
    is refused naming the file, with the peak memory of its read bounded (measured in a child): what
    Python allocates (tracemalloc) always, and the process's peak resident set too where the child
    runs without AddressSanitizer (``make test-sanitize`` preloads it; its shadow memory, redzones and
    quarantine multiply the resident set, not what the read allocates)."""
    import subprocess
    import sys

    import blake3

    from deltarefit.history_book import MAGIC

    p = str(tmp_path / "bomb.moves")
    idx = b'{"fingerprint":"ab","reset":[],"entries":[' + b"[]," * (20 << 20) + b'[]]}'
    with open(p, "wb") as f:
        body = MAGIC + len(idx).to_bytes(8, "little") + idx
        f.write(body + blake3.blake3(body).digest())
    del idx, body
    script = r"""
import sys, tracemalloc
tracemalloc.start()
from deltarefit.history_book import _MovesFile
from deltarefit.errors import DecodeError
try:
    _MovesFile(sys.argv[1])
    print("accepted")
except DecodeError as e:
    print("refused", e)
print(tracemalloc.get_traced_memory()[1] >> 20)
# VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork and exec
print(next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:")) // 1024)
print(any("libasan" in ln for ln in open("/proc/self/maps")))
"""
    r = subprocess.run([sys.executable, "-c", script, p], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    verdict, traced, peak, asan = r.stdout.strip().splitlines()
    assert verdict.startswith(f"refused {p}: malformed index") and "JSON arrays" in verdict, verdict
    # The 60 MiB file read whole is most of it; building the index cost 1.7 GiB
    assert int(traced) < 128, f"Python allocated {traced} MiB at its peak reading a 60 MiB index"
    if asan == "False":
        assert int(peak) < 256, f"peak {peak} MiB reading a 60 MiB index"
