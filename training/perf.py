"""Throughput accounting: measured matmul peak, tokens per second and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s / peak FLOP/s, with model FLOPs from `training.model.accounting.flops_per_token` (6N plus
the attention term; recomputation is not counted). The peak is a configured number (e.g. 989e12 for an H100/H200
in bf16) or, by default, a dense GEMM measured on the same device, dtype and thread count.
"""

from __future__ import annotations

import functools
import time

import torch

# Published dense bf16 peaks (FLOP/s), by device-name substring; see shared/notes/performance.md.
PUBLISHED_BF16_PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def published_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PUBLISHED_BF16_PEAKS.items() if key in name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_matmul_peak(
    dtype: torch.dtype, device: torch.device, m: int, k: int, n: int, seconds: float = 0.3
) -> float:
    """Best FLOP/s of an (m x k) @ (k x n) GEMM repeated for about `seconds`."""
    rng = torch.Generator(device).manual_seed(0)  # its own: measuring or not changes no run's random stream
    a = torch.randn(m, k, device=device, generator=rng).to(dtype)
    b = torch.randn(k, n, device=device, generator=rng).to(dtype)
    a @ b  # warm-up
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = max(best, 2 * m * k * n / (time.perf_counter() - start))
    return best


def process_peak(dtype: torch.dtype, device: torch.device, m: int, k: int, n: int) -> float:
    """`measure_matmul_peak`, once per process for each shape, dtype, device and thread count: a process that trains
    many short runs (a sweep's reused trial actor, a test session) measured the same GEMM again for each."""
    return _process_peak(dtype, device, m, k, n, torch.get_num_threads())


@functools.lru_cache(maxsize=64)
def _process_peak(dtype: torch.dtype, device: torch.device, m: int, k: int, n: int, threads: int) -> float:
    return measure_matmul_peak(dtype, device, m, k, n)
