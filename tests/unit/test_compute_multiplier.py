"""The compute multiplier from two fitted laws (evaluation/compute_multiplier.py): exact on laws whose effective
compute differs by a known factor, recovered with an interval from noisy ladders drawn from them, and the
`lmforge compare` refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from evaluation.chinchilla_fit import Law
from evaluation.compute_multiplier import compare_points, compute_for_loss, multiplier, optimal_loss
from evaluation.scaling_data import ScalingPoints

BASE = Law(E=1.8, A=400.0, B=900.0, alpha=0.35, beta=0.3)


def scaled(law: Law, k: float) -> Law:
    """L_k(N, D) = L(√k·N, √k·D): every run of this law is worth k times its compute under `law`."""
    return Law(
        E=law.E,
        A=law.A * k ** (-law.alpha / 2),
        B=law.B * k ** (-law.beta / 2),
        alpha=law.alpha,
        beta=law.beta,
    )


def ladder(law: Law, noise: float, seed: int) -> ScalingPoints:
    """An IsoFLOP ladder: 3 budgets × 7 sizes around each optimum, log-normal noise on the loss."""
    rng = np.random.default_rng(seed)
    n, d = [], []
    for c in (1e17, 4e17, 1.6e18):
        for f in np.geomspace(1 / 6, 6, 7):
            n.append(float(law.optimal_n(c)) * f)
            d.append(c / (6 * n[-1]))
    n_, d_ = np.array(n), np.array(d)
    loss = law.loss(n_, d_) * np.exp(noise * rng.standard_normal(len(n_)))
    return ScalingPoints(n_, d_, loss, 6 * n_ * d_, n_)


def test_multiplier_is_exact_for_laws_a_compute_factor_apart() -> None:
    for k in (0.5, 1.0, 3.0):
        assert multiplier(BASE, scaled(BASE, k), 1e18) == pytest.approx(k, rel=1e-6)
        assert multiplier(scaled(BASE, k), BASE, 1e20) == pytest.approx(1 / k, rel=1e-6)
    assert float(optimal_loss(BASE, 1e18)) > float(optimal_loss(BASE, 1e19)) > BASE.E  # falls towards E
    assert compute_for_loss(BASE, BASE.E - 0.1) == math.inf  # below the irreducible loss: never


def test_noisy_ladders_recover_the_multiplier_with_an_interval() -> None:
    comparison = compare_points(
        ladder(BASE, 0.003, 0), ladder(scaled(BASE, 2.0), 0.003, 1), 1.6e18, n_bootstrap=200
    )
    assert comparison.multiplier == pytest.approx(2.0, rel=0.15)
    low, high = comparison.interval
    assert low < comparison.multiplier < high and low < 2.0 < high
    assert comparison.n_pairs > 150
    same = compare_points(ladder(BASE, 0.003, 2), ladder(BASE, 0.003, 3), 1.6e18, n_bootstrap=200)
    assert same.interval[0] < 1.0 < same.interval[1]


def test_comparison_files_and_mlflow_run(tmp_path) -> None:
    """What `lmforge compare` writes after its two sweeps: the report, the plot, comparison.json last, and an
    MLflow run carrying the multiplier."""
    import json

    import mlflow

    from flows.compare import RESULT, write_comparison
    from flows.recipe import load_recipe

    recipe = load_recipe("smoke", [f"output_dir={tmp_path}"])
    points = (ladder(BASE, 0.003, 0), ladder(scaled(BASE, 2.0), 0.003, 1))
    out = tmp_path / "compare" / "a-vs-b-0123456789ab"
    summary = write_comparison(points, ("a", "b"), 1.6e18, 100, out, recipe, {"a": "x", "b": "y"})
    assert json.loads((out / RESULT).read_text()) == summary
    assert summary["points"] == {"a": 21, "b": 21} and summary["warnings"] == []
    assert (
        f"**a needs {summary['multiplier']:.3g}x" in (out / "comparison.md").read_text()
        and (out / "compare.png").stat().st_size > 10_000
    )
    run = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(summary["mlflow_run_id"])
    assert run.data.metrics["multiplier"] == pytest.approx(summary["multiplier"])


def test_compare_refuses_two_tokenizers_and_a_ladder_without_a_frontier(capsys) -> None:
    from evaluation.scaling_data import ScalingDataError
    from flows.cli import main

    code = main(["compare", "smoke", "smoke", "--names", "a,b", "--set-b", "data.tokenizer.vocab_size=300"])
    message = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in message
    assert message.startswith("lmforge: error: compare needs one tokenizer: a has data.tokenizer")
    # bigger models worse at every budget (runs far too short): the fitted law has no compute-optimal frontier
    n = np.array([1e4, 4e4, 1.6e5] * 3)
    d = np.repeat([1e5, 2e5, 4e5], 3)
    worse = ScalingPoints(n, d, 3.0 + 1e-5 * n**0.5 - 0.1 * np.log(d / 1e5), 6 * n * d, n)
    with pytest.raises(ScalingDataError, match="no compute-optimal frontier"):
        compare_points(worse, ladder(BASE, 0.003, 0), 1e10, n_bootstrap=10)


def test_a_finished_comparison_reads_back_an_unbounded_interval(tmp_path) -> None:
    """A rerun of `lmforge compare` returns the cached comparison as written: an interval the bootstrap could not
    bound stays NaN (a manifest round trip would turn it into null and crash the printout)."""
    import math

    from flows.compare import RESULT, Compared
    from infra.steps import Step, run_step
    from infra.storage import atomic_write_json

    def build(out, key):
        atomic_write_json(out / RESULT, {"multiplier": 2.0, "interval": [float("nan"), float("nan")]})
        return Compared(path=str(out))

    step = Step("compare", "a-vs-b", 1, {}, Compared)
    run_step(tmp_path, step, build)
    again = run_step(tmp_path, step, lambda out, key: pytest.fail("finished: not built again")).summary()
    assert again["multiplier"] == 2.0 and all(math.isnan(x) for x in again["interval"])
