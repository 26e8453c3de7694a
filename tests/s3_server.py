"""A real S3-protocol server on 127.0.0.1 for the object-storage tests: moto's standalone server (`moto[server]`)
with authentication on, one IAM user whose key the tests use, and a bucket. Stopped by its PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from infra.services import free_port

BUCKET = "lmforge"


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str

    def env(self, cache: Path) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "LMFORGE_CACHE": str(cache),
        }


def _user_and_bucket(endpoint: str) -> tuple[str, str]:
    """The first three requests are unauthenticated (INITIAL_NO_AUTH_ACTION_COUNT=3): an IAM user, its policy
    and its key; everything after needs that key."""
    import boto3
    import pyarrow.fs as pafs

    iam = boto3.client(
        "iam",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="setup",
        aws_secret_access_key="setup",
    )
    iam.create_user(UserName="lmforge")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    iam.put_user_policy(UserName="lmforge", PolicyName="all", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="lmforge")["AccessKey"]
    fs = pafs.S3FileSystem(
        access_key=key["AccessKeyId"],
        secret_key=key["SecretAccessKey"],
        endpoint_override=endpoint.split("://")[1],
        scheme="http",
        region="us-east-1",
        allow_bucket_creation=True,
    )
    fs.create_dir(BUCKET)
    return key["AccessKeyId"], key["SecretAccessKey"]


@contextmanager
def s3_server(log: Path) -> Iterator[S3Server]:
    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2)
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.2)
        yield S3Server(endpoint, *_user_and_bucket(endpoint))
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # its own process group: nothing else is touched
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
