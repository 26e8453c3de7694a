"""Tokenization on Ray Data (a real local Ray instance: files read and encoded by an actor pool) writes the same
shards as worker processes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from data_pipeline.config import DataConfig
from data_pipeline.shards import DatasetManifest
from data_pipeline.tokenize import run_tokenize

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_ray_backend_matches_processes(
    small_data_cfg: DataConfig, tokenized: tuple[DatasetManifest, Path], tmp_path: Path
) -> None:
    import ray

    manifest, _ = tokenized
    try:
        on_ray = run_tokenize(
            small_data_cfg.model_copy(update={"backend": "ray", "num_workers": 2}), tmp_path
        )
        # it stopped reading early (data.max_documents): no Ray Data thread may still call into Ray at shutdown
        assert not [t for t in threading.enumerate() if t.name == "iter_threaded"]
    finally:
        ray.shutdown()
    digests = {s: [i.sha256 for i in info.shards] for s, info in on_ray.splits.items()}
    assert digests == {s: [i.sha256 for i in info.shards] for s, info in manifest.splits.items()}
