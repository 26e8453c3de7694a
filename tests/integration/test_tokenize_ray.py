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
    """Run as a pipeline runs a stage (`flows.runner.Direct`): the private Ray instance the stage started is shut
    down when it ends (it idled beside the later stages)."""
    import ray

    from flows.stage_def import StageDef
    from tests.pretrain_helpers import quiet_runner

    manifest, _ = tokenized
    cfg = small_data_cfg.model_copy(update={"backend": "ray", "num_workers": 2})
    stage = StageDef(
        name="tokenize_on_ray",
        help="tokenize on Ray Data",
        run=lambda recipe, inputs, progress: run_tokenize(cfg, tmp_path),
        command=False,
        flow=False,
    )
    try:
        on_ray = quiet_runner()(stage, None, {})
        assert not ray.is_initialized()
        # it stopped reading early (data.max_documents): no Ray Data thread may still call into Ray at shutdown
        assert not [t for t in threading.enumerate() if t.name == "iter_threaded"]
    finally:
        ray.shutdown()
    digests = {s: [i.sha256 for i in info.shards] for s, info in on_ray.splits.items()}
    assert digests == {s: [i.sha256 for i in info.shards] for s, info in manifest.splits.items()}
