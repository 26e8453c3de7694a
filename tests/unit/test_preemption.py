"""Preemption signals while training: the first SIGTERM/SIGINT is a request the loop acts on at the end of its
step; a second one stops at once; the process's handlers come back afterwards. In a Ray worker, the exit Ray's own
SIGTERM handler raises inside a callback at shutdown is not reported as an error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from training.preemption import stop_on_signals


@pytest.fixture
def python_sigint():
    """Python's own Ctrl-C handler for the test (a pytest-xdist worker ignores SIGINT), restored afterwards."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_the_first_signal_asks_the_second_stops_and_handlers_come_back(python_sigint) -> None:
    before = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    with stop_on_signals() as stop:
        assert stop.signal is None
        os.kill(os.getpid(), signal.SIGTERM)  # handled in this (main) thread before the next line runs
        assert stop.signal == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):  # asked again (Ctrl-C): the previous handler, at once
            os.kill(os.getpid(), signal.SIGINT)
    assert {number: signal.getsignal(number) for number in before} == before


def test_outside_the_main_thread_nothing_is_installed() -> None:
    seen = []

    def worker() -> None:  # as Ray Train runs a worker's loop
        with stop_on_signals() as stop:
            seen.append((stop.signal, signal.getsignal(signal.SIGTERM)))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [(None, signal.getsignal(signal.SIGTERM))]


def test_an_ignored_signal_stays_ignored() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job of a shell
    try:
        with stop_on_signals() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.signal is None and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


# Ray's worker SIGTERM handler, landing while a weakref callback runs (what ended some sweep trials at shutdown),
# then a callback that fails for a real reason: only the real failure may reach stderr.
_RAY_WORKER_AT_SHUTDOWN = """
import os, signal, sys, weakref
from infra.ray_cluster import quiet_exits_in_callbacks
def sigterm_handler(signum, frame):
    raise SystemExit(1)
signal.signal(signal.SIGTERM, sigterm_handler)
if sys.argv[1] == "quiet":
    quiet_exits_in_callbacks()
    quiet_exits_in_callbacks()
class Thing: pass
def signalled(_):
    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside the callback
def broken(_):
    raise ValueError("a real bug in a callback")
a, b = Thing(), Thing()
keep = [weakref.ref(a, signalled), weakref.ref(b, broken)]
del a
del b
print("still running")
"""


@pytest.mark.parametrize("mode", ["quiet", "plain"])
def test_an_exit_inside_a_callback_is_not_reported_but_real_errors_are(mode: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _RAY_WORKER_AT_SHUTDOWN, mode], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout == "still running\n", done.stderr
    assert "ValueError: a real bug in a callback" in done.stderr
    # the plain run shows the report the quiet one drops
    assert ("SystemExit" in done.stderr) == (mode == "plain"), done.stderr


# A driver whose main thread waits outside the interpreter (as in `ray.get`) while the signal lands on another
# thread: Python's handler runs only when the wait ends, 5 s later here.
_BLOCKED_DRIVER = """
import signal, sys, time
from pathlib import Path
from training.preemption import stop_file_on_signals
with stop_file_on_signals(Path(sys.argv[1]), "the workers"):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # the main thread is busy elsewhere
    print("waiting", flush=True)
    time.sleep(5)
"""


def test_the_stop_file_appears_while_the_main_thread_is_still_blocked(tmp_path) -> None:
    import time

    stop_file = tmp_path / "run" / "STOP"
    driver = subprocess.Popen(
        [sys.executable, "-c", _BLOCKED_DRIVER, str(stop_file)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert driver.stdout.readline() == "waiting\n"
        driver.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2
        while not stop_file.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop_file.exists() and driver.poll() is None  # before the wait ends
    finally:
        driver.kill()
        driver.wait()
