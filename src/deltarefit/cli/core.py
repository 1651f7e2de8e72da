"""The command line's core commands (encode, apply, inspect, fingerprint, verify, keygen, compose), with the
group ``main`` and the helpers the other command modules share (``deltarefit.cli`` lists the exit codes)."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click

from .. import __version__
from ..errors import DeltaRefitError, FileSystemError

log = logging.getLogger("deltarefit")

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
    from ..storage.base import SET_PROGRESS

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
    from ..errors import UsageError

    d = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(d):
        raise UsageError(f"{output}: directory {d} does not exist")


def _not_an_input(output: str, *inputs: str | None, what: str = "output") -> None:
    """Refuse, before any work, an ``output`` that is one of ``inputs`` (same path, symlink, hard link)
    or lies inside an input directory: writing it would destroy the input it was computed from."""
    from ..errors import UsageError
    from ..fsutil import output_is_input

    hit = output_is_input(output, inputs)
    if hit is not None:
        raise UsageError(f"{output}: the {what} is the input {hit} (same file, a link to it, or inside it); "
                         f"write the {what} elsewhere")


def _names(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def _ckpt_bytes(path: str) -> int:
    from ..checkpoint import open_checkpoint

    with open_checkpoint(path) as ck:
        return sum(t.nbytes for t in ck.tensors.values())


def _os_error(e: OSError, where: str | None) -> FileSystemError:
    """A filesystem fault no layer below named (disk full, read-only, permission denied, ...) as the
    one-line error of the command running: ``sync: PATH (No space left on device)``. The path is the
    error's own (both, for a copy or a rename); an error without one (a write to an open file) names
    ``where``, what the command writes."""
    ctx = click.get_current_context(silent=True)
    op = ctx.command_path.removeprefix("deltarefit ") if ctx is not None else "deltarefit"
    paths = [os.fsdecode(p) for p in (e.filename, e.filename2) if p is not None]
    if not paths and isinstance(e, BrokenPipeError):  # `deltarefit log | head`: the reader left
        # What is still buffered for stdout would fail again at exit, as a second message.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        paths = ["stdout"]
    elif not paths and where is not None:
        paths = [f"writing {where}"]
    return FileSystemError.of(f"{op}: {' -> '.join(paths) or '(no path given)'}", e)


def _sigbus_as_one_line() -> None:
    """Checkpoints are read through mmap: a file another process truncates meanwhile raises SIGBUS, which
    Python cannot catch. In the CLI process it ends the run with one line naming the file, exit 4, as a
    kill would (an apply resumes on a rerun); where the optional extension was not built, SIGBUS stays
    the kernel's (the process dies by the signal)."""
    try:
        from .. import _sigbus
    except ImportError:
        return
    _sigbus.install()


def _run(fn: Callable[[], None], *, where: str | None = None) -> None:
    """Run a command's body: its errors as one line ``deltarefit: error: ...`` and their exit codes.
    ``where``: the path the command writes, named by a filesystem error that names none."""
    try:
        try:
            fn()
        except OSError as e:
            if isinstance(e, DeltaRefitError):
                raise
            # Not a traceback: the operator can act on "disk full at PATH" (and nothing was called
            # verified that was not: each layer verifies before it reports).
            raise _os_error(e, where) from None
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
    _sigbus_as_one_line()
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
@click.option("--history", "history_dir", type=click.Path(file_okay=False), default=None,
              help="History book of BASE (a directory, created if missing): code against its last three "
                   "versions' moves too (encoding 5), then advance it to TARGET. For a chain whose every delta "
                   "is delivered in order; the rollout applies with its own --history.")
@_threads
@_quiet
@_json
def encode(base: str, target: str, output: str, history_dir: str | None, threads: int | None, quiet: bool,
           as_json: bool) -> None:
    """Encode the delta taking checkpoint BASE to checkpoint TARGET (a .safetensors file or HF directory)."""

    def go() -> None:
        from ..encode import encode as enc

        _output_dir(output)
        _not_an_input(output, base, target, history_dir)
        book = None
        if history_dir is not None:
            from ..history_book import HistoryBook

            book = HistoryBook(history_dir)
        with _progress("encode", _ckpt_bytes(target) if _progress_enabled(quiet) else 0, quiet) as cb:
            rep = enc(base, target, output, threads=threads, progress=cb, history=book)
        if book is not None and rep.moves is not None:
            book.commit(rep.target_fingerprint, rep.moves, parent=rep.base_fingerprint)
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

    _run(go, where=output)


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

        _not_an_input(checkpoint, delta, history_dir, what="checkpoint")
        _not_an_input(delta, checkpoint, what="delta")  # a delta inside the checkpoint directory it writes
        book = None
        if history_dir is not None:
            from ..history_book import HistoryBook

            book = HistoryBook(history_dir)
        with _progress("apply", _ckpt_bytes(checkpoint) if _progress_enabled(quiet) else 0, quiet) as cb:
            rep = ap(delta, checkpoint, threads=threads, progress=cb, history=book)
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

    _run(go, where=checkpoint)


@main.command()
@click.argument("delta", type=click.Path())
@_json
@click.option("--all", "show_all", is_flag=True, help="List unchanged tensors too.")
def inspect(delta: str, as_json: bool, show_all: bool) -> None:
    """Show what DELTA changes: per tensor elements, changed fraction, encodings and bytes; totals and ratio."""

    def go() -> None:
        from ..api import inspect as ins

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
        from ..checkpoint import fingerprint_checkpoint, open_checkpoint

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
@_quiet
def compose(deltas, output, base, quiet) -> None:
    """Compose DELTAS (applied in order) into one delta equal to them bit for bit."""

    def go() -> None:
        from ..compose import compose as comp

        _output_dir(output)
        _not_an_input(output, base, *deltas)
        with _progress("compose", _ckpt_bytes(base) if _progress_enabled(quiet) else 0, quiet) as cb:
            rep = comp(list(deltas), output, base=base, progress=cb)
        click.echo(f"{output}: {rep.delta_bytes:,} bytes, {len(deltas)} deltas composed, target "
                   f"{rep.target_fingerprint}")

    _run(go, where=output)



# The stream and relay commands, and the apps' (demo, simulate, bench), register themselves on ``main``.
from . import apps as _apps  # noqa: E402, F401
from . import stream as _stream  # noqa: E402, F401
