"""The object-storage layer without a server: URIs, retries and their one-line errors, manifest path mapping,
the shard cache's bound. (Against a real S3-protocol server: tests/integration/test_object_storage.py.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from infra import blob_cache, mirror
from infra.object_store import StorageError, Store, is_remote, split_uri


def test_uris() -> None:
    assert split_uri("s3://bucket/a/b/") == ("s3", "bucket", "a/b")
    assert is_remote("gs://b/x") and not is_remote("/data/x") and not is_remote("file:///data/x")
    with pytest.raises(StorageError, match="unsupported storage scheme 'ftp'"):
        split_uri("ftp://host/x")
    with pytest.raises(StorageError, match="no bucket named"):
        split_uri("s3:///x")


def store() -> Store:
    return Store("s3://bucket/prefix", pafs.LocalFileSystem(), "bucket", "prefix")


def test_network_errors_are_retried_then_reported_in_one_line(monkeypatch) -> None:
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise OSError("AWS Error NETWORK_CONNECTION during PutObject operation: curlCode: 7")
        return "done"

    assert store()._retry("x", flaky) == "done" and len(calls) == 3

    def down() -> None:
        raise OSError("AWS Error NETWORK_CONNECTION during PutObject operation: curlCode: 7")

    with pytest.raises(StorageError, match=r"after 5 attempt\(s\)\); check the network and AWS_ENDPOINT_URL"):
        store()._retry("x", down)
    monkeypatch.setenv("LMFORGE_STORAGE_ATTEMPTS", "2")
    calls.clear()
    with pytest.raises(StorageError, match=r"after 2 attempt\(s\)"):
        store()._retry("x", lambda: calls.append(1) or down())
    assert len(calls) == 2
    monkeypatch.setenv("LMFORGE_STORAGE_ATTEMPTS", "0")
    with pytest.raises(StorageError, match="LMFORGE_STORAGE_ATTEMPTS='0': set a whole number of attempts"):
        store()._retry("x", down)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            "AWS Error ACCESS_DENIED during HeadObject operation",
            "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        ),
        ("AWS Error NO_SUCH_BUCKET during CreateMultipartUpload", "bucket 'bucket' does not exist"),
        ("AWS Error UNKNOWN (HTTP status 400)", "after 1 attempt"),  # not transient: no retry
    ],
)
def test_store_errors_name_the_fix(message: str, expected: str) -> None:
    def fail() -> None:
        raise OSError(message)

    with pytest.raises(StorageError, match=expected):
        store()._retry("x", fail)


def test_manifest_paths_become_uris_and_back(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path))
    local = mirror.local_path("s3://bucket/runs/pretrain/a-1")
    assert local == tmp_path.resolve() / "mirror" / "s3" / "bucket" / "runs" / "pretrain" / "a-1"
    manifest = {
        "path": str(local),
        "uri": "s3://bucket/runs/pretrain/a-1",
        "files": [str(local / "hf"), "/elsewhere"],
    }
    remote = mirror.to_uris(manifest)
    assert remote["path"] == "s3://bucket/runs/pretrain/a-1" and remote["files"] == [
        "s3://bucket/runs/pretrain/a-1/hf",
        "/elsewhere",
    ]
    assert mirror.to_local(remote) == manifest  # `uri` stays a URI on every node


def test_shard_cache_evicts_least_recently_used(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path))
    blob_cache.blob_dir().mkdir(parents=True)
    paths = []
    for i in range(4):
        path = blob_cache.blob_dir() / f"{i:064x}"
        path.write_bytes(b"x" * 100)
        os.utime(path, (1000 + i, 1000 + i))
        paths.append(path)
    removed = blob_cache.evict(limit=250, keep=paths[0])
    assert removed == [paths[1], paths[2]]  # oldest first, never the one just fetched
    assert sorted(p.name for p in blob_cache.blob_dir().iterdir()) == [paths[0].name, paths[3].name]
