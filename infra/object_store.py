"""Object storage (`s3://`, `gs://`, `abfs://`) behind one small interface, over `pyarrow.fs`.

A `Store` is a bucket and prefix: it lists, reads and writes objects by path relative to the prefix, retrying
network errors with backoff, and turns the store's errors into one-line `UserError`s that name what to set
(a bucket that does not exist, missing or wrong credentials, an unreachable endpoint, an unsupported scheme).
Credentials come from the environment only, as each cloud's own tools read them (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL` for MinIO and other S3-compatible servers; Google's application
default credentials; `AZURE_STORAGE_ACCOUNT_NAME` / `AZURE_STORAGE_ACCOUNT_KEY`); they never appear in a recipe
or a log. Object stores have no rename: whoever writes a directory writes its marker (manifest, COMPLETE) last
and readers treat a directory without one as unfinished. Downloads are hashed as they arrive and renamed into
place only when the sha256 matches, so a truncated or altered object is never taken for the real one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pyarrow.fs as pafs

from infra.errors import UserError

log = logging.getLogger(__name__)

SCHEMES = ("s3", "gs", "abfs")
# per operation (`$LMFORGE_STORAGE_ATTEMPTS`); network errors are retried with exponential backoff
ATTEMPTS = 5
BLOCK = 8 << 20
T = TypeVar("T")


class StorageError(UserError):
    """The object store refused or could not be reached; the message names what to set or check."""


class DamagedObject(StorageError):
    """An object whose size or sha256 differs from what was recorded when it was written."""


def is_remote(location: str | Path) -> bool:
    """True for a `scheme://` URI (a local path, `file://` included, is not remote)."""
    text = str(location)
    return "://" in text and not text.startswith("file://")


def split_uri(uri: str) -> tuple[str, str, str]:
    """(scheme, bucket, prefix) of `scheme://bucket/prefix`; an unsupported scheme is a one-line error."""
    scheme, _, rest = uri.partition("://")
    if scheme not in SCHEMES:
        raise StorageError(
            f"{uri}: unsupported storage scheme {scheme!r}; use a local path or one of "
            + ", ".join(f"{s}://bucket/prefix" for s in SCHEMES)
        )
    bucket, _, prefix = rest.rstrip("/").partition("/")
    if not bucket:
        raise StorageError(f"{uri}: no bucket named; write {scheme}://<bucket>/<prefix>")
    return scheme, bucket, prefix.strip("/")


def attempts(variable: str = "LMFORGE_STORAGE_ATTEMPTS", default: int = ATTEMPTS) -> int:
    """How many times a store operation is tried on network errors (lmforge's retries, or with `AWS_MAX_ATTEMPTS`
    the S3 client's own inside each of them)."""
    text = os.environ.get(variable, str(default))
    if not text.isdigit() or int(text) < 1:
        raise StorageError(f"{variable}={text!r}: set a whole number of attempts, 1 or more")
    return int(text)


def _s3_filesystem(uri: str) -> pafs.FileSystem:
    env = os.environ
    if not env.get("AWS_ACCESS_KEY_ID") and not (
        env.get("AWS_PROFILE")
        or env.get("AWS_WEB_IDENTITY_TOKEN_FILE")
        or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
    ):
        raise StorageError(
            f"{uri}: no S3 credentials in the environment; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(and AWS_ENDPOINT_URL for MinIO or another S3-compatible server)"
        )
    if env.get("AWS_ACCESS_KEY_ID") and not env.get("AWS_SECRET_ACCESS_KEY"):
        raise StorageError(f"{uri}: AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not; set it")
    options: dict[str, Any] = {
        "region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
        "connect_timeout": 5,
        "request_timeout": 60,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=attempts("AWS_MAX_ATTEMPTS", 3)),
    }
    if env.get("AWS_ACCESS_KEY_ID"):
        options |= {
            "access_key": env["AWS_ACCESS_KEY_ID"],
            "secret_key": env["AWS_SECRET_ACCESS_KEY"],
            "session_token": env.get("AWS_SESSION_TOKEN"),
        }
    if endpoint := env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"):
        scheme, _, host = endpoint.rpartition("://")
        options |= {"endpoint_override": host.rstrip("/"), "scheme": scheme or "https"}
    return pafs.S3FileSystem(**options)


GCS_RETRY_SECONDS = 15  # per operation, inside the client; `Store._retry` then logs and retries


def _filesystem(uri: str) -> pafs.FileSystem:
    scheme, _, _ = split_uri(uri)
    if scheme == "s3":
        return _s3_filesystem(uri)
    if scheme == "gs":
        # retries bounded like S3's: unbounded, a machine without credentials or network hung for minutes
        return pafs.GcsFileSystem(retry_time_limit=timedelta(seconds=GCS_RETRY_SECONDS))
    account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    if not account:
        raise StorageError(
            f"{uri}: set AZURE_STORAGE_ACCOUNT_NAME (and AZURE_STORAGE_ACCOUNT_KEY or az login)"
        )
    return pafs.AzureFileSystem(account, account_key=os.environ.get("AZURE_STORAGE_ACCOUNT_KEY"))


def _credential_variables(scheme: str) -> str:
    return {
        "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        "gs": "GOOGLE_APPLICATION_CREDENTIALS",
        "abfs": "AZURE_STORAGE_ACCOUNT_KEY",
    }[scheme]


_DENIED = (
    "ACCESS_DENIED",
    "INVALID_ACCESS_KEY",
    "SIGNATURE_DOES_NOT_MATCH",
    "AccessDenied",
    "Forbidden",
    "403",
    "OAuth2 access token",  # GCS without usable credentials (no key file, no metadata server)
)
_TRANSIENT = (
    "NETWORK_CONNECTION",
    "curlCode",
    "SLOW_DOWN",
    "SERVICE_UNAVAILABLE",
    "INTERNAL_FAILURE",
    "timed out",
)


@dataclass(frozen=True)
class Store:
    """`uri` = `scheme://bucket/prefix`; paths given to the methods are relative to the prefix."""

    uri: str
    fs: pafs.FileSystem
    bucket: str
    prefix: str

    def sub(self, relative: str) -> Store:
        """The store of a directory under this one."""
        prefix = "/".join(p for p in (self.prefix, relative.strip("/")) if p)
        return Store(self.url(relative), self.fs, self.bucket, prefix)

    def key(self, relative: str) -> str:
        return "/".join(p for p in (self.bucket, self.prefix, relative.strip("/")) if p)

    def url(self, relative: str = "") -> str:
        return f"{self.uri.rstrip('/')}/{relative}".rstrip("/")

    def _retry(self, what: str, operation: Callable[[], T]) -> T:
        """`operation()`, retried on network errors; store errors become one line naming the fix."""
        scheme = self.uri.partition("://")[0]
        limit = attempts()
        for attempt in range(1, limit + 1):
            try:
                return operation()
            except FileNotFoundError:
                raise
            except OSError as error:
                text = str(error)
                if "NO_SUCH_BUCKET" in text or "bucket does not exist" in text.lower():
                    raise StorageError(
                        f"{self.uri}: bucket {self.bucket!r} does not exist; create it or point output_dir at one "
                        "that does"
                    ) from None
                if any(word in text for word in _DENIED):
                    raise StorageError(
                        f"{self.uri}: the store refused the credentials ({text.split(':')[-1].strip()[:80]}); "
                        f"check {_credential_variables(scheme)}"
                    ) from None
                if not any(word in text for word in _TRANSIENT) or attempt == limit:
                    endpoint = {"s3": " and AWS_ENDPOINT_URL"}.get(scheme, "")
                    raise StorageError(
                        f"{self.url(what)}: {text.splitlines()[0][:160]} (after {attempt} attempt(s)); check the "
                        f"network{endpoint}, then rerun: finished work is kept and the stage resumes"
                    ) from None
                delay = min(8.0, 0.25 * 2**attempt)
                log.warning("%s: %s; retrying in %.1f s", self.url(what), text.splitlines()[0][:120], delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def check(self) -> None:
        """Fail early, in one line, when the bucket is missing or the credentials are refused."""
        info = self._retry("", lambda: self.fs.get_file_info(self.bucket))
        if info.type == pafs.FileType.NotFound:
            raise StorageError(
                f"{self.uri}: bucket {self.bucket!r} does not exist; create it or point output_dir at one that does"
            )
        # a request inside the bucket: refused credentials show here
        self._retry("", lambda: self.fs.get_file_info(self.key("")))

    def size(self, relative: str) -> int | None:
        """The object's size in bytes, or None when there is none."""
        info = self._retry(relative, lambda: self.fs.get_file_info(self.key(relative)))
        return info.size if info.type == pafs.FileType.File else None

    def listing(self, relative: str = "") -> dict[str, int]:
        """{path relative to `relative`: bytes} of every object under `relative` (empty when there are none)."""
        base = self.key(relative)
        selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
        infos = self._retry(relative, lambda: self.fs.get_file_info(selector))
        return {info.path[len(base) + 1 :]: info.size for info in infos if info.type == pafs.FileType.File}

    def read_bytes(self, relative: str) -> bytes:
        def read() -> bytes:
            with self.fs.open_input_stream(self.key(relative)) as stream:
                return stream.read()

        return self._retry(relative, read)

    def write_bytes(self, relative: str, data: bytes) -> None:
        def write() -> None:
            with self.fs.open_output_stream(self.key(relative)) as stream:
                stream.write(data)

        self._retry(relative, write)

    def upload(self, local: Path, relative: str) -> None:
        """Copy a local file to `relative` (a single object appears whole or not at all)."""

        def put() -> None:
            with open(local, "rb") as source, self.fs.open_output_stream(self.key(relative)) as stream:
                while block := source.read(BLOCK):
                    stream.write(block)

        self._retry(relative, put)

    def download(
        self, relative: str, local: Path, sha256: str | None = None, size: int | None = None
    ) -> None:
        """Copy `relative` to `local`, hashed as it arrives; it replaces `local` only when the size and sha256
        match what was recorded (a mismatch is a `StorageError` naming the object, and nothing is replaced)."""
        local.parent.mkdir(parents=True, exist_ok=True)
        # a name of its own: concurrent readers of the same object never collide
        tmp = local.with_name(f".{local.name}.{uuid.uuid4().hex[:8]}.part")

        def get() -> str:
            digest = hashlib.sha256()
            with self.fs.open_input_stream(self.key(relative)) as stream, open(tmp, "wb") as out:
                while block := stream.read(BLOCK):
                    digest.update(block)
                    out.write(block)
            return digest.hexdigest()

        try:
            actual = self._retry(relative, get)
            got = tmp.stat().st_size
            if size is not None and got != size:
                raise DamagedObject(
                    f"{self.url(relative)}: {got} bytes, {size} when written (truncated or replaced); rerun the stage "
                    "that wrote it: it rebuilds what is damaged"
                )
            if sha256 is not None and actual != sha256:
                raise DamagedObject(
                    f"{self.url(relative)}: bytes differ from the sha256 recorded when it was written (modified or "
                    "corrupted); rerun the stage that wrote it: it rebuilds what is damaged"
                )
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)

    def delete(self, relative: str) -> None:
        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.delete_file(self.key(relative))

        self._retry(relative, remove)


@functools.cache
def _cached_filesystem(uri_root: str, credentials: tuple[str | None, ...]) -> pafs.FileSystem:
    return _filesystem(uri_root)


def open_store(uri: str) -> Store:
    """The store at `uri` (one filesystem client per bucket and credentials, reused)."""
    scheme, bucket, prefix = split_uri(uri)
    env = os.environ
    credentials = tuple(
        env.get(name)
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL")
    )
    fs = _cached_filesystem(f"{scheme}://{bucket}", credentials)
    return Store(f"{scheme}://{bucket}/{prefix}".rstrip("/"), fs, bucket, prefix)
