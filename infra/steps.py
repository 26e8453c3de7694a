"""The cached-step protocol every stage runs through (in the spirit of Marin's executor).

A step names its config (opt-in: only what determines the output), its upstream artifacts (by content digest,
never by path) and how to build. `run_step` owns the rest: the content-addressed directory
`<root>/<stage>/<name>-<hash>/`, a lock so two identical runs never build into one directory, the manifest
written last and atomically, and the rule that a finished step is returned as is (a rerun is a no-op). A
directory without a manifest is unfinished: `build` is called on it again and may resume what it finds.

A root may be an object-store URI (`s3://bucket/prefix`): the step is built in this node's copy of its directory
(`infra/mirror.py`), after pulling what another node left of it, and pushed with the manifest last; a finished
remote step is pulled, verified, and returned with local paths.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from infra import mirror
from infra.errors import UserError
from infra.object_store import DamagedObject, Store, is_remote, open_store
from infra.storage import MANIFEST, atomic_write_json, digest_of

log = logging.getLogger(__name__)


class Artifact(BaseModel):
    """What a step leaves behind, stored as its manifest. `key` is the step's key digest (set by `run_step`)."""

    model_config = ConfigDict(frozen=True)

    path: str
    key: str = ""
    uri: str = ""  # where the step's directory lives when its root is an object store

    # files read lazily through the digest-keyed cache, never pulled with the directory (fnmatch patterns)
    lazy_files: ClassVar[tuple[str, ...]] = ()

    def digest(self) -> str:
        """What downstream steps key on: by default the digest of everything that determined this artifact."""
        return self.key

    def damage(self) -> str | None:
        """What is wrong with the files this artifact points at (none checked unless a kind overrides it)."""
        return None

    def materialize(self) -> None:
        """On a node that has no copy of a remote artifact (a worker elsewhere in the cluster): pull it, and the
        other stage directories of the same root it points into (a dataset's tokenizer, a run's base model)."""
        if not self.uri or (Path(self.path) / MANIFEST).is_file():
            return
        root_uri = self.uri.rsplit("/", 2)[0]
        mirror.pull_referenced(root_uri, self.model_dump(mode="json"), {self.uri: self.lazy_files})

    @classmethod
    def from_file(cls, file: Path) -> Any:
        """The manifest `file` as this kind, its paths rebased onto where its directory is now (`relocated`)."""
        return cls.model_validate(relocated(json.loads(file.read_text()), file.parent))

    @classmethod
    def _pull(cls, uri: str) -> Path:
        local = mirror.local_path(uri)
        if mirror.pull_finished(open_store(uri), local, cls.lazy_files) is None:
            raise UserError(
                f"{uri}: no {MANIFEST} there, so it has not finished: rerun the command that started it"
            )
        return local

    @classmethod
    def load(cls, directory: str | Path) -> Any:
        """The finished, intact artifact in `directory` (a path or an object-store URI, pulled to this node);
        anything else is a one-line UserError saying why."""
        if is_remote(directory):
            directory = cls._pull(str(directory))
        path = Path(directory) / MANIFEST
        if not Path(directory).is_dir():
            raise UserError(
                f"{directory}: no such directory; give the run directory a finished stage printed"
            )
        if not path.is_file():
            raise UserError(
                f"{directory}: no {MANIFEST}, so it has not finished: rerun the command that started it (it resumes)"
            )
        try:
            artifact = cls.from_file(path)
        except ValueError as error:
            raise UserError(f"{path}: not a {cls.__name__} manifest ({str(error).splitlines()[0]})") from None
        if problem := artifact.damage():
            raise UserError(
                f"{directory} is damaged ({problem}); rerun the command that made it: it resumes from the newest "
                "intact checkpoint and rewrites what is damaged"
            )
        return artifact


def relocated(manifest: dict[str, Any], directory: Path) -> dict[str, Any]:
    """`manifest`, written in a step directory that has since moved to `directory` (a copied or moved `outputs/`
    tree), with every path into its old directory, or into its old output root (another stage's directory: a
    dataset's tokenizer, a run's base model), rebased onto the new one; paths outside the root are left as they are.
    So a copy reads and verifies its own files, never the original's."""
    recorded = manifest.get("path")
    here = directory.resolve()
    if not recorded or Path(recorded) == here:
        return manifest
    moves = [(recorded, str(here)), (str(Path(recorded).parent.parent), str(here.parent.parent))]

    def rebased(value: str) -> str:
        for old, new in moves:
            if value == old or value.startswith(old + "/"):
                return new + value[len(old) :]
        return value

    return mirror.map_strings(manifest, rebased)


A = TypeVar("A", bound=Artifact)


@dataclass(frozen=True)
class Step(Generic[A]):
    """One cached unit of work: stage, name, version, opt-in config, upstream artifacts and the artifact type."""

    stage: str
    name: str
    version: int
    config: Mapping[str, Any]
    kind: type[A]
    deps: Mapping[str, Artifact | None] = field(default_factory=dict)

    def key(self) -> dict[str, Any]:
        deps = {name: (dep.digest() if dep is not None else None) for name, dep in self.deps.items()}
        return {"version": self.version, "config": dict(self.config), "deps": deps}

    def digest(self) -> str:
        return digest_of(self.key())

    def relative(self) -> str:
        return f"{self.stage}/{self.name}-{self.digest()[:12]}"

    def directory(self, root: str | Path) -> Path:
        """`<root>/<stage>/<name>-<first 12 hex of the key digest>` (this node's copy of it when `root` is an
        object store); not created."""
        return mirror.working_dir(root) / self.relative()

    def store(self, root: str | Path) -> Store:
        return open_store(str(root)).sub(self.relative())

    def finished(self, root: str | Path) -> A | None:
        """The step's artifact when it has finished and its files are intact, else None (a damaged one is named
        in a warning and built again: training resumes from its newest intact checkpoint)."""
        if is_remote(root):
            return self._finished_remote(root)
        manifest = self.directory(root) / MANIFEST
        if not manifest.is_file():
            return None
        return self._intact(self.kind.from_file(manifest), root)

    def _finished_remote(self, root: str | Path) -> A | None:
        store = self.store(root)
        try:
            manifest = mirror.pull_finished(store, self.directory(root), self.kind.lazy_files)
        except DamagedObject as problem:
            log.warning("%s finished but is damaged (%s); rebuilding it", store.uri, problem)
            return None
        return None if manifest is None else self._intact(self.kind.model_validate(manifest), root)

    def _intact(self, artifact: A, root: str | Path) -> A | None:
        if problem := artifact.damage():
            log.warning("%s finished but is damaged (%s); rebuilding it", self.directory(root), problem)
            return None
        return artifact


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on the (created) directory itself for the duration of the build."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def run_step(root: str | Path, step: Step[A], build: Callable[[Path, str], A]) -> A:
    """The step's artifact: the finished one, or `build(directory, key_digest)` with the manifest written last."""
    if is_remote(root):
        open_store(str(root)).check()  # a missing bucket or refused credentials: one line, before any work
    done = step.finished(root)
    if done is not None:
        return done
    out = step.directory(root)
    with _locked(out):
        done = step.finished(root)  # another process may have finished it while we waited
        if done is not None:
            return done
        key = step.digest()
        store = step.store(root) if is_remote(root) else None
        # finished in this node's copy but not in the store: an upload cut short, which only needs finishing
        if store is not None and (built := step.finished(mirror.working_dir(root))) is not None:
            mirror.push(out, store, built.model_dump(mode="json"))
            return built
        if store is not None:
            mirror.pull_unfinished(store, out)  # what another node left: resume from it
        artifact = build(out, key).model_copy(
            update={"path": str(out.resolve()), "key": key, "uri": store.uri if store else ""}
        )
        atomic_write_json(out / MANIFEST, artifact.model_dump(mode="json"))
        if store is not None:
            mirror.push(out, store, artifact.model_dump(mode="json"))
    return artifact
