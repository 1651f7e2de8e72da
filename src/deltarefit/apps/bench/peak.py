"""The peak memory of a measured child: ``python -c _MEASURED PEAK_FILE ARGS`` runs ``python -m deltarefit
ARGS`` and writes its own peak RSS to ``PEAK_FILE`` at exit, which ``read_peak`` reads (``bench.hostile``
and ``bench.fs_faults`` measure their children so)."""

from __future__ import annotations

# The child reports its own peak from /proc/self/status (VmHWM: this address space only). Not wait4's or
# getrusage's ru_maxrss: Linux carries the parent's peak into a child across exec (vfork shares it), so
# a child of a large process (a test runner) would seem as large as its parent.
_MEASURED = """import atexit, runpy, sys
out = sys.argv.pop(1)
def report():
    with open('/proc/self/status') as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith('VmHWM:'))
    with open(out, 'w') as f:
        f.write(str(hwm * 1024))
atexit.register(report)
sys.argv[0] = 'deltarefit'
runpy.run_module('deltarefit', run_name='__main__', alter_sys=True)
"""


def read_peak(peak_file: str) -> int:
    """The peak RSS a ``_MEASURED`` child wrote to ``peak_file`` at exit; 0 where it wrote none (killed)."""
    try:
        with open(peak_file) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0
