"""Local working copies of stage directories that live on object storage.

A stage whose root is `s3://bucket/prefix` builds in `<cache>/mirror/s3/bucket/prefix/<stage>/<name-hash>/` (the
cache is `$LMFORGE_CACHE`, default `~/.cache/lmforge`; nodes of one cluster use the same one) and is then pushed:
every file, then `.files.json` (each file's size and sha256), then the manifest, last, because an object store has
no rename. A directory without a remote manifest is unfinished. Pulling a finished directory downloads each file
once, checked against `.files.json`; files a kind reads lazily (token shards) are only size-checked here and are
fetched through the digest-keyed cache (`infra/blob_cache.py`) when read. Absolute paths inside manifests are
stored as URIs remotely and mapped back to this node's copy when pulled.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from infra.object_store import SCHEMES, DamagedObject, Store, is_remote, open_store, split_uri
from infra.storage import MANIFEST, atomic_write_json, damaged_file, file_records

log = logging.getLogger(__name__)

FILES = ".files.json"  # remote, per finished directory: {relative path: {bytes, sha256}}


def cache_root() -> Path:
    return Path(os.environ.get("LMFORGE_CACHE") or Path.home() / ".cache" / "lmforge").resolve()


def mirror_root() -> Path:
    return cache_root() / "mirror"


def local_path(uri: str) -> Path:
    """This node's copy of `uri`: `<cache>/mirror/<scheme>/<bucket>/<prefix>`."""
    scheme, bucket, prefix = split_uri(uri)
    return mirror_root().joinpath(scheme, bucket, *[p for p in prefix.split("/") if p])


def working_dir(location: str | Path) -> Path:
    """Where this node works on `location`: the path itself, or this node's copy of an object-store URI."""
    return local_path(str(location)) if is_remote(location) else Path(location)


def map_strings(value: Any, rename: Callable[[str], str]) -> Any:
    """`value` (a manifest as JSON) with `rename` applied to every string in it but an artifact's own `uri` (it
    names the store, whatever the node or directory)."""
    if isinstance(value, str):
        return rename(value)
    if isinstance(value, dict):
        return {k: v if k == "uri" else map_strings(v, rename) for k, v in value.items()}
    if isinstance(value, list):
        return [map_strings(v, rename) for v in value]
    return value


def _map_strings(value: Any, old: str, new: str) -> Any:
    return map_strings(value, lambda s: new + s[len(old) :] if s.startswith(old) else s)


def to_uris(value: Any) -> Any:
    """`value` (a manifest as JSON) with every path into the mirror written as the URI it copies."""
    for scheme in SCHEMES:
        value = _map_strings(value, f"{mirror_root()}/{scheme}/", f"{scheme}://")
    return value


def to_local(value: Any) -> Any:
    """The inverse of `to_uris`, for this node's mirror."""
    for scheme in SCHEMES:
        value = _map_strings(value, f"{scheme}://", f"{mirror_root()}/{scheme}/")
    return value


def _lazy(relative: str, lazy: Iterable[str]) -> bool:
    return any(fnmatch.fnmatch(relative, pattern) for pattern in lazy)


def read_manifest(store: Store) -> dict[str, Any] | None:
    """The remote manifest of `store`'s directory as local JSON, or None when it has not finished."""
    if store.size(MANIFEST) is None:
        return None
    return to_local(json.loads(store.read_bytes(MANIFEST)))


def pull(store: Store, local: Path, lazy: Iterable[str] = ()) -> None:
    """Make `local` a verified copy of the finished directory at `store` (files already here and intact are kept;
    `lazy` patterns are only size-checked). A damaged object raises `DamagedObject` after it and the remote
    manifest are deleted, so the directory reads as unfinished and the rebuild uploads it again."""
    records: dict[str, dict[str, Any]] = json.loads(store.read_bytes(FILES))
    sizes = store.listing()
    for relative, record in records.items():
        if sizes.get(relative) != record["bytes"]:
            _unfinish(store, relative, f"{sizes.get(relative, 0)} bytes, {record['bytes']} when written")
        if _lazy(relative, lazy) or _intact(local / relative, record):
            continue
        try:
            store.download(relative, local / relative, record["sha256"], record["bytes"])
        except DamagedObject:
            _unfinish(store, relative, "bytes differ from the sha256 recorded when it was written")


def pull_finished(store: Store, local: Path, lazy: Iterable[str] = ()) -> dict[str, Any] | None:
    """The manifest (local JSON) of the finished directory at `store`, pulled and verified into `local` with the
    manifest written there too; None when it has not finished. A damaged object raises `DamagedObject` (`pull`)."""
    manifest = read_manifest(store)
    if manifest is None:
        return None
    pull(store, local, lazy)
    atomic_write_json(local / MANIFEST, manifest)
    return manifest


def _intact(path: Path, record: dict[str, Any]) -> bool:
    return path.is_file() and damaged_file(path.parent, {path.name: record}) is None


def _unfinish(store: Store, relative: str, problem: str) -> None:
    store.delete(MANIFEST)
    store.delete(relative)
    raise DamagedObject(f"{store.url(relative)}: {problem} (truncated or corrupted); it is rebuilt")


def pull_plain(store: Store, local: Path) -> Path:
    """`local` as a copy of a plain directory on object storage, one lmforge did not write (a Hugging Face model's:
    no manifest, no `.files.json`): each object is downloaded unless a file of its size is already here."""
    for relative, size in store.listing().items():
        target = local / relative
        if not (target.is_file() and target.stat().st_size == size):
            store.download(relative, target, size=size)
    return local


def pull_unfinished(store: Store, local: Path, plain_files: bool = True) -> None:
    """What another node left of an unfinished directory: its newest complete checkpoint, unless an intact copy
    is here (`checkpoints/step-N/COMPLETE` is uploaded last, so a listed COMPLETE means every file before it is
    there), and with `plain_files` the other files that are missing here or have grown there (append-only logs;
    a local copy that is ahead is kept)."""
    listing = store.listing()
    complete = sorted(
        r.split("/")[1] for r in listing if r.startswith("checkpoints/step-") and r.endswith("/COMPLETE")
    )
    newest = f"checkpoints/{complete[-1]}/" if complete else None
    plain = [
        r for r in listing if plain_files and not r.startswith(("checkpoints/", "ray/")) and r != MANIFEST
    ]
    wanted = [r for r in plain if not (local / r).is_file() or (local / r).stat().st_size < listing[r]]
    if newest is not None:
        marker = json.loads(store.read_bytes(newest + "COMPLETE"))
        files = marker.get("files") or {}
        target = local / newest
        if not (target / "COMPLETE").is_file() or damaged_file(target, files) is not None:
            for relative, record in files.items():
                if not _intact(target / relative, record):
                    store.download(newest + relative, target / relative, record["sha256"], record["bytes"])
            wanted.append(newest + "COMPLETE")
            log.info("resuming from %s (pulled from the store)", store.url(newest))
    for relative in wanted:
        store.download(relative, local / relative, size=listing[relative])


def _digests_in_markers(relatives: Iterable[str], read: Any) -> dict[str, str]:
    """{relative path: sha256} that the checkpoint markers (`checkpoints/step-N/COMPLETE`, listing every file of
    the checkpoint) among `relatives` state, as `read(relative)` returns their JSON (None when absent)."""
    digests = {}
    for relative in relatives:
        if relative.startswith("checkpoints/") and relative.endswith("/COMPLETE"):
            marker = read(relative)
            for name, record in ((marker or {}).get("files") or {}).items():
                digests[f"{relative.removesuffix('COMPLETE')}{name}"] = record["sha256"]
    return digests


def push(local: Path, store: Store, manifest: dict[str, Any], exclude: tuple[str, ...] = ("ray/",)) -> None:
    """Upload a finished directory: each file the store lacks (checkpoints uploaded while training are not sent
    again), then `.files.json`, then the manifest (with URIs) last."""

    def local_marker(relative: str) -> Any:
        return json.loads((local / relative).read_text())

    def remote_marker(relative: str) -> Any:
        return json.loads(store.read_bytes(relative)) if remote.get(relative) else None

    names = [p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()]
    known = {
        r: {"bytes": (local / r).stat().st_size, "sha256": d}
        for r, d in _digests_in_markers(names, local_marker).items()
        if (local / r).is_file()
    }
    records = {
        relative: record
        for relative, record in file_records(local, exclude=(MANIFEST,), known=known).items()
        if not relative.startswith(exclude)
    }
    remote = store.listing()
    there = _digests_in_markers(records, remote_marker)
    if remote.get(FILES):
        there |= {r: record["sha256"] for r, record in json.loads(store.read_bytes(FILES)).items()}
    for relative, record in records.items():
        if remote.get(relative) != record["bytes"] or there.get(relative) != record["sha256"]:
            store.upload(local / relative, relative)
    store.write_bytes(FILES, json.dumps(records, indent=1).encode())
    store.write_bytes(MANIFEST, (json.dumps(to_uris(manifest), indent=2) + "\n").encode())


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict | list):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _strings(item)


def pull_referenced(root_uri: str, manifest: dict[str, Any], lazy: dict[str, tuple[str, ...]]) -> None:
    """Pull every finished stage directory of `root_uri` that `manifest` (local JSON) points into and this node
    lacks; `lazy` maps a directory's URI to its lazily read patterns."""
    local_root = local_path(root_uri)
    directories = set()
    for text in _strings(manifest):
        path = Path(text)
        if path.is_relative_to(local_root) and len(path.relative_to(local_root).parts) >= 2:
            directories.add("/".join(path.relative_to(local_root).parts[:2]))
    for relative in sorted(directories):
        target = local_root / relative
        if (target / MANIFEST).is_file():
            continue
        store = open_store(root_uri).sub(relative)
        pull_finished(store, target, lazy.get(store.uri, ()))
