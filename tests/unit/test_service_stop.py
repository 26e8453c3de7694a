"""`stop_all` on real process groups shaped like a `ray start --block` head: the leader stops its children in
order, and a process born during the shutdown is not left behind."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import psutil

from infra.services import Running, members, stop, stop_all

# One script, three roles. "gcs" exits on SIGTERM. "raylet" shuts down gracefully on SIGTERM only while its gcs
# still runs (Ray's raylet waited out the whole grace period once its GCS had died first); a clean exit writes
# `<role>.clean`. The "leader" starts both and, on SIGTERM, stops the raylet, then the gcs, as `ray start --block`
# does; with `spawn`, it first starts a process that ignores SIGTERM (born during the shutdown).
SERVICE = """
import os, signal, subprocess, sys, time
from pathlib import Path
role, out = sys.argv[1], Path(sys.argv[2])
def clean_exit(*_):
    (out / f"{role}.clean").touch()
    os._exit(0)
if role == "gcs":
    signal.signal(signal.SIGTERM, clean_exit)
elif role == "raylet":
    gcs = Path(f"/proc/{sys.argv[3]}/stat")
    def graceful(*_):
        time.sleep(0.5)  # draining: it talks to its gcs
        if gcs.exists() and gcs.read_text().rsplit(")", 1)[1].split()[0] != "Z":
            clean_exit()
        time.sleep(60)  # the gcs is gone (exited, or a zombie its parent has not reaped): it never finishes
    signal.signal(signal.SIGTERM, graceful)
elif role == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    spawn = len(sys.argv) > 3
    gcs = subprocess.Popen([sys.executable, __file__, "gcs", str(out)])
    raylet = subprocess.Popen([sys.executable, __file__, "raylet", str(out), str(gcs.pid)])
    def shutdown(*_):
        if spawn:
            subprocess.Popen([sys.executable, __file__, "stubborn", str(out)])
            time.sleep(0.5)
        for child in (raylet, gcs):
            child.terminate()
            child.wait()
        clean_exit()
    signal.signal(signal.SIGTERM, shutdown)
(out / f"{role}.ready").touch()
while True:
    time.sleep(1)
"""


def _start(tmp_path: Path, *spawn: str) -> Running:
    script = tmp_path / "service.py"
    script.write_text(SERVICE)
    proc = subprocess.Popen(
        [sys.executable, str(script), "leader", str(tmp_path), *spawn], start_new_session=True
    )
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"{role}.ready").exists() for role in ("leader", "gcs", "raylet")):
        assert time.monotonic() < deadline, "the service did not start"
        time.sleep(0.05)
    return Running.of("ray", proc.pid, "", "")


def _alive(running: Running) -> list[psutil.Process]:
    return [p for p in members(running) if p.status() != psutil.STATUS_ZOMBIE]


def test_the_leader_stops_its_children_in_its_own_order(tmp_path: Path) -> None:
    running = _start(tmp_path)
    stop_all([running], timeout=20)
    assert not _alive(running)
    assert {p.name for p in tmp_path.glob("*.clean")} == {"leader.clean", "raylet.clean", "gcs.clean"}


def test_a_process_born_during_the_shutdown_is_stopped_too(tmp_path: Path) -> None:
    running = _start(tmp_path, "spawn")
    stop_all([running], timeout=2.5)
    assert (tmp_path / "leader.clean").exists()
    assert not _alive(running)


def test_a_service_is_known_by_its_start_from_boot_when_the_clock_moves(tmp_path: Path) -> None:
    """A record whose epoch start is 25 s off (what a clock adjustment leaves: the kernel's boot time moved that far
    within ten minutes on a CI host) still names its process and `stop` stops the whole group; a record whose start
    from boot is another process's (a recycled PID) names nothing and stops nothing."""
    running = _start(tmp_path)
    try:
        recycled = dataclasses.replace(running, since_boot=running.since_boot - 100.0)
        assert members(recycled) == []
        stop(recycled, timeout=1)
        assert len(_alive(running)) == 3
        moved = dataclasses.replace(running, started=running.started + 25.0)
        assert len(members(moved)) == 3
        stop(moved, timeout=10)
        assert _alive(running) == []
    finally:
        stop(running, timeout=1)
