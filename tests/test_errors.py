"""The error hierarchy: one closed set in ``deltarefit.errors``, re-exported where each is raised, its
exit codes listed (and checked here) in docs/COMMAND-LINE.md and the CLI's docstring, and a worker's error
rebuilt on the driver as its own class from its name alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import deltarefit
import deltarefit.cli
from deltarefit import errors
from deltarefit.relay import protocol
from deltarefit.signing import SignatureError
from deltarefit.storage.base import StoreError
from deltarefit.stream import publisher, records
from deltarefit.transport import torchdist

ROOT = Path(__file__).resolve().parents[1]

# Each class as its raising module exports it (where they were defined before errors.py held them all).
EXPORTED = {
    "StreamError": records.StreamError,
    "MalformedRecordError": records.MalformedRecordError,
    "StreamIdentityError": records.StreamIdentityError,
    "PublishError": publisher.PublishError,
    "StoreError": StoreError,
    "SignatureError": SignatureError,
    "ProtocolError": protocol.ProtocolError,
    "AuthError": protocol.AuthError,
    "BadPartError": protocol.BadPartError,
    "BroadcastError": torchdist.BroadcastError,
}
EXIT_CODES = {"StreamError": 9, "MalformedRecordError": 9, "StreamIdentityError": 9, "PublishError": 9,
              "BroadcastError": 9, "StoreError": 7, "SignatureError": 8, "ProtocolError": 10, "AuthError": 10,
              "BadPartError": 10}


def _all_classes() -> list[type]:
    """Every DeltaRefitError subclass reachable from the base, defined anywhere in deltarefit."""
    out, todo = [], [errors.DeltaRefitError]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


def test_every_error_is_defined_in_errors_and_re_exported_as_the_same_object():
    for name, cls in EXPORTED.items():
        assert getattr(errors, name) is cls, name
        assert getattr(deltarefit, name) is cls and name in deltarefit.__all__, name
        assert cls.__module__ == "deltarefit.errors", name
        assert cls.exit_code == EXIT_CODES[name], name
    assert issubclass(torchdist.BroadcastError, records.StreamError)
    assert issubclass(publisher.PublishError, records.StreamError)
    assert issubclass(protocol.BadPartError, protocol.ProtocolError)
    # closed: nothing in deltarefit subclasses the hierarchy outside errors.py, and ERRORS names all
    assert {c.__module__ for c in _all_classes()} == {"deltarefit.errors"}
    assert {c.__name__: c for c in _all_classes()} == errors.ERRORS
    assert set(errors.ERRORS) <= set(deltarefit.__all__)


def _table_rows(text: str, row: re.Pattern[str]) -> dict[int, set[str]]:
    """exit code -> class names on its row (the row's class and the subclasses it names)."""
    out: dict[int, set[str]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = row.match(line)
        if not m:
            continue
        names = set(re.findall(r"\b[A-Z]\w*Error\b", line))
        j = i + 1  # continuation lines (the CLI docstring wraps long rows)
        while j < len(lines) and lines[j].startswith(" " * 8) and not row.match(lines[j]):
            names |= set(re.findall(r"\b[A-Z]\w*Error\b", lines[j]))
            j += 1
        code = int(m.group(1))
        assert code not in out, f"exit code {code} listed twice"
        out[code] = names
    return out


def _check_table(rows: dict[int, set[str]], where: str) -> None:
    want: dict[int, set[str]] = {}
    for name, cls in errors.ERRORS.items():
        want.setdefault(cls.exit_code, set()).add(name)
    got = {code: names for code, names in rows.items() if names}
    assert got == want, f"{where}: exit-code table does not match the classes' exit_code"
    assert set(rows) - set(got) <= {0, 130}, f"{where}: rows without a class: {sorted(set(rows) - set(got))}"


def test_docs_exit_code_table_matches_the_classes():
    rows = _table_rows((ROOT / "docs" / "COMMAND-LINE.md").read_text(), re.compile(r"^\| (\d+) \| "))
    assert len(rows) >= len({c.exit_code for c in errors.ERRORS.values()})
    _check_table(rows, "docs/COMMAND-LINE.md")


def test_cli_docstring_exit_code_table_matches_the_classes():
    doc = deltarefit.cli.__doc__
    assert doc
    rows = _table_rows(doc, re.compile(r"^ {4}(\d+) +\S"))
    assert 0 in rows and 130 in rows
    _check_table(rows, "deltarefit.cli docstring")


@pytest.mark.parametrize("name", sorted(errors.ERRORS))
def test_error_from_name_round_trips_every_class(name):
    cls = errors.ERRORS[name]
    e = errors.error_from_name(cls.__name__, "x.delta: the message")
    assert type(e) is cls and str(e) == "x.delta: the message" and e.exit_code == cls.exit_code


@pytest.mark.parametrize("name", ["ValueError", "SystemExit", "annotations", "", "__builtins__", "Exception",
                                  "errors.StoreError", None, 7])
def test_error_from_name_of_anything_else_is_a_plain_deltarefit_error(name):
    e = errors.error_from_name(name, "rank 0: boom")
    assert type(e) is errors.DeltaRefitError and str(e) == "rank 0: boom"


class _Worker:
    """A stand-in for a vLLM worker holding the real extension: ``_deltarefit_apply`` refuses with
    ``exc`` (vLLM is not needed for the error's way back)."""

    def __init__(self, rank: int, exc: Exception) -> None:
        from deltarefit.engines.vllm import DeltaRefitWorkerExtension

        class W(DeltaRefitWorkerExtension):
            def _deltarefit_apply(self, *a, **k):
                raise exc

        self.ext = W()
        self.ext.rank = rank


class _LLM:
    """``collective_rpc`` as vLLM's: the method runs on every worker, each report crosses a process
    boundary as plain data (here: through JSON), and the driver gets the list."""

    def __init__(self, workers: list[_Worker]) -> None:
        self.workers = workers

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [json.loads(json.dumps(getattr(w.ext, method)(*args, **(kwargs or {})))) for w in self.workers]


@pytest.mark.parametrize("name", [*sorted(EXPORTED), "BaseMismatchError", "LockedError"])
def test_a_workers_error_comes_back_across_collective_rpc_as_its_own_class(tmp_path, name):
    from deltarefit.engines.vllm import refit_engine

    cls = getattr(errors, name)
    llm = _LLM([_Worker(0, cls("s3://b/v/1/commit.json: the cause"))])
    with pytest.raises(cls, match=r"^rank 0: s3://b/v/1/commit.json: the cause$") as ei:
        refit_engine(llm, str(tmp_path / "x.delta"), str(tmp_path))
    assert type(ei.value) is cls


# -- range errors name the value found --------------------------------------------------------------


def test_publisher_options_out_of_range_name_the_values(tmp_path):
    with pytest.raises(errors.UsageError, match=r"got keyframe_every=0, keyframe_ratio=0.5, quorum=-2, "
                                                r"ack_timeout=60.0$"):
        publisher.Publisher(str(tmp_path / "store"), str(tmp_path / "state"), keyframe_every=0, quorum=-2)
    assert not (tmp_path / "store").exists() and not (tmp_path / "state").exists()


def test_shard_publisher_options_out_of_range_name_the_values(tmp_path):
    from deltarefit.shard.stream import ShardStreamPublisher

    with pytest.raises(errors.UsageError, match=r"got rank=3, committer=0, world=2, timeout=60.0, keyframe_every=0$"):
        ShardStreamPublisher(str(tmp_path / "store"), None, rank=3, world=2)  # refused before the layout is read
    assert not (tmp_path / "store").exists()


def _record(**change) -> bytes:
    rec = records.CommitRecord(version=1, parent=None, fingerprint="f" * 64, kind="delta",
                               delta=records.Part("v/000000000001/delta", 10, "0" * 64))
    d = json.loads(rec.to_bytes())
    d.update(change)
    return json.dumps(d).encode()


def test_commit_record_out_of_range_names_its_version_and_kind():
    assert records.parse_commit(_record(), "s/commit.json").version == 1
    with pytest.raises(records.MalformedRecordError, match=r"^s/commit.json: inconsistent commit record .*: "
                                                           r"version -4, kind 'delta'$"):
        records.parse_commit(_record(version=-4), "s/commit.json")


@pytest.mark.parametrize(("change", "field", "found", "want"), [
    ({"delta": {"key": "v/000000000001/delta", "bytes": "10", "blake3": "0" * 64}}, "delta.bytes", "'10'",
     "a non-negative integer"),
    ({"delta": {"key": "v/000000000001/delta", "bytes": 10, "blake3": 7}}, "delta.blake3", "7",
     "64 lowercase hex digits"),
    ({"delta": {"key": ["v"], "bytes": 10, "blake3": "0" * 64}}, "delta.key", r"\['v'\]", "a string"),
    ({"fingerprint": 5}, "fingerprint", "5", "a string"),
    ({"step": "3"}, "step", "'3'", "an integer or null"),
    ({"version": True}, "version", "True", "an integer"),
    ({"publisher": None}, "publisher", "None", "a string"),
    ({"kind": "keyframe", "keyframe": [[3, {"key": "v/000000000001/k", "bytes": 1, "blake3": "0" * 64}]]},
     r"keyframe\[0\]", ".*", r"a \[file name, object\] pair"),
    ({"signature": ["ed25519"]}, "signature", ".*", "an object of string alg, key_id and sig"),
])
def test_commit_record_field_of_the_wrong_type_is_named(change, field, found, want):
    """Each field of a plain record is checked for its type, as the sharded parser checks its own: a
    one-line refusal naming the field, what it holds and what it must be."""
    with pytest.raises(records.MalformedRecordError, match=rf"^s/commit.json: malformed commit record: {field} is "
                                                           rf"{found}, not {want}$"):
        records.parse_commit(_record(**change), "s/commit.json")


def test_commit_record_over_the_limit_names_its_size_and_the_limit():
    with pytest.raises(records.MalformedRecordError, match=rf"of {records.MAX_RECORD_BYTES + 1} bytes exceeds "
                                                           r"the limit \(4 MiB\)$"):
        records.parse_commit(b" " * (records.MAX_RECORD_BYTES + 1), "s/commit.json")


def test_delta_manifest_counts_out_of_range_name_the_values():
    from deltarefit.format import _tensor_entry

    meta = {"dtype": "F32", "shape": [4], "digest": "0" * 64}
    t = {"name": "w", "op": "add", "base": None, "target": meta, "changed": 4, "first": 0, "count": 4}
    assert _tensor_entry(t, "x.delta: tensor #0").count == 4
    with pytest.raises(errors.FormatError, match=r"^x.delta: tensor 'w': changed/first/count must be non-negative "
                                                 r"integers below 2\*\*62, got \[4, -1, 4\]$"):
        _tensor_entry({**t, "first": -1}, "x.delta: tensor #0")


def test_checkpoint_index_over_the_limit_names_its_size(tmp_path):
    from deltarefit.checkpoint import INDEX_NAME, MAX_HEADER_BYTES, open_checkpoint

    size = MAX_HEADER_BYTES + (1 << 20)
    with open(tmp_path / INDEX_NAME, "wb") as f:
        f.truncate(size)  # sparse: no disk is written for the zeros
    with pytest.raises(errors.CheckpointError, match=rf"{INDEX_NAME}: {size} bytes, larger than the 100 MiB limit$"):
        open_checkpoint(str(tmp_path))


def test_relay_frame_over_the_limits_names_its_size():
    import asyncio

    from deltarefit.relay.protocol import MAX_HEADER, MAX_PAYLOAD, Channel

    async def go() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            ch = Channel(reader, writer, b"k" * 32, b"k" * 32, peer="127.0.0.1:1")
            with pytest.raises(protocol.ProtocolError, match=rf"^frame to 127.0.0.1:1 of 2\+{MAX_PAYLOAD + 1} "
                                                            rf"bytes, over the size limits \({MAX_HEADER}\+{MAX_PAYLOAD}\)$"):
                await ch.send({}, bytes(MAX_PAYLOAD + 1))
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    asyncio.run(asyncio.wait_for(go(), 30))
