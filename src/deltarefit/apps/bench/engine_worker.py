"""The engine benchmark's measurements: timers installed in the vLLM worker around the apply protocol's
phases (called through ``collective_rpc``), and the disk bytes, CPU time and memory of a refit."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from .engine_model import io_delta

# ------------------------------------------------------------------------------------ in the worker
# Functions below run inside vLLM's worker (llm.collective_rpc with a callable: the worker is ``worker``).

_TIMES: dict[str, float] = {}
_TIMES_LOCK = threading.Lock()


def _timed(key: str, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        c = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t
            dc = time.thread_time() - c
            with _TIMES_LOCK:
                _TIMES[key] = _TIMES.get(key, 0.0) + dt
                _TIMES[key + "_cpu"] = _TIMES.get(key + "_cpu", 0.0) + dc

    wrapper.__wrapped__ = fn
    return wrapper


def worker_instrument(worker: Any) -> bool:
    """Timers around the apply protocol's phases and per-segment calls (benchmark only, idempotent)."""
    from ...apply import host as regions
    from ...apply import protocol as ap
    from ...engines import live

    if getattr(ap.Applier.plan, "__wrapped__", None) is not None:
        return False
    for cls, names in ((ap.Applier, ("plan", "write", "target_digests")),
                       (live.LiveTarget, ("read_segment", "write_segment"))):
        for n in names:
            setattr(cls, n, _timed(n, getattr(cls, n)))
    regions.HOST_REGIONS.decode_region = _timed("decode", regions._decode)  # what the applier calls for host regions
    return True


def worker_reset_times(worker: Any) -> None:
    with _TIMES_LOCK:
        _TIMES.clear()


def worker_times(worker: Any) -> dict[str, Any]:
    eng = worker.weight_transfer_engine
    with _TIMES_LOCK:
        times = dict(_TIMES)
    return {"times": times, "last": getattr(eng, "last", {})}


def worker_wait_prepared(worker: Any) -> None:
    """Wait until the plan a ``prepare`` update started on the worker's thread is made."""
    worker.weight_transfer_engine.wait_prepared()


def worker_describe(worker: Any) -> dict[str, Any]:
    d = worker.weight_transfer_engine.live.describe()
    return {"in_place": len(d["in_place"]), "in_place_names": d["in_place"], "reload": len(d["reload"]),
            "host_bytes": d["host_bytes"],
            "seconds_init": d["seconds_init"], "pid": os.getpid(), "threads": d.get("threads")}


# ------------------------------------------------------------------------------------ measuring


def _engine_procs() -> list[Any]:
    import psutil

    return psutil.Process().children(recursive=True)


def _io(procs: Iterable[Any]) -> dict[str, int]:
    tot = {"read_bytes": 0, "write_bytes": 0, "cancelled_write_bytes": 0, "rchar": 0, "wchar": 0}
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/io") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    if k in tot:
                        tot[k] += int(v)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return tot


def _status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def evict_page_cache(paths: Iterable[str]) -> None:
    """Flush every file under ``paths`` and drop its pages from the page cache (pages some process maps
    stay; the kernel may ignore the advice)."""
    for root in paths:
        files = [root] if os.path.isfile(root) else [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
        for p in files:
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def measure(fn, worker_pid: int, evict: Iterable[str]) -> dict[str, Any]:
    """Run ``fn()`` and return its wall time, the engine processes' disk bytes, and the worker's peak memory
    growth (see the module docstring)."""
    evict_page_cache(evict)
    procs = _engine_procs()
    with open(f"/proc/{worker_pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    rss0 = _status_kb(worker_pid, "VmRSS")
    anon0 = _status_kb(worker_pid, "RssAnon")
    peak = {"anon": anon0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            try:
                peak["anon"] = max(peak["anon"], _status_kb(worker_pid, "RssAnon"))
            except (FileNotFoundError, KeyError):
                return

    th = threading.Thread(target=sample, daemon=True)
    io0 = _io(procs)
    cpu0 = _cpu(procs)
    th.start()
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    stop.set()
    th.join()
    io1 = _io(procs)
    cpu1 = _cpu(procs)
    hwm = _status_kb(worker_pid, "VmHWM")
    return {"seconds": dt, "io": io_delta(io0, io1), "rss_before": rss0, "rss_peak_growth": max(0, hwm - rss0),
            "anon_peak_growth": max(0, peak["anon"] - anon0), "result": out,
            "proc_cpu": {k: cpu1[k] - cpu0[k] for k in cpu0 if k in cpu1}}


def _cpu(procs: Iterable[Any]) -> dict[str, float]:
    """CPU seconds (user + system) of each engine process, by ``name:pid``."""
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[f"{p.name()}:{p.pid}"] = t.user + t.system
        except Exception:
            pass
    return out
