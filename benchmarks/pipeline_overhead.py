"""Orchestration overhead of the smoke pipeline: (flow wall time − sum of the stages' own compute times) /
flow wall time, with a real local Prefect server and embedded MLflow (goal ≤ 15 %). Prints one JSON line.

    .venv/bin/python benchmarks/pipeline_overhead.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from flows.cli_services import prefect_api

CORPUS = Path(__file__).resolve().parent.parent / "tests/assets/corpus/stdlib_docstrings.jsonl"


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        overrides = [
            f"output_dir={root}",
            f"data.sources=[{CORPUS}]",
            "data.num_workers=1",
            "eval.max_documents=20",
            "eval.builtin_questions=20",
            "data.sft.max_examples=300",
        ]
        with prefect_api(Path(root) / "services"):
            from flows.pipeline import PipelineParams, pipeline

            summary = pipeline(PipelineParams(recipe="smoke", overrides=overrides))
    stages = summary["stage_seconds"]
    print(
        json.dumps(
            {
                "benchmark": "pipeline_overhead",
                "recipe": "smoke",
                "flow_wall_s": round(summary["wall_seconds"], 1),
                "sum_stage_s": round(sum(stages.values()), 1),
                "overhead_fraction": round(summary["orchestration_overhead"], 3),
                "goal": 0.15,
                "stages_s": {k: round(v, 1) for k, v in stages.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
