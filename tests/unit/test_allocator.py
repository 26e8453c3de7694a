"""Large blocks are reused by the allocator, not mapped (and zero-filled by the kernel) again for every tensor."""

from __future__ import annotations

import subprocess
import sys

# five steps of a 32 MiB-logits loss and its gradient, after six to reach the heap's working size; prints whether the
# policy was set and the page faults taken
_STEPS = """
import resource, sys, torch
from infra.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "kept" else None
torch.set_num_threads(1)
w, x = (0.02 * torch.randn(512, 8192)).requires_grad_(), torch.randn(1024, 512)
def step():
    torch.nn.functional.cross_entropy(x @ w, torch.zeros(1024, dtype=torch.long)).backward()
    w.grad = None
for _ in range(6):  # the heap grows to its working size in the first 3-5 steps (fresh pages there either way)
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, timeout=60, check=True
    )
    kept, faults = done.stdout.split()
    return kept, int(faults)


def test_training_steps_reuse_the_memory_of_the_last_step() -> None:
    kept, faults = _faults("kept")
    _, default = _faults("default")  # glibc's own policy: every large tensor is fresh pages
    assert kept == "True" and default > 5 * 8192  # at least the logits' pages, every step
    assert faults < default / 4, (faults, default)  # kept: 0-2 fresh 32 MiB blocks in 5 steps, default ~20
