"""The verl checkpoint engine's inputs (``integrations.verl``), each checked before it is used: the
engine's arguments (``engine_kwargs.deltarefit``, types and ranges), the round's handoff a peer writes
in the store (read capped, its shape bounded, then type-checked), the rollout copy's place (a private
directory by default), and the tensors handed to verl (read from the bytes the sync verified).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from typing import Any

import blake3

from ..errors import StreamError, UsageError
from ..io.jsonlimits import brief

SERVED = (None, "BF16", "F16", "F32")
KEYS = ("stream", "state_dir", "signing_key", "verify_key", "served", "keyframe_every", "local_dir", "checkpoint",
        "subscriber_id", "timeout_s", "in_place", "format_version")  # engine_kwargs.deltarefit
HANDOFF_MAX_BYTES = 64 << 10  # the handoff is a version, a fingerprint and a step (or the trainer's error)
MAX_VERSION = 10**12 - 1  # a version is 12 decimal digits in the store (``stream.chain.vkey``)
HANDOFF_PREFIX = "verl/"
LOCAL_PREFIX = "deltarefit-verl"


_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}")  # one name in local_dir and the store: no path
_TOKEN = re.compile(r"[A-Za-z0-9]{1,64}")


def _handoff_key(token: Any) -> str:
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise UsageError(f"deltarefit verl round token {brief(token)}: 1 to 64 ASCII letters and digits only")
    return f"{HANDOFF_PREFIX}{token}.json"


def _refuse(name: str, value: Any, expected: str) -> UsageError:
    return UsageError(f"engine_kwargs.deltarefit.{name} is {type(value).__name__} {brief(value)}; expected {expected}")


def check_kwargs(*, stream: Any, served: Any, keyframe_every: Any, subscriber_id: Any, timeout_s: Any,
                 in_place: Any, **paths: Any) -> None:
    """Refuse (``UsageError``, one line naming the key, the value's type and what is expected) an engine
    argument of the wrong type or range: a configuration typo ends the run at the engine's construction,
    not in the middle of a round. ``subscriber_id`` names the copy inside ``local_dir`` and the store's
    heartbeat: one plain name (letters, digits, ``._@+-``), never a path that leaves them."""
    if not stream or not isinstance(stream, str):
        raise UsageError("engine_kwargs.deltarefit.stream is required: the directory or s3:// URL of the "
                         "version stream (+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltarefit"
                         ".stream=...)" + (f"; got {type(stream).__name__} {brief(stream)}" if stream else ""))
    for name, value in paths.items():  # state_dir, signing_key, verify_key, local_dir, checkpoint
        if value is not None and (not isinstance(value, str) or not value or "\0" in value):
            raise _refuse(name, value, "a non-empty path string, or null")
    if served not in SERVED:
        raise UsageError(f"engine_kwargs.deltarefit.served: {brief(served)}; use BF16, F16, F32 or null")
    if type(keyframe_every) is not int or keyframe_every < 1:
        raise _refuse("keyframe_every", keyframe_every, "an int >= 1")
    if type(timeout_s) not in (int, float) or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise _refuse("timeout_s", timeout_s, "a finite number of seconds > 0")
    if type(in_place) is not bool:
        raise _refuse("in_place", in_place, "true or false")
    if subscriber_id is not None and (not isinstance(subscriber_id, str) or not _ID.fullmatch(subscriber_id)):
        raise _refuse("subscriber_id", subscriber_id, "a name of letters, digits and ._@+- (at most 128, first a "
                      "letter or digit): it names the copy inside local_dir")


def parse_handoff(raw: bytes, where: str, token: str | None) -> dict[str, Any]:
    """The round's handoff (``raw``, read capped at ``HANDOFF_MAX_BYTES``), as any object a peer can write
    is read: its shape bounded before it is parsed (``io.jsonlimits.small_json``: a flat object), then
    every field type-checked. ``StreamError`` naming ``where`` otherwise, or carrying the trainer's error."""
    from ..io.jsonlimits import small_json

    try:
        body = small_json(raw, max_depth=2)
    except ValueError as e:
        raise StreamError(f"{where}: malformed handoff ({e})") from None
    if not isinstance(body, dict):
        raise StreamError(f"{where}: malformed handoff (a JSON {type(body).__name__}, not an object)")
    if "error" in body:
        err = body["error"]
        shown = err[:500] if isinstance(err, str) else brief(err)
        raise StreamError(f"{where.rsplit('/', 2)[0]}: the trainer's publish for round {token} failed: "
                          f"{shown.encode('unicode_escape').decode('ascii')}")
    version, fp, step = body.get("version"), body.get("fingerprint"), body.get("step")
    if (type(version) is not int or not 1 <= version <= MAX_VERSION or not isinstance(fp, str)
            or not 0 < len(fp) <= 128 or not (step is None or type(step) is int)):
        raise StreamError(f"{where}: malformed handoff (version {brief(version)}, fingerprint {brief(fp)}, "
                          f"step {brief(step)}: expected an int version, a fingerprint string, an int or null step)")
    return body


def default_local_dir(*, make: bool = False) -> str:
    """The rollout copies' default directory: this user's private ``deltarefit-verl-UID`` in ``/dev/shm``
    (else the temp directory), made 0700 or reused only when ``io.private`` finds it this user's alone
    (``make``; else only named)."""
    from ..io.private import shared_root, user_dir, user_dir_path

    return (user_dir if make else user_dir_path)(shared_root(prefer_memory=True), LOCAL_PREFIX)


def local_copy(local_dir: str, stream: str, subscriber_id: str) -> str:
    """A rollout worker's copy: one per worker and stream in ``local_dir`` (workers of a host share the dir)."""
    tag = blake3.blake3(stream.encode()).hexdigest(6)
    return os.path.join(os.path.abspath(local_dir), f"{tag}-{subscriber_id}.safetensors")


def _default_id() -> str:
    rank = os.environ.get("RANK")
    return f"verl-{os.uname().nodename}-" + (f"rank{rank}" if rank and rank.isdigit() else f"pid{os.getpid()}")


def verified_tensors(holder: Any) -> Iterator[tuple[str, Any]]:
    """Every tensor of the checkpoint ``holder`` (a ``stream.holder.CheckpointHolder``) holds as verified,
    one at a time, each a CPU tensor of its own: read through the handles ``holder.open_verified`` opened
    (refused unless they are the files the sync verified), never by opening the path again, each copied
    out of the map (the next sync writes it in place) and yielded only once the files are seen unwritten
    since (``still_verified``). A file renamed over the copy, or written in it, after the verification is
    refused (``VerificationError``), and nothing read from it is yielded."""
    import torch

    from ..apply.tensors import torch_dtype
    from ..stream.holder import still_verified

    with holder.open_verified() as ck:
        identity = ck.identity()
        for name, info in ck.tensors.items():
            dtype = torch_dtype(info.dtype)
            if info.nbytes == 0:
                t = torch.empty(info.shape, dtype=dtype)
            else:
                t = torch.frombuffer(bytearray(ck.raw(name)), dtype=torch.uint8).view(dtype).reshape(info.shape)
            still_verified(ck, identity)
            yield name, t
