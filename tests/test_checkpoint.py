"""Checkpoint I/O: raw bytes round trip bit for bit, layouts fingerprint alike, hostile files are refused."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from safetensors import safe_open

from deltarefit.checkpoint import (
    TensorSource,
    fingerprint_checkpoint,
    is_checkpoint,
    open_checkpoint,
    write_safetensors,
)
from deltarefit.checkpoint import read as ckmod
from deltarefit.dtypes import DTYPES
from deltarefit.errors import CheckpointError
from deltarefit.integrity import tensor_digest

TORCH = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def rand_bytes(rng: np.random.Generator, dt: str, n_elems: int) -> bytes:
    if dt == "BOOL":
        return rng.integers(0, 2, n_elems, dtype=np.uint8).tobytes()
    return rng.integers(0, 256, n_elems * DTYPES[dt].itemsize, dtype=np.uint8).tobytes()


def as_torch(dt: str, data: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch tensor holding exactly these bytes, built through an integer view (no value conversion)."""
    ints = np.frombuffer(data, dtype=f"<i{DTYPES[dt].itemsize}").copy()
    return torch.from_numpy(ints).view(TORCH[dt]).reshape(shape)


def as_numpy(dt: str, data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    kind = {"float": "f", "int": "i", "uint": "u"}
    npdt = np.bool_ if dt == "BOOL" else np.dtype(f"<{kind[DTYPES[dt].kind]}{DTYPES[dt].itemsize}")
    return np.frombuffer(data, dtype=npdt).reshape(shape).copy()


def src(name: str, dt: str, shape: tuple[int, ...], data: bytes, piece: int = 7) -> TensorSource:
    def chunks():
        for i in range(0, len(data), piece):
            yield data[i : i + piece]

    return TensorSource(name, dt, shape, len(data), chunks)


def raw_bytes(path) -> dict[str, bytes]:
    with open_checkpoint(path) as ck:
        return {n: ck.raw(n).tobytes() for n in ck.tensors}


# ----------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dt", list(DTYPES))
def test_every_dtype_round_trips_through_safetensors_and_our_writer(tmp_path, dt):
    rng = np.random.default_rng(len(dt))
    data = {"a": rand_bytes(rng, dt, 15), "b.scalar": rand_bytes(rng, dt, 1), "c": b""}
    shapes = {"a": (3, 5), "b.scalar": (), "c": (4, 0)}
    theirs = tmp_path / "theirs.safetensors"
    if dt.startswith("U") and dt != "U8":
        safetensors.numpy.save_file({k: as_numpy(dt, v, shapes[k]) for k, v in data.items()}, str(theirs))
    else:
        safetensors.torch.save_file({k: as_torch(dt, v, shapes[k]) for k, v in data.items()}, str(theirs))
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, [src(k, dt, shapes[k], v) for k, v in data.items()], metadata={"k": "v"})

    for path in (theirs, ours):
        with open_checkpoint(path) as ck:
            assert set(ck.tensors) == set(data)
            for name, info in ck.tensors.items():
                assert (info.dtype, info.shape, info.nbytes) == (dt, shapes[name], len(data[name]))
                view = ck.raw(name)
                assert view.dtype == np.uint8 and view.ndim == 1 and not view.flags.writeable
                assert view.tobytes() == data[name]
                assert info.offset % DTYPES[dt].itemsize == 0 and info.file == str(path)

    with safe_open(str(ours), framework="numpy" if dt.startswith("U") and dt != "U8" else "pt") as f:
        assert f.metadata() == {"k": "v"}
        for name, want in data.items():
            t = f.get_tensor(name)
            got = t.tobytes() if isinstance(t, np.ndarray) else t.view(-1).view(torch.uint8).numpy().tobytes()
            assert got == want


def test_special_values_survive_bit_for_bit(tmp_path):
    every_f8 = np.arange(256, dtype=np.uint8).tobytes()  # NaNs, -0, inf (E5M2), subnormals: all of them
    every_bf16 = np.arange(1 << 16, dtype=np.uint16).astype("<u2").tobytes()
    f32 = np.array(
        [0x7FC00001, 0xFFA00000, 0x7F800001, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001, 0x807FFFFF],
        dtype="<u4",
    ).tobytes()  # quiet/signalling NaNs with payloads, -0, +-inf, subnormals
    tensors = {
        "e4m3": as_torch("F8_E4M3", every_f8, (256,)),
        "e5m2": as_torch("F8_E5M2", every_f8, (16, 16)),
        "bf16": as_torch("BF16", every_bf16, (256, 256)),
        "f16": as_torch("F16", every_bf16, (1 << 16,)),
        "f32": as_torch("F32", f32, (8,)),
    }
    path = tmp_path / "special.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    want = {"e4m3": every_f8, "e5m2": every_f8, "bf16": every_bf16, "f16": every_bf16, "f32": f32}
    assert raw_bytes(path) == want

    copy = tmp_path / "copy.safetensors"
    with open_checkpoint(path) as ck:
        write_safetensors(
            copy,
            [
                TensorSource(n, i.dtype, i.shape, i.nbytes, lambda n=n: [ck.raw(n)])
                for n, i in ck.tensors.items()
            ],
        )
    assert raw_bytes(copy) == want
    back = safetensors.torch.load_file(str(copy))
    assert back["bf16"].view(torch.int16).numpy().tobytes() == every_bf16


def test_zero_d_and_empty_tensors_and_header_only_file(tmp_path):
    path = tmp_path / "empty.safetensors"
    write_safetensors(path, [src("e", "F32", (0,), b""), src("z", "BF16", (2, 0, 3), b"")])
    assert os.path.getsize(path) % 8 == 0  # header only: no data section
    with open_checkpoint(path, writable=True) as ck:
        assert ck.raw("e").size == 0 and ck.raw("z").shape == (0,) and ck.raw("e").flags.writeable
        _fp, digests = fingerprint_checkpoint(ck)
        assert digests["z"] == tensor_digest("BF16", (2, 0, 3), np.zeros(0, np.uint8))
        ck.flush()
    assert {k: tuple(v.shape) for k, v in safetensors.torch.load_file(str(path)).items()} == {
        "e": (0,),
        "z": (2, 0, 3),
    }

    none = tmp_path / "none.safetensors"
    write_safetensors(none, [])
    with open_checkpoint(none) as ck:
        assert ck.tensors == {} and len(fingerprint_checkpoint(ck)[0]) == 64


def test_chunk_kinds_are_all_accepted(tmp_path):
    arr = np.arange(12, dtype="<i4").reshape(3, 4)
    b = arr.tobytes()
    def chunks():
        return [arr[:1], memoryview(arr[1:2]), bytearray(b[32:40]), b[40:]]
    path = tmp_path / "kinds.safetensors"
    write_safetensors(path, [TensorSource("x", "I32", (3, 4), 48, chunks)])
    assert raw_bytes(path) == {"x": b}


# ------------------------------------------------------------------------------ layouts and fingerprints


def _model(rng) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {
        "embed": ("BF16", (700, 1024), rand_bytes(rng, "BF16", 700 * 1024)),  # > 1 MiB: several segments
        "layer.0.w": ("F32", (64, 33), rand_bytes(rng, "F32", 64 * 33)),
        "layer.0.q": ("F8_E4M3", (99,), rand_bytes(rng, "F8_E4M3", 99)),
        "layer.1.b": ("F16", (), rand_bytes(rng, "F16", 1)),
        "step": ("I64", (0,), b""),
    }


def _sources(model, names):
    return [src(n, *model[n], piece=1 << 16) for n in names]


def _sharded(tmp_path, model, first: list[str]):
    d = tmp_path / "sharded"
    d.mkdir()
    rest = [n for n in model if n not in first]
    write_safetensors(d / "model-00001-of-00002.safetensors", _sources(model, first))
    write_safetensors(d / "model-00002-of-00002.safetensors", _sources(model, rest))
    wm = {n: f"model-0000{1 if n in first else 2}-of-00002.safetensors" for n in model}
    (d / ckmod.INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": wm}))
    (d / "config.json").write_text("{}")
    return d


def test_one_file_and_two_shards_fingerprint_alike(tmp_path, monkeypatch):
    monkeypatch.setattr(ckmod, "HASH_TASK_SEGMENTS", 1)  # a multi-segment tensor spans several tasks
    model = _model(np.random.default_rng(1))
    single = tmp_path / "model.safetensors"
    write_safetensors(single, _sources(model, model))
    d = _sharded(tmp_path, model, ["layer.0.w", "embed"])

    with open_checkpoint(single) as a, open_checkpoint(d) as b:
        fa, da = fingerprint_checkpoint(a, threads=1)
        fb, db = fingerprint_checkpoint(b, threads=3)
        assert fa == fb and da == db
        for n, (dt, shape, data) in model.items():
            assert da[n] == tensor_digest(dt, shape, np.frombuffer(data, np.uint8))
        assert len(b.files()) == 2 and all(os.path.isabs(f) for f in b.files())
        assert list(b.tensors)[:2] == ["layer.0.w", "embed"]  # shard order, then data order (F32 before BF16)

    dt, shape, data = model["embed"]
    model["embed"] = (dt, shape, data[:-1] + bytes([data[-1] ^ 1]))
    write_safetensors(single, _sources(model, model))
    with open_checkpoint(single) as a:
        fc, dc = fingerprint_checkpoint(a)
    assert fc != fa and dc["embed"] != da["embed"] and dc["step"] == da["step"]


def test_directory_without_index_uses_every_shard(tmp_path):
    model = _model(np.random.default_rng(2))
    d = _sharded(tmp_path, model, ["step"])
    (d / ckmod.INDEX_NAME).unlink()
    assert is_checkpoint(d)
    assert raw_bytes(d) == {n: v[2] for n, v in model.items()}


def test_index_ignores_shard_tensors_it_does_not_map(tmp_path):
    model = _model(np.random.default_rng(3))
    d = _sharded(tmp_path, model, ["step"])
    idx = json.loads((d / ckmod.INDEX_NAME).read_text())
    del idx["weight_map"]["embed"]
    (d / ckmod.INDEX_NAME).write_text(json.dumps(idx))
    assert set(raw_bytes(d)) == set(model) - {"embed"}


def test_writable_checkpoint_modified_through_raw_persists(tmp_path):
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(4, 4, dtype=torch.bfloat16), "b": torch.ones(3)}, str(path))
    with open_checkpoint(path) as ck, pytest.raises(ValueError):
        ck.raw("w")[0] = 1
    ck = open_checkpoint(path, writable=True)
    view = ck.raw("w")
    assert view.flags.writeable
    view[:4] = [0x80, 0x3F, 0x00, 0xC0]  # bf16 1.0, -2.0
    ck.flush()
    ck.close()
    ck.close()  # idempotent, even with a view still alive
    del view
    with open_checkpoint(path) as ck:
        assert ck.raw("w")[:4].tolist() == [0x80, 0x3F, 0x00, 0xC0]
    w = safetensors.torch.load_file(str(path))["w"]
    assert w[0, :2].tolist() == [1.0, -2.0] and float(w.abs().sum()) == 3.0


def test_write_raw_goes_through_the_file_and_the_map_sees_it(tmp_path):
    """``write_raw`` (the apply's write of a checked post-image) lands in the file, is seen at once
    through ``raw`` views of the same open checkpoint, and refuses a read-only checkpoint or a range
    outside the tensor with nothing written."""
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file({"a": torch.zeros(8, dtype=torch.uint8), "w": torch.zeros(4, 4, dtype=torch.bfloat16),
                                 "z": torch.zeros(3, dtype=torch.uint8)}, str(path))
    before = path.read_bytes()
    with open_checkpoint(path) as ck, pytest.raises(CheckpointError, match="cannot write"):
        ck.write_raw("w", 0, np.ones(2, np.uint16))
    with open_checkpoint(path, writable=True) as ck:
        view = ck.raw("w")
        for off, n in ((-2, 2), (30, 2), (0, 17)):
            with pytest.raises(CheckpointError, match="cannot write"):
                ck.write_raw("w", off, np.ones(n, np.uint16))
        assert path.read_bytes() == before
        ck.write_raw("w", 6, np.array([0x3F80, 0xC000], np.uint16))  # bf16 1.0, -2.0 at elements 3 and 4
        assert view.view(np.uint16)[3:5].tolist() == [0x3F80, 0xC000]
        del view
    w = safetensors.torch.load_file(str(path))
    assert w["w"].reshape(-1)[3:5].tolist() == [1.0, -2.0] and float(w["w"].abs().sum()) == 3.0
    assert not w["a"].any() and not w["z"].any()  # the neighbours untouched


def test_start_writeback_is_a_hint_that_never_fails_or_changes_bytes(tmp_path):
    """``io.fsutil.start_writeback`` (what ``write_raw`` calls after each write, so that the apply's final
    fsync waits only for what is in flight) is found on Linux, leaves the file's bytes as written, and
    neither raises on a bad descriptor nor on a range past the end."""
    import sys

    from deltarefit.io import fsutil

    if sys.platform.startswith("linux"):
        assert fsutil._sync_file_range() is not None
    path = tmp_path / "f.bin"
    data = os.urandom(3 << 20)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, data, 0)
        fsutil.start_writeback(fd, 0, len(data))
        fsutil.start_writeback(fd, len(data), 1 << 20)  # past the end
    finally:
        os.close(fd)
    fsutil.start_writeback(fd, 0, 1)  # closed: nothing raised
    fsutil.start_writeback(-1, 0, 1)
    assert path.read_bytes() == data


def test_closed_checkpoint_refuses_use(tmp_path):
    path = tmp_path / "m.safetensors"
    write_safetensors(path, [src("x", "U8", (3,), b"abc")])
    ck = open_checkpoint(path)
    ck.close()
    with pytest.raises(CheckpointError, match="closed"):
        ck.raw("x")
    with open_checkpoint(path) as ck, pytest.raises(CheckpointError, match="no tensor 'y'"):
        ck.raw("y")


def test_is_checkpoint(tmp_path):
    path = tmp_path / "m.safetensors"
    write_safetensors(path, [src("x", "U8", (3,), b"abc")])
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    assert is_checkpoint(path) and is_checkpoint(tmp_path)
    assert not is_checkpoint(tmp_path / "config.json")
    assert not is_checkpoint(tmp_path / "empty") and not is_checkpoint(tmp_path / "missing")


# -------------------------------------------------------------------------------------- hostile corpus


def st_bytes(header, data: bytes = b"", *, hlen: int | None = None) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if hlen is None else hlen) + h + data


def entry(dtype="BF16", shape=(3, 2), offsets=(0, 12)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


HOSTILE = {
    "short": (b"\x10\x00\x00", "truncated: 3 bytes"),
    "header_past_end": (st_bytes({"w": entry()}, bytes(12), hlen=1000), "header length 1000 runs past the end"),
    "header_too_big": (st_bytes(b"{}", hlen=200 << 20), "exceeds the 100 MiB limit"),
    "not_json": (st_bytes(b"{'w': nope}"), "header is not valid JSON"),
    "not_utf8": (st_bytes(b'{"\xff": 1}'), "header is not valid JSON"),
    "not_object": (st_bytes([1, 2]), "header is not a JSON object"),
    "duplicate_key": (st_bytes(b'{"w": {}, "w": {}}'), "duplicate key 'w'"),
    "bad_metadata": (st_bytes({"__metadata__": {"a": 1}}), "__metadata__ is not an object of strings"),
    "unknown_dtype": (st_bytes({"w": entry(dtype="F4")}, bytes(12)), "tensor 'w': unknown dtype 'F4'"),
    "negative_dim": (st_bytes({"w": entry(shape=(-3, 2))}, bytes(12)), "tensor 'w': shape [-3, 2]"),
    "float_dim": (st_bytes({"w": entry(shape=(3.0, 2))}, bytes(12)), "tensor 'w': shape [3.0, 2]"),
    "bad_offsets": (st_bytes({"w": entry(offsets=(0,))}, bytes(12)), "tensor 'w': data_offsets [0] is not a pair"),
    "reversed": (st_bytes({"w": entry(offsets=(12, 0))}, bytes(12)), "tensor 'w': data_offsets [12, 0] begin after"),
    "wrong_nbytes": (
        st_bytes({"w": entry(offsets=(0, 10))}, bytes(12)),
        "tensor 'w': data_offsets [0, 10] hold 10 bytes but BF16[3,2] needs 12",
    ),
    "beyond_file": (st_bytes({"w": entry(offsets=(4, 16))}, bytes(12)), "tensor 'w': data_offsets [4, 16] run past"),
    "truncated_data": (st_bytes({"w": entry()}, bytes(11)), "run past the end of the data section (11 bytes)"),
    "overlap": (
        st_bytes({"a": entry(), "b": entry(shape=(2,), offsets=(8, 12)), "e": entry(shape=(0,), offsets=(4, 4))},
                 bytes(12)),
        "tensors 'a' [0, 12] and 'b' [8, 12] overlap",
    ),
    # Shapes a header never has, refused before json.loads builds them: dense containers, deep nesting.
    "nested_lists": (st_bytes({"w": entry(shape=[[]] * 20000)}, bytes(12)), "header holds 20004 JSON arrays/objects"),
    "deep": (st_bytes({"w": entry(shape=[[[[3]]], 2])}, bytes(12)), "header nests JSON 6 levels deep, limit 3"),
    "strings_in_shape": (st_bytes({"w": entry(shape=["3", 2])}, bytes(12)), "header has a JSON array holding strings"),
    "object_in_array": (st_bytes({"w": [{"dtype": "U8"}]}, bytes(12)), "header has a JSON array holding strings or"),
    "too_many_dims": (st_bytes({"w": entry(shape=[1] * 65, offsets=(0, 1))}, bytes(12)),
                      "tensor 'w': shape has 65 dimensions, limit 64"),
    "long_shape_cut_short": (st_bytes({"w": entry(shape=[1.5] * 120)}, bytes(12)),
                             "tensor 'w': shape [1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, ...] is not a list"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_file_is_refused(tmp_path, case):
    blob, message = HOSTILE[case]
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    assert message in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
    assert len(str(e.value)) < 400  # one short line, whatever the header holds


def test_header_bomb_is_refused_in_bounded_memory(tmp_path):
    """64 MiB of ``[[],[],...]`` as a header (within the 100 MiB limit): refused by counting brackets,
    before json.loads (which spends ~20 bytes per byte of such text), in a process that stays small."""
    from deltarefit.apps.bench.hostile import measure, write_header_bomb

    path = tmp_path / "bomb.safetensors"
    write_header_bomb(str(path), 64 << 20)
    with pytest.raises(CheckpointError, match=r"header holds \d+ JSON arrays/objects in \d+ bytes") as e:
        open_checkpoint(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    r = measure(["fingerprint", str(path)])
    print(f"fingerprint of a 64 MiB header bomb: rc {r.rc}, peak RSS {r.peak_rss >> 20} MiB, {r.seconds:.2f} s")
    assert r.rc == CheckpointError.exit_code and "JSON arrays/objects" in r.last_line
    assert r.peak_rss < 512 << 20  # generous: the interpreter and its imports ~150 MiB, the header 64 MiB


def test_truncated_real_file_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": torch.ones(8, 8)}, str(path))
    blob = path.read_bytes()
    path.write_bytes(blob[:-1])
    with pytest.raises(CheckpointError, match=r"tensor 'w': data_offsets \[0, 256\] run past"):
        open_checkpoint(path)
    path.write_bytes(blob[:20])
    with pytest.raises(CheckpointError, match="runs past the end of the file"):
        open_checkpoint(path)


def test_missing_paths_and_bad_indexes_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        open_checkpoint(tmp_path / "nope.safetensors")
    (tmp_path / "bare").mkdir()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors\.index\.json and no"):
        open_checkpoint(tmp_path / "bare")

    model = _model(np.random.default_rng(4))
    d = _sharded(tmp_path, model, ["step"])
    index = d / ckmod.INDEX_NAME
    good = json.loads(index.read_text())

    def refused(weight_map, message):
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(CheckpointError, match=message):
            open_checkpoint(d)

    refused(
        {**good["weight_map"], "extra": "model-00009-of-00009.safetensors"},
        r"shard 'model-00009-of-00009.safetensors' \(holding tensor 'extra'\) does not exist",
    )
    refused(
        {**good["weight_map"], "ghost": "model-00001-of-00002.safetensors"},
        "model-00001-of-00002.safetensors: index maps tensor 'ghost' to this shard but it has none",
    )
    refused({"embed": "../model.safetensors"}, "shard name '../model.safetensors' is not a file inside")
    refused([1], "'weight_map' is missing")
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"index\.json is not valid JSON"):
        open_checkpoint(d)


def test_same_tensor_in_two_unindexed_shards_is_refused(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", [src("x", "U8", (3,), b"abc")])
    write_safetensors(tmp_path / "b.safetensors", [src("x", "U8", (3,), b"abc")])
    with pytest.raises(CheckpointError, match=r"b\.safetensors: tensor 'x' is also in .*a\.safetensors"):
        open_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------------- writer


def test_writer_leaves_no_temp_file_and_keeps_target_on_failure(tmp_path):
    path = tmp_path / "out.safetensors"
    write_safetensors(path, [src("x", "U8", (3,), b"abc")])
    assert os.listdir(tmp_path) == ["out.safetensors"]

    def boom():
        yield b"ab"
        raise RuntimeError("source broke")

    failing = [
        ([TensorSource("x", "U8", (3,), 3, boom)], RuntimeError, "source broke"),
        (
            [TensorSource("x", "U8", (3,), 3, lambda: [b"a", b"b"])],
            CheckpointError,
            "tensor 'x': source produced 2 bytes but U8\\[3\\] needs 3",
        ),
        (
            [TensorSource("x", "U8", (3,), 3, lambda: [b"abcd"])],
            CheckpointError,
            "produced more than 3 bytes",
        ),
        ([src("x", "U8", (4,), b"abc")], CheckpointError, "tensor 'x': nbytes 3 but U8\\[4\\] needs 4"),
        ([src("x", "Q8", (3,), b"abc")], CheckpointError, "unknown dtype 'Q8'"),
        ([src("x", "U8", (3,), b"abc")] * 2, CheckpointError, "given twice"),
    ]
    for sources, exc, message in failing:
        with pytest.raises(exc, match=message):
            write_safetensors(path, sources)
        assert os.listdir(tmp_path) == ["out.safetensors"]
        assert raw_bytes(path) == {"x": b"abc"}


def test_writer_orders_by_itemsize_for_alignment(tmp_path):
    path = tmp_path / "mixed.safetensors"
    sources = [src("a", "U8", (3,), b"abc"), src("b", "F64", (1,), bytes(8))]
    write_safetensors(path, [*sources, src("c", "BF16", (1,), b"xy"), src("d", "I32", (1,), b"1234")])
    with open_checkpoint(path) as ck:
        assert list(ck.tensors) == ["b", "d", "c", "a"]
        assert all(i.offset % DTYPES[i.dtype].itemsize == 0 for i in ck.tensors.values())
    assert safetensors.torch.load_file(str(path))["d"].numpy().tobytes() == b"1234"


def test_a_shape_of_millions_of_numbers_is_refused_before_parsing(tmp_path):
    """8 MiB of integers in one shape: refused by the array-length bound before json.loads builds an int
    object per number (a header of them near the 100 MiB limit cost about 1.2 GB when parsed)."""
    from deltarefit.apps.bench.hostile import write_header_of_ints

    path = tmp_path / "ints.safetensors"
    write_header_of_ints(str(path), 8 << 20)
    with pytest.raises(CheckpointError, match=r"header has a JSON array of \d+ elements, limit 128") as e:
        open_checkpoint(path)
    assert "\n" not in str(e.value)
