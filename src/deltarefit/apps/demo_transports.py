"""The demo's transports: where the version stream lives and how the rollouts reach it. ``local``, the
embedded default, is a directory under the output; ``s3`` is a bucket at a given URL or, without one, in a
SeaweedFS server started on loopback for the run; ``relay`` serves the local store through a tree of
``deltarefit relay`` processes on loopback, one node per rollout keeping its checkpoint in sync.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

from ..errors import UsageError

TRANSPORTS = ("local", "s3", "relay")
LABELS = {"local": "a local store", "s3": "S3", "relay": "a local store through a relay tree"}


def open_transport(stack: contextlib.ExitStack, transport: str, store: str, out_dir: str,
                   s3_url: str | None) -> tuple[str, str, RelayTree | None]:
    """(store the rollouts read, where it is in words, the relay tree or None) for ``transport``; what it
    starts (a SeaweedFS server, relay processes) is stopped when ``stack`` closes."""
    where = "the embedded default store: a local directory"
    if transport == "s3":
        if s3_url:
            store, where = s3_url, "S3, endpoint from the AWS environment"
        else:
            from .bench import seaweed

            if seaweed.missing_reason():
                raise UsageError(f"--transport s3 without --s3-url starts a local SeaweedFS: "
                                 f"{seaweed.missing_reason()}")
            srv = stack.enter_context(seaweed.running(os.path.join(out_dir, "seaweedfs")))
            os.environ.update(srv.env)  # the rollout processes inherit the endpoint and credentials
            store, where = srv.url("demo"), f"S3: a SeaweedFS server on loopback, {srv.endpoint}"
    relay = None
    if transport == "relay":
        relay = RelayTree(store, out_dir)
        stack.callback(relay.close)
        where = f"a relay tree on loopback: root {relay.root} serving the local store, a node per rollout"
    return store, where, relay


class RelayTree:
    """--transport relay: a ``deltarefit relay root`` serving the store and one ``relay node`` per
    rollout (fan-out 2), real processes on loopback with a fresh shared key. Each node keeps its
    rollout's checkpoint in sync; the rollout waits for it."""

    def __init__(self, store: str, out: str) -> None:
        from ..relay.protocol import write_key
        from .bench.relay import listening, start

        self._start, self._listening = start, listening
        self.dir = os.path.join(out, "relay")
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        self.key = os.path.join(self.dir, "relay.key")
        write_key(self.key)
        self.procs: list[subprocess.Popen] = []
        log = os.path.join(self.dir, "root.log")
        root = start(["root", store, "--listen", "127.0.0.1:0", "--key", self.key, "--fanout", "2", "--poll",
                      "0.02", "--mirror", os.path.join(self.dir, "root-mirror"), "--id", "root"], log)
        self.procs.append(root)
        self.root = listening(log, root)

    def add_node(self, i: int, checkpoint: str, rollout_dir: str) -> str:
        """Start rollout ``i``'s node; returns its mirror, the store its rollout reads records from."""
        mirror = os.path.join(rollout_dir, "relay-mirror")
        log = os.path.join(self.dir, f"node-{i}.log")
        p = self._start(["node", checkpoint, "--join", self.root, "--listen", "127.0.0.1:0", "--key", self.key,
                         "--fanout", "2", "--mirror", mirror, "--id", f"rollout-{i}"], log)
        self.procs.append(p)
        self._listening(log, p)
        return mirror

    def close(self) -> None:
        from ..io.procs import stop

        stop(reversed(self.procs))
