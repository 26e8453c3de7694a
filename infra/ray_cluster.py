"""Which Ray instance lmforge work runs on, decided in one place: the cluster at `RAY_ADDRESS`, or else a private
local instance started for (and ending with) this process — never a Ray head that merely happens to run on this
machine (say `lmforge up`'s), unless `RAY_ADDRESS` names it."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from infra.errors import UserError


def ensure_ray(min_cpus: int = 1, log_to_driver: bool = True) -> bool:
    """Connect to `RAY_ADDRESS`, or start a private local instance with at least `min_cpus` logical CPUs (the
    machine's count when larger); nothing when Ray is up already. True when the instance is private."""
    import ray  # deferred: Ray takes seconds to import, and most commands never need it

    private = not os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return private
    if not private:
        try:
            ray.init()
        except (ConnectionError, TimeoutError) as error:
            raise UserError(
                f"no Ray cluster answers at RAY_ADDRESS={os.environ['RAY_ADDRESS']} ({str(error).splitlines()[0]}): "
                "start it (`lmforge up`, or `ray start --head`), export what `lmforge up` printed, or unset "
                "RAY_ADDRESS to run on a private local instance"
            ) from None
    else:
        cpus = max(min_cpus, os.cpu_count() or 1)
        # no idle workers started ahead of the first driver's tasks: lmforge's actors (Ray Train's, Tune's) each need
        # a process of their own, and the prestarted ones only took CPU from the start (~1.4 s a launch here)
        ray.init(
            address="local",
            num_cpus=cpus,
            include_dashboard=False,
            log_to_driver=log_to_driver,
            _system_config={"prestart_worker_first_driver": False},
        )
    return private


@contextmanager
def released() -> Iterator[None]:
    """The block's own Ray: an instance it starts is shut down (a cluster it connects to, disconnected) when it
    ends, so a pipeline's later stages do not run beside an idle private instance (its GCS, raylet and agents took
    ~3% of a core here) and a signal at the end of a flow run finds no Ray to stop. An instance that was up before
    the block stays."""
    up_before = _connected()
    try:
        yield
    finally:
        if not up_before and _connected():
            import ray

            ray.shutdown()


def _connected() -> bool:
    ray = sys.modules.get("ray")  # never imported: never started
    return ray is not None and ray.is_initialized()


def quiet_exits_in_callbacks() -> None:
    """For code Ray runs in a worker process: Ray's SIGTERM handler there raises SystemExit, and when the signal
    lands while a weakref or garbage-collector callback runs (seen at the end of sweep trials, as the driver shuts its
    instance down), Python can only print it as "Exception ignored in: ... SystemExit: 1" with a traceback, which the
    driver forwards to the user's terminal after a clean stop. Those reports are dropped; every other one is printed."""
    previous = sys.unraisablehook
    if getattr(previous, "lmforge_quiet_exits", False):
        return

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if unraisable.exc_type is None or not issubclass(unraisable.exc_type, SystemExit):
            previous(unraisable)

    hook.lmforge_quiet_exits = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
