"""How well the loss-curve law predicts curves it has not seen, on a finished pipeline's outputs (`make demo`'s by
default): fitted on every sweep run, its in-sample error; fitted without one run, its error on that run's points
(each run in turn), anchored to the point law refitted without the run as the rung's curve is, and alone; how far
one seed's curve strays from its seeds' mean (the floor under any law's error on one run); and the rung's curve
against the prediction its fit.json recorded before it trained.

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

from evaluation.law_noise import calibrated_fit  # noqa: E402
from evaluation.loss_curve import Anchor, fit_curve_law  # noqa: E402
from flows.scaling import sweep_curves, sweep_points  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outputs", nargs="?", default="outputs")
    parser.add_argument("--recipe", default="demo")
    parser.add_argument("--min-step", type=int, default=100, help="the recipe's sweep.min_steps")
    args = parser.parse_args()
    out = Path(args.outputs)
    # the newest rung's fit.json names the sweep it was fitted on; without a rung, the newest sweep
    checked = sorted(out.glob(f"rung/{args.recipe}-*/fit.json"), key=lambda p: p.stat().st_mtime)
    rung_fit = json.loads(checked[-1].read_text()) if checked else {}
    sweeps = sorted(out.glob(f"sweep/{args.recipe}-*/results.parquet"), key=lambda p: p.stat().st_mtime)
    source = Path(rung_fit["source"]) if rung_fit.get("source") else (sweeps[-1] if sweeps else None)
    if source is None or not source.is_file():
        sys.exit(
            f"no {args.recipe} sweep under {out}/sweep: run `make demo` (or the recipe's pipeline) first"
        )
    table = sweep_points(source)
    points = sweep_curves(table, args.min_step)
    if points is None:
        sys.exit(f"{source}: its runs' directories are not on this machine")
    point_law = calibrated_fit(table, n_resamples=10)
    anchor = Anchor.chinchilla(table, point_law.fit.law, point_law.delta)
    fit = fit_curve_law(points, start=point_law.fit.law.as_dict(), anchor=anchor)
    alone = fit_curve_law(points, start=point_law.fit.law.as_dict())
    record: dict = {
        "benchmark": "loss_curve",
        "sweep": str(source),
        "points": len(points),
        "runs": len(points.runs),
    }
    record |= {k: v for k, v in fit.summary().items() if k != "law"}
    record |= {
        f"unanchored_{k}": alone.summary()[k] for k in ("held_out_mean_rel_error", "held_out_rel_error_95")
    }
    curve = rung_fit.get("rung", {}).get("curve")
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
