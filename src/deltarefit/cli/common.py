"""What the command modules share: the group ``main`` (errors rendered as one line with an exit code, the
CLI's SIGBUS handler), ``_run``, the progress bars, and the common options."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

import click

from .. import __version__
from ..errors import DeltaRefitError, FileSystemError
from .progress import bar as _progress  # noqa: F401  (the bars: cli.progress; rich is imported only there)
from .progress import enabled as _progress_enabled  # noqa: F401

log = logging.getLogger("deltarefit")


def _output_dir(output: str) -> None:
    """Refuse an output path whose directory does not exist, before any work."""
    from ..errors import UsageError

    d = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(d):
        raise UsageError(f"{output}: directory {d} does not exist; nothing was written; create it first "
                         f"(mkdir -p {d}) or write elsewhere")
    if os.path.isdir(output):
        raise UsageError(f"{output} is a directory; -o names the file to write (e.g. -o "
                         f"{os.path.join(output, 'out.delta')}); nothing was written")


def _not_an_input(output: str, *inputs: str | None, what: str = "output") -> None:
    """Refuse, before any work, an ``output`` that is one of ``inputs`` (same path, symlink, hard link)
    or lies inside an input directory: writing it would destroy the input it was computed from."""
    from ..errors import UsageError
    from ..io.fsutil import output_is_input

    hit = output_is_input(output, inputs)
    if hit is not None:
        raise UsageError(f"{output}: the {what} is the input {hit} (same file, a link to it, or inside it); "
                         f"nothing was written; write the {what} elsewhere")


def _names(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _ckpt_bytes(path: str) -> int:
    """The bytes of the checkpoint's tensors: a progress bar's total (``stream.progress.tensor_bytes``)."""
    from ..stream.progress import tensor_bytes

    return tensor_bytes(path)


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
            click.echo("deltarefit: interrupted; rerunning the same command is safe (an apply, sync or publish "
                       "resumes where it stopped; nothing half-written is ever taken as done)", err=True)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)


# The commands that read or write checkpoints and deltas: each imports numpy, and none multiplies floating
# matrices (the only work numpy hands to BLAS; the codec's threads are the library's own).
NUMPY_WITHOUT_BLAS = frozenset({"apply", "compose", "encode", "fingerprint", "inspect", "publish", "relay",
                                "status", "sync", "verify"})
# What OpenBLAS (and an OpenMP build of it) reads, once, when numpy loads it.
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")


def _numpy_with_one_blas_thread(command: str | None) -> None:
    """Before a command of ``NUMPY_WITHOUT_BLAS`` runs, load numpy with its BLAS pool at one thread. On
    import, OpenBLAS starts a thread per core, which costs a command about 50 ms of its start on two
    cores and does no work in it. Nothing is done where numpy is already loaded (a test calling the CLI
    in its own process: the setting would not apply), for another command, or where the user set any of
    ``BLAS_THREAD_VARIABLES``. The variables are set only while numpy loads, then removed again: neither
    a library loaded later (torch reads ``OMP_NUM_THREADS``) nor a child process sees them."""
    if command not in NUMPY_WITHOUT_BLAS or "numpy" in sys.modules:
        return
    if any(v in os.environ for v in BLAS_THREAD_VARIABLES):
        return
    os.environ.update({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    try:
        import numpy  # noqa: F401
    finally:
        del os.environ["OPENBLAS_NUM_THREADS"], os.environ["OMP_NUM_THREADS"]


class _OneLine(logging.Formatter):
    """``deltarefit: warning: message``, the errors' style, without -v."""

    def format(self, record: logging.LogRecord) -> str:
        return f"deltarefit: {record.levelname.lower()}: {record.getMessage()}"


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="deltarefit")
@click.option("-v", "--verbose", is_flag=True, help="Log progress details to stderr.")
def main(verbose: bool) -> None:
    """Bit-exact compressed weight deltas for RL refit: encode, apply in place, verify."""
    _numpy_with_one_blas_thread(click.get_current_context().invoked_subcommand)
    _sigbus_as_one_line()
    # One line per warning, as errors are (deltarefit: warning: ...); timestamps and modules with -v.
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not verbose:
        for h in logging.getLogger().handlers:
            h.setFormatter(_OneLine())


_threads = click.option("--threads", type=click.IntRange(min=1), default=None,
                        help="Worker threads (default: available cores, at most 8).")
_quiet = click.option("-q", "--quiet", is_flag=True, help="No progress bar (also off when stderr is not a tty).")
_json = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def _format_version(default: int | None, help_default: str):
    """``--format-version {1,2}``: the delta format version to write (FORMAT.md, "Versions")."""
    return click.option("--format-version", "format_version", type=click.Choice(["1", "2"]),
                        default=None if default is None else str(default),
                        callback=lambda _c, _p, v: None if v is None else int(v),
                        help="Delta format version to write: 2 (encodings ulp2/ulp2_hist, smaller, decoded in "
                             "parallel) or 1 (today's bytes, for readers that know version 1 only). "
                             + help_default)
