"""What a vLLM engine takes from its caller (``deltarefit.engines.vllm.trust``), without vLLM: the backend's
message fields checked when built (the same ``InitFields``/``UpdateFields`` the backend's messages are),
the trust pinned by the engine's environment (``EngineTrust``), and the worker extension's path methods
refusing what those pins do not allow (``DeltaRefitWorkerExtension`` on a bare instance: the refusals come
before any model is touched). A real ``vllm serve`` with pinned trust is in tests/test_vllm_trust.py.
"""

from __future__ import annotations

import logging
import os
import shutil
from types import SimpleNamespace

import pytest
from _stream_util import make_chain, run_ok

import deltarefit
from deltarefit.engines.vllm import trust as trust_mod
from deltarefit.engines.vllm.extension import DeltaRefitWorkerExtension
from deltarefit.engines.vllm.trust import (
    ENV_STREAMS,
    ENV_VERIFY_KEY,
    EngineTrust,
    InitFields,
    UpdateFields,
    parse_message,
)
from deltarefit.errors import UntrustedError, UsageError
from deltarefit.storage import LocalStore
from deltarefit.stream import Publisher
from deltarefit.stream.records import load_commit

# ------------------------------------------------------------------------------------ argument types


@pytest.mark.parametrize("value, shown", [("3", "str '3'"), (2.5, "float 2.5"), ([1], "list"),
                                          (10**5000, "an int of 16610 bits"), (True, "bool True"), (0, "is 0"),
                                          (-1, "is -1"), (10**12, "is 1000000000000"), ({"v": 1}, "dict")],
                         ids=["str", "float", "list", "huge", "bool", "zero", "negative", "13-digits", "dict"])
def test_a_version_of_the_wrong_type_or_range_is_refused_in_one_line(value, shown):
    for build in (lambda: UpdateFields(version=value), lambda: InitFields(stream="/s", version=value),
                  lambda: parse_message(UpdateFields, {"version": value}, "update_info")):
        with pytest.raises(UsageError) as e:
            build()
        msg = str(e.value)
        assert "\n" not in msg and ".version is " in msg and shown in msg and "expected an int from 1" in msg, msg


@pytest.mark.parametrize("fields, words", [
    ({"verify": 1}, ["update_info.verify is int 1", "true or false"]),
    ({"prepare": "yes"}, ["update_info.prepare is str 'yes'", "true or false"]),
    ({"stream": 5}, ["update_info.stream is int 5", "a non-empty string"]),
    ({"stream": ""}, ["update_info.stream is str ''", "a non-empty string"]),
])
def test_update_fields_of_the_wrong_type_are_refused_naming_field_type_and_expectation(fields, words):
    with pytest.raises(UsageError) as e:
        UpdateFields(**fields)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("fields, words", [
    ({"stream": None}, ["init_info.stream is NoneType", "a non-empty string"]),
    ({"stream": ["/s"]}, ["init_info.stream is list"]),
    ({"stream": "/s", "verify_key": 3}, ["init_info.verify_key is int 3"]),
    ({"stream": "/s", "checkpoint": b"/c"}, ["init_info.checkpoint is bytes"]),
    ({"stream": "/s", "apply_cpus": "all"}, ["init_info.apply_cpus is str 'all'", "'worker' or 'node'"]),
    ({"stream": "/s\0x"}, ["init_info.stream is str"]),
])
def test_init_fields_of_the_wrong_type_are_refused_naming_field_type_and_expectation(fields, words):
    with pytest.raises(UsageError) as e:
        InitFields(**fields)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)


def test_messages_that_are_no_object_of_the_fields_are_refused_in_one_line():
    for message, words in [([1], ["update_info is list", "a JSON object"]), (2.5, ["update_info is float"]),
                           ({"version": 2, "bogus": 1}, ["unknown fields ['bogus']"])]:
        with pytest.raises(UsageError) as e:
            parse_message(UpdateFields, message, "update_info")
        assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(UsageError, match=r"init_info lacks \['stream'\]"):
        parse_message(InitFields, {}, "init_info")
    good = parse_message(UpdateFields, {"version": 3, "prepare": True}, "update_info")
    assert (good.version, good.prepare, good.verify) == (3, True, False)
    assert UpdateFields().version is None and InitFields(stream="s3://b/p").apply_cpus == "node"


# ------------------------------------------------------------------------------------ a signed stream


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """A stream of 3 versions signed by key ``k``, another key ``other``, and the checkpoints."""
    d = tmp_path_factory.mktemp("engine-trust")
    chain = make_chain(str(d / "chain"), steps=3)
    key, other = str(d / "k.pem"), str(d / "other.pem")
    run_ok("keygen", key)
    run_ok("keygen", other)
    root = str(d / "streams")
    store = os.path.join(root, "s")
    pub = Publisher(store, str(d / "pub"), keyframe_every=5, keyframe_ratio=1000.0, signing_key=key)
    for ck in chain:
        pub.publish(ck)
    unsigned = os.path.join(root, "unsigned")
    upub = Publisher(unsigned, str(d / "upub"), keyframe_every=5, keyframe_ratio=1000.0)
    for ck in chain:
        upub.publish(ck)
    return SimpleNamespace(d=d, chain=chain, key=key, pub=key + ".pub", other=other + ".pub", root=root,
                           store=store, unsigned=unsigned)


def _delta(store: str, version: int) -> str:
    rec = load_commit(LocalStore(store), version)
    return os.path.join(store, rec.delta.key)


# ------------------------------------------------------------------------------------ pinned trust


def test_the_environment_is_parsed_once_and_a_pin_that_cannot_hold_is_refused(signed, tmp_path):
    t = EngineTrust.from_env({ENV_VERIFY_KEY: signed.pub, ENV_STREAMS: f" {signed.root}/ ,s3://b/runs/, ,"})
    assert t.pinned and t.key_id and t.urls == ("s3://b/runs",) and t.roots == (os.path.realpath(signed.root),)
    assert not EngineTrust.from_env({ENV_VERIFY_KEY: " ", ENV_STREAMS: ""}).pinned
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    for bad, words in [(fifo, "not a regular file"), ("/dev/zero", "not a regular file"),
                       (signed.key, "cannot load a public key"), (str(tmp_path / "none"), "cannot open")]:
        with pytest.raises(UsageError, match=words) as e:
            EngineTrust.from_env({ENV_VERIFY_KEY: bad})
        assert str(e.value).startswith(ENV_VERIFY_KEY) and "\n" not in str(e.value)
    with pytest.raises(UsageError, match="relative path"):
        EngineTrust.from_env({ENV_STREAMS: "streams/s"})


def test_a_pinned_key_refuses_an_init_that_names_another_key_or_none(signed, tmp_path):
    t = EngineTrust.from_env({ENV_VERIFY_KEY: signed.pub})
    with pytest.raises(UntrustedError, match=f"names no verify_key; this engine pins key {t.key_id}"):
        t.check_init(signed.store, None)
    with pytest.raises(UntrustedError, match=f"is key .*; this engine pins key {t.key_id}"):
        t.check_init(signed.store, signed.other)
    with pytest.raises(UntrustedError, match="not a regular file"):
        t.check_init(signed.store, "/dev/zero")
    copy = str(tmp_path / "same.pub")
    shutil.copy(signed.pub, copy)
    # the pinned key is what records are checked with, whichever path names it
    assert t.check_init(signed.store, copy) == t.check_init(signed.store, signed.pub) == os.path.abspath(signed.pub)


def test_pinned_streams_refuse_an_init_naming_a_stream_outside_them(signed, tmp_path):
    t = EngineTrust.from_env({ENV_STREAMS: f"{signed.root},s3://bucket/runs"})
    for ok in (signed.store, signed.root, "file://" + signed.store, "s3://bucket/runs", "s3://bucket/runs/a/"):
        t.check_stream(ok)
    link = str(tmp_path / "link")
    os.symlink(signed.root, link)
    t.check_stream(os.path.join(link, "s"))  # by its real path
    escape = os.path.join(signed.root, "esc")
    os.symlink(str(tmp_path), escape)
    try:
        for bad in (str(tmp_path / "other"), signed.root + "-x", escape, os.path.join(signed.root, "..", "x"),
                    "s3://bucket/runs-x", "s3://bucket", "memory://runs"):
            with pytest.raises(UntrustedError, match=f"is not one this engine trusts.*{ENV_STREAMS}"):
                t.check_stream(bad)
    finally:
        os.unlink(escape)
    assert t.check_init(signed.store, signed.other) == signed.other  # no key pinned: the caller's


def test_nothing_pinned_takes_the_callers_stream_and_key_and_warns_once(signed, caplog, monkeypatch):
    monkeypatch.setattr(trust_mod, "_WARNED", [False])
    t = EngineTrust.from_env({})
    with caplog.at_level(logging.WARNING, logger="deltarefit.engines.vllm.trust"):
        assert t.check_init("/anywhere", signed.other) == signed.other
        assert t.check_init("/elsewhere", None) is None
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "trust is not pinned" in caplog.records[0].message and len(caplog.records) == 1
    assert t.check_path("/etc/passwd", "delta") == "/etc/passwd"


def test_a_signed_version_is_found_by_fingerprint_and_an_unsigned_one_refused(signed):
    t = EngineTrust.from_env({ENV_VERIFY_KEY: signed.pub})
    fps = [deltarefit.fingerprint(ck) for ck in signed.chain]
    store = LocalStore(signed.store, create=False)
    assert [t.signed_version(store, fp, "x") for fp in fps] == [1, 2, 3]
    with pytest.raises(UntrustedError, match=r"which no version of .* signed by key"):
        t.signed_version(LocalStore(signed.unsigned, create=False), fps[1], "delta d")
    with pytest.raises(UntrustedError, match="delta d leads to 0000000000000000"):
        t.signed_version(store, "0" * 64, "delta d")


# ------------------------------------------------------------------------------------ the extension's paths


@pytest.fixture
def pin(monkeypatch):
    """Pin the trust of this process (as a worker's environment would) and read it afresh."""

    def set_env(**env: str) -> EngineTrust:
        for k in (ENV_VERIFY_KEY, ENV_STREAMS):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(trust_mod, "_TRUST", [])
        return trust_mod.engine_trust()

    return set_env


def _worker(own: str) -> DeltaRefitWorkerExtension:
    """The extension as mixed into a worker, before any model: what it reads of the worker is the directory
    the engine was loaded from (``vllm_config.model_config.model``)."""
    w = DeltaRefitWorkerExtension()
    w.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=own))
    return w


def _refused(report: dict, *words: str) -> None:
    assert report["ok"] is False and report["error_type"] == "UntrustedError", report
    assert "\n" not in report["error"] and all(w in report["error"] for w in words), report["error"]


def test_path_methods_take_only_paths_under_the_pinned_roots(signed, tmp_path, pin):
    pin(**{ENV_STREAMS: signed.root})
    own = str(tmp_path / "own")
    os.makedirs(own)
    w = _worker(own)
    outside = str(tmp_path / "d.delta")
    shutil.copy(_delta(signed.store, 2), outside)
    planted = os.path.join(signed.root, "planted.delta")  # a link under the root to a file outside it
    os.symlink(outside, planted)
    try:
        for delta in (outside, planted, "/etc/passwd"):
            _refused(w.apply_delta(delta, own), "delta", "lies outside what this engine trusts", ENV_STREAMS)
            _refused(w.deltarefit_live_apply(delta, own), "delta", "lies outside")
            _refused(w.deltarefit_live_prepare(delta, own), "delta", "lies outside")
    finally:
        os.unlink(planted)
    _refused(w.apply_delta(_delta(signed.store, 2), str(tmp_path)), "checkpoint directory", "lies outside")
    _refused(w.deltarefit_reload_all("/"), "checkpoint directory /", "lies outside")
    with pytest.raises(UntrustedError, match="checkpoint directory"):
        w.deltarefit_verify(str(tmp_path))
    # the delta under the root and the engine's own directory pass the pins (and fail later, on no model here)
    r = w.apply_delta(_delta(signed.store, 2), own)
    assert r["ok"] is False and r["error_type"] != "UntrustedError", r


def test_a_pinned_key_takes_a_delta_by_path_only_when_a_signed_version_holds_its_target(signed, tmp_path, pin):
    pin(**{ENV_VERIFY_KEY: signed.pub})
    own = str(tmp_path / "own")
    os.makedirs(own)
    w = _worker(own)
    # no backend initialized: nothing names the stream whose signed versions decide
    _refused(w.apply_delta(_delta(signed.store, 2), own), "pins a verify key", ENV_VERIFY_KEY, "update_weights")
    _refused(w.deltarefit_live_apply(_delta(signed.store, 2), own), "pins a verify key")
    # a backend that follows the signed stream: a delta of the unsigned one leads to the same weights (the
    # same chain), so it is taken; one whose target no signed version holds is refused, and its private copy
    # is gone
    w.weight_transfer_engine = SimpleNamespace(info=SimpleNamespace(stream=signed.store), follower=None)
    before = set(os.listdir(os.environ.get("TMPDIR", "/tmp")))
    other = make_chain(str(signed.d / "other-chain"), steps=2, seed=7)
    opub = Publisher(str(tmp_path / "o"), str(tmp_path / "opub"), keyframe_every=5, keyframe_ratio=1000.0)
    for ck in other:
        opub.publish(ck)
    foreign = _delta(str(tmp_path / "o"), 2)
    for call in (w.apply_delta, w.deltarefit_live_apply, w.deltarefit_live_prepare):
        _refused(call(foreign, own), "which no version of", "signed by key")
    assert not {n for n in set(os.listdir(os.environ.get("TMPDIR", "/tmp"))) - before
                if n.startswith("deltarefit-checked-")}
    r = w.apply_delta(_delta(signed.unsigned, 2), own)  # same target as signed version 2: past the pins
    assert r["ok"] is False and r["error_type"] != "UntrustedError", r
