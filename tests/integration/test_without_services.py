"""The engine-level path runs where Ray, MLflow and Prefect are not installed (the GPU machine): tokenize, pretrain
with DeepSpeed (one in-process worker, tracking off, checkpoints written in the background), export and a cached
rerun, in a process where importing any of the three fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pretrain_helpers import ROOT, clean_env, smoke_overrides

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MISSING = ("ray", "mlflow", "prefect")
SCRIPT = """
import json, site, sys

site.addsitedir(sys.argv[2])  # the environment's packages less the missing ones
sys.path.insert(0, sys.argv[3])
from data_pipeline.tokenize import run_tokenize
from flows.recipe import load_recipe
from training.stages.pretrain import run_pretrain

recipe = load_recipe("smoke", json.loads(sys.argv[1]))
model = run_pretrain(recipe.pretrain_spec(), run_tokenize(recipe.data, recipe.output_dir))
again = run_pretrain(recipe.pretrain_spec(), run_tokenize(recipe.data, recipe.output_dir))
loaded = [m for m in ("ray", "mlflow", "prefect") if m in sys.modules]
print(json.dumps({"model": model.model_dump(mode="json"), "same": again == model, "loaded": loaded}))
"""


def without(names: tuple[str, ...], target: Path) -> Path:
    """A site directory with links to every entry of this environment's site-packages except `names` (packages
    and their metadata), as if they had never been installed."""
    (site_packages,) = {Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()}
    target.mkdir()
    for entry in site_packages.iterdir():
        if not entry.name.lower().replace("-", "_").startswith(names):
            (target / entry.name).symlink_to(entry)
    return target


def test_pretraining_needs_no_ray_mlflow_or_prefect(tmp_path) -> None:
    overrides = smoke_overrides(
        tmp_path,
        "tracking.enabled=false",
        "train.max_steps=5",
        "train.checkpoint_every=2",
        "train.async_checkpoint=true",
    )
    done = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            SCRIPT,
            json.dumps(overrides),
            str(without(MISSING, tmp_path / "site")),
            ROOT,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=clean_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    model = result["model"]
    assert result["loaded"] == [] and result["same"]  # the rerun is a cache hit
    assert model["step"] == 5 and model["export_valid"] and model["mlflow_run_id"] is None
    assert model["checkpoint"].endswith("step-00000005")
