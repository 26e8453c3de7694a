"""Planning a scaling sweep (no training): sizes, multi-horizon runs, the batch and warmup rules, and what the
fit is told when a sweep has nothing usable."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from evaluation.chinchilla_fit import Law
from evaluation.loss_curve import CurveLaw, Schedule
from evaluation.scaling_data import ScalingDataError
from flows.recipe import load_recipe
from flows.scaling import rung_curve, rung_size, size_for_budget, sweep_points
from training.sizing import count_n
from training.stages.sweep import SweepResult, plan_trials, trial_spec


def demo(*overrides: str):
    return load_recipe("demo", ["output_dir=/tmp/unused", *overrides])


def test_demo_sweep_brackets_a_decade_with_one_run_per_size_and_seed():
    recipe = demo()
    plans, skipped = plan_trials(recipe.sweep_spec())
    assert recipe.sweep.seeds == [0, 1]
    assert len(plans) == 2 * len(recipe.sweep.sizes) == 14
    assert len(skipped) == 4  # the four largest sizes' shortest horizons (see the next test)
    assert [p.seed for p in plans] == [0, 1] * 7  # each size's replicas side by side
    assert [p.model for p in plans[::2]] == [p.model for p in plans[1::2]]
    sizes = [p.n_active for p in plans[::2]]
    assert sizes == sorted(sizes) and sizes[-1] / sizes[0] >= 10
    for plan in plans:
        assert plan.budgets == sorted(recipe.sweep.budgets)[-len(plan.budgets) :]  # one point per budget kept
        assert plan.steps == sorted(plan.steps) and plan.steps[0] >= recipe.sweep.min_steps == 100
        assert plan.shape.warmup == max(round(0.1 * plan.steps[0]), 60)
        assert plan.batch & (plan.batch - 1) == 0  # a power of two
        for budget, steps in zip(plan.budgets, plan.steps, strict=True):
            assert 6 * plan.n_active * steps * plan.tokens_per_step == pytest.approx(budget, rel=0.05)
    # more tokens, a larger batch: the smallest model trains with the largest batch
    assert plans[0].batch > plans[-1].batch


def test_a_size_can_have_its_own_seeds():
    """Replicas where they pay: a size's own `seeds` replace the sweep's for that size alone."""
    sizes = [{"depth": 1, "width": 16}, {"depth": 3, "width": 48, "seeds": [0, 1, 2]}]
    plans, _ = plan_trials(demo(f"sweep.sizes={sizes}", "sweep.seeds=[5]").sweep_spec())
    assert [(p.depth, p.width, p.seed) for p in plans] == [(1, 16, 5), (3, 48, 0), (3, 48, 1), (3, 48, 2)]


def test_a_horizon_mostly_warmup_is_left_out_and_says_why():
    """Where the warmup floor would be over `max_warmup_share` of a run's shortest horizon, that horizon is not
    trained (the next one sets the warmup and may stay); every other horizon and run is as without the rule."""
    share = {k: plan_trials(demo(f"sweep.max_warmup_share={k}").sweep_spec()) for k in (0.25, 0.5)}
    (kept, skipped), (everything, none) = share[0.25], share[0.5]
    assert not none and all(len(p.budgets) == 3 for p in everything)
    assert len(kept) == len(everything)
    for plan, full in zip(kept, everything, strict=True):
        left_out = full.steps[0] < 4 * full.shape.warmup
        assert plan.steps == full.steps[left_out:] and plan.budgets == full.budgets[left_out:]
        assert plan.shape.warmup == full.shape.warmup <= 0.25 * plan.steps[0]
        assert plan.shape.batch == full.shape.batch
    assert len(skipped) == sum(full.steps[0] < 4 * full.shape.warmup for full in everything) // 2 == 4
    assert all("warmup 60 steps is over sweep.max_warmup_share=0.25" in line for line in skipped)
    with pytest.raises(ValueError, match="would leave out every horizon"):
        demo("sweep.warmup_fraction=0.3")


def test_multi_horizon_costs_less_than_a_run_per_point():
    recipe = demo("sweep.max_warmup_share=0.5")  # every horizon kept, both ways
    multi, _ = plan_trials(recipe.sweep_spec())
    single, _ = plan_trials(recipe.override({"sweep.multi_horizon": False}).sweep_spec())
    assert len(single) == 3 * len(multi)
    assert sum(p.flops for p in single) / sum(p.flops for p in multi) > 1.4


def test_multi_horizon_needs_wsd():
    with pytest.raises(ValueError, match="optim.schedule=wsd"):
        plan_trials(demo("optim.schedule=cosine").sweep_spec())


def test_parameter_count_convention():
    recipe = demo()
    model = recipe.model
    assert count_n(model, "matmul") - count_n(model, "non_embedding") == model.vocab_size * model.d_model


def test_rung_is_sized_by_the_sweeps_rules():
    recipe = demo()
    rung, note = size_for_budget(recipe, 1.0e5, 1.2e12, (1.2e4, 2.5e5))
    n, d = rung_size(rung)
    assert n == pytest.approx(1.0e5, rel=0.25) and 6 * n * d == pytest.approx(1.2e12, rel=0.05)
    # trained as the sweep's run of its size that ends at the rung's budget: batch, rate, warmup, steps
    scale = 1.2e12 / max(recipe.sweep.budgets)
    size = {"depth": rung.model.n_layers, "width": rung.model.d_model}
    (plan,), _ = plan_trials(
        recipe.override(
            {
                "sweep.budgets": [b * scale for b in recipe.sweep.budgets],
                "sweep.sizes": [size],
                "sweep.seeds": [0],
            }
        ).sweep_spec()
    )
    assert rung.optim.warmup_steps == plan.shape.warmup < round(0.1 * rung.train.max_steps)
    assert rung.train.max_steps == plan.steps[-1] and rung.train.global_batch_size == plan.shape.batch
    assert rung.optim.lr == pytest.approx(plan.lr * plan.shape.lr_scale)
    assert "extrapolation" not in note
    _, outside = size_for_budget(recipe, 1.0e6, 1.2e12, (1.2e4, 2.5e5))
    assert "outside the swept sizes" in outside


def test_a_rung_shaped_unlike_the_sweeps_sizes_says_so():
    """The demo's sweep spans width/depth 16-32; its rung at N* 9.05e4 is two layers 48 wide (24: like the
    sweep's), not the nearer one layer 64 wide (aspect 64: no depth is exempt from 16-48); at 5.45e4 one layer 48
    wide, which the note flags."""
    recipe = demo()
    rung, note = size_for_budget(recipe, 9.05e4, 2.4e12)
    assert (rung.model.n_layers, rung.model.d_model) == (2, 48) and "swept shapes" not in note
    rung, note = size_for_budget(recipe, 5.45e4, 2.4e12)
    assert (rung.model.n_layers, rung.model.d_model) == (1, 48)
    assert "width/depth 48 lies outside the swept shapes' (16–32)" in note


def test_the_rungs_curve_is_the_point_law_at_each_evaluation_plus_what_its_schedule_adds():
    """Each evaluation: the point law's loss at its tokens (a run like the sweep's, decayed there) plus the curve
    law's difference between the rung's schedule and that run's. With the sweep's warmup the rung's own, the end
    is the point law's prediction; with a shorter one (a rung warmed up for a tenth of its steps, as until
    2026-12-05), the rung's longer warmup costs a little on top."""
    rung, _ = size_for_budget(demo(), 8.0e4, 2.4e12)
    rung = rung.override({"optim.warmup_steps": rung.train.max_steps // 10})
    law = CurveLaw(E=1.9, A=1900.0, B=0.88, alpha=0.79, beta=0.48, D=0.22, C=0.11)
    point = Law(E=1.6, A=700.0, B=2900.0, alpha=0.7, beta=0.53)
    n, d = rung_size(rung)
    steps, per_step = rung.train.max_steps, rung.train.global_batch_size * rung.train.seq_len
    optim, warmup = rung.optim, rung.optim.warmup_steps
    assert warmup > 100
    same = rung_curve(rung, law, point, warmup)
    assert same.steps[-1] == steps and len(same.steps) == rung.sweep.curve_points
    tokens = np.array(same.tokens)
    assert tokens.tolist() == [s * per_step for s in same.steps]
    assert same.loss[-1] == pytest.approx(float(point.loss(n, d)), rel=1e-12)
    assert same.schedules["as planned"] == same.loss[-1]
    assert (np.array(same.loss[:-1]) > point.loss(n, tokens[:-1]) + 0.01).all()  # not decayed yet
    sweep = rung_curve(rung, law, point, 60)
    assert (same.reference_warmup, sweep.reference_warmup) == (warmup, 60)
    first = same.steps[0]
    reference = law.curve(n, Schedule.ending(optim, first, per_step, 60), [first])[0]
    own = law.curve(n, Schedule.of(optim, steps, per_step), [first])[0]
    assert sweep.loss[0] == pytest.approx(float(point.loss(n, tokens[0])) + own - reference, rel=1e-12)
    assert float(point.loss(n, d)) < sweep.loss[-1] < float(point.loss(n, d)) * 1.02
    assert sweep.schedules["constant"] > sweep.schedules["as planned"]  # no decay: no annealing gain
    assert sweep.curve_law_end == pytest.approx(law.curve(n, Schedule.of(optim, steps, per_step), [steps])[0])


def test_warmup_has_a_floor_in_steps_up_to_half_the_shortest_horizon():
    """A tenth of a short horizon is too few steps for the larger models; the floor lifts it, never past half of
    the shortest horizon, and leaves longer warmups alone; the rung's is the sweep's run's that ends at its
    budget (its shortest horizon at the sweep's budget span, 4x on the demo)."""
    floors = {k: demo(f"sweep.min_warmup_steps={k}", "sweep.max_warmup_share=0.5") for k in (0, 60, 90)}
    plans = {k: plan_trials(r.sweep_spec())[0] for k, r in floors.items()}
    for bare, sixty, ninety in zip(plans[0], plans[60], plans[90], strict=True):
        shortest = bare.steps[0]
        assert bare.shape.warmup == round(0.1 * shortest)
        assert sixty.shape.warmup == max(bare.shape.warmup, 60)
        assert ninety.shape.warmup == max(bare.shape.warmup, min(90, shortest // 2))
    assert min(p.steps[0] for p in plans[0]) // 2 < 90  # the cap is exercised
    assert any(p.shape.warmup < 60 for p in plans[0])  # and the floor
    rungs = {k: size_for_budget(r, 8.0e4, 2.4e12)[0] for k, r in floors.items()}
    tenth = round(0.1 * rungs[0].train.max_steps / 4)  # a tenth of a quarter of the rung
    assert rungs[0].optim.warmup_steps == rungs[60].optim.warmup_steps == tenth > 60
    assert rungs[90].optim.warmup_steps == 90
    assert load_recipe("ladder").sweep.min_warmup_steps == 60


def test_the_learning_rate_follows_the_batch_in_trials_and_rung():
    """lr ∝ batch^lr_batch_exponent from the grid's rate at the recipe's batch, the same rule for the rung."""
    recipe = demo("sweep.lr_batch_exponent=0.5", "sweep.lrs=[0.004,0.008]")
    spec = recipe.sweep_spec()
    plans, _ = plan_trials(spec)
    reference = recipe.train.global_batch_size
    assert {p.batch for p in plans} > {reference}  # the demo's batches straddle the recipe's
    for plan in plans:
        trained = trial_spec(spec, plan, None)
        assert trained.optim.lr == pytest.approx(plan.lr * (plan.batch / reference) ** 0.5, rel=1e-12)
        assert trained.train.global_batch_size == plan.batch
    rung, _ = size_for_budget(recipe, 1.5e5, 2.0e11)  # a large model on few tokens: a small batch
    assert rung.train.global_batch_size < reference
    assert rung.optim.lr == pytest.approx(recipe.optim.lr * (rung.train.global_batch_size / reference) ** 0.5)
    # without the rule (the default) every batch trains at the grid's rate
    flat = demo("sweep.lr_batch_exponent=0").sweep_spec()
    assert all(trial_spec(flat, p, None).optim.lr == p.lr for p in plan_trials(flat)[0])


def results_table(tmp_path, statuses, losses):
    rows = [
        {
            "N": 1000 * (i + 1),
            "N_total": 1000 * (i + 1),
            "D": 1e6,
            "C": 6e9 * (i + 1),
            "loss": loss,
            "status": s,
        }
        for i, (s, loss) in enumerate(zip(statuses, losses, strict=True))
    ]
    path = tmp_path / "results.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_a_sweep_where_every_run_diverged_is_refused_with_the_reason(tmp_path):
    path = results_table(tmp_path, ["diverged"] * 3 + ["stopped"], [None] * 4)
    with pytest.raises(ScalingDataError, match="3 diverged, 1 stopped.*lower optim.lr"):
        sweep_points(path)


def test_the_points_of_one_multi_horizon_run_are_labelled_as_that_run(tmp_path):
    """The fit's bootstrap redraws a run's offset once for all its horizons: sweep_points keeps which run each
    point came from (its run directory)."""
    rows = [
        {
            "N": n,
            "N_total": n,
            "D": d,
            "C": 6.0 * n * d,
            "loss": 3.0,
            "status": "completed",
            "run_dir": f"run-{n}",
        }
        for n in (1000, 2000, 4000)
        for d in (1e6, 2e6)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "results.parquet")
    points = sweep_points(tmp_path / "results.parquet")
    assert points.runs.tolist() == [0, 0, 1, 1, 2, 2]
    assert points.subset(points.n > 1000).runs.tolist() == [0, 0, 1, 1]


def test_nan_and_negative_losses_are_dropped_and_counted(tmp_path):
    path = results_table(tmp_path, ["completed"] * 4, [3.0, float("nan"), -1.0, 2.5])
    points = sweep_points(path)
    assert len(points) == 2 and points.dropped == 2


def sweep_of(results: Path) -> SweepResult:
    """A finished sweep whose table is `results` (in its directory), as the fit reads it: no MLflow run."""
    table = pq.read_table(results)
    return SweepResult(
        path=str(results.parent),
        key="k",
        results=str(results),
        n_trials=table.num_rows,
        n_completed=0,
        n_stopped=0,
        n_points=table.num_rows,
        flops=0.0,
        points_per_flop_gain=1.0,
        skipped=[],
        mlflow_run_id=None,
        wall_seconds=0.0,
        trial_seconds=0.0,
        overhead=None,
    )


def test_a_failed_fit_is_never_cached(tmp_path):
    """The fit of a sweep whose runs all diverged refuses, and leaves no fit.json to be taken as finished."""
    from flows.scaling import fit_sweep

    path = results_table(tmp_path, ["diverged"] * 4, [None] * 4)
    sweep = sweep_of(path)
    with pytest.raises(ScalingDataError, match="no sweep run finished"):
        fit_sweep(demo(f"output_dir={tmp_path}", "tracking.enabled=false"), sweep, data=None)
    assert not list(tmp_path.rglob("fit.json")) and not list(tmp_path.rglob("manifest.json"))


def test_rung_sizes_keep_whole_kv_groups():
    """With grouped-query attention (smoke: 2 query heads per kv head) every candidate width holds whole groups."""
    recipe = load_recipe("smoke", ["output_dir=/tmp/unused"])
    for n_opt in (2e4, 5e4, 1.3e5, 4e5):
        rung, _ = size_for_budget(recipe, n_opt, 1e11)
        assert rung.model.n_heads % rung.model.n_kv_heads == 0
    with pytest.raises(ValueError, match="kv grouping"):
        plan_trials(recipe.override({"sweep.sizes": [{"depth": 2, "width": 80}]}).sweep_spec())


def test_seed_replicas_are_runs_of_their_own(tmp_path):
    """`sweep.seeds` replicates every run under another train.seed; each replica's points stay in the fit as a run
    of its own (the best learning rate is chosen per seed, never the luckier seed's loss per point)."""
    recipe = demo("sweep.seeds=[0, 1]", "sweep.lrs=[0.004, 0.008]", "sweep.lr_batch_exponent=0")
    plans, _ = plan_trials(recipe.sweep_spec())
    single, _ = plan_trials(demo("sweep.seeds=[]").sweep_spec())
    assert len(plans) == 4 * len(single) and len({p.name for p in plans}) == len(plans)
    specs = [trial_spec(recipe.sweep_spec(), p, None) for p in plans]
    assert sorted({(s.train.seed, s.optim.lr) for s in specs}) == [
        (0, 0.004),
        (0, 0.008),
        (1, 0.004),
        (1, 0.008),
    ]
    assert (
        trial_spec(demo("sweep.seeds=[]").sweep_spec(), single[0], None).name
        == f"demo-sweep-{single[0].name}"
    )  # unchanged
    rows = [
        {
            "N": 1000,
            "N_total": 1000,
            "D": d,
            "C": 6e3 * d,
            "loss": loss,
            "status": "completed",
            "run_dir": run,
        }
        | {"seed": seed, "lr": lr}
        for seed, lr, run, losses in (
            (0, 0.004, "a", (3.1, 3.0)),
            (0, 0.008, "b", (3.2, 3.1)),
            (1, 0.004, "c", (3.3, 3.2)),
            (1, 0.008, "d", (3.25, 3.15)),
        )
        for d, loss in zip((1e6, 2e6), losses, strict=True)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "results.parquet")
    points = sweep_points(tmp_path / "results.parquet")
    assert sorted(zip(points.run.tolist(), points.loss.tolist(), strict=True)) == [
        ("a", 3.0),
        ("a", 3.1),
        ("d", 3.15),
        ("d", 3.25),
    ]


def test_trials_side_by_side_share_the_cores_the_machine_runs_at_full_pace(monkeypatch):
    """`sweep.max_concurrent: auto` runs as many trials as `parallel_cores` measures (one on a cluster or with GPUs),
    each with its share of the CPUs as torch threads unless the recipe sets them; a number is taken as given."""
    import os

    from infra.cores import parallel_cores
    from training.stages.sweep import concurrent_trials, shared_cores

    recipe = load_recipe("demo", ["sweep.max_concurrent=auto"])
    spec = recipe.sweep_spec()
    cores = parallel_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    assert concurrent_trials(spec.sweep, 14) == cores and concurrent_trials(spec.sweep, 1) == 1
    assert concurrent_trials(spec.sweep.model_copy(update={"max_concurrent": 3}), 2) == 2
    assert concurrent_trials(spec.sweep.model_copy(update={"gpus_per_trial": 1.0}), 14) == 1
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert concurrent_trials(spec.sweep, 14) == 1
    trial = trial_spec(spec, plan_trials(spec)[0][0], None)
    assert shared_cores(trial, 1) is trial
    assert shared_cores(trial, 2).parallel.threads_per_worker == max(1, (os.cpu_count() or 1) // 2)
    pinned = trial.model_copy(
        update={"parallel": trial.parallel.model_copy(update={"threads_per_worker": 3})}
    )
    assert shared_cores(pinned, 2).parallel.threads_per_worker == 3
    assert shared_cores(trial, 2).key() == trial.key()  # the same run, cached under the same key
