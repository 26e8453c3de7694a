"""Preemption: schedulers send SIGTERM before they kill, users press Ctrl-C. While the training loop runs in the
process's main thread (an `lmforge` launch training in-process), the first SIGTERM or SIGINT asks it to stop after
the current step: it writes a checkpoint there and raises `Preempted`, which ends the command in one line (exit 2)
with the MLflow run KILLED, and the same command resumes from that checkpoint. A second signal stops at once, as
without the handler. Ray Train runs a worker's loop in a thread of its own, where signals are not delivered."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """The signal that asked training to stop (its name), or None."""

    def __init__(self) -> None:
        self.signal: str | None = None


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Within the block, SIGTERM and SIGINT (unless ignored) set the yielded request instead of ending the process
    (the first one; the second gets the handler that was there before). Outside the main thread: a request nothing
    sets."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    # a signal the process ignores (SIGINT in a shell's background job) stays ignored
    previous = {n: signal.getsignal(n) for n in SIGNALS if signal.getsignal(n) is not signal.SIG_IGN}

    def handle(number: int, _frame: FrameType | None) -> None:
        if request.signal is not None:  # asked twice: stop now
            signal.signal(number, previous[number])
            signal.raise_signal(number)
            return
        request.signal = signal.Signals(number).name
        log.warning(
            "%s: training stops after this step, once its checkpoint is written (send it again to stop now)",
            request.signal,
        )

    for number in previous:
        signal.signal(number, handle)
    try:
        yield request
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
