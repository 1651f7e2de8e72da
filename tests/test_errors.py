"""The error hierarchy: one closed set in ``deltarefit.errors``, re-exported where each is raised, and
a worker's error rebuilt on the driver as its own class from its name alone."""

from __future__ import annotations

import json

import pytest

import deltarefit
from deltarefit import errors
from deltarefit.relay import protocol
from deltarefit.signing import SignatureError
from deltarefit.storage.base import StoreError
from deltarefit.stream import publisher, records
from deltarefit.transport import torchdist

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
