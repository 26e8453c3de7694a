"""lmforge's own log records where its users look: the console and, inside a Prefect run, that run's logs in the
Prefect UI. lmforge logs at INFO what a user acts on (a run resumed from a checkpoint and at which step, blocks
compiled or trained eager and why, how many sweep trials run at once), which Python's default level, WARNING,
drops. `LMFORGE_LOG_LEVEL` (DEBUG, INFO, WARNING, ERROR) sets another level."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from infra.errors import UserError, bad_input

PACKAGES = ("infra", "data_pipeline", "training", "evaluation", "flows")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class _Console(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is when a record comes (rich's progress bars redirect it so that lines
    print above the bars). Its name starts with `_` so that Prefect, setting up its logging when first imported,
    counts it as no user's handler and replaces it with its own console, which then prints these records."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(
            logging.Formatter("%(asctime)s | %(levelname)-7s | %(name)s - %(message)s", "%H:%M:%S")
        )

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


def show_lmforge_logs() -> None:
    """lmforge's packages log at `LMFORGE_LOG_LEVEL` (default INFO) to the root logger's handlers; a console
    handler is added there if the root has none (Python's last resort would print only warnings)."""
    level = os.environ.get("LMFORGE_LOG_LEVEL", "INFO").upper()
    if level not in LEVELS:
        raise UserError(f"LMFORGE_LOG_LEVEL={level} is not a level: use one of {', '.join(LEVELS)}")
    for name in PACKAGES:
        logging.getLogger(name).setLevel(level)
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(_Console())


class _OneLineUserErrors(logging.Filter):
    """Prefect logs a failed run's exception with its traceback. Bad input, which the CLI ends in one line (a
    `UserError`, a library's `ValueError`, an expected OS failure), is that line in the run's log too: the
    record's message names the error. `LMFORGE_DEBUG=1` keeps every traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and bad_input(error) and not os.environ.get("LMFORGE_DEBUG"):
            record.exc_info, record.exc_text = None, None
        return True


def send_to_prefect_runs() -> None:
    """Inside a Prefect flow or task run, lmforge's records also go to that run's logs (the Prefect UI); outside
    one they only print. Prefect's `PREFECT_LOGGING_EXTRA_LOGGERS` does the first but warns on every record
    outside a run, which the CLI's stage commands log all the time. The runs' own records of bad input lose
    their tracebacks (`_OneLineUserErrors`)."""
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.logging.handlers import APILogHandler

    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OneLineUserErrors) for f in logger.filters):
            logger.addFilter(_OneLineUserErrors())

    class _InRuns(APILogHandler):
        def emit(self, record: logging.LogRecord) -> None:
            if FlowRunContext.get() is not None or TaskRunContext.get() is not None:
                super().emit(record)

    for name in PACKAGES:
        logger = logging.getLogger(name)
        if not any(type(h).__name__ == "_InRuns" for h in logger.handlers):
            logger.addHandler(_InRuns())
