"""The subscriber's side of a joint commit (``Subscriber.prepare``): verify a proposed (prepared, not yet
committed) version against the local checkpoint without writing it, and acknowledge it in the store,
where the publisher counts the acks (``Attempts.joint``)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

from ..apply.files import check as check_delta
from ..io.beside import own_dir
from ..storage.base import Store
from .chain import MAX_RECORD_BYTES, get_bounded
from .history import open_book
from .records import check_identity, fetch_part, now, parse_proposal, prepared_key


def acknowledge(store: Store, cur: tuple[int, str] | None, subscriber_id: str, *,
                verifier: Any, stream: Callable[[], str | None],
                staging: str, checkpoint: str, threads: int | None, book_path: str) -> int | None:
    """Acknowledge the version proposed after ``cur`` (the checkpoint's version and fingerprint): a yes
    where its delta, staged in ``staging``, checks against ``checkpoint`` (its history book at
    ``book_path``), else a no with the reason. The proposal must pass ``check_signature(rec, where)``
    and be of the stream ``stream()`` names. Returns the version acknowledged yes, or None (none
    proposed, or a no)."""
    if cur is None:
        return None
    v = cur[0] + 1
    try:
        data = get_bounded(store, prepared_key(v), MAX_RECORD_BYTES, "proposal")
    except KeyError:
        return None
    rec, _ = parse_proposal(data, f"{store.url} proposed version {v}", verifier)
    check_identity(rec, stream(), f"{store.url} proposed version {v}")
    ok, why = True, ""
    if rec.parent != cur[1] or rec.delta is None:
        ok, why = False, "parent is not the local checkpoint"
    else:
        # Refused, not voted on: a link planted at the staging name is never followed.
        dest = os.path.join(own_dir(staging, "staging directory"), rec.delta.key.replace("/", "_"))
        try:
            fetch_part(store, rec.delta, dest)
            check_delta(dest, checkpoint, threads=threads, history=open_book(book_path) if rec.history else None)
        except Exception as e:  # any failure is a "no" vote, and its reason goes into the ack
            ok, why = False, str(e)
    ack = {"ok": ok, "fingerprint": rec.fingerprint, "subscriber": subscriber_id, "why": why, "at": now()}
    store.put(f"acks/{v:012d}/{subscriber_id}.json", json.dumps(ack).encode())
    shutil.rmtree(staging, ignore_errors=True)  # the proposal may never commit; sync fetches again
    return v if ok else None
