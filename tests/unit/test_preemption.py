"""Preemption signals while training: the first SIGTERM/SIGINT is a request the loop acts on at the end of its
step; a second one stops at once; the process's handlers come back afterwards."""

from __future__ import annotations

import os
import signal
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
