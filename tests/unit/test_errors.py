"""Expected failures become one line at the CLI edge (exit code 2); bugs keep their traceback. The failures here
are real ones: a full device, torch writing a checkpoint to it, SQLite out of pages, a path through a file."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch

from flows.cli import main
from infra.errors import UserError, bad_input, expected_failure

needs_dev_full = pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")


def _raised(action) -> BaseException:
    try:
        action()
    except Exception as error:  # noqa: BLE001 - the error is what the test inspects
        return error
    raise AssertionError("expected a failure")


@needs_dev_full
def test_a_full_disk_is_one_line_naming_the_fix() -> None:
    def write() -> None:
        with open("/dev/full", "wb") as f:
            f.write(b"x" * 100_000)
            f.flush()

    line = expected_failure(_raised(write))
    assert (
        line.startswith("disk full ([Errno 28] No space left on device)") and "rerun the same command" in line
    )
    line = expected_failure(_raised(lambda: torch.save({"w": torch.zeros(100_000)}, "/dev/full")))
    assert line.startswith("torch could not write a checkpoint file") and "disk is full" in line


@needs_dev_full
def test_the_checkpoint_write_the_disk_refused_is_named_not_a_later_write(tmp_path: Path) -> None:
    """A checkpoint file hits the full disk, then marking the MLflow run FAILED hits it too (SQLite): the line
    names the checkpoint file, not SQLAlchemy's hint about the second failure."""
    from training.parallel.checkpoint_writer import write_file

    db = sqlite3.connect(tmp_path / "mlflow.db")
    db.execute("pragma max_page_count=2")

    def save_then_track() -> None:
        try:
            write_file({"w": torch.zeros(100_000)}, "/dev/full")
        finally:
            db.execute("create table t(x)")
            db.execute("insert into t values (?)", ("a" * 100_000,))

    line = expected_failure(_raised(save_then_track))
    assert line.startswith("disk full writing /dev/full ([Errno 28] No space left on device): free space"), (
        line
    )


def test_sqlite_out_of_space_is_a_full_disk(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "mlflow.db")
    db.execute("pragma max_page_count=2")

    def insert() -> None:
        db.execute("create table t(x)")
        db.execute("insert into t values (?)", ("a" * 100_000,))

    assert expected_failure(_raised(insert)).startswith("disk full (database or disk is full)")


def test_os_errors_on_paths_and_user_errors_are_one_line_bugs_are_not(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    line = expected_failure(_raised(lambda: (tmp_path / "file" / "out").mkdir(parents=True)))
    assert line == f"{tmp_path / 'file' / 'out'}: Not a directory; check the path and its permissions"
    wrapped = _raised(lambda: _reraise(UserError("data.sources: nothing matches")))
    assert expected_failure(wrapped) == "data.sources: nothing matches"
    assert expected_failure(_raised(lambda: {}["missing"])) is None
    assert expected_failure(_raised(lambda: 1 / 0)) is None
    # what a Prefect run's log keeps without its traceback (flows/logs.py): the same errors and a library's
    # validation message; a bug keeps its traceback
    assert bad_input(wrapped) and bad_input(_raised(lambda: int("x")))
    assert not bad_input(_raised(lambda: {}["missing"])) and not bad_input(_raised(lambda: 1 / 0))


def _reraise(error: Exception) -> None:
    try:
        raise error
    except UserError as inner:
        raise RuntimeError("a worker failed") from inner


def test_cli_turns_an_unwritable_output_dir_into_exit_2(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("")
    code = main(["tokenize", "smoke", "--set", f"output_dir={tmp_path / 'file' / 'outputs'}"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("lmforge: error:")]
    assert code == 2 and len(errors) == 1 and "Not a directory" in errors[0] and "Traceback" not in err, err
