"""Ray Tune sweep overhead: Tuner.fit() wall time divided by the sum of the trials' own run_pretrain times at
concurrency 1 (goal ≤ 1.15). On a 2-vCPU machine that behaves like one core this measures orchestration
cost (actor start, result handling, MLflow nesting), not parallel speed-up. Ray start-up is timed separately.

    .venv/bin/python benchmarks/sweep_overhead.py [--budgets 4e10 8e10] [--depths 1 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from data_pipeline.tokenize import run_tokenize
from flows.recipe import load_recipe
from infra.ray_cluster import ensure_ray
from training.stages.sweep import run_sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budgets", nargs="+", type=float, default=[4e10, 8e10])
    parser.add_argument("--depths", nargs="+", type=int, default=[1, 2])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        recipe = load_recipe(
            "smoke",
            [
                "data.max_documents=400",
                "data.num_workers=1",
                "train.eval_batches=2",
                f"sweep.budgets={args.budgets}",
                f"sweep.depths={args.depths}",
                "sweep.max_concurrent=1",
                f"output_dir={root}",
            ],
        )
        data = run_tokenize(recipe.data, root)
        t0 = time.perf_counter()
        ensure_ray(1)
        ray_start = time.perf_counter() - t0
        result = run_sweep(recipe.sweep_spec(), data)
    print(
        json.dumps(
            {
                "benchmark": "sweep_overhead",
                "trials": result.n_trials,
                "tune_wall_s": round(result.wall_seconds, 2),
                "sum_trial_s": round(result.trial_seconds, 2),
                "overhead_ratio": round(result.overhead or float("nan"), 3),
                "goal": 1.15,
                "ray_start_s": round(ray_start, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
