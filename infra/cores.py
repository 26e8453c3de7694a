"""How many one-thread processes this machine runs side by side at full pace, measured.

The vCPUs a machine reports are not always cores: some of our 2-vCPU machines behave like one core (two hyperthreads,
`shared/notes`), on another (an AMD EPYC, `lscpu`: one thread per core) two processes each kept 95-97% of their speed.
A sweep runs that many trials at once (`sweep.max_concurrent: auto`); each trial's numbers do not depend on it.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

# each probe process: wait for the shared start, then count 128x128 float64 GEMMs for a fixed time
_PROBE = """
import sys, time
import numpy as np
start, seconds = float(sys.argv[1]), float(sys.argv[2])
a = np.random.default_rng(0).random((128, 128))
a @ a
while time.time() < start:
    time.sleep(0.001)
n, end = 0, start + seconds
while time.time() < end:
    a @ a
    n += 1
print(n / seconds)
"""
# two processes count as two cores when each keeps this share of its speed alone
FULL_PACE = 0.8


def one_thread_env() -> dict[str, str]:
    """This process's environment for a child that runs one BLAS/OpenMP thread."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def cores_each(processes: int) -> int:
    """The CPUs each of `processes` side by side gets as its threads: an equal share, at least one."""
    return max(1, (os.cpu_count() or 1) // processes)


def _rates(processes: int, seconds: float) -> list[float]:
    """GEMMs per second of each of `processes` probes run at once, one BLAS thread each."""
    env = one_thread_env()
    start = time.time() + 0.3  # after every interpreter has started
    probes = [
        subprocess.Popen(
            [sys.executable, "-c", _PROBE, str(start), str(seconds)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(processes)
    ]
    return [float(p.communicate()[0]) for p in probes]


@functools.cache
def parallel_cores(limit: int | None = None, seconds: float = 0.4, tries: int = 3) -> int:
    """The most one-thread processes (up to `limit`, default the CPUs this process may use) that each keep
    `FULL_PACE` of a lone process's speed when run together, in the best of `tries` (a process busy beside the probe
    for a moment must not decide it); 1 when the probe cannot run. ~1 s a try."""
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = min(limit or available, available)
    cores = 1
    try:
        for _ in range(tries):
            alone = _rates(1, seconds)[0]
            for k in range(cores + 1, limit + 1):
                if min(_rates(k, seconds)) < FULL_PACE * alone:
                    break
                cores = k
            if cores == limit:
                break
    except (OSError, ValueError, subprocess.SubprocessError):
        return cores
    return cores
