"""How much of the rung's error is the shape it got: a finished pipeline's rung (`make demo`'s by default) trained
again at other shapes near N* and other warmups, each under the given seeds, each scored against what its fit
predicts before it trains: both law forms' point predictions at its end and the curve anchored to the chosen
form's at each evaluation. About a minute a run on the demo here; nothing is tracked.

    .venv/bin/python benchmarks/rung_shapes.py [outputs] [--recipe demo] [--shapes d1w64,d2w48,d3w48]
        [--warmups rung,tenth,60] [--seeds 0,1]

`--shapes`: by default the three nearest N* with width/depth 16-64 (the sizing keeps to 16-48). `--warmups`:
`rung` is the sizing's (the sweep's run's), `tenth` a tenth of the rung's steps (the rule until 2026-12-05), a
number is steps. One JSON line: per (shape, warmup) the seeds' end losses, both forms' predicted/measured − 1 on
the seeds' mean and the anchored curve's largest |predicted/measured − 1| on it, and the forms' mean |error| over
the shapes at the rung's own warmup. With three sizes or more, also the compute-optimal N they measure (Approach
2's parabola in log N through their end losses at the rung's warmup) beside each form's N* and 95% interval:
give shapes spanning 4x or more around N* (`--shapes d2w32,d2w48,d3w48,d2w64,d3w64,d4w64`), as
three neighbours put the parabola's vertex anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from data_pipeline.shards import DatasetManifest  # noqa: E402
from evaluation.chinchilla_fit import Law  # noqa: E402
from evaluation.isoflop import fit_parabolas  # noqa: E402
from evaluation.kaplan_fit import KaplanLaw  # noqa: E402
from evaluation.loss_curve import CurveLaw  # noqa: E402
from evaluation.scaling_data import ScalingDataError, ScalingPoints  # noqa: E402
from flows.recipe import Recipe, load_recipe  # noqa: E402
from flows.scaling import (  # noqa: E402
    nearest_shapes,
    rung_curve,
    rung_recipe,
    rung_size,
    sweep_points,
    sweep_warmup,
)
from training.stages.lifecycle import read_metrics  # noqa: E402
from training.stages.pretrain import run_pretrain  # noqa: E402


def newest(pattern: str, out: Path) -> Path:
    found = sorted(out.glob(pattern), key=lambda p: p.stat().st_mtime)
    if not found:
        sys.exit(f"nothing matches {out}/{pattern}: run `make demo` (or the recipe's pipeline) first")
    return found[-1]


def runs(
    recipe: Recipe,
    fit: dict,
    data: DatasetManifest,
    warmups: list[str],
    seeds: list[int],
    shapes: list[tuple[int, int]],
) -> tuple[list[dict], list[dict], dict[str, list[float]]]:
    """Each (shape, warmup)'s record, those at the rung's own warmup, and each form's |error| there, shape by
    shape."""
    answers = form_answers(fit)
    laws = {
        "chinchilla": Law(**answers["chinchilla"]["law"]),
        "kaplan": KaplanLaw(**answers["kaplan"]["law"]),
    }
    anchor = laws[anchor_form(fit)]  # the curve is anchored to the chosen form's law
    curve_law = CurveLaw(**fit["curve_law"]["law"])
    reference_warmup = sweep_warmup(sweep_points(fit["source"]))
    budget = float(fit["optimal"]["budget"])
    shapes = shapes or [
        (depth, width)
        for depth, width, _ in nearest_shapes(recipe, answers[anchor_form(fit)]["n_opt"], 64)[:3]
    ]
    results, at_rung, own = [], [], {"chinchilla": [], "kaplan": []}
    for depth, width in shapes:
        name = f"d{depth}w{width}"
        sized = rung_recipe(recipe, depth, width, budget)
        n, d = rung_size(sized)
        for warmup in warmups:
            named_warmups = {"rung": sized.optim.warmup_steps, "tenth": round(0.1 * sized.train.max_steps)}
            steps = named_warmups[warmup] if warmup in named_warmups else int(warmup)
            rung = sized.override({"optim.warmup_steps": steps})
            predicted = rung_curve(rung, curve_law, anchor, reference_warmup)
            curves = []
            for seed in seeds:
                run = rung.override({"train.seed": seed, "name": f"{name}-w{warmup}-s{seed}"})
                model = run_pretrain(run.pretrain_spec(), data)
                measured = {
                    int(m["step"]): m["val/loss"] for m in read_metrics(model.run_dir) if "val/loss" in m
                }
                curves.append([measured[s] for s in predicted.steps])
            mean = np.mean(curves, axis=0)
            errors = {form: float(law.loss(n, d)) / mean[-1] - 1 for form, law in laws.items()}
            record = {
                "shape": name,
                "n": n,
                "warmup": rung.optim.warmup_steps,
                "end_losses": [round(c[-1], 4) for c in curves],
                **{f"{form}_rel_error": round(e, 4) for form, e in errors.items()},
                "curve_max_rel_error": round(float(np.abs(np.array(predicted.loss) / mean - 1).max()), 4),
            }
            results.append(record)
            if warmup == "rung":
                at_rung.append(record)
                for form, error in errors.items():
                    own[form].append(abs(error))
    return results, at_rung, own


def anchor_form(fit: dict) -> str:
    """The form that sized the fit's rung and predicted it (Chinchilla's in fits from before the choice)."""
    return fit["rung"].get("form", "chinchilla")


def form_answers(fit: dict) -> dict[str, dict]:
    """Each law form's parameters, N* and its 95% interval in a fit.json: Chinchilla's (the fit's `law` and
    `optimal`), the other form's from `choice` (when it sized the rung) or `rung.second_form`."""
    optimal = fit["optimal"]
    answers = {
        "chinchilla": {
            "law": {k: fit["law"][k] for k in ("E", "A", "B", "alpha", "beta")},
            "n_opt": optimal["n_opt"],
            "n_opt_interval": optimal["n_opt_interval"],
        }
    }
    for entry in (fit["rung"].get("second_form"), fit.get("choice")):
        if entry and entry["form"] != "chinchilla":
            answers[entry["form"]] = {k: entry[k] for k in ("law", "n_opt", "n_opt_interval")}
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outputs", nargs="?", default="outputs")
    parser.add_argument("--recipe", default="demo")
    parser.add_argument("--shapes", help="dDEPTHwWIDTH, comma-separated")
    parser.add_argument("--warmups", default="rung")
    parser.add_argument("--seeds", default="0")
    args = parser.parse_args()
    named = [re.fullmatch(r"d(\d+)w(\d+)", s) for s in args.shapes.split(",")] if args.shapes else []
    if not all(named):
        parser.error(f"--shapes {args.shapes}: give dDEPTHwWIDTH, comma-separated (e.g. d2w48,d3w48)")
    warmups = args.warmups.split(",")
    if not all(w in ("rung", "tenth") or w.isdigit() for w in warmups):
        parser.error(f"--warmups {args.warmups}: give rung, tenth or a number of steps, comma-separated")
    if not all(s.isdigit() for s in args.seeds.split(",")):
        parser.error(f"--seeds {args.seeds}: give whole numbers, comma-separated")
    torch.set_num_threads(1)
    out = Path(args.outputs)
    fit = json.loads(newest(f"rung/{args.recipe}-*/fit.json", out).read_text())
    if not fit.get("curve_law") or "kaplan" not in form_answers(fit):
        sys.exit("this fit has no curve law or second form: rerun its pipeline with this version of lmforge")
    data = DatasetManifest.from_file(newest("tokenize/*/manifest.json", out))
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory(prefix="rung_shapes-") as scratch:  # the runs' outputs, removed after
        recipe = load_recipe(
            args.recipe, [f"output_dir={scratch}", "tracking.enabled=false", "sweep.probe=null"]
        )
        results, at_rung, own = runs(
            recipe, fit, data, warmups, seeds, [(int(m[1]), int(m[2])) for m in named]
        )
    record = {
        "benchmark": "rung_shapes",
        "fit": fit["path"],
        "budget": fit["optimal"]["budget"],
        "n_opt": fit["optimal"]["n_opt"],
        "seeds": seeds,
        "runs": results,
        **{
            f"{form}_mean_abs_error_at_rung_warmup": round(float(np.mean(e)), 4)
            for form, e in own.items()
            if e
        },
    }
    record |= measured_optimum(fit, at_rung)
    print(json.dumps(record))


def measured_optimum(fit: dict, runs: list[dict]) -> dict:
    """The compute-optimal N the shapes trained at the rung's budget (and warmup) show, Approach 2's parabola in
    log N through their seeds' mean end losses, beside each form's N* and 95% interval (and which form sized the
    rung): where the sizing's answer is checked, not only the loss it predicts. Three sizes at least, bracketing
    the minimum."""
    budget = float(fit["optimal"]["budget"])
    n = np.array([r["n"] for r in runs], dtype=float)
    points = ScalingPoints(
        n, budget / (6 * n), np.array([np.mean(r["end_losses"]) for r in runs]), np.full_like(n, budget), n
    )
    try:
        found = fit_parabolas(points)
    except ScalingDataError as e:
        return {"measured_n_opt": None, "measured_n_opt_why_not": str(e)}
    measured = found.parabolas[0].n_opt
    record = {"measured_n_opt": round(measured), "chosen_form": anchor_form(fit)}
    for form, answer in form_answers(fit).items():
        low, high = answer["n_opt_interval"]
        record |= {
            f"{form}_n_opt_interval": [round(low), round(high)],
            f"{form}_n_opt_over_measured": round(answer["n_opt"] / measured, 3),
            f"{form}_interval_holds_measured": bool(low <= measured <= high),
        }
    return record


if __name__ == "__main__":
    main()
