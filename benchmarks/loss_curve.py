"""How well the loss-curve law predicts curves it has not seen, on a finished pipeline's outputs (`make demo`'s by
default): fitted on every sweep run, its in-sample error; fitted without one run, its error on that run's points
(each run in turn); and the rung's curve against the prediction its fit.json recorded before it trained.

    .venv/bin/python benchmarks/loss_curve.py [outputs] [--recipe demo]

One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from evaluation.loss_curve import fit_curve_law  # noqa: E402
from flows.scaling import sweep_curves, sweep_points  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outputs", nargs="?", default="outputs")
    parser.add_argument("--recipe", default="demo")
    parser.add_argument("--min-step", type=int, default=100, help="the recipe's sweep.min_steps")
    args = parser.parse_args()
    out = Path(args.outputs)
    sweeps = sorted(out.glob(f"sweep/{args.recipe}-*/results.parquet"), key=lambda p: p.stat().st_mtime)
    if not sweeps:
        sys.exit(
            f"no {args.recipe} sweep under {out}/sweep: run `make demo` (or the recipe's pipeline) first"
        )
    points = sweep_curves(sweep_points(sweeps[-1]), args.min_step)
    if points is None:
        sys.exit(f"{sweeps[-1]}: its runs' directories are not on this machine")
    fit = fit_curve_law(points)
    record: dict = {"benchmark": "loss_curve", "points": len(points), "runs": len(points.runs)}
    record |= {k: v for k, v in fit.summary().items() if k != "law"}
    checked = sorted(out.glob(f"rung/{args.recipe}-*/fit.json"), key=lambda p: p.stat().st_mtime)
    curve = json.loads(checked[-1].read_text())["rung"].get("curve") if checked else None
    if curve and curve.get("measured"):
        record |= {
            "rung_curve_errors": [
                round(p / m - 1, 5) for p, m in zip(curve["loss"], curve["measured"], strict=True)
            ],
            "rung_curve_max_rel_error": curve["max_rel_error"],
            "rung_schedules": curve["schedules"],
        }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
