"""Hang detection: a step that runs far longer than the steps before it (a rank stuck in a collective, a dead
file system) is a hang. The watchdog writes the stacks of every thread of this rank to `<run>/hang-rank<r>.txt`,
says so in one line on stderr, and ends the process (exit code 3), so the launch fails and Ray Train (with
`parallel.max_failures`) or the rerun resumes from the last complete checkpoint instead of waiting forever."""

from __future__ import annotations

import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

EXIT_HUNG = 3
WARMUP_STEPS = 3  # the first steps compile and fill caches: they neither arm the watchdog nor set its pace


class Watchdog:
    """Arm before a step, disarm after it; the limit is max(`min_seconds`, `factor` x the median recent step). One
    daemon thread, started at the first arming, checks the armed deadline a few times per limit, so arming and
    disarming cost two assignments (a timer thread per step cost ~10% of a small model's step)."""

    def __init__(self, run_dir: Path, rank: int, factor: float, min_seconds: float) -> None:
        self.path = run_dir / f"hang-rank{rank}.txt"
        self.factor, self.min_seconds = factor, min_seconds
        self.seconds: deque[float] = deque(maxlen=50)  # the recent steps that set the pace
        self.armed: tuple[int, float, float] | None = None  # (step, limit, deadline on the monotonic clock)
        self.thread: threading.Thread | None = None
        self.closed = threading.Event()

    def limit(self) -> float | None:
        if self.factor == 0 or len(self.seconds) < WARMUP_STEPS:
            return None
        return max(self.min_seconds, self.factor * statistics.median(self.seconds))

    def arm(self, step: int) -> None:
        limit = self.limit()
        if limit is None:
            return
        self.armed = (step, limit, time.monotonic() + limit)
        if self.thread is None:
            self.thread = threading.Thread(target=self._watch, args=(limit / 10,), daemon=True)
            self.thread.start()

    def disarm(self, seconds: float) -> None:
        self.armed = None
        self.seconds.append(seconds)

    def close(self) -> None:
        """Stop watching (the loop ended)."""
        self.closed.set()

    def _watch(self, poll: float) -> None:
        while not self.closed.wait(poll):
            armed = self.armed
            if armed is not None and time.monotonic() > armed[2]:
                self._hung(armed[0], armed[1])

    def _hung(self, step: int, limit: float) -> None:
        with self.path.open("a") as out:
            out.write(f"step {step} still running after {limit:.1f} s; every thread's stack:\n")
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
        median = statistics.median(self.seconds)
        print(
            f"lmforge: step {step} hung: still running after {limit:.1f} s (the median step took {median:.2f} s); "
            f"stacks in {self.path}; the attempt ends so it resumes from the last checkpoint "
            "(train.hang_factor=0 turns this off)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_HUNG)
