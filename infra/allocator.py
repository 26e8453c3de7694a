"""The C allocator's large-block policy for processes that train or evaluate on a CPU.

glibc's malloc serves a block over its mmap threshold (at most 32 MiB) with a fresh mapping and unmaps it when
freed, and returns freed memory at the top of its heap to the kernel. A training step allocates and frees the same
large tensors (activations, logits, gradients) every step, so each one arrived as new pages the kernel zeroes on
first touch: a 1024 x 8192 fp32 add took 11.7 ms instead of 2.5-4.1 ms here. `keep_freed_memory` makes malloc keep
and reuse them, as preloading tcmalloc or jemalloc (the usual advice for PyTorch on CPUs) does. Measured on an engine
at d_model 384 in bf16 (60 steps): 19.3 -> 16.5 s, peak resident memory 969 -> 995 MiB, and it stays resident until
the process ends. glibc's heap still fragments: a loop of one 32 MiB loss grew to 1.9x its default peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1  # bytes kept free at the heap's top before returning them (mallopt takes an int)


@functools.cache
def keep_freed_memory() -> bool:
    """Once per process: large blocks come from the heap (no mapping per block; a thread's arena still maps a block
    larger than its 64 MiB heap) and freed memory stays there for the next one. False where the C library is not
    glibc (nothing changed)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except (OSError, TypeError):
        libc = None
    if libc is None or not hasattr(libc, "gnu_get_libc_version"):  # another libc's mallopt means other things
        log.debug("no glibc (%s): the allocator keeps its defaults", name)
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
