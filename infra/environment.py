"""A temporary change to this process's environment, for the settings libraries read from it when they start
(Ray Train's controller, Tune's signal handling, Prefect's client)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def environment(**values: str) -> Iterator[None]:
    """`values` in this process's environment within the block; each variable restored (or unset) after it."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
