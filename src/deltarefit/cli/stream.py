"""The command line's version-stream commands: publish, sync, log, retain, and the relay tree's
(``deltarefit relay root|node|keygen``). They register on ``cli.main``; see ``cli`` for exit codes."""

from __future__ import annotations

import json
import sys

import click

from .common import _format_version, _json, _not_an_input, _quiet, _run, _threads, main
from .progress import phases


@main.command()
@click.argument("store")
@click.argument("checkpoint", type=click.Path(exists=True))
@click.option("--step", type=int, default=None, help="Training step to record in the commit.")
@click.option("--state", "state_dir", type=click.Path(), default=None,
              help="Publisher state directory holding the committed baseline (default: STORE/.publisher for a "
                   "directory store, else ~/.cache/deltarefit/publisher-<hash of STORE>).")
@click.option("--keyframe-every", type=click.IntRange(min=1), default=20, show_default=True,
              help="A full keyframe every K versions (the first version always is one).")
@click.option("--keyframe-ratio", type=float, default=0.5, show_default=True,
              help="Also a keyframe once deltas since the last one reach this fraction of a checkpoint.")
@click.option("--quorum", default="0", show_default=True,
              help="Joint commit: wait for this many subscribers to acknowledge, or 'all' live ones (0 = off).")
@click.option("--ack-timeout", type=float, default=60.0, show_default=True, help="Seconds to wait for acks.")
@click.option("--sign", "signing_key", type=click.Path(exists=True), default=None,
              help="Sign the commit record with this Ed25519 private key (see keygen).")
@click.option("--catchup", is_flag=True,
              help="Also ship a delta straight from the newest keyframe (late joiners skip the chain).")
@click.option("--history", is_flag=True,
              help="Also code each delta against the stream's history (the last versions' moves, kept in the "
                   "state directory): smaller deltas for momentum-like training; subscribers keep a book beside "
                   "their checkpoint (docs/STREAMS.md, \"History\").")
@click.option("--advance", type=click.Choice(["copy", "apply"]), default="copy", show_default=True,
              help="Move the baseline to the committed version by a verified copy of CHECKPOINT (fast; a second "
                   "copy on disk for a moment) or by applying the delta in place.")
@click.option("--reset-baseline", is_flag=True,
              help="First rebuild the publisher's baseline and state from the stream (newest keyframe, then the "
                   "deltas to the head): after the baseline was edited, or the store wiped or replaced.")
@click.option("--quarantine-head", is_flag=True,
              help="First set aside head records that can be no version of this stream (malformed, another "
                   "stream's, unsigned in a signed stream, not verifying with --sign's key) to quarantine/.")
@_format_version(None, "Default: the stream's, as this publisher last published it (2 for a new stream, 1 for a "
                       "stream published before the setting existed); a change holds for the versions after it.")
@_threads
@_quiet
@_json
def publish(store, checkpoint, step, state_dir, keyframe_every, keyframe_ratio, quorum, ack_timeout, signing_key,
            catchup, history, advance, reset_baseline, quarantine_head, format_version, threads, quiet,
            as_json) -> None:
    """Commit CHECKPOINT as the next version of the stream in STORE (a directory, or s3://bucket/prefix).

    One publisher per state directory at a time: a second one exits 11 naming the first."""

    def go() -> None:
        from ..errors import UsageError
        from ..stream.publisher import ALL, Publisher
        from .hints import check_kinds, check_order

        check_order("publish", "deltarefit publish STORE CHECKPOINT", (("store", store), ("checkpoint", checkpoint)))
        if quorum != "all" and not quorum.isdigit():
            raise UsageError(f"--quorum must be a number or 'all', not {quorum!r}")
        q = ALL if quorum == "all" else int(quorum)
        from ..storage.base import open_store
        from ..stream.publisher import default_state_dir

        sd = state_dir or default_state_dir(store)
        _not_an_input(sd, checkpoint, signing_key, what="state directory")
        if "://" not in store:
            _not_an_input(store, checkpoint, signing_key, what="store")
        check_kinds("publish", "deltarefit publish STORE CHECKPOINT", (("checkpoint", checkpoint),))
        st = open_store(store)
        pub = Publisher(st, sd, keyframe_every=keyframe_every, keyframe_ratio=keyframe_ratio, quorum=q,
                        ack_timeout=ack_timeout, signing_key=signing_key, threads=threads,
                        catchup=catchup, advance=advance, history=history, format_version=format_version)
        from ..stream.chain import head

        before = head(st)
        with phases(quiet) as pub.progress:  # the encode, then the upload (cli.progress)
            rec = pub.publish(checkpoint, step=step, reset_baseline=reset_baseline, quarantine_head=quarantine_head)
        if as_json:
            click.echo(rec.to_bytes().decode())
        elif rec.version <= before:  # publish returned the committed version: the checkpoint holds it already
            click.echo(f"{store}: already version {rec.version} (fingerprint {rec.fingerprint}); nothing published")
        else:
            click.echo(f"{store}: version {rec.version} ({rec.kind}, {rec.part_bytes:,} bytes) fingerprint "
                       f"{rec.fingerprint}")

    _run(go)


@main.command()
@click.argument("store")
@click.argument("checkpoint", type=click.Path())
@click.option("--to", "to_version", type=click.IntRange(min=1), default=None, help="Stop at this version.")
@click.option("--id", "subscriber_id", default=None, help="Subscriber id (for acks and retention).")
@click.option("--verify-key", "public_key", type=click.Path(exists=True), default=None,
              help="Refuse commit records not signed by this Ed25519 public key.")
@click.option("--prepare", is_flag=True, help="Joint commit: acknowledge a proposed version instead of syncing.")
@click.option("--verify", "full_verify", is_flag=True,
              help="At the head, hash the checkpoint even if its files are unchanged since they were verified.")
@click.option("--repair", is_flag=True,
              help="Ignore the recorded version: adopt the checkpoint by its fingerprint, or restore it from the "
                   "stream's newest keyframe (after an edit, a store wiped and republished, another stream).")
@click.option("--stream-id", default=None, help="Follow only the stream of this identity (see 'log').")
@_threads
@_quiet
@_json
def sync(store, checkpoint, to_version, subscriber_id, public_key, prepare, full_verify, repair, stream_id, threads,
         quiet, as_json) -> None:
    """Bring CHECKPOINT to the newest version of STORE (a directory, or s3://bucket/prefix; it must
    exist) (a CHECKPOINT file missing in an existing directory is created from a keyframe). One run per checkpoint at a time: a
    second one exits 11 naming the first."""

    def go() -> None:
        from ..storage.base import open_store
        from ..stream.subscriber import Subscriber
        from .hints import check_kinds, check_order

        check_order("sync", "deltarefit sync STORE CHECKPOINT", (("store", store), ("checkpoint", checkpoint)))
        _not_an_input(checkpoint, None if "://" in store else store, public_key, what="checkpoint")
        check_kinds("sync", "deltarefit sync STORE CHECKPOINT", (("checkpoint", checkpoint),))
        st = open_store(store, create=False)
        sub = Subscriber(st, checkpoint, subscriber_id=subscriber_id, public_key=public_key, threads=threads,
                         stream_id=stream_id)
        if prepare:
            v = sub.prepare()
            click.echo(f"{checkpoint}: " + (f"acknowledged version {v}" if v else "nothing to acknowledge"))
            return
        with phases(quiet) as sub.progress:  # the download, then each version's apply (cli.progress)
            rep = sub.sync(to_version=to_version, verify=full_verify, repair=repair)
        if as_json:
            click.echo(json.dumps(rep.__dict__, indent=2))
        elif rep.verified and rep.from_version == rep.version and rep.route == "none":
            click.echo(f"{checkpoint}: at version {rep.version}, nothing to do; fingerprint {rep.fingerprint} "
                       "verified")
        elif rep.verified:
            click.echo(f"{checkpoint}: version {rep.from_version} -> {rep.version} via {rep.route} "
                       f"({rep.bytes_fetched:,} bytes fetched) fingerprint {rep.fingerprint} verified")
        else:  # only what was hashed is called verified
            click.echo(f"{checkpoint}: version {rep.version} up to date (files unchanged since verified at version "
                       f"{rep.version}; --verify hashes them) fingerprint {rep.fingerprint}")

    _run(go, where=checkpoint)


@main.command("log")
@click.argument("store")
@click.option("--verify-key", "public_key", type=click.Path(exists=True), default=None,
              help="Check each record's signature with this Ed25519 public key (else 'signed' is unchecked).")
@_json
def log_cmd(store, public_key, as_json) -> None:
    """List the versions of STORE (a directory, or s3://bucket/prefix): parents, kinds, sizes and ratios.

    Malformed records are listed as such (and the exit status is 9); the others are listed still.
    """

    def go() -> None:
        from ..signing import SignatureError, Verifier
        from ..storage.base import open_store
        from ..stream.records import MalformedRecordError, StreamError, list_versions, load_commit

        st = open_store(store, create=False)
        verifier = Verifier(public_key) if public_key else None
        rows, bad = [], []
        for v in list_versions(st):
            verified = None  # without a key a signature is only present, not checked
            try:  # with a key, the signature is checked over the stored bytes before they are parsed
                r = load_commit(st, v, verifier)
                verified = verifier is not None or None
            except MalformedRecordError as e:
                rows.append({"version": v, "malformed": str(e)})
                bad.append(str(e))
                continue
            except SignatureError as e:  # listed unparsed: an untrusted record costs its size, not a parse
                rows.append({"version": v, "signature_verified": False, "signed": "not signed" not in str(e),
                             "refused": str(e)})
                continue
            rows.append({"version": v, "kind": r.kind, "step": r.step, "parent": r.parent, "stream": r.stream,
                         "signature_verified": verified,
                         "fingerprint": r.fingerprint, "delta_bytes": r.delta.bytes if r.delta else None,
                         "keyframe_bytes": sum(p.bytes for _, p in r.keyframe) or None, "full_bytes": r.full_bytes,
                         "catchup_from": r.catchup_from, "catchup_bytes": r.catchup.bytes if r.catchup else None,
                         "history": r.history,
                         "ratio": (r.full_bytes / r.delta.bytes) if r.delta and r.delta.bytes else None,
                         "signed": bool(r.signature), "created": r.created})
        if as_json:
            click.echo(json.dumps(rows, indent=2))
        elif not rows:
            click.echo(f"{store}: no versions yet; the trainer publishes the first: deltarefit publish {store} "
                       "CHECKPOINT")
        for r in [] if as_json else rows:
            if "malformed" in r:
                click.echo(f"v{r['version']:<5} malformed record: {r['malformed']}")
                continue
            if "refused" in r:  # its fields unread: 'log' without --verify-key lists them
                click.echo(f"v{r['version']:<5} not read (log without --verify-key lists it)  "
                           + ("SIGNATURE DOES NOT VERIFY" if r["signed"] else "UNSIGNED"))
                continue
            if r["signature_verified"] is None:
                sig = "  signed (unchecked)" if r["signed"] else ""
            elif r["signature_verified"]:
                sig = "  signed"
            else:
                sig = "  SIGNATURE DOES NOT VERIFY" if r["signed"] else "  UNSIGNED"
            size = f"delta {r['delta_bytes']:,} B ({r['ratio']:.1f}x)" if r["delta_bytes"] else "no delta"
            kf = f", keyframe {r['keyframe_bytes']:,} B" if r["keyframe_bytes"] else ""
            if r["catchup_bytes"]:
                kf += f", catch-up from v{r['catchup_from']} {r['catchup_bytes']:,} B"
            if r["history"]:
                kf += ", with history"
            parent = (r["parent"] or "-")[:12]
            click.echo(f"v{r['version']:<5} {r['kind']:<8} step {r['step']!s:<6} parent {parent:<12} "
                       f"fp {r['fingerprint'][:12]}  {size}{kf}{sig}")
        if bad:  # listed above; still an error, named on stderr
            raise StreamError(bad[-1] if len(bad) == 1 else f"{len(bad)} malformed records; the newest: {bad[-1]}")

    _run(go)


@main.command()
@click.argument("store")
@click.option("--ttl", type=float, default=24 * 3600.0, show_default=True,
              help="Seconds since its last sync after which a subscriber no longer holds back retention.")
@click.option("--orphan-grace", type=float, default=3600.0, show_default=True,
              help="Seconds before uncommitted parts (dead or losing publishes) may be deleted; at least 600, "
                   "and longer than the stream's longest part upload.")
@click.option("--unsafe-short-grace", is_flag=True,
              help="Allow an --orphan-grace under 600 s: only where no publish runs on the stream meanwhile.")
@click.option("--dry-run", is_flag=True, help="List what would be deleted (unfinished uploads too), delete nothing.")
@_json
def retain(store, ttl, orphan_grace, unsafe_short_grace, dry_run, as_json) -> None:
    """Delete parts of STORE (a directory, or s3://bucket/prefix) that no live subscriber or late joiner
    can need, and unfinished uploads of killed publishers."""

    def go() -> None:
        from ..storage.base import open_store
        from ..stream.chain import check_orphan_grace
        from ..stream.retention import retain as ret

        check_orphan_grace(orphan_grace, unsafe_short_grace)  # before the store is opened
        rep = ret(open_store(store, create=False), ttl=ttl, orphan_grace=orphan_grace, dry_run=dry_run,
                  unsafe_short_grace=unsafe_short_grace)
        if as_json:
            click.echo(json.dumps(rep.__dict__, indent=2))
        else:
            verb = "would delete" if dry_run else "deleted"
            click.echo(f"{store}: head {rep.head}, newest keyframe {rep.keyframe}, oldest live subscriber "
                       f"{rep.oldest_live}; {verb} {len(rep.deleted)} objects, kept {rep.kept_bytes:,} bytes of parts")
            for v, why in sorted(rep.malformed.items()):
                click.echo(f"version {v}: malformed record, its objects kept ({why})")

    _run(go)


@main.group()
def relay() -> None:
    """Relay tree: a root serves a version stream; nodes keep their checkpoints in sync and forward it."""


_relay_common = [
    click.option("--listen", required=True, help="HOST:PORT to serve children on (port 0: any free port)."),
    click.option("--key", "key_file", required=True, type=click.Path(exists=True),
                 help="Shared key file (>= 32 bytes, see 'relay keygen'); every connection is authenticated."),
    click.option("--fanout", type=click.IntRange(min=0), default=2, show_default=True, help="Children per relay."),
    click.option("--rate", default=None, help="Pace each connection's sends (link emulation), e.g. 1Gbit, 125MB."),
    click.option("--mirror", default=None, type=click.Path(),
                 help="Directory for this relay's mirror of the stream (default: beside the checkpoint, or a "
                      "per-port cache directory for the root)."),
    click.option("--id", "node_id", default=None, help="Relay id (letters, digits, '-', '_', '.'; default host-port)."),
]


def _relay_opts(f):
    for opt in reversed(_relay_common):
        f = opt(f)
    return f


@relay.command("root")
@click.argument("store")
@_relay_opts
@click.option("--poll", type=float, default=1.0, show_default=True, help="Seconds between looks at the head.")
def relay_root(store, listen, key_file, fanout, rate, mirror, node_id, poll) -> None:
    """Serve the version stream in STORE (a directory or s3://bucket/prefix) to a relay tree."""
    from ..relay import run_root

    _run(lambda: sys.exit(run_root(store, listen=listen, key_file=key_file, fanout=fanout, rate=rate,
                                   mirror=mirror, node_id=node_id, poll=poll)))


@relay.command("node")
@click.argument("checkpoint", type=click.Path())
@click.option("--join", required=True, help="HOST:PORT[,HOST:PORT...] of relays to join (the root first).")
@_relay_opts
@click.option("--until-version", type=click.IntRange(min=1), default=None,
              help="Exit 0 once the checkpoint is verified at this version (and the children are done too).")
def relay_node(checkpoint, join, listen, key_file, fanout, rate, mirror, node_id, until_version) -> None:
    """Keep CHECKPOINT in sync from a relay tree and forward the stream to children."""
    from ..relay import run_node

    _run(lambda: _not_an_input(checkpoint, key_file, mirror, what="checkpoint"))
    _run(lambda: sys.exit(run_node(checkpoint, join=join, listen=listen, key_file=key_file, fanout=fanout,
                                   rate=rate, mirror=mirror, node_id=node_id, until=until_version)))


@relay.command("keygen")
@click.argument("key_file", type=click.Path())
def relay_keygen(key_file) -> None:
    """Write a new random shared key (64 hex digits, mode 0600) to KEY_FILE."""

    def go() -> None:
        from ..relay.protocol import write_key

        try:
            write_key(key_file)
        except FileExistsError:
            from ..errors import UsageError

            raise UsageError(f"{key_file} exists; not overwriting a key (nothing was written): name a new path, or "
                             "remove the old key first") from None
        click.echo(f"wrote {key_file} (copy it to every relay; keep it secret)")

    _run(go)
