"""Which law form extrapolates: Chinchilla's L = E + A/N^α + B/D^β (lmforge's fit) against Kaplan et al.'s
L = E + ((N_c/N)^(α_N/α_D) + D_c/D)^α_D, each fitted to a sweep's points and scored where the sweep has no data:
the largest budget predicted from the others (held out by `holdout_mask`, as `lmforge fit` does; bias and mean
error), and every trained rung under the outputs (the measured loss of each `rung/*/fit.json`, whichever sweep it
was sized from: a rung is a point any law of the same data can be asked about). One JSON line per sweep.

    .venv/bin/python benchmarks/law_forms.py [outputs ...]

Both fits are the product's: `lmforge fit`'s calibrated Chinchilla fit and `evaluation/kaplan_fit.py` (whose
prediction for the rung fit.json carries as `rung.second_form`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from evaluation.kaplan_fit import fit_kaplan  # noqa: E402
from evaluation.law_noise import calibrated_fit  # noqa: E402
from evaluation.scaling_data import ScalingPoints  # noqa: E402
from evaluation.scaling_report import holdout_mask  # noqa: E402
from flows.scaling import sweep_points  # noqa: E402

FORMS = {
    "chinchilla": lambda points: calibrated_fit(points, n_resamples=10).fit.law.loss,  # as `lmforge fit`
    "kaplan": lambda points: fit_kaplan(points).loss,
}


def scores(points: ScalingPoints, rungs: list[dict]) -> dict:
    held = holdout_mask(points)  # the split fit.json's held-out check uses
    train, test = points.subset(~held), points.subset(held)
    out = {}
    for name, fit in FORMS.items():
        err = 100 * (fit(train)(test.n, test.d) / test.loss - 1)
        full = fit(points)
        out[name] = {
            "heldout_bias_pct": round(float(err.mean()), 2),
            "heldout_mean_abs_pct": round(float(np.abs(err).mean()), 2),
            "rung_errors_pct": [
                round(float(100 * (full(r["n"], r["d"]) / r["measured"] - 1)), 2) for r in rungs
            ],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outputs", nargs="*", default=["outputs"])
    args = parser.parse_args()
    for out in map(Path, args.outputs):
        rungs = []
        for path in sorted(out.glob("rung/*/fit.json")):
            rung = json.loads(path.read_text()).get("rung", {})
            measured = {"n": rung.get("n"), "d": rung.get("d"), "measured": rung.get("measured_loss")}
            if measured["measured"] is not None and measured not in rungs:  # a rung retrained: once
                rungs.append(measured)
        for table in sorted(out.glob("sweep/*/results.parquet")):
            record = {"benchmark": "law_forms", "sweep": str(table), "rungs": rungs}
            print(json.dumps(record | scores(sweep_points(table), rungs)), flush=True)


if __name__ == "__main__":
    main()
