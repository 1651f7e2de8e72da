"""A real S3 server for the S3 store tests: SeaweedFS on loopback (see ``deltarefit.apps.bench.seaweed``),
one per test session, with a temporary data directory and generated credentials. Imported by
``test_s3.py`` (a plugin module, not a conftest: only the S3 tests start the server). The server is
killed at session end (and if the start fails); an ``atexit`` hook kills it too should the session die
without running finalizers, and on Linux the kernel kills it if the test process itself is killed.
"""

from __future__ import annotations

import os

import pytest

from deltarefit.apps.bench.seaweed import (  # noqa: F401 (re-exported for the tests)
    BUCKET,
    S3Server,
    _free_ports,
    missing_reason,
    start,
    stop,
    weed_binary,
)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A running SeaweedFS S3 server with bucket ``deltarefit-test``; killed at session end."""
    reason = missing_reason()
    if reason:
        if os.environ.get("CI"):  # CI installs the test extra: a missing server there is a broken set-up
            raise RuntimeError(f"S3 tests cannot run in CI: {reason}")
        pytest.skip(reason)
    try:
        p, srv = start(str(tmp_path_factory.mktemp("seaweedfs")))
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        yield srv
    finally:
        stop(p)


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """This test's process environment points boto3 at the server (and at nothing else)."""
    for k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL_S3",
              "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
              "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(k, raising=False)
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    return s3_server


def subprocess_env(srv: S3Server, **extra: str) -> dict[str, str]:
    """An environment for a child process (the CLI) that talks to the server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(srv.env, DELTAREFIT_NO_PROGRESS="1", **extra)
    return env
