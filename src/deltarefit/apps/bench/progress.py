"""What the command line's progress bars cost: encode and apply with no bar, with a callback that only
counts, and with the CLI's rich bar drawn as to a terminal.

``python -m deltarefit.apps.bench.progress [--mib 256] [--rate 0.03] [--repeat 5]`` encodes the synthetic
bf16 pair of ``bench.stream`` (``--mib`` MiB, ``--rate`` of its elements moved by one ulp), then
``--repeat`` times, in turn, for each way: ``deltarefit.encode`` of the pair and ``deltarefit.apply`` of
its delta to a fresh copy of the base (``progress=None``; ``progress=`` a counting callable;
``progress=`` the bar of ``cli.progress``, drawn to /dev/null as to a terminal, its refresh thread
running). Prints the medians (min-max) and each way's difference from no bar; every delta written is
checked byte-identical to the first, every applied checkpoint to the target. A figure, not a gate: no
assertion on time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext


def _ways(devnull) -> dict[str, Callable[[str, int], AbstractContextManager]]:
    from ...cli.progress import bar

    def counted(label: str, total: int):
        seen = [0]
        return nullcontext(lambda n: seen.__setitem__(0, seen[0] + n))

    return {"no bar": lambda label, total: nullcontext(None), "callback only": counted,
            "rich bar": lambda label, total: bar(label, total, False, file=devnull)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltarefit.apps.bench.progress", description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="Size of the synthetic pair (MiB).")
    ap.add_argument("--rate", type=float, default=0.03, help="Fraction of elements changed.")
    ap.add_argument("--repeat", type=int, default=5, help="Timed runs per way and operation.")
    args = ap.parse_args(argv)
    import deltarefit

    from .stream import _chain

    with tempfile.TemporaryDirectory(prefix="deltarefit-progress-") as work, open(os.devnull, "w") as devnull:
        base, target = _chain(work, args.mib, 2, args.rate, 0)
        total = os.path.getsize(target)
        ref = os.path.join(work, "ref.delta")
        deltarefit.encode(base, target, ref)
        want = open(target, "rb").read()
        times: dict[tuple[str, str], list[float]] = {}
        ways = _ways(devnull)
        for _ in range(args.repeat):
            for name, make in ways.items():  # interleaved: a drift in the machine's load hits every way alike
                out = os.path.join(work, "d.delta")
                with make("encode", total) as cb:
                    t = time.perf_counter()
                    deltarefit.encode(base, target, out, progress=cb)
                    times.setdefault(("encode", name), []).append(time.perf_counter() - t)
                if open(out, "rb").read() != open(ref, "rb").read():
                    raise SystemExit(f"{name}: the delta differs from the one encoded without a bar")
                ck = os.path.join(work, "w.safetensors")
                shutil.copyfile(base, ck)
                with make("apply", total) as cb:
                    t = time.perf_counter()
                    deltarefit.apply(ref, ck, progress=cb)
                    times.setdefault(("apply", name), []).append(time.perf_counter() - t)
                if open(ck, "rb").read() != want:
                    raise SystemExit(f"{name}: the applied checkpoint is not the target")
    print(f"synthetic {args.mib} MiB bf16 pair, {100 * args.rate:g}% changed; {args.repeat} runs per way, "
          "median (min-max) s, and the difference from no bar")
    for op in ("encode", "apply"):
        none = statistics.median(times[(op, "no bar")])
        for name in ways:
            xs = times[(op, name)]
            med = statistics.median(xs)
            print(f"  {op:<6} {name:<13} {med:.3f} ({min(xs):.3f}-{max(xs):.3f})  {100 * (med - none) / none:+.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
