"""Every path that holds a key checks a record's signature over its stored bytes before parsing it
(issue 46 item 7): the engine's find-by-fingerprint, ``deltarefit log --verify-key`` and a joint
commit's proposal; retention, which holds no key, reads a proposal's deadline without parsing its
record. The witness is tracemalloc's peak next to a record of distinct keys at the cap, which costs
about 6.5x its size when parsed: a path that parsed it first would peak past 5x its size."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
from click.testing import CliRunner

from deltarefit.apps.bench.trust_memory import MIB, forged, keys_record, traced
from deltarefit.errors import SignatureError
from deltarefit.signing import Signer, keygen, record_signature
from deltarefit.storage import LocalStore
from deltarefit.storage.memory import MemoryStore
from deltarefit.stream.joint import acknowledge
from deltarefit.stream.records import (
    MAX_RECORD_BYTES,
    CommitRecord,
    Part,
    commit_key,
    parse_proposal,
    prepared_key,
    proposal_bytes,
)
from deltarefit.stream.retention import _open_proposals

HOSTILE = MAX_RECORD_BYTES - 256
FP = "cd" * 32


@pytest.fixture(scope="module")
def key(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("key") / "k.pem")
    keygen(path)
    return path


def _signed(key: str, version: int = 1, fp: str = FP) -> CommitRecord:
    ref = Part(f"v/{version:012d}/0123456789abcdef/delta", 10, "ab" * 32)
    rec = CommitRecord(version, "ef" * 32, fp, "delta", ref, stream="0" * 32)
    return replace(rec, signature=record_signature(Signer(key), rec.signed_bytes()))


def _bounded(peak: int, data: bytes) -> None:
    assert peak < 1.1 * len(data) + 2 * MIB, f"{peak / MIB:.1f} MiB for a record of {len(data) / MIB:.1f} MiB"


@pytest.mark.parametrize("kind", ["unsigned", "forged"])
def test_engine_find_by_fingerprint_checks_each_record_before_parsing_it(key, kind):
    """An engine started without a version finds the newest signed version holding its weights: an
    unsigned or forged record above it is passed over unparsed, and named when no signed one holds them."""
    backend = pytest.importorskip("deltarefit.engines.vllm.backend", reason="needs vllm: make test-vllm runs it")
    hostile = keys_record(HOSTILE) if kind == "unsigned" else forged(keys_record(HOSTILE))
    store = MemoryStore(f"find-{kind}")
    store.put(commit_key(1), _signed(key).to_bytes())
    store.put(commit_key(2), hostile)
    out: list = []
    peak, err = traced(lambda: out.append(backend.held_version(store, FP, None, key + ".pub")))
    assert err == "" and out == [(1, FP)]
    _bounded(peak, hostile)
    peak, err = traced(lambda: backend.held_version(store, FP, 2, key + ".pub"))
    assert err.startswith("SignatureError") and "version 2" in err, err
    _bounded(peak, hostile)
    peak, err = traced(lambda: backend.held_version(store, "01" * 32, None, key + ".pub"))
    assert err.startswith("SignatureError") and "version 2" in err, err  # the refusal, not "no version"
    _bounded(peak, hostile)


def test_log_with_a_key_lists_a_record_that_does_not_verify_without_parsing_it(tmp_path, key):
    store = str(tmp_path / "s")
    st = LocalStore(store, create=True)
    st.put(commit_key(1), _signed(key).to_bytes())
    hostile = keys_record(HOSTILE)
    st.put(commit_key(2), hostile)
    st.put(commit_key(3), forged(keys_record(1 << 10)))
    runner = CliRunner()
    res: list = []
    peak, _ = traced(lambda: res.append(runner.invoke(_main(), ["log", store, "--verify-key", key + ".pub"])))
    assert res[0].exit_code == 0, res[0].output
    lines = res[0].output.splitlines()
    assert lines[0].endswith("  signed") and lines[1].endswith("UNSIGNED") and lines[2].endswith("DOES NOT VERIFY")
    assert "log without --verify-key" in lines[1]
    _bounded(peak, hostile)
    rows = json.loads(runner.invoke(_main(), ["log", store, "--json", "--verify-key", key + ".pub"]).output)
    assert [r["signature_verified"] for r in rows] == [True, False, False]
    assert [r["signed"] for r in rows] == [True, False, True] and "not signed" in rows[1]["refused"]


def _main():
    from deltarefit.cli import main

    return main


def test_a_proposal_carries_the_record_as_stored_and_is_checked_before_it_is_parsed(key, tmp_path):
    """The record inside ``prepared.json`` is its stored bytes verbatim, so its signature checks over
    them unparsed; a hostile proposal costs a subscriber with a key its size, and one re-serialised
    (as older publishers wrote them) is refused as not as signed."""
    rec = _signed(key, 2)
    data = proposal_bytes(rec, 1.5e9)
    assert json.loads(data)["deadline"] == 1.5e9 and rec.to_bytes() in data
    assert parse_proposal(data, "p", Signer(key).verifier()) == (rec, 1.5e9)
    old = json.dumps({"deadline": 1.5e9, "record": json.loads(rec.to_bytes())}, sort_keys=True).encode()
    assert parse_proposal(old, "p") == (rec, 1.5e9)  # readable without a key
    with pytest.raises(SignatureError, match="not as signed"):
        parse_proposal(old, "p", Signer(key).verifier())
    hostile = b'{"deadline": 1500000000.0, "record": ' + keys_record(HOSTILE) + b"}"
    store = MemoryStore("proposal")
    store.put(prepared_key(2), hostile)
    peak, err = traced(lambda: acknowledge(store, (1, "ef" * 32), "sub", verifier=Signer(key).verifier(),
                                           stream=lambda: None, staging=str(tmp_path / "st"),
                                           checkpoint=str(tmp_path / "ck"), threads=1,
                                           book_path=str(tmp_path / "book")))
    assert err.startswith("SignatureError") and "proposed version 2" in err and "not signed" in err, err
    _bounded(peak, hostile)
    assert not os.path.exists(tmp_path / "st") and not store.list("acks/")


def test_retention_reads_a_proposals_deadline_without_parsing_its_record():
    hostile = b'{"deadline": 1.0, "record": ' + keys_record(HOSTILE) + b"}"
    store = MemoryStore("retain-proposal")
    store.put(prepared_key(2), hostile)
    out: list = []
    peak, err = traced(lambda: out.append(_open_proposals(store, 1, 0.0)))
    assert err == "" and out == [(set(), [prepared_key(2)])]  # past its deadline: settled
    _bounded(peak, hostile)
