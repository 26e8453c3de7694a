"""Verifiable rewards in the sandbox: passing and failing programs, and what a hostile or broken completion can
do — loop forever, exhaust memory, fill the disk, read the caller's credentials, leave a process running — each
ends in a reward of 0 (or, for the credentials, finds nothing), never in an exception or a hang of the caller."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from training.verifiable import SandboxLimits, run_python_tests

ADD = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


def test_passing_and_failing_completions() -> None:
    assert run_python_tests(ADD, TESTS).reward == 1.0
    wrong = run_python_tests("def add(a, b):\n    return a - b\n", TESTS)
    assert (wrong.reward, wrong.status) == (0.0, "failed") and "AssertionError" in wrong.detail
    broken = run_python_tests("def add(a, b) return a\n", TESTS)
    assert broken.reward == 0.0 and "SyntaxError" in broken.detail


def test_a_completion_that_never_ends_costs_its_timeout_only() -> None:
    start = time.monotonic()
    verdict = run_python_tests(
        "def add(a, b):\n    while True:\n        pass\n", TESTS, SandboxLimits(wall_seconds=2)
    )
    assert verdict.reward == 0.0 and verdict.status in ("timeout", "failed")  # wall clock or CPU limit
    assert time.monotonic() - start < 10


def test_a_sleeping_completion_is_stopped_by_the_wall_clock() -> None:
    """A program that sleeps uses no CPU, so only the wall-clock timeout can end it: status `timeout`, within a
    few seconds of the limit (a missing timeout would wait the program's 120 s out)."""
    start = time.monotonic()
    verdict = run_python_tests("import time\ntime.sleep(120)\n" + ADD, TESTS, SandboxLimits(wall_seconds=1.5))
    assert (verdict.reward, verdict.status) == (0.0, "timeout")
    assert time.monotonic() - start < 8


def test_memory_and_disk_bombs_are_stopped_by_the_limits() -> None:
    memory = run_python_tests("blob = bytearray(4 << 30)\n" + ADD, TESTS)
    assert memory.reward == 0.0 and "MemoryError" in memory.detail
    disk = run_python_tests("open('big', 'wb').write(b'x' * (8 << 20))\n" + ADD, TESTS)
    assert disk.reward == 0.0 and "File too large" in disk.detail


def test_no_credentials_or_site_packages_reach_the_program(monkeypatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "canary-secret")
    leaks = "import os\nassert 'canary-secret' not in str(os.environ), os.environ\nassert set(os.environ) <= {'PATH', 'HOME', 'LANG', 'LC_CTYPE'}\n"
    assert run_python_tests(leaks, "").status == "passed"
    assert run_python_tests("import torch\n", "").reward == 0.0  # an isolated interpreter: the stdlib only


def test_nothing_the_program_started_outlives_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    spawn = (
        "import subprocess\n"
        f"child = subprocess.Popen(['sleep', '60'])\nopen({str(pid_file)!r}, 'w').write(str(child.pid))\n"
    )
    assert run_python_tests(spawn + ADD, TESTS).reward == 1.0
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the sandboxed program's child is still running"
        time.sleep(0.05)


@pytest.mark.skipif(
    os.geteuid() != 0, reason="only root can be refused a write outside the directory by nothing"
)
def test_the_program_runs_in_a_directory_of_its_own() -> None:
    where = run_python_tests(
        "import os\nassert os.getcwd().startswith('/tmp/lmforge-sandbox-'), os.getcwd()\n", ""
    )
    assert where.status == "passed"
