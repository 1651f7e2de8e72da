"""A version stream in an S3 bucket (or any S3-compatible object store), through ``boto3``.

``S3Store("s3://bucket/prefix")`` keeps each key as the object ``prefix/key``. Endpoint, region and
credentials come from the standard AWS environment and config files (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_PROFILE``, ...): boto3 reads them.

How the contract maps onto S3:
* ``put``/``put_file``: one ``PutObject``, or a multipart upload with parallel parts for large objects. S3
  makes an object visible only when its upload completes, so a reader never sees a partial object. A
  failed multipart upload is aborted (the transfer manager does; this store checks and aborts any left).
* ``create``: ``PutObject`` with ``If-None-Match: *``: S3 answers 412 to every creator but the first.
* ``get_to``: parallel ranged GETs into a temp file next to the destination, then ``os.replace``.
* ``sweep_temps``: aborts incomplete multipart uploads under the prefix (writers killed mid-upload).
* Optional operations: all but ``path_of`` (objects are no local files); ``mtime`` is the object's
  ``LastModified`` (the server's clock, to the second).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from typing import Any

from ..errors import UsageError
from .base import (
    GET_RANGE,
    MTIME,
    SET_PROGRESS,
    SWEEP_TEMPS,
    StoreBase,
    StoreError,
    check_key,
    check_range,
    local_write_error,
)

MiB = 1 << 20
_TOKEN = "deltarefit-put"  # object metadata naming one put_file call, to find its multipart upload


class S3Store(StoreBase):
    capabilities = frozenset({GET_RANGE, MTIME, SWEEP_TEMPS, SET_PROGRESS})

    def __init__(self, url: str, *, multipart_threshold: int = 8 * MiB, multipart_chunksize: int = 8 * MiB,
                 max_concurrency: int = 10, rate: float | None = None) -> None:
        if not url.startswith("s3://"):
            raise UsageError(f"{url}: not an s3:// URL")
        bucket, _, prefix = url[len("s3://"):].partition("/")
        prefix = prefix.strip("/")
        if not bucket:
            raise UsageError(f"{url}: no bucket in the S3 URL (s3://bucket/prefix)")
        if prefix:
            check_key(prefix)
        self.bucket = bucket
        self.prefix = prefix
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.multipart_threshold = multipart_threshold
        self.multipart_chunksize = multipart_chunksize
        self.max_concurrency = max_concurrency
        self._lock = threading.Lock()
        self._cli: Any = None
        self._cfg: Any = None
        self._started: dict[str, list[str]] = {}  # put_file token -> multipart upload ids it started
        # Link emulation: one token bucket for the store, shared by every connection of every transfer
        # (they share the emulated link). boto3 calls the callback from its worker threads as bytes
        # move; sleeping there holds that connection back, as a slow link would.
        self._cb = None
        self._pace = None
        if rate:
            from ..transport.ratelimit import TokenBucket

            self._cb = self._pace = TokenBucket(rate).take

    def set_progress(self, progress) -> None:
        """Call ``progress(n)`` as each ``n`` bytes of a part go in or out of the store (a progress bar;
        called from the transfer threads)."""
        pace = self._pace
        if progress is None:
            self._cb = pace
        elif pace is None:
            self._cb = progress
        else:
            def both(n: int) -> None:
                pace(n)
                progress(n)

            self._cb = both

    # ------------------------------------------------------------------------------------ plumbing

    def _client(self) -> Any:
        """The boto3 client, made on first use (boto3 is imported only then). Clients are thread-safe;
        sessions are not, so each store makes its own session under a lock."""
        if self._cli is not None:
            return self._cli
        with self._lock:
            if self._cli is None:
                try:
                    import boto3
                    from boto3.s3.transfer import TransferConfig
                    from botocore.config import Config
                except ImportError:
                    raise StoreError(f"{self.url}: S3 stores need boto3 (pip install boto3)") from None
                try:
                    cli = boto3.session.Session().client("s3", config=Config(
                        connect_timeout=10, read_timeout=120,
                        max_pool_connections=max(10, 2 * self.max_concurrency)))
                except Exception as e:
                    raise StoreError(f"{self.url}: cannot set up an S3 client ({_one_line(e)})") from None
                ev = cli.meta.events
                ev.register("before-parameter-build.s3.CreateMultipartUpload", self._note_token)
                ev.register("after-call.s3.CreateMultipartUpload", self._note_upload)
                self._cfg = TransferConfig(multipart_threshold=self.multipart_threshold,
                                           multipart_chunksize=self.multipart_chunksize,
                                           max_concurrency=self.max_concurrency, use_threads=True)
                self._cli = cli
        return self._cli

    @staticmethod
    def _note_token(params: dict, context: dict, **_: Any) -> None:
        token = (params.get("Metadata") or {}).get(_TOKEN)
        if token:
            context["deltarefit_token"] = token

    def _note_upload(self, parsed: dict, context: dict, **_: Any) -> None:
        token = context.get("deltarefit_token")
        if token and parsed.get("UploadId"):
            with self._lock:
                self._started.setdefault(token, []).append(parsed["UploadId"])

    def _obj(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, obj: str) -> str:
        return obj[len(self.prefix) + 1:] if self.prefix else obj

    def _where(self, key: str | None) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _error(self, e: BaseException, what: str, key: str | None = None) -> BaseException:
        """The exception to raise for a boto3/botocore failure: ``KeyError`` for a missing key (when
        ``key`` is given), ``StoreError`` with one line naming the URL for everything else."""
        import botocore.exceptions as bx

        where = self._where(key)
        if isinstance(e, bx.ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket":
                return StoreError(f"{self.url}: {what} failed: bucket {self.bucket!r} does not exist")
            if key is not None and (code in ("NoSuchKey", "404", "NotFound") or status == 404):
                return KeyError(key)
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                        "InvalidToken", "403") or status == 403:
                return StoreError(f"{where}: {what} refused by S3 ({code or status}): check the AWS "
                                  f"credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE)")
            msg = _one_line(err.get("Message", "")) or str(status)
            return StoreError(f"{where}: {what} failed ({code}: {msg})")
        if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError)):
            return StoreError(f"{where}: {what} failed: no usable AWS credentials (set AWS_ACCESS_KEY_ID and "
                              f"AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)")
        if isinstance(e, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError,
                          bx.ConnectionClosedError)):
            endpoint = getattr(self._cli, "meta", None)
            endpoint = endpoint.endpoint_url if endpoint else "?"
            return StoreError(f"{where}: {what} failed: cannot reach the S3 endpoint {endpoint} "
                              f"(AWS_ENDPOINT_URL): {_one_line(e)}")
        if isinstance(e, bx.NoRegionError):
            return StoreError(f"{where}: {what} failed: no AWS region (set AWS_REGION)")
        if isinstance(e, OSError):
            return StoreError(f"{where}: {what} failed ({e.strerror or _one_line(e)})")
        return StoreError(f"{where}: {what} failed ({type(e).__name__}: {_one_line(e)})")

    def _call(self, what: str, key: str | None, fn, /, **kw: Any) -> Any:
        try:
            return fn(Bucket=self.bucket, **kw)
        except Exception as e:
            if isinstance(e, (StoreError, UsageError)):
                raise
            raise self._error(e, what, key) from None

    def _tcfg(self) -> Any:
        self._client()
        return self._cfg

    # ------------------------------------------------------------------------------------ writes

    def put(self, key: str, data: bytes) -> None:
        obj = self._obj(key)
        c = self._client()
        if len(data) < self.multipart_threshold:
            self._call("put", key, c.put_object, Key=obj, Body=bytes(data))
            return
        import io

        self._upload(key, lambda extra: c.upload_fileobj(io.BytesIO(data), self.bucket, obj, ExtraArgs=extra,
                                                         Config=self._tcfg(), Callback=self._cb))

    def put_file(self, key: str, path: str) -> None:
        obj = self._obj(key)
        c = self._client()
        if not os.path.isfile(path):
            raise StoreError(f"{self._where(key)}: put_file: {path} is not a readable file")
        self._upload(key, lambda extra: c.upload_file(path, self.bucket, obj, ExtraArgs=extra,
                                                      Config=self._tcfg(), Callback=self._cb))

    def _upload(self, key: str, go) -> None:
        """Run a transfer-manager upload. On failure the transfer manager aborts its multipart upload;
        if that abort itself failed (a lost connection), abort it here, so no upload is left behind."""
        token = uuid.uuid4().hex
        try:
            go({"Metadata": {_TOKEN: token}})
        except BaseException as e:
            for upload_id in self._take(token):
                with contextlib.suppress(Exception):
                    self._client().abort_multipart_upload(Bucket=self.bucket, Key=self._obj(key),
                                                          UploadId=upload_id)
            if isinstance(e, Exception) and not isinstance(e, (StoreError, UsageError)):
                raise self._error(_cause(e), "upload", key) from None
            raise
        self._take(token)

    def _take(self, token: str) -> list[str]:
        with self._lock:
            return self._started.pop(token, [])

    def create(self, key: str, data: bytes) -> bool:
        import botocore.exceptions as bx

        obj = self._obj(key)
        c = self._client()
        for attempt in range(8):
            try:
                c.put_object(Bucket=self.bucket, Key=obj, Body=bytes(data), IfNoneMatch="*")
                return True
            except bx.ClientError as e:
                code = str(e.response.get("Error", {}).get("Code", ""))
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status == 412 or code == "PreconditionFailed":
                    return False
                if status == 409 or code == "ConditionalRequestConflict":
                    # Another conditional write to the key is in flight: AWS asks to retry; the retry
                    # answers 412 if it won, or succeeds if it failed. Out of retries: not ours.
                    if attempt == 7:
                        return False
                    time.sleep(0.05 * 2**attempt)
                    continue
                raise self._error(e, "create", key) from None
            except Exception as e:
                raise self._error(e, "create", key) from None
        return False

    def delete(self, key: str) -> None:
        self._call("delete", key, self._client().delete_object, Key=self._obj(key))

    # ------------------------------------------------------------------------------------ reads

    def get(self, key: str) -> bytes:
        r = self._call("get", key, self._client().get_object, Key=self._obj(key))
        try:
            return r["Body"].read()
        except Exception as e:
            raise self._error(e, "get", key) from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """One ranged GET: ``length`` bytes from ``start`` (fewer at the end of the object, none past
        it: S3 answers 416 for a range that starts at or after the end of an existing object)."""
        obj = self._obj(key)
        check_range(key, start, length)
        if length == 0:
            self._head(key, "get")  # a missing key is a KeyError whatever the length
            return b""
        c = self._client()  # (a StoreError naming boto3 where it is not installed)
        import botocore.exceptions as bx

        try:
            r = c.get_object(Bucket=self.bucket, Key=obj, Range=f"bytes={start}-{start + length - 1}")
        except bx.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code == "InvalidRange" or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416:
                return b""
            raise self._error(e, "get", key) from None
        except Exception as e:
            raise self._error(e, "get", key) from None
        try:
            data = r["Body"].read()
        except Exception as e:
            raise self._error(e, "get", key) from None
        if self._cb is not None:
            self._cb(len(data))
        return data

    def get_to(self, key: str, dest: str) -> None:
        obj = self._obj(key)
        c = self._client()
        tmp = f"{dest}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            c.download_file(self.bucket, obj, tmp, Config=self._tcfg(), Callback=self._cb)
            os.replace(tmp, dest)
        except BaseException as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            local = local_write_error(_cause(e), dest)
            if local is not None:  # the local side: a full disk, a directory it may not write
                raise local from None
            if isinstance(e, Exception) and not isinstance(e, (StoreError, UsageError, KeyError)):
                raise self._error(_cause(e), f"download to {dest}", key) from None
            raise

    def _head(self, key: str, what: str) -> dict:
        return self._call(what, key, self._client().head_object, Key=self._obj(key))

    def exists(self, key: str) -> bool:
        try:
            self._head(key, "exists")
            return True
        except KeyError:
            return False

    def size(self, key: str) -> int:
        return int(self._head(key, "size")["ContentLength"])

    def mtime(self, key: str) -> float:
        return self._head(key, "mtime")["LastModified"].timestamp()

    def list(self, prefix: str = "") -> list[str]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        out: list[str] = []
        try:
            pages = self._client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full)
            for page in pages:
                out.extend(self._rel(o["Key"]) for o in page.get("Contents", ()))
        except Exception as e:
            if isinstance(e, StoreError):
                raise
            raise self._error(e, f"list {prefix!r}") from None
        return sorted(k for k in out if k.startswith(prefix))

    # ------------------------------------------------------------------------------------ upkeep

    def sweep_temps(self, older_than: float, *, prefix: str = "", dry_run: bool = False) -> list[str]:
        """Abort incomplete multipart uploads under this store's prefix (and ``prefix`` within it)
        started more than ``older_than`` seconds ago (a writer killed mid-upload leaves one; they are
        never objects, but their parts take space). Returns their keys; ``dry_run``: only those,
        nothing aborted."""
        cutoff = time.time() - older_than
        full = (f"{self.prefix}/" if self.prefix else "") + prefix
        c = self._client()
        swept = []
        try:
            for page in c.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=full):
                for u in page.get("Uploads", ()):
                    if u["Initiated"].timestamp() <= cutoff:
                        if not dry_run:
                            with contextlib.suppress(c.exceptions.NoSuchUpload):
                                c.abort_multipart_upload(Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"])
                        swept.append(self._rel(u["Key"]))
        except Exception as e:
            if isinstance(e, StoreError):
                raise
            raise self._error(e, "sweep_temps") from None
        return swept


def _cause(e: BaseException) -> BaseException:
    """boto3's transfer errors (``S3UploadFailedError``) wrap the botocore error as their cause/context."""
    seen = 0
    while seen < 5 and type(e).__name__ in ("S3UploadFailedError", "S3TransferFailedError", "RetriesExceededError"):
        inner = e.__cause__ or e.__context__ or getattr(e, "last_exception", None)
        if inner is None:
            break
        e = inner
        seen += 1
    return e


def _one_line(e: object) -> str:
    return " ".join(str(e).split())
