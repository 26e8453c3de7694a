"""lmforge's INFO records reach the console once, before and after Prefect sets up its logging; a Prefect run's
record of bad input has no traceback, a bug's keeps it; a bad `LMFORGE_LOG_LEVEL` is one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import main

SCRIPT = """
import logging
from flows.logs import send_to_prefect_runs, show_lmforge_logs

show_lmforge_logs()
log = logging.getLogger("training.loop")
log.info("resumed before Prefect")
log.debug("a debug record")
import prefect  # noqa: E402  its logging setup replaces the root's handlers with its console
send_to_prefect_runs()
log.info("resumed after Prefect")  # outside any flow run: printed, not sent
"""

FAILED_RUNS = """
import logging
import prefect  # noqa: F401
from data_pipeline.sources import DataError
from flows.logs import send_to_prefect_runs

send_to_prefect_runs()
for error in (DataError("data.sources: no files match"), RuntimeError("a bug")):
    try:
        raise error
    except Exception as e:  # as Prefect's flow engine logs a failed run
        logging.getLogger("prefect.flow_runs").error("Encountered exception during execution: %r", e, exc_info=True)
"""


def run_python(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`script` in a fresh interpreter (logging not yet set up), Prefect's state in `tmp_path`."""
    environ = {**os.environ, "PREFECT_HOME": str(tmp_path), "PYTHONWARNINGS": "default", **env}
    for name in ("LMFORGE_LOG_LEVEL", "LMFORGE_DEBUG"):
        environ.pop(name, None)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=environ, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done


def test_info_records_print_once_before_and_after_prefect_sets_up_its_logging(tmp_path: Path) -> None:
    done = run_python(SCRIPT, tmp_path)
    assert done.stderr.count("resumed before Prefect") == 1, done.stderr
    assert done.stderr.count("resumed after Prefect") == 1, done.stderr
    assert "training.loop" in done.stderr and "a debug record" not in done.stderr
    assert "flow run" not in done.stderr  # no "attempted to send logs to the API without a flow run id"


def test_a_runs_record_of_bad_input_is_one_line_and_a_bugs_keeps_its_traceback(tmp_path: Path) -> None:
    done = run_python(FAILED_RUNS, tmp_path, PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW="ignore")
    assert "DataError('data.sources: no files match')" in done.stderr, done.stderr
    assert "sources.DataError: data.sources" not in done.stderr  # a traceback's last line
    assert done.stderr.count("Traceback") == 1 and "RuntimeError: a bug" in done.stderr, done.stderr


def test_a_log_level_that_is_none_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LMFORGE_LOG_LEVEL", "loud")
    assert main(["model", "summary", "smoke"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "LMFORGE_LOG_LEVEL=LOUD is not a level: use one of DEBUG" in err, err
