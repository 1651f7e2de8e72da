"""Command line: parse, call one library function, render errors as one line with an exit code.

Exit codes: each error's ``exit_code`` (``deltarefit.errors``; a subclass exits as its parent, named in
parentheses). Usage errors too are one line, exit 2, click's own included.

    0    ok
    1    DeltaRefitError     unexpected
    2    UsageError          usage: an option combination or argument that cannot work
    3    FormatError         bad delta: malformed or corrupt (UnsupportedVersionError, IntegrityError,
                             LimitError, DecodeError)
    4    CheckpointError     bad checkpoint: unreadable, or cannot be written
    5    BaseMismatchError   wrong base: the checkpoint is not the delta's base (nothing written)
    6    VerificationError   verification: a result does not match its fingerprint or digest
    7    StoreError          storage: I/O, permissions, a lost connection
    8    SignatureError      signature: a commit record unsigned, or its signature does not verify
    9    StreamError         version stream: broken chain, lost publish race, no route, another stream
                             (MalformedRecordError, StreamIdentityError, PublishError, BroadcastError)
    10   ProtocolError       relay: failed authentication, a bad frame or part, a relay not reached
                             (AuthError, BadPartError)
    11   LockedError         locked: another run holds the checkpoint or the publisher state (the
                             message names its pid)
    130  interrupted
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click

from . import __version__
from .errors import DeltaRefitError

log = logging.getLogger("deltarefit")

ENCODE_EXAMPLES = """
\b
Examples:
  deltarefit encode base.safetensors new.safetensors -o step42.delta
  deltarefit encode ckpt/step41 ckpt/step42 -o step42.delta --threads 8
"""
APPLY_EXAMPLES = """
\b
Examples:
  deltarefit apply step42.delta rollout/model.safetensors
  deltarefit apply step42.delta rollout/ --quiet
"""


def _progress_enabled(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty() and os.environ.get("DELTAREFIT_NO_PROGRESS", "") in ("", "0")


@contextmanager
def _progress(label: str, total: int, quiet: bool) -> Iterator[Callable[[int], None] | None]:
    """A rich progress bar on stderr over ``total`` bytes; None when stderr is not a terminal or --quiet."""
    if not _progress_enabled(quiet) or total <= 0:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), transient=True, console=_stderr_console()) as p:
        task = p.add_task(label, total=total)
        yield lambda n: p.update(task, advance=n)


@contextmanager
def _transfer_progress(store, label: str, quiet: bool) -> Iterator[None]:
    """Bytes moved in or out of ``store`` (a Store) as a progress bar on stderr, for the duration;
    nothing when stderr is not a terminal or --quiet. The total is not known ahead (the route and
    the parts are chosen inside), so the bar shows bytes and speed."""
    from .storage.base import SET_PROGRESS

    if not _progress_enabled(quiet) or SET_PROGRESS not in store.capabilities:
        yield
        return
    from rich.progress import DownloadColumn, Progress, SpinnerColumn, TransferSpeedColumn

    with Progress(SpinnerColumn(), "[progress.description]{task.description}", DownloadColumn(),
                  TransferSpeedColumn(), transient=True, console=_stderr_console()) as p:
        task = p.add_task(label, total=None)
        store.set_progress(lambda n: p.update(task, advance=n))
        try:
            yield
        finally:
            store.set_progress(None)


def _output_dir(output: str) -> None:
    """Refuse an output path whose directory does not exist, before any work."""
    from .errors import UsageError

    d = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(d):
        raise UsageError(f"{output}: directory {d} does not exist")


def _names(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def _ckpt_bytes(path: str) -> int:
    from .checkpoint import open_checkpoint

    with open_checkpoint(path) as ck:
        return sum(t.nbytes for t in ck.tensors.values())


def _run(fn: Callable[[], None]) -> None:
    try:
        fn()
    except DeltaRefitError as e:
        click.echo(f"deltarefit: error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("deltarefit: interrupted", err=True)
        sys.exit(130)


class _Group(click.Group):
    """click's group, with its usage errors (unknown option, missing argument) as one line and exit 2,
    like every other error, instead of a usage block."""

    def main(self, *args, **kwargs):
        kwargs["standalone_mode"] = False
        kwargs.setdefault("prog_name", "deltarefit")  # not "python -m deltarefit"
        try:
            rv = super().main(*args, **kwargs)
        except click.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else "deltarefit"
            msg = " ".join(e.format_message().split())
            click.echo(f"deltarefit: error: {where}: {msg} (see '{where} --help')", err=True)
            sys.exit(2)
        except click.ClickException as e:
            click.echo(f"deltarefit: error: {' '.join(e.format_message().split())}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("deltarefit: interrupted", err=True)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="deltarefit")
@click.option("-v", "--verbose", is_flag=True, help="Log progress details to stderr.")
def main(verbose: bool) -> None:
    """Bit-exact compressed weight deltas for RL refit: encode, apply in place, verify."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


_threads = click.option("--threads", type=click.IntRange(min=1), default=None,
                        help="Worker threads (default: available cores, at most 8).")
_quiet = click.option("-q", "--quiet", is_flag=True, help="No progress bar (also off when stderr is not a tty).")
_json = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


@main.command(epilog=ENCODE_EXAMPLES)
@click.argument("base", type=click.Path(exists=True))
@click.argument("target", type=click.Path(exists=True))
@click.option("-o", "--output", required=True, type=click.Path(), help="Delta file to write (atomically).")
@_threads
@_quiet
@_json
def encode(base: str, target: str, output: str, threads: int | None, quiet: bool, as_json: bool) -> None:
    """Encode the delta taking checkpoint BASE to checkpoint TARGET (a .safetensors file or HF directory)."""

    def go() -> None:
        from .encode import encode as enc

        _output_dir(output)
        with _progress("encode", _ckpt_bytes(target) if _progress_enabled(quiet) else 0, quiet) as cb:
            rep = enc(base, target, output, threads=threads, progress=cb)
        summary = {
            "delta": output, "delta_bytes": rep.delta_bytes, "full_bytes": rep.full_bytes, "ratio": rep.ratio,
            "changed_fraction": rep.changed_fraction, "seconds": rep.seconds,
            "base_fingerprint": rep.base_fingerprint, "target_fingerprint": rep.target_fingerprint,
        }
        if as_json:
            click.echo(json.dumps(summary, indent=2))
        else:
            click.echo(f"{output}: {rep.delta_bytes:,} bytes, {rep.ratio:.1f}x smaller than the full checkpoint "
                       f"({rep.full_bytes:,} bytes), {100 * rep.changed_fraction:.3f}% of elements changed, "
                       f"{rep.seconds:.2f} s")
            click.echo(f"target fingerprint {rep.target_fingerprint}")

    _run(go)


@main.command(epilog=APPLY_EXAMPLES)
@click.argument("delta", type=click.Path())
@click.argument("checkpoint", type=click.Path())
@_threads
@_quiet
@_json
def apply(delta: str, checkpoint: str, threads: int | None, quiet: bool, as_json: bool) -> None:
    """Apply DELTA to CHECKPOINT in place. Verifies the base first and the target fingerprint last.

    Idempotent and crash-safe: running it again after an interruption finishes the job; running it on
    a checkpoint that already is the target changes nothing.
    """

    def go() -> None:
        from .apply import apply as ap

        with _progress("apply", _ckpt_bytes(checkpoint) if _progress_enabled(quiet) else 0, quiet) as cb:
            rep = ap(delta, checkpoint, threads=threads, progress=cb)
        if as_json:
            click.echo(json.dumps(rep.__dict__, indent=2))
        else:
            tensors = ""
            for op, verb in (("add", "added"), ("remove", "removed"), ("replace", "replaced")):
                names = [n for n in rep.structural if rep.structural_ops.get(n) == op]
                if names:
                    tensors += f"; {verb} {len(names)} tensor{'s' * (len(names) != 1)} ({_names(names)})"
            click.echo(f"{checkpoint}: applied {rep.chunks_applied} chunks ({rep.chunks_skipped} already done, "
                       f"{rep.chunks_recovered} recovered){tensors} in {rep.seconds:.2f} s; "
                       f"fingerprint {rep.target_fingerprint} verified")

    _run(go)


@main.command()
@click.argument("delta", type=click.Path())
@_json
@click.option("--all", "show_all", is_flag=True, help="List unchanged tensors too.")
def inspect(delta: str, as_json: bool, show_all: bool) -> None:
    """Show what DELTA changes: per tensor elements, changed fraction, encodings and bytes; totals and ratio."""

    def go() -> None:
        from .api import inspect as ins

        info = ins(delta)
        if as_json:
            click.echo(json.dumps(info, indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{delta}  ({info['delta_bytes']:,} bytes, {info['ratio']:.1f}x)")
        for col in ("tensor", "op", "dtype", "elements", "changed", "bytes", "encodings"):
            table.add_column(col, justify="right" if col in ("elements", "changed", "bytes") else "left")
        for t in info["tensors"]:
            if t["op"] == "same" and not show_all:
                continue
            enc = " ".join(f"{k}:{v}" for k, v in sorted(t["encodings"].items()))
            table.add_row(t["name"], t["op"], t["dtype"], f"{t['elements']:,}",
                          f"{100 * t['changed_fraction']:.3f}%", f"{t['bytes']:,}", enc)
        Console(width=160).print(table)
        click.echo(f"total: {info['changed_elements']:,} of {info['total_elements']:,} elements changed "
                   f"({100 * info['changed_fraction']:.3f}%); delta {info['delta_bytes']:,} bytes vs full "
                   f"{info['full_bytes']:,} bytes: {info['ratio']:.1f}x")
        click.echo(f"base   {info['base_fingerprint']}\ntarget {info['target_fingerprint']}")

    _run(go)


@main.command()
@click.argument("checkpoint", type=click.Path())
@_threads
@_json
def fingerprint(checkpoint: str, threads: int | None, as_json: bool) -> None:
    """Print the layout-independent fingerprint of CHECKPOINT (file or directory)."""

    def go() -> None:
        from .checkpoint import fingerprint_checkpoint, open_checkpoint

        with open_checkpoint(checkpoint) as ck:
            fp, digests = fingerprint_checkpoint(ck, threads=threads)
        if as_json:
            click.echo(json.dumps({"fingerprint": fp, "tensors": {k: v.hex() for k, v in digests.items()}}, indent=2))
        else:
            click.echo(fp)

    _run(go)


@main.command()
@click.argument("checkpoint", type=click.Path())
@click.argument("expected")
@_threads
def verify(checkpoint: str, expected: str, threads: int | None) -> None:
    """Exit 0 if CHECKPOINT's fingerprint is EXPECTED, else 6 with a one-line error."""

    def go() -> None:
        from .api import verify as ver

        click.echo(f"{checkpoint}: fingerprint {ver(checkpoint, expected, threads=threads)} verified")

    _run(go)


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
@click.option("--advance", type=click.Choice(["copy", "apply"]), default="copy", show_default=True,
              help="Move the baseline to the committed version by a verified copy of CHECKPOINT (fast; a second "
                   "copy on disk for a moment) or by applying the delta in place.")
@click.option("--reset-baseline", is_flag=True,
              help="First rebuild the publisher's baseline and state from the stream (newest keyframe, then the "
                   "deltas to the head): after the baseline was edited, or the store wiped or replaced.")
@click.option("--quarantine-head", is_flag=True,
              help="First set aside head records that can be no version of this stream (malformed, another "
                   "stream's, unsigned in a signed stream, not verifying with --sign's key) to quarantine/.")
@_threads
@_quiet
@_json
def publish(store, checkpoint, step, state_dir, keyframe_every, keyframe_ratio, quorum, ack_timeout, signing_key,
            catchup, advance, reset_baseline, quarantine_head, threads, quiet, as_json) -> None:
    """Commit CHECKPOINT as the next version of the stream in STORE (a directory, or s3://bucket/prefix).

    One publisher per state directory at a time: a second one exits 11 naming the first."""

    def go() -> None:
        from .errors import UsageError
        from .stream.publisher import ALL, Publisher

        if quorum != "all" and not quorum.isdigit():
            raise UsageError(f"--quorum must be a number or 'all', not {quorum!r}")
        q = ALL if quorum == "all" else int(quorum)
        from .storage.base import open_store
        from .stream.publisher import default_state_dir

        sd = state_dir or default_state_dir(store)
        st = open_store(store)
        pub = Publisher(st, sd, keyframe_every=keyframe_every, keyframe_ratio=keyframe_ratio, quorum=q,
                        ack_timeout=ack_timeout, signing_key=signing_key, threads=threads,
                        catchup=catchup, advance=advance)
        with _transfer_progress(st, "publish: upload", quiet):
            rec = pub.publish(checkpoint, step=step, reset_baseline=reset_baseline, quarantine_head=quarantine_head)
        if as_json:
            click.echo(rec.to_bytes().decode())
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
    exist) (CHECKPOINT is created from a keyframe if missing). One run per checkpoint at a time: a
    second one exits 11 naming the first."""

    def go() -> None:
        from .storage.base import open_store
        from .stream.subscriber import Subscriber

        st = open_store(store, create=False)
        sub = Subscriber(st, checkpoint, subscriber_id=subscriber_id, public_key=public_key, threads=threads,
                         stream_id=stream_id)
        if prepare:
            v = sub.prepare()
            click.echo(f"{checkpoint}: " + (f"acknowledged version {v}" if v else "nothing to acknowledge"))
            return
        with _transfer_progress(st, "sync: fetch", quiet):
            rep = sub.sync(to_version=to_version, verify=full_verify, repair=repair)
        if as_json:
            click.echo(json.dumps(rep.__dict__, indent=2))
        elif rep.verified:
            click.echo(f"{checkpoint}: version {rep.from_version} -> {rep.version} via {rep.route} "
                       f"({rep.bytes_fetched:,} bytes fetched) fingerprint {rep.fingerprint} verified")
        else:  # only what was hashed is called verified
            click.echo(f"{checkpoint}: version {rep.version} up to date (files unchanged since verified at version "
                       f"{rep.version}; --verify hashes them) fingerprint {rep.fingerprint}")

    _run(go)


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
        from .signing import SignatureError, Verifier, check_record_signature
        from .storage.base import open_store
        from .stream.records import MalformedRecordError, StreamError, list_versions, load_commit

        st = open_store(store, create=False)
        verifier = Verifier(public_key) if public_key else None
        rows, bad = [], []
        for v in list_versions(st):
            try:
                r = load_commit(st, v)
            except MalformedRecordError as e:
                rows.append({"version": v, "malformed": str(e)})
                bad.append(str(e))
                continue
            verified = None  # without a key a signature is only present, not checked
            if verifier is not None:
                try:
                    check_record_signature(r.signature, r.signed_bytes(), verifier, f"version {v}")
                    verified = True
                except SignatureError:
                    verified = False
            rows.append({"version": v, "kind": r.kind, "step": r.step, "parent": r.parent, "stream": r.stream,
                         "signature_verified": verified,
                         "fingerprint": r.fingerprint, "delta_bytes": r.delta.bytes if r.delta else None,
                         "keyframe_bytes": sum(p.bytes for _, p in r.keyframe) or None, "full_bytes": r.full_bytes,
                         "catchup_from": r.catchup_from, "catchup_bytes": r.catchup.bytes if r.catchup else None,
                         "ratio": (r.full_bytes / r.delta.bytes) if r.delta and r.delta.bytes else None,
                         "signed": bool(r.signature), "created": r.created})
        if as_json:
            click.echo(json.dumps(rows, indent=2))
        for r in [] if as_json else rows:
            if "malformed" in r:
                click.echo(f"v{r['version']:<5} malformed record: {r['malformed']}")
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
              help="Seconds before uncommitted parts (dead or losing publishes) may be deleted.")
@click.option("--dry-run", is_flag=True, help="List what would be deleted (unfinished uploads too), delete nothing.")
@_json
def retain(store, ttl, orphan_grace, dry_run, as_json) -> None:
    """Delete parts of STORE (a directory, or s3://bucket/prefix) that no live subscriber or late joiner
    can need, and unfinished uploads of killed publishers."""

    def go() -> None:
        from .storage.base import open_store
        from .stream.retention import retain as ret

        rep = ret(open_store(store, create=False), ttl=ttl, orphan_grace=orphan_grace, dry_run=dry_run)
        if as_json:
            click.echo(json.dumps(rep.__dict__, indent=2))
        else:
            verb = "would delete" if dry_run else "deleted"
            click.echo(f"{store}: head {rep.head}, newest keyframe {rep.keyframe}, oldest live subscriber "
                       f"{rep.oldest_live}; {verb} {len(rep.deleted)} objects, kept {rep.kept_bytes:,} bytes of parts")
            for v, why in sorted(rep.malformed.items()):
                click.echo(f"version {v}: malformed record, its objects kept ({why})")

    _run(go)


@main.command()
@click.argument("private_key", type=click.Path())
def keygen(private_key) -> None:
    """Write a new Ed25519 signing key to PRIVATE_KEY and its public key to PRIVATE_KEY.pub."""

    def go() -> None:
        from .signing import keygen as kg

        click.echo(f"wrote {private_key} (keep it secret) and {kg(private_key)}")

    _run(go)


@main.command()
@click.argument("deltas", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("-o", "--output", required=True, type=click.Path(), help="Composed delta to write.")
@click.option("--base", required=True, type=click.Path(exists=True),
              help="The checkpoint the first delta applies to (read only; chunk contexts come from it).")
@_quiet
def compose(deltas, output, base, quiet) -> None:
    """Compose DELTAS (applied in order) into one delta equal to them bit for bit."""

    def go() -> None:
        from .compose import compose as comp

        _output_dir(output)
        with _progress("compose", _ckpt_bytes(base) if _progress_enabled(quiet) else 0, quiet) as cb:
            rep = comp(list(deltas), output, base=base, progress=cb)
        click.echo(f"{output}: {rep.delta_bytes:,} bytes, {len(deltas)} deltas composed, target "
                   f"{rep.target_fingerprint}")

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
    from .relay import run_root

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
    from .relay import run_node

    _run(lambda: sys.exit(run_node(checkpoint, join=join, listen=listen, key_file=key_file, fanout=fanout,
                                   rate=rate, mirror=mirror, node_id=node_id, until=until_version)))


@relay.command("keygen")
@click.argument("key_file", type=click.Path())
def relay_keygen(key_file) -> None:
    """Write a new random shared key (64 hex digits, mode 0600) to KEY_FILE."""

    def go() -> None:
        from .relay.protocol import write_key

        try:
            write_key(key_file)
        except FileExistsError:
            from .errors import UsageError

            raise UsageError(f"{key_file} exists; not overwriting a key") from None
        click.echo(f"wrote {key_file} (copy it to every relay; keep it secret)")

    _run(go)


@main.command()
@click.option("--out", default="out/demo", show_default=True, type=click.Path(), help="Working directory.")
@click.option("--steps", default=8, show_default=True, type=click.IntRange(min=1), help="Optimizer steps.")
@click.option("--lr", default=1e-5, show_default=True, type=float, help="AdamW learning rate.")
@click.option("--rollouts", default=2, show_default=True, type=click.IntRange(min=1),
              help="Rollout processes syncing from the version stream.")
@click.option("--transport", default="local", show_default=True, type=click.Choice(["local", "s3", "relay"]),
              help="local: a directory store; s3: S3 (--s3-url, else a SeaweedFS on loopback); relay: the "
                   "local store through a relay tree, a node per rollout.")
@click.option("--s3-url", default=None, help="s3://bucket/prefix for --transport s3 (AWS environment for the "
              "endpoint and credentials); without it a local SeaweedFS server is started for the run.")
def demo(out: str, steps: int, lr: float, rollouts: int, transport: str, s3_url: str | None) -> None:
    """RL refit over a version stream: a trainer process publishes each step, rollout processes sync,
    verify bit for bit, and generate stamped rollouts; a table and OUT/refit.png at the end."""

    def go() -> None:
        from .apps.demo import run_demo

        if not run_demo(out, steps=steps, lr=lr, rollouts=rollouts, transport=transport, s3_url=s3_url):
            sys.exit(6)

    _run(go)


@main.command()
@click.option("--params", "params", multiple=True,
              help="Model parameters, e.g. 8B, 70B, 1T (repeatable; default: 8B 70B 235B 1T).")
@click.option("--change-pct", default=3.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Percent of bf16 elements changed per step.")
@click.option("--ratio", default=None, type=click.FloatRange(min=1),
              help="Compression ratio at that change rate (default: the codec's measured curve).")
@click.option("--codec", default="ours", show_default=True, type=click.Choice(["ours", "nemo", "trl"]),
              help="Whose measured ratio curve to use (docs/BENCHMARKS.md).")
@click.option("--link-gbps", default=25.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Bandwidth between the trainer's and the rollouts' clusters, Gbit/s.")
@click.option("--store-gbps", default=400.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Object storage aggregate throughput, Gbit/s.")
@click.option("--fabric-gbps", default=400.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Each rollout node's link inside its cluster, Gbit/s.")
@click.option("--nodes", default=16, show_default=True, type=click.IntRange(min=1), help="Rollout nodes.")
@click.option("--fanout", default=2, show_default=True, type=click.IntRange(min=1), help="Relay tree fan-out.")
@click.option("--shards", default=64, show_default=True, type=click.IntRange(min=1),
              help="Trainer shards encoding in parallel (rollout replicas are sharded alike for apply).")
@click.option("--encode-cores", default=8.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Cores encoding per shard.")
@click.option("--apply-cores", default=8.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Cores applying per shard.")
@click.option("--encode-gbps-core", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Encode GB/s per core (default: measured, docs/BENCHMARKS.md).")
@click.option("--apply-gbps-core", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Apply GB/s per core (default: measured, docs/BENCHMARKS.md).")
@click.option("--chunk-mb", default=512.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Transfer chunk in MiB (pipelining granularity).")
@click.option("--rollout", default="engine", show_default=True, type=click.Choice(["engine", "file"]),
              help="Apply into live engines (docs/ENGINES.md) or into checkpoint files (docs/BENCHMARKS.md).")
@click.option("--calibrate", is_flag=True, help="Measure encode/apply GB/s per core now on a synthetic pair.")
@click.option("--references", is_flag=True, help="Reproduce the published refit figures and exit.")
@click.option("--plot", "plot_path", default="out/simulate.png", show_default=True, type=click.Path(),
              help="PNG to write (empty: none).")
def simulate(params, change_pct, ratio, codec, link_gbps, store_gbps, fabric_gbps, nodes, fanout, shards,
             encode_cores, apply_cores, encode_gbps_core, apply_gbps_core, chunk_mb, rollout, calibrate, references,
             plot_path) -> None:
    """Model refit time at scale: full checkpoint vs delta, via object storage or a relay tree."""

    def go() -> None:
        from .apps import simulate as sim
        from .errors import UsageError

        try:
            sizes = [sim.parse_params(p) for p in params] or [8e9, 70e9, 235e9, 1e12]
        except ValueError as e:
            raise UsageError(f"--params: {e}") from None
        base = sim.Setup(change=change_pct / 100, ratio=ratio, codec=codec, link_gbps=link_gbps,
                         store_gbps=store_gbps, fabric_gbps=fabric_gbps, nodes=nodes, fanout=fanout, shards=shards,
                         encode_cores=encode_cores, apply_cores=apply_cores,
                         encode_gbps_core=encode_gbps_core or sim.ENCODE_GBPS_PER_CORE,
                         apply_gbps_core=apply_gbps_core or sim.APPLY_GBPS_PER_CORE, chunk_bytes=chunk_mb * (1 << 20),
                         rollout=rollout)
        sim.run(base, sizes, do_calibrate=calibrate, show_references=references, plot_path=plot_path or None)

    _run(go)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True}, add_help_option=False)
@click.pass_context
def bench(ctx: click.Context) -> None:
    """Codec benchmark against peers and the entropy bound (--quick, --out, --markdown; --help for all)."""

    def go() -> None:
        from .apps.bench.report import main as bench_main

        sys.exit(bench_main(list(ctx.args)) or 0)

    _run(go)


if __name__ == "__main__":
    main()
