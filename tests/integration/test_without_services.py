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
(SITE_PACKAGES,) = {p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()}

MISSING = ("ray", "mlflow", "prefect")
# The environment's own site-packages with the three made unfindable, modules and metadata alike, as if they had
# never been installed. (A directory of links to the other packages did the same, but it moved DeepSpeed's sources
# to a new path, so every run rebuilt its C++ communication op: ~30 s.)
SCRIPT = """
import importlib.machinery, json, site, sys

MISSING = tuple(json.loads(sys.argv[4]))


class Uninstalled(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0].startswith(MISSING) else super().find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        for dist in super().find_distributions(*args, **kwargs):
            if not (dist.metadata["Name"] or "").lower().replace("-", "_").startswith(MISSING):
                yield dist


sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = Uninstalled
site.addsitedir(sys.argv[2])
sys.path.insert(0, sys.argv[3])
from data_pipeline.tokenize import run_tokenize
from flows.recipe import load_recipe
from training.stages.pretrain import run_pretrain

recipe = load_recipe("smoke", json.loads(sys.argv[1]))
model = run_pretrain(recipe.pretrain_spec(), run_tokenize(recipe.data, recipe.output_dir))
again = run_pretrain(recipe.pretrain_spec(), run_tokenize(recipe.data, recipe.output_dir))
loaded = [m for m in sys.modules if m.partition(".")[0].startswith(MISSING)]
print(json.dumps({"model": model.model_dump(mode="json"), "same": again == model, "loaded": loaded}))
"""


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
            SITE_PACKAGES,
            ROOT,
            json.dumps(MISSING),
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
