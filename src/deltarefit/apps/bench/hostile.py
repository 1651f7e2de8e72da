"""Memory and time before trust: what hostile inputs cost before they are refused.

``python -m deltarefit.apps.bench.hostile [--connections 40] [--seconds 3]`` builds, in a temporary
directory, each of:

* a *manifest bomb*: a 24 KB delta whose zstd manifest expands to 256 MiB of ``[[],[],...]``, read by
  ``deltarefit inspect``;
* the worst manifest that still parses: a list of short strings filling the expansion the reader
  allows for its compressed size (the bound is linear in that size, see FORMAT.md);
* a *safetensors header bomb*: a file whose 100 MiB header is nested lists, read by
  ``deltarefit fingerprint``;
* a header of 100 MiB of integers in one shape (refused before parsing by the bound on array lengths;
  parsed whole it would build an int object per number);

runs each command in a child process and prints its exit code, peak RSS (the child's VmHWM) and
wall time.
Then it starts a ``deltarefit relay root`` on an empty store, opens ``--connections`` connections to
it on loopback that never authenticate (each completes the handshake, declares the largest frame
and floods bytes for ``--seconds``), and prints the root's RSS before and its peak after, and how many
connections it answered BUSY.
Then "memory before trust, by input shape" (``trust_memory``): a commit record (in a signed stream,
unsigned or forged; in an unsigned one, the costliest text its bounds admit), a part header, a version
manifest, a key file and a local JSON state file, each at its cap: the traced peak, its size, the ratio
and whether it is under 256 MiB and twice its size plus 32 MiB.
Then the counts of the classes already fixed (``classes``, ``--no-classes`` skips it): exits that
disagree with docs/COMMAND-LINE.md, planted files, the engine's trust, from the tests that pin them.
Then the "filesystem faults" section (``fs_faults``, ``--no-fs-faults`` skips it): ``apply``,
``encode``, ``sync``, ``publish`` and ``retain`` on a full tmpfs (a sweep of fill levels), a
read-only one and a directory they may not write, each rerun with the fault lifted; by command and
fault, the cases, false "verified", committed versions with missing parts, tracebacks, half-written
results a rerun cannot finish and the peak memory (root mounts the tmpfs; other users get the
permission cases only). Figures are printed, never asserted; the tests assert generous bounds
with the same helpers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import zstandard

from ...io.procs import stop
from .peak import _MEASURED, read_peak
from .relay import ENV, listening, relay_cmd

MIB = 1 << 20


# ------------------------------------------------------------------------------------- hostile files


def _zstd_stream(parts, total: int, level: int = 3) -> bytes:
    """One zstd frame declaring ``total`` bytes, from an iterable of pieces (never all in memory)."""
    c = zstandard.ZstdCompressor(level=level).compressobj(size=total)
    out = [c.compress(p) for p in parts]
    out.append(c.flush())
    return b"".join(out)


def _repeat(unit: bytes, count: int, block: int = 1 << 18):
    piece = unit * block
    while count > 0:
        k = min(count, block)
        yield piece[:len(unit) * k]
        count -= k


def write_delta_with_manifest(path: str, frame: bytes) -> int:
    """A delta file with no payload and no chunk table whose manifest section is ``frame``; every
    header field and hash is right, so only the manifest itself can be refused. Returns its size. The
    header says format version 1, as the manifests written here do (``MANIFEST_HEAD``)."""
    from ...format import FLAG_MANIFEST_ZSTD, HEADER, HEADER_SIZE, MAGIC, ZERO_HASH
    from ...integrity import seg_hash

    off = HEADER_SIZE
    head = HEADER.pack(MAGIC, 1, FLAG_MANIFEST_ZSTD, HEADER_SIZE, off, 0, off, len(frame),
                       off + len(frame), 0, seg_hash(frame), ZERO_HASH)
    head = head[:-16] + seg_hash(head[:-16])
    with open(path, "wb") as f:
        f.write(head + frame)
    return len(head) + len(frame)


MANIFEST_HEAD = b'{"format":"deltarefit.delta","version":1,"tensors":['


def write_manifest_bomb(path: str, expands_to: int = 256 * MIB) -> int:
    """A delta whose manifest expands to ``expands_to`` bytes of ``[[],[],...]`` (about 24 KB for
    256 MiB). Returns the file size."""
    tail = b"[]]}"
    n = (expands_to - len(MANIFEST_HEAD) - len(tail)) // 3
    frame = _zstd_stream([MANIFEST_HEAD, *_repeat(b"[],", n), tail], len(MANIFEST_HEAD) + 3 * n + len(tail))
    return write_delta_with_manifest(path, frame)


def write_strings_at_limit(path: str, compressed: int = 24 << 10) -> int:
    """The worst manifest the reader parses for a ``compressed``-byte frame: random hex (which does
    not compress) buys the expansion allowance, the rest is ``"ab",`` (16 bytes of memory per byte of
    text). It is refused after parsing (the tensors are not objects)."""
    try:
        from ...format import manifest_limit
    except ImportError:  # a reader without the expansion bound: fill the same 25 MiB
        def manifest_limit(n: int) -> int:
            return min(256 * MIB, MIB + 1024 * n)

    pad = os.urandom(compressed // 2).hex().encode()  # hex: about 2:1 under zstd
    head = MANIFEST_HEAD[:-len(b'"tensors":[')] + b'"stats":"' + pad + b'","tensors":['
    tail = b'"ab"]}'
    n = (manifest_limit(compressed) - len(head) - len(tail)) // 5
    for _ in range(8):  # the allowance depends on the compressed size: converge on it from above
        raw = len(head) + 5 * n + len(tail)
        frame = _zstd_stream([head, *_repeat(b'"ab",', n), tail], raw)
        if raw <= manifest_limit(len(frame)):
            break
        n -= (raw - manifest_limit(len(frame))) // 5 + 4096
    return write_delta_with_manifest(path, frame)


def _write_shape_header(path: str, header_bytes: int, unit: bytes, tail: bytes) -> int:
    """A safetensors file of one tensor entry whose shape is ``unit`` repeated to fill ``header_bytes``
    of header, closed by ``tail``. Returns the file size."""
    head = b'{"w":{"dtype":"U8","data_offsets":[0,0],"shape":['
    n = (header_bytes - len(head) - len(tail)) // len(unit)
    hlen = len(head) + len(unit) * n + len(tail)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", hlen))
        f.write(head)
        for piece in _repeat(unit, n):
            f.write(piece)
        f.write(tail)
    return 8 + hlen


def write_header_bomb(path: str, header_bytes: int = 100 * MIB) -> int:
    """A safetensors file whose header (``header_bytes`` long, within the 100 MiB limit) is one
    tensor entry with a shape of nested lists ``[[],[],...]``. Returns the file size."""
    return _write_shape_header(path, header_bytes, b"[],", b"[]]}}")


def write_header_of_ints(path: str, header_bytes: int = 100 * MIB) -> int:
    """One shape holding ``header_bytes`` of ``1000,`` (an int object per 5 bytes of text, were it parsed);
    refused before parsing by the bound on array lengths."""
    return _write_shape_header(path, header_bytes, b"1000,", b"1]}}")


@dataclass
class Run:
    rc: int
    peak_rss: int  # bytes
    seconds: float
    last_line: str


def measure(args: list[str], timeout: float = 120.0) -> Run:
    """Run ``python -m deltarefit ARGS`` in a child; its exit code, peak RSS, wall time and the last line
    it wrote to stderr. A child killed at ``timeout`` reports a peak of 0."""
    with tempfile.TemporaryDirectory(prefix="deltarefit-measure-") as d:
        peak_file = os.path.join(d, "peak")
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, "-c", _MEASURED, peak_file, *args], check=False,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV, timeout=timeout)
            rc, err = p.returncode, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, err = -9, e.stderr or b""
        seconds = time.perf_counter() - t0
        peak = read_peak(peak_file)
    lines = err.decode(errors="replace").strip().splitlines()
    return Run(rc, peak, seconds, lines[-1] if lines else "")


# ------------------------------------------------------------------------------------- relay flood


def proc_mem(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a live process, in bytes."""
    got = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                got[k] = int(v.split()[0]) * 1024
    return got["VmRSS"], got["VmHWM"]


def flood(addr: str, connections: int, seconds: float) -> dict[str, int]:
    """Open ``connections`` connections to a relay at ``addr`` (loopback) that never authenticate: each
    sends the handshake, reads the answer, declares a frame of the largest size and sends bytes for
    ``seconds`` (or until the relay closes it). All are open at once. Returns counts: ``busy``
    (answered BUSY), ``hello`` (answered with a handshake), ``sent`` (bytes sent in all)."""
    from ...relay import protocol

    prefix, magic = protocol._PREFIX, protocol.MAGIC
    most = (protocol.MAX_HEADER, protocol.MAX_PAYLOAD)
    BUSY = getattr(protocol, "BUSY", b"DRRBUSY\x00")  # (also measures relays that have no BUSY answer)

    host, _, port = addr.rpartition(":")
    counts = {"busy": 0, "hello": 0, "sent": 0, "other": 0}
    lock = threading.Lock()
    ready = threading.Barrier(connections + 1)
    end = [0.0]
    socks: list[socket.socket] = []

    def one() -> None:
        sent = [0]
        s = socket.create_connection((host, int(port)), timeout=5)
        with lock:
            socks.append(s)
        try:
            ready.wait(10)  # all connected before anyone sends: they are pending together
            s.sendall(magic + os.urandom(32))
            answer = b""
            while len(answer) < 40:
                b = s.recv(40 - len(answer))
                if not b:
                    break
                answer += b
            kind = "busy" if answer.startswith(BUSY) else "hello" if answer.startswith(magic) else "other"
            with lock:
                counts[kind] += 1
            if kind != "hello":
                return
            s.settimeout(0.2)
            junk = os.urandom(64 << 10)
            s.sendall(prefix.pack(0, *most))
            while time.monotonic() < end[0] and sent[0] < sum(most):
                try:
                    sent[0] += s.send(junk)
                except TimeoutError:
                    continue  # the relay is not reading: keep the connection open until the end
        except (OSError, threading.BrokenBarrierError):
            pass  # the relay closed it
        finally:
            with lock:
                counts["sent"] += sent[0]

    threads = [threading.Thread(target=one, daemon=True) for _ in range(connections)]
    for t in threads:
        t.start()
    end[0] = time.monotonic() + seconds + 1
    with contextlib.suppress(threading.BrokenBarrierError):
        ready.wait(10)
    end[0] = time.monotonic() + seconds
    for t in threads:
        t.join(seconds + 10)
    time.sleep(0.2)
    for s in socks:
        s.close()
    return counts


def start_root(tmp: str) -> tuple[subprocess.Popen, str]:
    """A ``deltarefit relay root`` on an empty store in ``tmp``: (process, its address)."""
    from ...relay.protocol import write_key

    key = os.path.join(tmp, "relay.key")
    if not os.path.exists(key):
        write_key(key)
    os.makedirs(os.path.join(tmp, "store"), exist_ok=True)
    log = os.path.join(tmp, "root.log")
    with open(log, "ab") as f:
        p = subprocess.Popen(relay_cmd("root", os.path.join(tmp, "store"), "--listen", "127.0.0.1:0", "--key", key,
                                       "--mirror", os.path.join(tmp, "mirror")),
                             stdout=f, stderr=subprocess.STDOUT, env=ENV)
    return p, listening(log, p)


def relay_flood(tmp: str, connections: int = 40, seconds: float = 3.0) -> dict[str, int]:
    """Root RSS before (``rss_before``), its peak after the flood (``hwm_after``), and ``flood``'s counts."""
    p, addr = start_root(tmp)
    try:
        time.sleep(0.5)  # settle: imports done, listening
        before, hwm_before = proc_mem(p.pid)
        counts = flood(addr, connections, seconds)
        _, hwm = proc_mem(p.pid)
        return {"rss_before": before, "hwm_before": hwm_before, "hwm_after": hwm, **counts}
    finally:
        stop(p)


# ------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=40)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--no-fs-faults", action="store_true", help="Skip the filesystem-faults section.")
    ap.add_argument("--no-classes", action="store_true", help="Skip the counts from the tests (classes.py).")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="deltarefit-hostile-") as tmp:
        print(f"{'case':<44} {'input':>10} {'rc':>3} {'peak RSS':>10} {'time':>7}  refusal")
        base = measure(["--version"])
        print(f"{'(python -m deltarefit --version)':<44} {'':>10} {base.rc:>3} {base.peak_rss / MIB:>7.0f} MiB "
              f"{base.seconds:>6.2f}s")
        cases = [
            ("manifest bomb, 256 MiB of [[],...]", "bomb.delta", write_manifest_bomb, "inspect"),
            ("manifest of short strings at the limit", "strings.delta", write_strings_at_limit, "inspect"),
            ("safetensors header, 100 MiB of [[],...]", "bomb.safetensors", write_header_bomb, "fingerprint"),
            ("safetensors header, 100 MiB of ints in a shape", "ints.safetensors", write_header_of_ints,
             "fingerprint"),
        ]
        for label, name, make, cmd in cases:
            path = os.path.join(tmp, name)
            size = make(path)
            r = measure([cmd, path])
            os.unlink(path)
            print(f"{label:<44} {_size(size):>10} {r.rc:>3} {r.peak_rss / MIB:>7.0f} MiB {r.seconds:>6.2f}s  "
                  f"{r.last_line[:150]}")
        f = relay_flood(tmp, a.connections, a.seconds)
        print(f"\nrelay root, {a.connections} unauthenticated connections for {a.seconds:g} s (loopback): RSS "
              f"{f['rss_before'] / MIB:.0f} MiB before, peak {f['hwm_after'] / MIB:.0f} MiB after "
              f"(+{(f['hwm_after'] - f['rss_before']) / MIB:.0f} MiB); {f['hello']} got a handshake, "
              f"{f['busy']} were answered BUSY; {f['sent'] / MIB:.1f} MiB sent to it")
        from .trust_memory import section as trust_memory

        trust_memory()
        if not a.no_classes:
            from .classes import section as classes

            classes()
        if not a.no_fs_faults:
            from .fs_faults import section

            section()
        print(f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}")
    return 0


def _size(n: int) -> str:
    return f"{n / MIB:.0f} MiB" if n >= MIB else f"{n / 1024:.0f} KB"


if __name__ == "__main__":
    sys.exit(main())
