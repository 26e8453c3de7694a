"""Which Ray instance lmforge work runs on, decided in one place: the cluster at `RAY_ADDRESS`, or else a private
local instance started for (and ending with) this process — never a Ray head that merely happens to run on this
machine (say `lmforge up`'s), unless `RAY_ADDRESS` names it."""

from __future__ import annotations

import os


def ensure_ray(min_cpus: int = 1, log_to_driver: bool = True) -> bool:
    """Connect to `RAY_ADDRESS`, or start a private local instance with at least `min_cpus` logical CPUs (the
    machine's count when larger); nothing when Ray is up already. True when the instance is private."""
    import ray  # deferred: Ray takes seconds to import, and most commands never need it

    private = not os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return private
    if not private:
        ray.init()
    else:
        cpus = max(min_cpus, os.cpu_count() or 1)
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=log_to_driver)
    return private
