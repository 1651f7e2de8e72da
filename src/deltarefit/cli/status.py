"""The command line's ``deltarefit status CKPT``: which stream and version a checkpoint holds and whether
it is behind (``stream.status``; read-only). Registers on ``cli.main``."""

from __future__ import annotations

import json

import click

from .common import _json, _run, _threads, main

STATUS_EXAMPLES = """
\b
Examples:
  deltarefit status rollout/model.safetensors
  deltarefit status rollout/model.safetensors --store s3://bucket/run7 --json
  deltarefit status rollout/ --verify
"""


@main.command(epilog=STATUS_EXAMPLES)
@click.argument("checkpoint", type=click.Path())
@click.option("--store", default=None,
              help="Compare with this store's head (a directory or s3://bucket/prefix; default: the store the "
                   "version record names).")
@click.option("--verify", is_flag=True,
              help="Hash the checkpoint (a pass over every byte): check it holds the recorded version; without a "
                   "record, look its fingerprint up in the store.")
@click.option("--verify-key", "public_key", type=click.Path(exists=True), default=None,
              help="Refuse store records (the head's, the held version's) not signed by this Ed25519 public key.")
@_threads
@_json
def status(checkpoint: str, store: str | None, verify: bool, public_key: str | None, threads: int | None,
           as_json: bool) -> None:
    """Say which stream and version CHECKPOINT holds (its version record, written by 'deltarefit sync'),
    and whether it is behind the store's head. Writes nothing; exits 0 whatever the state (--json's
    "state" tells it to a script)."""

    def go() -> None:
        from ..stream.status import checkpoint_status

        s = checkpoint_status(checkpoint, store=store, verify=verify, threads=threads, public_key=public_key)
        if as_json:
            click.echo(json.dumps(s.as_dict(), indent=2))
            return
        for line in lines(s, checkpoint):
            click.echo(printable(line))

    _run(go)


def printable(line: str) -> str:
    """``line`` with every character a terminal would act on (escape sequences, carriage returns, bidi
    controls) written as its Python escape: a record's fields are anyone's text."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in line)


def lines(s, name: str) -> list[str]:
    """The human form: a few one-line facts, the fix last."""
    where = f"store {s.store} ({s.store_from})" if s.store else None
    if s.version is None:
        out = [f"{name}: no version record ({s.record}): not synced from a stream here"]
        if s.hashed is not None:
            out.append(f"fingerprint {s.hashed} (hashed now)")
            if s.store and s.found_version is not None:
                out.append(f"that fingerprint is version {s.found_version} of {where}, head version {s.head}: "
                           f"'{s.fix}' adopts it")
            elif s.store:
                out.append(f"that fingerprint is no version of {where} (another model, or edited): '{s.fix}' "
                           "replaces it from the newest keyframe")
            else:
                out.append(f"'{s.fix}' adopts it by its fingerprint, or replaces it from the newest keyframe")
        else:
            out.append(f"'{s.fix}' adopts it by its fingerprint (--verify looks it up first) or replaces it from "
                       "the newest keyframe")
        return out
    stream = f"stream {s.stream_id}" if s.stream_id else "a stream with no recorded identity"
    out = [f"{name}: version {s.version} of {stream}"]
    if s.hashed is not None:
        same = "the recorded one" if s.hashed == s.fingerprint else f"NOT the recorded {s.fingerprint}"
        out.append(f"fingerprint {s.hashed} (hashed now: {same})")
    else:
        files = ("files unchanged since verified" if s.files_unchanged else
                 "files written under a timestamp tick ago, too soon to tell: --verify hashes them" if s.too_soon
                 else "files changed since verified: --verify hashes them")
        out.append(f"fingerprint {s.fingerprint} (recorded; {files})")
    at = f"store {s.store} ({s.store_from}): head version {s.head}"
    if s.state == "modified":
        out.append(f"modified since synced: '{s.fix}' restores version {s.version}'s bytes, or a newer version's")
    elif s.state == "no-store":
        out.append(f"no store recorded to compare with: --store STORE; '{s.fix}' syncs it")
    elif s.state == "at-head":
        out.append(f"{at}; at the head, nothing to sync")
    elif s.state == "behind":
        out.append(f"{at}; {s.behind} version{'s' * (s.behind != 1)} behind: '{s.fix}' brings it there")
    elif s.state == "ahead":
        out.append(f"{at}; ahead of it (store wiped, or another store?): '{s.fix}' follows the store again")
    elif s.state == "other-stream":
        out.append(f"{at}; the store holds another stream (wiped and republished, or another run's store?): "
                   f"'{s.fix}' follows it instead")
    elif s.state == "replaced":
        out.append(f"{at}; its version {s.version} is another fingerprint (store wiped and republished?): "
                   f"'{s.fix}' follows it again")
    return out
