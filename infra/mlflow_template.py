"""A new MLflow sqlite store starts as a copy of an empty one this MLflow version already migrated.

MLflow builds a new store by creating its first tables and running every schema migration since (~1.5 s here),
which each command paid when it tracked into a new output directory, and each `mlflow server` over a new file.
The template is that empty database, made once per MLflow version in lmforge's cache; MLflow itself adds the
default experiment (whose artifact location is the store's own) when it first opens the copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
from importlib.metadata import version
from pathlib import Path

log = logging.getLogger(__name__)


def seed_store(uri: str) -> None:
    """If `uri` is a sqlite store whose file does not exist yet, create the file as a copy of the template. Best
    effort: when that fails, MLflow migrates its own as before; an existing file is never replaced."""
    if not uri.startswith("sqlite:///") or uri == "sqlite:///:memory:":
        return
    path = Path(uri.removeprefix("sqlite:///"))
    if path.exists():
        return
    staging = path.with_name(f".{path.name}-{os.getpid()}")
    try:
        template = _template()
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, staging)
        with contextlib.suppress(FileExistsError):  # another process created the store first: it stays
            os.link(staging, path)  # appears whole, never over an existing file
    except (OSError, sqlite3.Error, ImportError) as error:
        log.debug("no MLflow store template used for %s: %s", path, error)
    finally:
        staging.unlink(missing_ok=True)


def template_path() -> Path:
    """Where this MLflow version's migrated, empty database is kept (in lmforge's cache)."""
    from infra.mirror import cache_root  # (object storage's imports, not needed by `lmforge up` otherwise)

    return cache_root() / "mlflow-db" / f"{version('mlflow')}.db"


def _template() -> Path:
    """The template database, migrated now if this MLflow version has none yet."""
    path = template_path()
    if path.is_file():
        return path
    import sqlalchemy
    from mlflow.store.db.utils import _initialize_tables  # what MLflow runs on a store with no tables

    staging = path.with_name(f".{path.name}-{os.getpid()}")
    staging.parent.mkdir(parents=True, exist_ok=True)
    staging.unlink(missing_ok=True)
    engine = sqlalchemy.create_engine(f"sqlite:///{staging}")
    try:
        _initialize_tables(engine)
    finally:
        engine.dispose()
    os.replace(staging, path)  # whole or not at all; a concurrent maker's identical copy may be replaced
    return path
