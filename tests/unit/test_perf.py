"""The matmul peak MFU is measured against: once per process for each GEMM shape, dtype and thread count, and
never from the random stream training draws from."""

from __future__ import annotations

import torch

from training import perf


def test_the_peak_is_measured_once_per_gemm_and_thread_count(monkeypatch) -> None:
    measured, measure = [], perf.measure_matmul_peak

    def quick(dtype, device, m, k, n):  # the real measurement, shortened
        measured.append((dtype, m, k, n, torch.get_num_threads()))
        return measure(dtype, device, m, k, n, seconds=0.01)

    monkeypatch.setattr(perf, "measure_matmul_peak", quick)
    perf._process_peak.cache_clear()
    cpu, threads = torch.device("cpu"), torch.get_num_threads()
    first = perf.process_peak(torch.float32, cpu, 64, 32, 48)
    assert perf.process_peak(torch.float32, cpu, 64, 32, 48) == first > 0  # the same run's number again
    perf.process_peak(torch.float32, cpu, 64, 32, 96)  # another shape
    perf.process_peak(torch.bfloat16, cpu, 64, 32, 48)  # another dtype
    torch.set_num_threads(threads + 1)
    try:
        perf.process_peak(torch.float32, cpu, 64, 32, 48)  # another thread count
    finally:
        torch.set_num_threads(threads)
    assert len(measured) == 4 and len(set(measured)) == 4, measured
    perf._process_peak.cache_clear()


def test_measuring_the_peak_draws_nothing_from_the_global_random_stream() -> None:
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    perf.measure_matmul_peak(torch.float32, torch.device("cpu"), 16, 16, 16, seconds=0.01)
    assert torch.equal(torch.rand(4), expected)  # a run's dropout and sampling are the same measured or not
