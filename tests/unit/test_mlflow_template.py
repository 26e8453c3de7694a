"""A new sqlite MLflow store is a copy of a migrated empty one: the same database MLflow would have built, with
MLflow's own default experiment for this store; an existing store is never replaced, and without a usable cache
MLflow builds its own as before."""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
from pathlib import Path

import mlflow
import pytest

from infra import mlflow_template
from infra.mlflow_template import seed_store, template_path
from infra.tracking import TrackingConfig, open_run


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _schema(db: Path) -> dict[str, object]:
    """Tables with their columns, indexes and the schema revision (MLflow's migrations order a table's
    constraints differently from one database to the next, so its SQL text is not compared)."""
    with contextlib.closing(sqlite3.connect(db)) as con:
        names = con.execute("SELECT type, name FROM sqlite_master ORDER BY type, name").fetchall()
        tables = [n for t, n in names if t == "table"]
        columns = {n: con.execute(f"PRAGMA table_info('{n}')").fetchall() for n in tables}
        return {
            "names": names,
            "columns": columns,
            "revision": con.execute("SELECT * FROM alembic_version").fetchall(),
        }


def test_a_seeded_store_is_the_database_mlflow_builds(tmp_path, cache) -> None:
    built = tmp_path / "built" / "mlflow.db"
    built.parent.mkdir()
    mlflow.MlflowClient(f"sqlite:///{built}").search_experiments()  # MLflow migrates its own
    run = open_run(TrackingConfig(), tmp_path / "out", "seeded", {})  # lmforge's store: from the template
    copied = tmp_path / "copied" / "mlflow.db"
    seed_store(f"sqlite:///{copied}")
    assert copied.read_bytes() == template_path().read_bytes()  # before MLflow opens it
    seeded = tmp_path / "out" / "mlflow.db"
    assert run.uri == f"sqlite:///{seeded.resolve()}" and _schema(seeded) == _schema(built)
    client = mlflow.MlflowClient(run.uri)
    assert client.get_run(run.run_id).info.run_name == "seeded"
    (default,) = [e for e in client.search_experiments() if e.name == "Default"]  # MLflow's, made on the copy
    assert default.experiment_id == "0"
    run.finish()


def test_an_existing_store_is_never_replaced(tmp_path, cache, monkeypatch) -> None:
    first = open_run(TrackingConfig(), tmp_path, "first", {})
    store = tmp_path / "mlflow.db"
    before = store.read_bytes()
    seed_store(first.uri)
    assert store.read_bytes() == before
    # another process creates the store while this one copies the template: its store stays
    other = tmp_path / "other" / "mlflow.db"
    copy = shutil.copyfile

    def racing(source, target):
        copy(source, target)
        copy(store, other)  # the other process's store, with its run in it

    monkeypatch.setattr(mlflow_template.shutil, "copyfile", racing)
    seed_store(f"sqlite:///{other}")
    assert other.read_bytes() == before and not list(other.parent.glob(".*"))  # no staging file left


def test_without_a_usable_cache_mlflow_builds_its_own(tmp_path, monkeypatch) -> None:
    (tmp_path / "cache").write_text("a file where the cache directory should be")
    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path / "cache"))
    run = open_run(TrackingConfig(), tmp_path / "out", "unseeded", {})
    assert mlflow.MlflowClient(run.uri).get_run(run.run_id).info.run_name == "unseeded"
    run.finish()
