"""Preemption: schedulers send SIGTERM before they kill, users press Ctrl-C. While the training loop runs in the
process's main thread (an `lmforge` launch training in-process), the first SIGTERM or SIGINT asks it to stop after
the current step: it writes a checkpoint there and raises `Preempted`, which ends the command in one line (exit 2)
with the MLflow run KILLED, and the same command resumes from that checkpoint. A second signal stops at once, as
without the handler. Ray runs a sweep trial's or a Ray Train worker's loop in a thread of its own, where signals are
not delivered: the driver (`lmforge sweep`, a `--workers N` launch) creates a stop file on the signal instead, which
the loop of a process given its path in `$LMFORGE_STOP_FILE` checks after every step (all ranks agree)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGTERM, signal.SIGINT)


STOP_FILE = "LMFORGE_STOP_FILE"


class StopRequest:
    """What asked training to stop: a signal (its name), the stop file's appearance, or nothing (None)."""

    def __init__(self, file: Path | None = None) -> None:
        self.signal: str | None = None
        self.file = file

    def reason(self) -> str | None:
        if self.signal is None and self.file is not None and self.file.exists():
            self.by_file()
        return self.signal

    def by_file(self) -> None:
        """The stop file asked (seen here, or by another rank)."""
        self.signal = f"a stop request ({self.file})"


@contextmanager
def stop_on_signals(on_stop: Callable[[], None] | None = None) -> Iterator[StopRequest]:
    """Within the block, SIGTERM and SIGINT (unless ignored) set the yielded request instead of ending the process
    (the first one, after calling `on_stop`; the second gets the handler that was there before). Outside the main
    thread: a request only the stop file named in `$LMFORGE_STOP_FILE` sets."""
    request = StopRequest(Path(os.environ[STOP_FILE]) if os.environ.get(STOP_FILE) else None)
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
        if on_stop is not None:
            on_stop()
            return
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


@contextmanager
def stop_file_on_signals(path: Path, what: str) -> Iterator[StopRequest]:
    """For the driver of loops that signals never reach (sweep trials, Ray Train workers: threads of Ray actors):
    within the block, the first SIGTERM or SIGINT creates `path`, which those loops, given it in `$LMFORGE_STOP_FILE`,
    check after every step. A stale one, left by an earlier attempt, is removed first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)

    def ask() -> None:
        path.touch()
        log.warning(
            "%s stop after their current step, once it is checkpointed (send the signal again to stop now)",
            what,
        )

    with stop_on_signals(ask) as request, _touched_on_arrival(path):
        yield request


@contextmanager
def _touched_on_arrival(path: Path) -> Iterator[None]:
    """Within the block, a thread creates `path` the moment SIGTERM or SIGINT arrives. Python runs signal handlers
    in the main thread only, between bytecodes, and a driver waiting in `ray.get` (in C++, without the GIL) runs them
    up to a second late: at ~10 ms a step the workers trained ~50 more steps first, or finished. The C-level handler
    writes the signal's number to the wakeup fd at once, which this thread reads. Skipped when the process already
    has a wakeup fd (an asyncio loop's)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    receive, send = socket.socketpair()
    send.setblocking(False)
    theirs = signal.set_wakeup_fd(send.fileno(), warn_on_full_buffer=False)
    if theirs != -1:
        signal.set_wakeup_fd(theirs)
        receive.close()
        send.close()
        yield
        return
    numbers = {int(n) for n in SIGNALS}

    def watch() -> None:
        while data := receive.recv(64):  # b"" once `send` is closed
            if numbers.intersection(data):
                path.touch()

    watcher = threading.Thread(target=watch, name="lmforge-stop-file", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(-1)
        send.close()
        watcher.join()
        receive.close()
