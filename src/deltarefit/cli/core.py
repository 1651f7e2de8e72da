"""The command line's core commands: encode, apply, inspect, fingerprint, verify, keygen, compose."""

from __future__ import annotations

import json
import shutil
import sys

import click

from ..errors import BaseMismatchError
from .common import (
    _ckpt_bytes,
    _format_version,
    _json,
    _names,
    _not_an_input,
    _output_dir,
    _progress,
    _progress_enabled,
    _quiet,
    _run,
    _threads,
    main,
)

ENCODE_EXAMPLES = """
\b
Examples:
  deltarefit encode base.safetensors new.safetensors -o step42.delta
  deltarefit encode ckpt/step41 ckpt/step42 -o step42.delta --threads 8
  deltarefit encode ckpt/step42 ckpt/step43 -o step43.delta --history trainer.history
"""
APPLY_EXAMPLES = """
\b
Examples:
  deltarefit apply step42.delta rollout/model.safetensors
  deltarefit apply step42.delta rollout/ --quiet
  deltarefit apply step43.delta rollout/model.safetensors --history rollout/model.history
"""


@main.command(epilog=ENCODE_EXAMPLES)
@click.argument("base", type=click.Path(exists=True))
@click.argument("target", type=click.Path(exists=True))
@click.option("-o", "--output", required=True, type=click.Path(), help="Delta file to write (atomically).")
@click.option("--history", "history_dir", type=click.Path(file_okay=False), default=None,
              help="History book of BASE (a directory, created if missing): code against its last three "
                   "versions' moves too (encoding 5), then advance it to TARGET. For a chain whose every delta "
                   "is delivered in order; the rollout applies with its own --history.")
@_format_version(2, "Default: 2.")
@_threads
@_quiet
@_json
def encode(base: str, target: str, output: str, history_dir: str | None, format_version: int, threads: int | None,
           quiet: bool, as_json: bool) -> None:
    """Encode the delta taking checkpoint BASE to checkpoint TARGET (a .safetensors file or HF directory)."""

    def go() -> None:
        from ..encode import encode as enc
        from .hints import check_kinds

        check_kinds("encode", "deltarefit encode BASE TARGET -o OUT", (("checkpoint", base), ("checkpoint", target)))
        _output_dir(output)
        _not_an_input(output, base, target, history_dir)
        book = None
        if history_dir is not None:
            from ..history_book import HistoryBook

            book = HistoryBook(history_dir)
        with _progress("encode", _ckpt_bytes(target) if _progress_enabled(quiet) else 0, quiet) as cb:
            rep = enc(base, target, output, threads=threads, progress=cb, history=book, format_version=format_version)
        if book is not None and rep.moves is not None:
            book.commit(rep.target_fingerprint, rep.moves, parent=rep.base_fingerprint)
        summary = {
            "delta": output, "delta_bytes": rep.delta_bytes, "full_bytes": rep.full_bytes, "ratio": rep.ratio,
            "changed_fraction": rep.changed_fraction, "seconds": rep.seconds,
            "base_fingerprint": rep.base_fingerprint, "target_fingerprint": rep.target_fingerprint,
            "format_version": format_version, "encodings": rep.encodings,
        }
        _unrelated_warning(base, target, rep)
        if as_json:
            click.echo(json.dumps(summary, indent=2))
        else:
            size = (f"{rep.ratio:.1f}x smaller than" if rep.ratio >= 1 else f"{1 / rep.ratio:.2f}x the size of"
                    if rep.ratio > 0 else "no ratio to")
            click.echo(f"{output}: {rep.delta_bytes:,} bytes, {size} the full checkpoint "
                       f"({rep.full_bytes:,} bytes), {100 * rep.changed_fraction:.3f}% of elements changed, "
                       f"{rep.seconds:.2f} s")
            click.echo(f"target fingerprint {rep.target_fingerprint}")

    _run(go, where=output)


def _unrelated_warning(base: str, target: str, rep) -> None:
    """A warning (stderr, one line) for an encode of two checkpoints that look like no two versions of one
    model (most elements changed), or of the same weights twice (none changed): written all the same."""
    from ..stream.relatedness import looks_unrelated, unrelated_words

    if looks_unrelated(rep.changed_fraction):
        click.echo(f"deltarefit: warning: {unrelated_words(base, target, rep.changed_fraction)}, and the delta "
                   "saves nothing over the full checkpoint; check the two paths", err=True)
    elif rep.changed_fraction == 0 and rep.base_fingerprint == rep.target_fingerprint:
        click.echo(f"deltarefit: warning: {base} and {target} hold the same weights (fingerprint "
                   f"{rep.target_fingerprint[:16]}…): the delta changes nothing; check the two paths", err=True)


@main.command(epilog=APPLY_EXAMPLES)
@click.argument("delta", type=click.Path())
@click.argument("checkpoint", type=click.Path())
@click.option("--history", "history_dir", type=click.Path(file_okay=False), default=None,
              help="History book of CHECKPOINT (a directory, created if missing): decode encoding-5 chunks "
                   "against it, and advance it once the apply is verified.")
@_threads
@_quiet
@_json
def apply(delta: str, checkpoint: str, history_dir: str | None, threads: int | None, quiet: bool,
          as_json: bool) -> None:
    """Apply DELTA to CHECKPOINT in place. Verifies the base first and the target fingerprint last.

    Idempotent and crash-safe: running it again after an interruption finishes the job; running it on
    a checkpoint that already is the target changes nothing.
    """

    def go() -> None:
        from ..apply.files import apply as ap
        from .hints import check_kinds, check_order

        check_order("apply", "deltarefit apply DELTA CHECKPOINT", (("delta", delta), ("checkpoint", checkpoint)))
        _not_an_input(checkpoint, delta, history_dir, what="checkpoint")
        _not_an_input(delta, checkpoint, what="delta")  # a delta inside the checkpoint directory it writes
        check_kinds("apply", "deltarefit apply DELTA CHECKPOINT", (("delta", delta), ("checkpoint", checkpoint)))
        book = None
        if history_dir is not None:
            from ..history_book import HistoryBook

            book = HistoryBook(history_dir)
        with _progress("apply", _ckpt_bytes(checkpoint) if _progress_enabled(quiet) else 0, quiet) as cb:
            try:
                rep = ap(delta, checkpoint, threads=threads, progress=cb, history=book)
            except BaseMismatchError as e:  # refused before any write: both files named, the cause told
                from ..apply.mismatch import explain

                raise BaseMismatchError(explain(delta, checkpoint, e)) from None
        if as_json:
            click.echo(json.dumps(rep.__dict__, indent=2))
        else:
            tensors = ""
            for op, verb in (("add", "added"), ("remove", "removed"), ("replace", "replaced")):
                names = [n for n in rep.structural if rep.structural_ops.get(n) == op]
                if names:
                    tensors += f"; {verb} {len(names)} tensor{'s' * (len(names) != 1)} ({_names(names)})"
            if not (rep.chunks_applied or rep.chunks_recovered or tensors):
                click.echo(f"{checkpoint}: already the target of {delta}, nothing to do; fingerprint "
                           f"{rep.target_fingerprint} verified")
                return
            click.echo(f"{checkpoint}: applied {rep.chunks_applied} chunks ({rep.chunks_skipped} already done, "
                       f"{rep.chunks_recovered} recovered){tensors} in {rep.seconds:.2f} s; "
                       f"fingerprint {rep.target_fingerprint} verified")

    _run(go, where=checkpoint)


@main.command()
@click.argument("delta", type=click.Path())
@_json
@click.option("--all", "show_all", is_flag=True, help="List unchanged tensors too.")
def inspect(delta: str, as_json: bool, show_all: bool) -> None:
    """Show what DELTA changes: per tensor elements, changed fraction, encodings and bytes; totals and ratio."""

    def go() -> None:
        from ..api import inspect as ins
        from .hints import check_kinds

        check_kinds("inspect", "deltarefit inspect DELTA", (("delta", delta),))
        info = ins(delta)
        if as_json:
            click.echo(json.dumps(info, indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        rows = [[t["name"], t["op"], t["dtype"], f"{t['elements']:,}", f"{100 * t['changed_fraction']:.3f}%",
                 f"{t['bytes']:,}", " ".join(f"{k}:{v}" for k, v in sorted(t["encodings"].items()))]
                for t in info["tensors"] if t["op"] != "same" or show_all]
        cols = ("tensor", "op", "dtype", "elements", "changed", "bytes", "encodings")
        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else 80
        # The figures keep their width; a tensor name longer than what they leave breaks after a dot.
        fixed = sum(max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(cols) if i) + 3 * len(cols) + 1
        room = max(width - fixed, 16)
        table = Table(title=f"{delta}  ({info['delta_bytes']:,} bytes, {info['ratio']:.1f}x)")
        for col in cols:
            table.add_column(col, justify="right" if col in ("elements", "changed", "bytes") else "left",
                             no_wrap=col not in ("tensor", "encodings"), overflow="fold")
        for r in rows:
            table.add_row(_break_name(r[0], room), *r[1:])
        Console(width=width, highlight=False).print(table)
        click.echo(f"total: {info['changed_elements']:,} of {info['total_elements']:,} elements changed "
                   f"({100 * info['changed_fraction']:.3f}%)")
        click.echo(f"delta {info['delta_bytes']:,} bytes vs full {info['full_bytes']:,} bytes: {info['ratio']:.1f}x")
        chunks = ", ".join(f"{k} {v:,}" for k, v in info["encodings"].items()) or "none"
        click.echo(f"format version {info['format_version']}; chunks per encoding: {chunks}")
        click.echo(f"base   {info['base_fingerprint']}\ntarget {info['target_fingerprint']}")

    _run(go)


def _break_name(name: str, room: int) -> str:
    """``name`` in lines of at most ``room`` characters, broken after a dot where it can be (a part longer
    than ``room`` is left to the table, which folds it)."""
    lines = [""]
    for part in name.replace(".", ".\0").split("\0"):
        if lines[-1] and len(lines[-1]) + len(part) > room:
            lines.append("")
        lines[-1] += part
    return "\n".join(lines)


@main.command()
@click.argument("checkpoint", type=click.Path())
@_threads
@_quiet
@_json
def fingerprint(checkpoint: str, threads: int | None, quiet: bool, as_json: bool) -> None:
    """Print the layout-independent fingerprint of CHECKPOINT (file or directory)."""

    def go() -> None:
        from ..checkpoint.read import fingerprint_checkpoint, open_checkpoint
        from ..stream.progress import tensor_bytes
        from .hints import check_kinds

        check_kinds("fingerprint", "deltarefit fingerprint CHECKPOINT", (("checkpoint", checkpoint),))
        with open_checkpoint(checkpoint) as ck, _progress("fingerprint", tensor_bytes(ck), quiet) as cb:
            fp, digests = fingerprint_checkpoint(ck, threads=threads, progress=cb)
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
        from ..api import verify as ver

        click.echo(f"{checkpoint}: fingerprint {ver(checkpoint, expected, threads=threads)} verified")

    _run(go)


@main.command()
@click.argument("private_key", type=click.Path())
def keygen(private_key) -> None:
    """Write a new Ed25519 signing key to PRIVATE_KEY and its public key to PRIVATE_KEY.pub."""

    def go() -> None:
        from ..signing import keygen as kg

        click.echo(f"wrote {private_key} (keep it secret) and {kg(private_key)}")

    _run(go)


@main.command()
@click.argument("deltas", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("-o", "--output", required=True, type=click.Path(), help="Composed delta to write.")
@click.option("--base", required=True, type=click.Path(exists=True),
              help="The checkpoint the first delta applies to (read only; chunk contexts come from it).")
@_format_version(2, "Default: 2.")
@_quiet
def compose(deltas, output, base, format_version, quiet) -> None:
    """Compose DELTAS (applied in order) into one delta equal to them bit for bit."""

    def go() -> None:
        from ..compose import compose as comp
        from .hints import check_kinds

        usage = "deltarefit compose DELTA... --base CHECKPOINT -o OUT"
        check_kinds("compose", usage, (("checkpoint", base), *(("delta", d) for d in deltas)))
        _output_dir(output)
        _not_an_input(output, base, *deltas)
        with _progress("compose", _ckpt_bytes(base) if _progress_enabled(quiet) else 0, quiet) as cb:
            try:
                rep = comp(list(deltas), output, base=base, progress=cb, format_version=format_version)
            except BaseMismatchError as e:
                raise BaseMismatchError(f"{base}: not the base of {deltas[0]} ({e}); nothing was written. --base "
                                        "names the checkpoint the first delta was encoded from") from None
        click.echo(f"{output}: {rep.delta_bytes:,} bytes, {len(deltas)} deltas composed, target "
                   f"{rep.target_fingerprint}")

    _run(go, where=output)



# The stream and relay commands, and the apps' (demo, simulate, bench), register themselves on ``main``.
