"""Verifiable rewards: a Python completion run against unit tests in a sandboxed child process.

The program (the completion, then the tests) runs in a temporary directory of its own, under an isolated
interpreter (`python -I -S`: no site-packages, no PYTHON* variables, no user site), with an environment of three
variables (nothing inherited: no credentials, no tokens), in a process group of its own with limits on CPU time,
address space, file size, open files and core dumps, and a wall-clock timeout. Whatever happens (a failed assert,
an infinite loop, a memory bomb, a child left running) costs a reward of 0 and a log line, never the caller: the
process group is killed when the run ends. Not isolated: the network and the file system outside the directory
(that needs namespaces or a container); `RLIMIT_NPROC` does not bind root.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 1 << 30
    file_bytes: int = 1 << 20
    open_files: int = 64


@dataclass(frozen=True)
class Verdict:
    """The reward (1 when every test passed, else 0), how the run ended, and its last line of output."""

    reward: float
    status: Literal["passed", "failed", "timeout", "error"]
    detail: str = ""


def run_python_tests(code: str, tests: str, limits: SandboxLimits = SandboxLimits()) -> Verdict:
    """Run `code` followed by `tests` in the sandbox; the tests pass when the program exits 0."""
    with tempfile.TemporaryDirectory(prefix="lmforge-sandbox-") as workdir:
        program = os.path.join(workdir, "program.py")
        with open(program, "w", encoding="utf-8") as f:
            f.write(f"{code}\n\n{tests}\n")
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"}
        log_path = os.path.join(
            workdir, "output.txt"
        )  # a file, not a pipe: a child left running holds a pipe open
        try:
            with open(log_path, "wb") as out:
                process = subprocess.Popen(
                    [sys.executable, "-I", "-S", program],
                    cwd=workdir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    preexec_fn=lambda: _limit(limits),  # noqa: PLW1509 - setrlimit must run in the child
                    start_new_session=True,
                )
        except OSError as error:
            return _verdict(0.0, "error", f"could not start the sandbox: {error}")
        try:
            process.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            process.wait()
            return _verdict(0.0, "timeout", f"still running after {limits.wall_seconds:g} s")
        finally:
            _kill_group(process.pid)  # whatever the program left running
        with open(log_path, "rb") as f:
            output = f.read()[-4000:]
    last = output.decode(errors="replace").strip().splitlines()[-1:] or [""]
    if process.returncode == 0:
        return Verdict(1.0, "passed")
    if process.returncode < 0:
        return _verdict(0.0, "failed", f"killed by {signal.Signals(-process.returncode).name}; {last[0]}")
    return _verdict(0.0, "failed", last[0][:300])


def _limit(limits: SandboxLimits) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _verdict(reward: float, status: Literal["failed", "timeout", "error"], detail: str) -> Verdict:
    log.debug("sandboxed tests %s: %s", status, detail)
    return Verdict(reward, status, detail)
