"""Shared test setup: one torch thread per process (2 threads were 2.5-3.7x slower on this machine)."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
