"""The error hierarchy: one closed set in ``deltarefit.errors``, re-exported where each is raised."""

from __future__ import annotations

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

