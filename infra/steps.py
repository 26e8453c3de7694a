"""The cached-step protocol every stage runs through (in the spirit of Marin's executor).

A step names its config (opt-in: only what determines the output), its upstream artifacts (by content digest,
never by path) and how to build. `run_step` owns the rest: the content-addressed directory
`<root>/<stage>/<name>-<hash>/`, a lock so two identical runs never build into one directory, the manifest
written last and atomically, and the rule that a finished step is returned as is (a rerun is a no-op). A
directory without a manifest is unfinished: `build` is called on it again and may resume what it finds.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from infra.errors import UserError
from infra.storage import MANIFEST, atomic_write_json, digest_of

log = logging.getLogger(__name__)


class Artifact(BaseModel):
    """What a step leaves behind, stored as its manifest. `key` is the step's key digest (set by `run_step`)."""

    model_config = ConfigDict(frozen=True)

    path: str
    key: str = ""

    def digest(self) -> str:
        """What downstream steps key on: by default the digest of everything that determined this artifact."""
        return self.key

    def damage(self) -> str | None:
        """What is wrong with the files this artifact points at (none checked unless a kind overrides it)."""
        return None

    @classmethod
    def load(cls, directory: str | Path) -> Any:
        """The finished, intact artifact in `directory`; anything else is a one-line UserError saying why."""
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
            artifact = cls.model_validate_json(path.read_text())
        except ValueError as error:
            raise UserError(f"{path}: not a {cls.__name__} manifest ({str(error).splitlines()[0]})") from None
        if problem := artifact.damage():
            raise UserError(
                f"{directory} is damaged ({problem}); rerun the command that made it: it resumes from the newest "
                "intact checkpoint and rewrites what is damaged"
            )
        return artifact


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

    def directory(self, root: str | Path) -> Path:
        """`<root>/<stage>/<name>-<first 12 hex of the key digest>`; not created."""
        return Path(root) / self.stage / f"{self.name}-{self.digest()[:12]}"

    def finished(self, root: str | Path) -> A | None:
        """The step's artifact when it has finished and its files are intact, else None (a damaged one is named
        in a warning and built again: training resumes from its newest intact checkpoint)."""
        manifest = self.directory(root) / MANIFEST
        if not manifest.is_file():
            return None
        artifact = self.kind.model_validate_json(manifest.read_text())
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
    done = step.finished(root)
    if done is not None:
        return done
    out = step.directory(root)
    with _locked(out):
        done = step.finished(root)  # another process may have finished it while we waited
        if done is not None:
            return done
        key = step.digest()
        artifact = build(out, key).model_copy(update={"path": str(out.resolve()), "key": key})
        atomic_write_json(out / MANIFEST, artifact.model_dump(mode="json"))
    return artifact
