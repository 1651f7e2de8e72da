"""End-to-end encode/apply on real safetensors files and directories."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import deltarefit
from deltarefit.errors import BaseMismatchError, UsageError


def bf16_pair(seed: int = 0, change: float = 0.03) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    base = {
        "model.embed.weight": (torch.randn(700, 1024, generator=g) * 0.02).to(torch.bfloat16),  # 1.4 MiB: 2 chunks
        "model.layers.0.mlp.weight": (torch.randn(256, 512, generator=g) * 0.02).to(torch.bfloat16),
        "model.norm.weight": torch.ones(512, dtype=torch.bfloat16),
        "model.scale": torch.tensor(0.5, dtype=torch.float32),
        "model.step": torch.tensor([7, 8, 9], dtype=torch.int64),
    }
    target = {}
    for k, v in base.items():
        t = v.clone()
        if v.dtype == torch.bfloat16 and k != "model.norm.weight":
            bits = t.view(torch.int16)
            mask = torch.rand(bits.shape, generator=g) < change
            bits[mask] += torch.where(torch.rand(bits.shape, generator=g) < 0.5, 1, -1).to(torch.int16)[mask]
        target[k] = t
    target["model.scale"] = torch.tensor(0.25, dtype=torch.float32)
    return base, target


def same_bytes(a: str, b: str) -> bool:
    ta, tb = load_file(a), load_file(b)
    return ta.keys() == tb.keys() and all(
        ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape
        and ta[k].contiguous().view(torch.uint8).equal(tb[k].contiguous().view(torch.uint8))
        if ta[k].dim() else ta[k].reshape(1).view(torch.uint8).equal(tb[k].reshape(1).view(torch.uint8))
        for k in ta)


@pytest.fixture
def pair(tmp_path):
    base, target = bf16_pair()
    b, t = str(tmp_path / "base.safetensors"), str(tmp_path / "target.safetensors")
    save_file(base, b)
    save_file(target, t)
    return b, t


def test_apply_makes_the_base_file_equal_to_the_target_and_reports_it(pair, tmp_path):
    b, t = pair
    d = str(tmp_path / "d.delta")
    rep = deltarefit.encode(b, t, d)
    assert 0.01 < rep.changed_fraction < 0.05 and rep.ratio > 10
    work = str(tmp_path / "work.safetensors")
    shutil.copy(b, work)
    ar = deltarefit.apply(d, work)
    assert ar.target_fingerprint == rep.target_fingerprint == deltarefit.fingerprint(t)
    assert open(work, "rb").read() == open(t, "rb").read()  # in place: same layout, same bytes
    assert not os.path.exists(work + ".deltarefit-journal")


def test_apply_and_encode_are_both_modules_and_functions(pair, tmp_path):
    """``import deltarefit.apply`` gives the module its names live in, which is also the function."""
    import deltarefit.apply
    import deltarefit.encode
    from deltarefit import apply, encode

    assert deltarefit.apply.Journal.__name__ == "Journal" and deltarefit.apply.run_apply is not None
    assert deltarefit.encode.KnownHashes.__name__ == "KnownHashes"
    assert apply is deltarefit.apply and encode is deltarefit.encode
    b, t = pair
    d, work = str(tmp_path / "d.delta"), str(tmp_path / "work.safetensors")
    shutil.copy(b, work)
    rep = encode(b, t, d)
    assert apply(d, work).target_fingerprint == rep.target_fingerprint == deltarefit.fingerprint(t)


def test_applying_twice_is_a_no_op(pair, tmp_path):
    b, t = pair
    d = str(tmp_path / "d.delta")
    deltarefit.encode(b, t, d)
    work = str(tmp_path / "work.safetensors")
    shutil.copy(b, work)
    first = deltarefit.apply(d, work)
    before = os.stat(work).st_mtime_ns, open(work, "rb").read()
    again = deltarefit.apply(d, work)
    assert first.chunks_applied > 0
    assert again.chunks_applied == 0 and again.chunks_skipped == first.chunks_applied
    assert open(work, "rb").read() == before[1]


def test_a_delta_for_another_base_is_refused_with_nothing_written(pair, tmp_path):
    b, t = pair
    d = str(tmp_path / "d.delta")
    deltarefit.encode(b, t, d)
    other = bf16_pair(seed=1)[0]
    o = str(tmp_path / "other.safetensors")
    save_file(other, o)
    before = open(o, "rb").read()
    with pytest.raises(BaseMismatchError, match="tensor '"):
        deltarefit.apply(d, o)
    assert open(o, "rb").read() == before
    assert not os.path.exists(o + ".deltarefit-journal")


def test_a_change_in_an_unchanged_chunk_of_the_base_is_caught_before_writing(pair, tmp_path):
    b, t = pair
    d = str(tmp_path / "d.delta")
    deltarefit.encode(b, t, d)
    base = load_file(b)
    base["model.norm.weight"][3] = 2.0  # a tensor the delta does not change
    o = str(tmp_path / "o.safetensors")
    save_file(base, o)
    before = open(o, "rb").read()
    with pytest.raises(BaseMismatchError, match=r"model\.norm\.weight"):
        deltarefit.apply(d, o)
    assert open(o, "rb").read() == before


def shard(tensors: dict, d: str, groups: list[list[str]]) -> None:
    os.makedirs(d, exist_ok=True)
    wm = {}
    for i, names in enumerate(groups):
        fn = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in names}, os.path.join(d, fn))
        wm.update({k: fn for k in names})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)


def test_sharded_directories_apply_in_place_and_fingerprints_ignore_layout(tmp_path):
    base, target = bf16_pair(2)
    names = sorted(base)
    groups = [names[:2], names[2:]]
    shard(base, str(tmp_path / "b"), groups)
    shard(target, str(tmp_path / "t"), [names[:3], names[3:]])  # a different layout
    save_file(target, str(tmp_path / "t.safetensors"))
    assert deltarefit.fingerprint(str(tmp_path / "t")) == deltarefit.fingerprint(str(tmp_path / "t.safetensors"))
    d = str(tmp_path / "d.delta")
    rep = deltarefit.encode(str(tmp_path / "b"), str(tmp_path / "t"), d)
    # The delta depends on tensors only, not on the files they sit in.
    d2 = str(tmp_path / "d2.delta")
    deltarefit.encode(str(tmp_path / "b"), str(tmp_path / "t.safetensors"), d2)
    assert open(d, "rb").read() == open(d2, "rb").read()
    ar = deltarefit.apply(d, str(tmp_path / "b"))
    assert ar.target_fingerprint == rep.target_fingerprint
    assert not os.path.exists(str(tmp_path / "b" / ".deltarefit-journal"))


def test_added_removed_and_retyped_tensors_are_explicit_and_apply(tmp_path):
    base, target = bf16_pair(3)
    del target["model.step"]  # removed
    target["lm_head.weight"] = torch.randn(64, 32).to(torch.bfloat16)  # added
    target["model.scale"] = torch.tensor([1.0, 2.0], dtype=torch.float16)  # re-typed and reshaped
    b, t = str(tmp_path / "b.safetensors"), str(tmp_path / "t.safetensors")
    save_file(base, b, metadata={"format": "pt"})
    save_file(target, t, metadata={"format": "pt"})
    d = str(tmp_path / "d.delta")
    deltarefit.encode(b, t, d)
    ops = {x["name"]: x["op"] for x in deltarefit.inspect(d)["tensors"]}
    assert ops["model.step"] == "remove" and ops["lm_head.weight"] == "add" and ops["model.scale"] == "replace"
    rep = deltarefit.apply(d, b)
    assert sorted(rep.structural) == ["lm_head.weight", "model.scale", "model.step"]
    assert same_bytes(b, t)
    assert deltarefit.fingerprint(b) == deltarefit.fingerprint(t)
    again = deltarefit.apply(d, b)
    assert again.chunks_applied == 0 and again.structural == []


def test_structural_changes_in_a_multi_file_directory_without_index_are_refused_before_writing(tmp_path):
    base, target = bf16_pair(4)
    target["extra"] = torch.zeros(4, dtype=torch.bfloat16)
    names = sorted(base)
    shard(base, str(tmp_path / "b"), [names[:2], names[2:]])
    os.unlink(tmp_path / "b" / "model.safetensors.index.json")  # shards with no index
    save_file(target, str(tmp_path / "t.safetensors"))
    d = str(tmp_path / "d.delta")
    deltarefit.encode(str(tmp_path / "b"), str(tmp_path / "t.safetensors"), d)
    before = {f: open(tmp_path / "b" / f, "rb").read() for f in os.listdir(tmp_path / "b")}
    with pytest.raises(UsageError, match="no index"):
        deltarefit.apply(d, str(tmp_path / "b"))
    assert {f: open(tmp_path / "b" / f, "rb").read() for f in os.listdir(tmp_path / "b")} == before


def _structural_target(seed: int) -> tuple[dict, dict]:
    base, target = bf16_pair(seed)
    del target["model.step"]  # removed from shard 2
    target["lm_head.weight"] = torch.randn(64, 32).to(torch.bfloat16)  # added
    target["model.scale"] = torch.tensor([1.0, 2.0], dtype=torch.float16)  # re-typed, in shard 2
    return base, target


def test_structural_changes_in_an_indexed_directory_rewrite_only_the_touched_shards(tmp_path):
    base, target = _structural_target(5)
    names = sorted(base)  # embed, mlp | norm, scale, step
    shard(base, str(tmp_path / "b"), [names[:2], names[2:]])
    untouched = open(tmp_path / "b" / "model-00001-of-00002.safetensors", "rb").read()
    save_file(target, str(tmp_path / "t.safetensors"))
    d = str(tmp_path / "d.delta")
    deltarefit.encode(str(tmp_path / "b"), str(tmp_path / "t.safetensors"), d)
    rep = deltarefit.apply(d, str(tmp_path / "b"))
    assert sorted(rep.structural) == ["lm_head.weight", "model.scale", "model.step"]
    assert deltarefit.fingerprint(str(tmp_path / "b")) == deltarefit.fingerprint(str(tmp_path / "t.safetensors"))
    files = sorted(os.listdir(tmp_path / "b"))
    assert "model-00002-of-00002.safetensors" not in files  # replaced, then deleted
    assert not any(f.startswith(".deltarefit") for f in files)
    # The shard holding no structural change was patched in place, never rewritten.
    assert len(open(tmp_path / "b" / "model-00001-of-00002.safetensors", "rb").read()) == len(untouched)
    assert deltarefit.apply(d, str(tmp_path / "b")).structural == []


def test_a_rewrite_killed_after_its_index_commit_is_finished_by_the_next_run(tmp_path):
    base, target = _structural_target(6)
    names = sorted(base)
    shard(base, str(tmp_path / "b"), [names[:2], names[2:]])
    save_file(target, str(tmp_path / "t.safetensors"))
    d = str(tmp_path / "d.delta")
    deltarefit.encode(str(tmp_path / "b"), str(tmp_path / "t.safetensors"), d)
    old = open(tmp_path / "b" / "model-00002-of-00002.safetensors", "rb").read()
    deltarefit.apply(d, str(tmp_path / "b"))
    # Put the world back as a kill between the index commit and the deletes leaves it.
    (tmp_path / "b" / "model-00002-of-00002.safetensors").write_bytes(old)
    (tmp_path / "b" / ".deltarefit-replaced.json").write_text('["model-00002-of-00002.safetensors"]')
    again = deltarefit.apply(d, str(tmp_path / "b"))
    assert again.chunks_applied == 0 and again.structural == []
    files = os.listdir(tmp_path / "b")
    assert "model-00002-of-00002.safetensors" not in files and ".deltarefit-replaced.json" not in files
    assert deltarefit.fingerprint(str(tmp_path / "b")) == deltarefit.fingerprint(str(tmp_path / "t.safetensors"))


def test_empty_and_zero_d_tensors_round_trip(tmp_path):
    base = {"e": torch.zeros(0, 5, dtype=torch.bfloat16), "s": torch.tensor(1.5, dtype=torch.bfloat16),
            "v": torch.arange(10, dtype=torch.int32)}
    target = {"e": torch.zeros(0, 5, dtype=torch.bfloat16), "s": torch.tensor(-1.5, dtype=torch.bfloat16),
              "v": torch.arange(10, dtype=torch.int32) * 3}
    b, t = str(tmp_path / "b.safetensors"), str(tmp_path / "t.safetensors")
    save_file(base, b)
    save_file(target, t)
    d = str(tmp_path / "d.delta")
    deltarefit.encode(b, t, d)
    deltarefit.apply(d, b)
    assert open(b, "rb").read() == open(t, "rb").read()


def test_encoding_is_deterministic_across_thread_counts(pair, tmp_path):
    b, t = pair
    outs = []
    for n in (1, 2, 3):
        p = str(tmp_path / f"d{n}.delta")
        deltarefit.encode(b, t, p, threads=n)
        outs.append(open(p, "rb").read())
    assert outs[0] == outs[1] == outs[2]


def test_unaligned_tensor_data_is_patched_correctly(tmp_path):
    # A hand-written file whose bf16 tensor starts at an odd offset (safetensors does not forbid it).
    def write(path: str, vals: np.ndarray) -> None:
        hdr = {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
               "w": {"dtype": "BF16", "shape": [vals.size], "data_offsets": [1, 1 + 2 * vals.size]}}
        h = json.dumps(hdr).encode()
        h += b" " * (-len(h) % 8)
        with open(path, "wb") as f:
            f.write(len(h).to_bytes(8, "little") + h + b"\x05" + vals.astype("<u2").tobytes())

    rng = np.random.default_rng(5)
    v = rng.integers(0, 1 << 16, 300000, dtype=np.uint64).astype(np.uint16)
    v2 = v.copy()
    v2[::37] += 1
    b, t = str(tmp_path / "b.safetensors"), str(tmp_path / "t.safetensors")
    write(b, v)
    write(t, v2)
    d = str(tmp_path / "d.delta")
    deltarefit.encode(b, t, d)
    deltarefit.apply(d, b)
    assert open(b, "rb").read() == open(t, "rb").read()
