"""The new surfaces tried as a hostile local user and a careless one would (issue 54, items 6, 9, 10, 11,
12, 15, 16): a rewritten sharded descriptor, version records with fields of the wrong type, manifests
with non-canonical escapes, the part-header budget of a manifest read as bytes, tensors publish_tensors
cannot publish, ``status`` on odd stores and records, ``simulate --plot`` and ``encode`` of an empty
target. Real files, real CLI processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from _shard_util import SHAPES, masters, step
from safetensors.torch import save_file

from deltarefit.errors import FormatError, UsageError, VerificationError
from deltarefit.shard.budget import header_budget
from deltarefit.shard.manifest import VersionManifest
from deltarefit.shard.names import (
    cuts_from_layouts,
    identity_layout,
    local_from_full,
    tp_layout,
    trainer_layout,
)
from deltarefit.shard.records import head_key
from deltarefit.shard.stream import ShardStreamPublisher, held_version, new_attempt, sync_sharded
from deltarefit.storage.memory import MemoryStore
from deltarefit.stream.publisher import Publisher, PublishError
from deltarefit.stream.records import commit_key, head

ENV = dict(os.environ, DELTAREFIT_NO_PROGRESS="1")


def cli(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltarefit", *args], capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=120, check=False)


def one_line_error(p: subprocess.CompletedProcess, code: int) -> str:
    assert p.returncode == code, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and p.stderr.strip().count("\n") == 0, p.stderr
    return p.stderr


# -- 6. sharded part binding -----------------------------------------------------------------------

TLAYS = [trainer_layout(SHAPES, [2], [r], ["S0"]) for r in range(2)]
CUTS = cuts_from_layouts([tp_layout(SHAPES, 2, 0), tp_layout(SHAPES, 2, 1), identity_layout(SHAPES)])


def _trainers(store):
    return [ShardStreamPublisher(store, TLAYS[r], "BF16", cuts=CUTS, rank=r, world=2, timeout=5, poll=0.01)
            for r in range(2)]


def test_a_descriptor_rewritten_with_another_parts_head_is_refused_by_the_committer():
    store = MemoryStore()
    tps = _trainers(store)
    full = masters()
    att = new_attempt()
    refs = [tps[r].upload(local_from_full(TLAYS[r], full, np.float32), att) for r in range(2)]
    rec = tps[0].commit_version(1, att, refs=refs)
    for tp in tps:
        tp.advance(rec)
    step(full, np.random.default_rng(1), scale=1e-3)
    a, b = new_attempt(), new_attempt()
    refs_a = [tps[r].upload(local_from_full(TLAYS[r], full, np.float32), a) for r in range(2)]
    other = {n: x + 1e-2 for n, x in full.items()}
    tps[0].upload(local_from_full(TLAYS[0], other, np.float32), b)  # rank 0's part of another attempt
    da, db = (json.loads(store.get(head_key(2, att_, 0))) for att_ in (a, b))
    da["head"] = db["head"]  # the rank's true key, size and BLAKE3; another part's head
    store.put(head_key(2, a, 0), json.dumps(da, sort_keys=True).encode())
    with pytest.raises(PublishError, match="part head that is not the one its upload"):
        tps[0].commit_version(2, a, refs=refs_a)
    assert not store.exists(commit_key(2))


def test_a_single_rank_rollout_checks_the_manifests_targets_before_it_records(tmp_path):
    """A manifest signed over a header its part does not carry (committed before the binding): the
    rollout's cells verify against their part, the tensors then miss the manifest's targets."""
    import blake3

    from deltarefit.shard.records import PartRef

    store = MemoryStore()
    tps = _trainers(store)
    full = masters()
    att = new_attempt()
    rec = tps[0].commit_version(1, att, refs=[tps[r].upload(local_from_full(TLAYS[r], full, np.float32), att)
                                              for r in range(2)])
    for tp in tps:
        tp.advance(rec)
    whole = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
    sp = str(tmp_path / "whole.json")
    sync_sharded(store, whole, identity_layout(SHAPES), state_path=sp)
    step(full, np.random.default_rng(1), scale=1e-3)
    a, b = new_attempt(), new_attempt()
    refs_a = [tps[r].upload(local_from_full(TLAYS[r], full, np.float32), a) for r in range(2)]
    other = {n: x + 1e-2 for n, x in full.items()}
    tps[0].upload(local_from_full(TLAYS[0], other, np.float32), b)
    da, db = (json.loads(store.get(head_key(2, att_, 0))) for att_ in (a, b))
    da["head"] = db["head"]
    store.put(head_key(2, a, 0), json.dumps(da, sort_keys=True).encode())
    import base64

    forged = PartRef(refs_a[0].key, refs_a[0].bytes, refs_a[0].blake3,
                     blake3.blake3(base64.b64decode(db["head"])).hexdigest())  # a ref that vouches for it
    tps[0].commit_version(2, a, refs=[forged, refs_a[1]])
    assert head(store) == 2
    with pytest.raises(VerificationError):
        sync_sharded(store, whole, identity_layout(SHAPES), state_path=sp)
    assert held_version(sp)[0] == 1  # the wrong fingerprint is not recorded


# -- 9. version records' fields --------------------------------------------------------------------

def _synced_checkpoint(tmp_path) -> tuple[str, str]:
    ck = str(tmp_path / "model.safetensors")
    save_file({"w": torch.randn(32, 32).to(torch.bfloat16)}, ck)
    store = str(tmp_path / "store")
    Publisher(store, str(tmp_path / "state")).publish(ck)
    rec = ck + ".deltarefit-version.json"
    assert cli("sync", store, ck).returncode == 0 and os.path.exists(rec)
    return ck, rec


@pytest.mark.parametrize("field,value", [("stream", ["s3://x"]), ("stream", 7), ("version", "Infinity"),
                                         ("version", "-Infinity"), ("version", 1.5), ("version", True),
                                         ("fingerprint", 12), ("stream_id", {"a": 1}), ("updated", "NaN"),
                                         ("identity", "x"), ("identity_at_ns", 1.5)])
def test_a_version_record_with_a_field_of_the_wrong_type_exits_9_with_repair(tmp_path, field, value):
    ck, rec = _synced_checkpoint(tmp_path)
    d = json.loads(open(rec).read())
    d[field] = value
    text = json.dumps(d)
    if value in ("Infinity", "-Infinity", "NaN"):
        text = text.replace(f'"{value}"', value)  # the JSON extensions Python's parser takes
    open(rec, "w").write(text)
    for args in (("status", ck), ("sync", str(tmp_path / "store"), ck)):
        err = one_line_error(cli(*args), 9)
        assert "--repair" in err


# -- 10, 11. manifests read as bytes ----------------------------------------------------------------

def _manifest(name: str = "a\u00e9") -> bytes:
    man = {"changed": 0, "elements": 4, "format": "deltarefit.shard_version", "format_version": 1, "keyframe": True,
           "parts": [{"blake3": "0" * 64, "bytes": 10, "covers": {name: [[0, 2], [0, 2]]}, "rank": 0}],
           "tensors": {name: {"base": None, "dtype": "BF16", "shape": [2, 2], "target": "0" * 32}},
           "version": 1, "world": 1}
    return json.dumps(man, sort_keys=True, separators=(",", ":")).encode()


def test_a_manifest_name_with_a_non_canonical_escape_is_refused():
    VersionManifest(_manifest())  # the committer's form
    for bad in (b"\\u0061", b"\\u0022"):  # 'a' escaped where json.dumps writes it plain; '"' as \u0022
        data = _manifest("zz").replace(b'"zz"', b'"' + bad + b'z"')
        with pytest.raises(FormatError, match="non-canonical escape"):
            VersionManifest(data)


def test_the_part_header_budget_applies_to_a_manifest_read_as_bytes():
    data = _manifest()
    assert header_budget(VersionManifest(data), 0) == header_budget(json.loads(data), 0)
    assert header_budget(VersionManifest(data), 0) < 1 << 20


# -- 12. publish_tensors' one-line refusals ----------------------------------------------------------

@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("case", ["meta", "nested", "jagged", "surrogate"])
def test_publish_tensors_refuses_what_it_cannot_publish_in_one_line(tmp_path, case):
    good = torch.randn(4, 4).to(torch.bfloat16)
    nested = torch.nested.nested_tensor
    tensors = {"meta": {"w": torch.empty(4, 4, device="meta", dtype=torch.bfloat16)},
               "nested": {"w": nested([torch.randn(2), torch.randn(3)])},
               "jagged": {"w": nested([torch.randn(2), torch.randn(3)], layout=torch.jagged)},
               "surrogate": {"w\udc80": good}}[case]
    pub = Publisher(str(tmp_path / "store"), str(tmp_path / "state"))
    with pytest.raises(UsageError) as e:
        pub.publish_tensors(tensors)
    assert "\n" not in str(e.value) and "'w" in str(e.value)
    assert head(pub.store) == 0


# -- 15. status ---------------------------------------------------------------------------------------

def test_status_verify_on_a_store_without_version_1_says_no_version(tmp_path):
    ck, rec = _synced_checkpoint(tmp_path)
    os.unlink(rec)
    store = tmp_path / "store"
    other = str(tmp_path / "other.safetensors")
    save_file({"w": torch.randn(32, 32).to(torch.bfloat16)}, other)
    Publisher(str(store), str(tmp_path / "state"), keyframe_every=1, another_model=True).publish(other)  # v2, a keyframe
    os.unlink(store / commit_key(1))  # retention, or a mirror that starts at a later keyframe
    p = cli("status", ck, "--store", str(store), "--verify")
    assert p.returncode == 0, p.stderr
    assert "is no version of" in p.stdout


def test_status_verify_key_refuses_a_forged_unsigned_head(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    priv, pub = tmp_path / "k.pem", tmp_path / "k.pub"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    ck = str(tmp_path / "model.safetensors")
    save_file({"w": torch.randn(32, 32).to(torch.bfloat16)}, ck)
    store = tmp_path / "store"
    Publisher(str(store), str(tmp_path / "state"), signing_key=str(priv)).publish(ck)
    assert cli("status", ck, "--store", str(store), "--verify-key", str(pub)).returncode == 0
    forged = json.loads((store / commit_key(1)).read_text())
    forged.pop("signature", None)
    forged["version"] = 2
    (store / commit_key(2)).parent.mkdir(parents=True, exist_ok=True)
    (store / commit_key(2)).write_text(json.dumps(forged))
    (store / "HEAD").write_text("2\n")
    one_line_error(cli("status", ck, "--store", str(store), "--verify-key", str(pub)), 8)


def test_status_escapes_terminal_control_sequences_from_a_record(tmp_path):
    ck, rec = _synced_checkpoint(tmp_path)
    d = json.loads(open(rec).read())
    d["stream_id"] = "evil\x1b]0;owned\x07\x1b[2J\r"
    open(rec, "w").write(json.dumps(d))
    p = cli("status", ck)
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout and "\x07" not in p.stdout and "\r" not in p.stdout
    assert "\\x1b" in p.stdout


def test_status_of_a_record_naming_s3_without_a_bucket_exits_9(tmp_path):
    ck, rec = _synced_checkpoint(tmp_path)
    d = json.loads(open(rec).read())
    d["stream"] = "s3://"
    open(rec, "w").write(json.dumps(d))
    assert "--repair" in one_line_error(cli("status", ck), 9)


# -- 16. simulate --plot, encode of an empty target ----------------------------------------------------

def test_simulate_plot_to_a_non_png_name_is_one_line_exit_2(tmp_path):
    one_line_error(cli("simulate", "--plot", str(tmp_path / "x.txt")), 2)
    assert not (tmp_path / "x.txt").exists()


def test_encode_to_a_target_with_no_tensors_reports_without_a_traceback(tmp_path):
    base, empty = str(tmp_path / "b.safetensors"), str(tmp_path / "e.safetensors")
    save_file({"w": torch.randn(8, 8).to(torch.bfloat16)}, base)
    save_file({}, empty)
    p = cli("encode", base, empty, "-o", str(tmp_path / "d.delta"))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "target fingerprint" in p.stdout
