"""The product as users see it: a real Prefect server and MLflow server on 127.0.0.1, the flows served as
deployments, a pipeline run created through the Prefect API (what the UI's Run button does), MLflow lineage
checked through the client, kill-and-rerun, and a headless-Chromium look at both UIs."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import pytest

from flows.recipe import load_recipe
from flows.registry import pipeline, toggles
from infra.services import free_port, start_mlflow, start_prefect, stop_all
from infra.storage import sha256_file
from tests.pretrain_helpers import clean_env, lmforge_command, quiet_runner, smoke_overrides, with_sets
from training.model.config import ModelConfig
from training.sizing import count_n
from training.stages.sweep import plan_trials

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
EVAL = ["eval.max_documents=20", "eval.builtin_questions=20", "data.sft.max_examples=300"]
# the served pipeline sweeps as the demo does: one WSD run per size with decay branches at the smaller budgets
# (3 trials for the smoke recipe's 7 points)
MULTI_HORIZON = ["sweep.multi_horizon=true", "optim.schedule=wsd"]
# the default rung, 3x the largest swept budget (6e10, ~680 steps), not the smoke recipe's target 1e11 (~1,100)
RUNG = "sweep.target_budget=null"
# two variants (torchao's int8, lmforge's GPTQ) of the seven tests/integration/test_compress.py makes
VARIANTS = "compress.variants=[{method: int8-weight}, {method: gptq, bits: 4, group_size: 4}]"


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    state = tmp_path_factory.mktemp("services")
    store = tmp_path_factory.mktemp("mlstore")
    with ThreadPoolExecutor(2) as pool:  # side by side, as `lmforge up` starts them
        starting = pool.submit(start_prefect, state, port=free_port())
        ml = start_mlflow(state, f"sqlite:///{store / 'mlflow.db'}", store / "artifacts", port=free_port())
        prefect = starting.result()
    env = {**clean_env(), "PREFECT_API_URL": f"{prefect.url}/api", "LMFORGE_TRACKING_URI": ml.url}
    yield prefect, ml, env, state
    stop_all([ml, prefect], timeout=2)  # disposable servers: no need to wait for a graceful exit


@pytest.fixture(scope="module")
def served_run(services, tmp_path_factory):
    """`lmforge serve` plus one pipeline flow run created through the Prefect API, completed."""
    prefect, ml, env, state = services
    out = tmp_path_factory.mktemp("pipeline")
    log = open(state / "serve.log", "wb")  # noqa: SIM115 - closed at teardown
    server = subprocess.Popen(
        lmforge_command("serve", "--state-dir", str(state)),
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    # Prefect reads its settings once per process (collection imported it already): override them in context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    try:
        with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}):
            from prefect.client.orchestration import get_client
            from prefect.deployments import run_deployment
            from prefect.exceptions import ObjectNotFound

            deadline = time.monotonic() + 120  # wait for the deployment, then start exactly one flow run
            with get_client(sync_client=True) as client:
                while True:
                    try:
                        client.read_deployment_by_name("pipeline/lmforge")
                        break
                    except ObjectNotFound:
                        assert server.poll() is None, (state / "serve.log").read_text()[-3000:]
                        assert time.monotonic() < deadline, (
                            "`lmforge serve` registered no deployment in 120 s"
                        )
                        time.sleep(1)
            flow_run = run_deployment(
                "pipeline/lmforge",
                parameters={
                    "params": {
                        "recipe": "smoke",
                        "overrides": smoke_overrides(out, *EVAL, *MULTI_HORIZON, RUNG, VARIANTS),
                        "dpo": True,
                        "distill": True,
                        "compress": True,
                    }
                },
                timeout=1200,
                poll_interval=1,  # Prefect's default, 5 s, noticed the finished run 2.5 s late on average
            )
            yield flow_run, out, ml, prefect
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
        log.close()


def test_pipeline_run_through_the_prefect_api_completes(served_run):
    flow_run, _, _, _ = served_run
    assert flow_run.state.is_completed(), flow_run.state


def test_mlflow_holds_the_lineage(served_run):
    flow_run, out, ml, _ = served_run
    client = mlflow.MlflowClient(ml.url)
    experiment = client.get_experiment_by_name("lmforge")
    runs = client.search_runs([experiment.experiment_id], max_results=200)
    parents = [r for r in runs if r.data.tags.get("lmforge.stage") == "pipeline"]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.info.run_name == "pipeline-smoke"
    assert parent.data.tags["prefect.flow_run_id"] == str(flow_run.id)
    nested = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    children = {r.data.tags.get("lmforge.stage"): r for r in nested}
    # two pretraining runs: the rung, and the distillation student trained from scratch
    (children["pretrain"],) = [r for r in nested if r.info.run_name == "pretrain-smoke-optimal"]
    assert any(r.info.run_name == "pretrain-smoke-optimal-student" for r in nested)
    assert set(children) >= {
        "tokenize",
        "sweep",
        "fit",
        "pretrain",
        "sft",
        "dpo",
        "distill",
        "eval",
        "register",
        "compress",
    }
    for stage, child in children.items():  # every stage run says which code and which config made it
        assert (
            len(child.data.tags["lmforge.git"]) in (40, 7) or child.data.tags["lmforge.git"] == "unknown"
        ), stage
        assert child.data.tags["lmforge.config_digest"], stage
    assert {a.path for a in client.list_artifacts(children["fit"].info.run_id, "fit")} >= {"fit/fit.json"}
    sweep = children["sweep"]
    trials = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == sweep.info.run_id]
    plans, _ = plan_trials(
        load_recipe("smoke", smoke_overrides(out, *EVAL, *MULTI_HORIZON, RUNG, VARIANTS)).sweep_spec()
    )
    assert len(plans) == 3 and len(trials) == len(plans)
    assert all(r.data.tags["prefect.flow_run_id"] == str(flow_run.id) for r in trials)
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {
        "recipe.json",
        "data",
        "tokenizer",
        "pipeline_summary.json",
    }
    assert parent.inputs.dataset_inputs and parent.inputs.dataset_inputs[0].dataset.name == "tokens-smoke"
    assert {a.path for a in client.list_artifacts(sweep.info.run_id, "fit")} >= {
        "fit/fit.json",
        "fit/isoflop.png",
        "fit/contours.png",
        "fit/prediction.png",
        "fit/curve.png",
    }
    # the rung (the model trained at the target budget) was predicted, then measured
    rung_metrics = children["pretrain"].data.metrics
    assert rung_metrics["fit/rung_rel_error"] == pytest.approx(
        abs(
            rung_metrics["fit/rung_measured_loss"]
            - client.get_run(sweep.info.run_id).data.metrics["fit/rung_predicted_loss"]
        )
        / rung_metrics["fit/rung_measured_loss"]
    )
    assert "results.parquet" in {a.path for a in client.list_artifacts(sweep.info.run_id)}
    # the plots once per content: the sweep's run has the fit as fitted, the fit's lineage run the checked fit
    plotted = [
        r.data.tags.get("lmforge.stage")
        for r in runs
        if "fit/prediction.png" in {a.path for a in client.list_artifacts(r.info.run_id, "fit")}
    ]
    assert sorted(plotted) == ["fit", "sweep"], plotted
    # the size chosen from the fit is the size trained: N* is the law's closed form (Hoffmann et al. 2022, eq. 4),
    # and the pretraining run has exactly the rung's N and D
    (fit_json,) = out.glob("rung/*/fit.json")  # the fit, its prediction and the measurement
    fit = json.loads(fit_json.read_text())
    law, optimal, rung = fit["law"], fit["optimal"], fit["rung"]
    assert children["fit"].data.tags["lmforge.law_form"] == fit["choice"]["form"] == rung["form"]
    alpha, beta = law["alpha"], law["beta"]
    g = (alpha * law["A"] / (beta * law["B"])) ** (1 / (alpha + beta))
    assert optimal["n_opt"] == pytest.approx(g * (optimal["budget"] / 6) ** (beta / (alpha + beta)), rel=1e-9)
    (rung_dir,) = [d for d in out.glob("pretrain/smoke-optimal-*") if "-student-" not in d.name]
    spec = json.loads((rung_dir / "spec.json").read_text())
    assert count_n(ModelConfig(**spec["model"]), fit["param_count"]) == rung["n"]
    train = spec["train"]
    assert train["max_steps"] * train["global_batch_size"] * train["seq_len"] == rung["d"]
    # its whole validation curve: predicted before it trained (the fit stage's fit.json holds no measurement),
    # then measured at every evaluation the run logged; the error is the largest over them
    (before,) = out.glob("fit/*/fit.json")
    predicted = json.loads(before.read_text())["rung"]["curve"]
    curve = rung["curve"]
    assert predicted["measured"] is None and curve["loss"] == predicted["loss"]
    records = [json.loads(line) for line in (rung_dir / "metrics.jsonl").read_text().splitlines()]
    logged = {m["step"]: m["val/loss"] for m in records if "val/loss" in m and m["step"] > 0}
    assert curve["steps"] == sorted(logged) and curve["measured"] == [logged[s] for s in curve["steps"]]
    errors = [abs(p / m - 1) for p, m in zip(curve["loss"], curve["measured"], strict=True)]
    assert len(errors) == 8 and curve["max_rel_error"] == pytest.approx(max(errors))
    assert "hf_export" in {a.path for a in client.list_artifacts(children["pretrain"].info.run_id)}
    sft_artifacts = {a.path for a in client.list_artifacts(children["sft"].info.run_id)}
    assert {"adapter", "hf_export"} <= sft_artifacts
    dpo_artifacts = {a.path for a in client.list_artifacts(children["dpo"].info.run_id)}
    assert {
        "data",
        "hf_export",
        "eval_report",
    } <= dpo_artifacts  # the registered model's run holds the report
    assert "eval/report.md" in {a.path for a in client.list_artifacts(children["eval"].info.run_id, "eval")}
    versions = [
        client.get_model_version("lmforge-smoke", v.version)
        for v in client.search_model_versions("name='lmforge-smoke'")
    ]
    (version,) = [v for v in versions if "lmforge.compression" not in v.tags]
    # the compress stage's variants are nested runs of its own run; the smallest within tolerance is registered
    # under its own alias next to the tuned model
    compress = children["compress"]
    variant_runs = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == compress.info.run_id]
    assert len(variant_runs) == 1 + 2  # the uncompressed reference and each variant
    (small,) = [v for v in versions if "lmforge.compression" in v.tags]
    assert "compressed" in small.aliases and small.tags["gate.export_verified"] == "true"
    assert version.tags["gate.export_verified"] == "true"
    gates = {k: v for k, v in version.tags.items() if k.startswith("gate.")}
    smoke = load_recipe("smoke").eval
    declared = {  # the DPO model is the candidate, gated against the LoRA SFT, and that against the pretrained model
        *(f"gate.{g.metric}" for g in smoke.dpo_gates),
        *(f"gate.lora vs pretrain/{g.metric}" for g in smoke.gates),
    }
    assert set(gates) | {
        f"gate.{m}" for m in version.tags.get("lmforge.gates_skipped", "").split(",") if m
    } == {
        "gate.export_verified",
        *declared,
    }
    assert ("candidate" in version.aliases) == all(
        v == "true" for v in gates.values()
    )  # alias iff all passed
    assert Path(version.tags["lmforge.run_dir"]).parent.name == "dpo"
    # the report puts the fine-tuned and preference-tuned models, and the distilled student and its
    # from-scratch twin, side by side
    (report_json,) = out.glob("eval/*/report.json")
    report = json.loads(report_json.read_text())
    assert list(report["models"]) == ["pretrain", "lora", "dpo-full", "student-distilled", "student-scratch"]
    margin = report["metrics"]["preference-heldout/logp_margin"]
    assert margin["dpo-full"] > margin["lora"]  # DPO raised the chosen answers' log-probabilities relative
    assert all(
        report["metrics"]["heldout/all/bits_per_byte"][m] > 0
        for m in ("student-distilled", "student-scratch")
    )
    assert children["dpo"].data.tags["lmforge.base_run_id"] == children["sft"].info.run_id
    assert version.tags["scaling.prediction_held"] in ("true", "false")
    mlflow.set_tracking_uri(ml.url)
    model = mlflow.pyfunc.load_model(f"models:/lmforge-smoke/{version.version}")
    assert isinstance(model.predict(["def "])[0], str)


def test_stage_artifacts_are_published_to_prefect(served_run):
    from prefect import get_client

    flow_run, _, _, _ = served_run

    async def published() -> list:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
            )

    artifacts = asyncio.run(published())
    assert all(a.task_run_id is not None for a in artifacts)  # each on its stage's task run, not the flow run
    # stages that train nothing link their lineage run; the evaluation's metric per model is a column per model
    links = {a.key: "[MLflow run](" in a.data for a in artifacts}
    assert all(links[f"smoke-{stage}"] for stage in ("tokenize", "rung", "register", "pretrain", "eval")), (
        links
    )
    (evaluation,) = [a.data for a in artifacts if a.key == "smoke-eval"]
    assert "| | pretrain | lora | dpo-full |" in evaluation, evaluation
    assert {a.key for a in artifacts} >= {
        "smoke-tokenize",
        "smoke-sweep",
        "smoke-fit",
        "smoke-pretrain",
        "smoke-dpo",
        "smoke-distill",
        "smoke-rung",
        "smoke-frontier",
        "smoke-eval",
        "smoke-register",
    }


def test_lmforge_log_records_join_the_stage_task_runs_logs(served_run):
    """What lmforge logs at INFO inside a stage (here the sweep's concurrency) shows in the Prefect UI's run
    logs, on the stage's task run."""
    from prefect import get_client

    flow_run, _, _, _ = served_run

    async def logged() -> list:
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        async with get_client() as client:
            return await client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id]))
            )

    ours = [log for log in asyncio.run(logged()) if log.name == "training.stages.sweep"]
    assert any("trial(s) at once" in log.message and log.task_run_id is not None for log in ours), ours


def test_invalid_parameters_are_refused_before_work(services):
    from flows.pipeline import PipelineParams

    with pytest.raises(ValueError, match="did you mean"):
        PipelineParams(recipe="smoke", overrides=["train.max_stepz=3"])
    with pytest.raises(ValueError, match="greater than 0"):
        PipelineParams(recipe="smoke", budget=-1)


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "chromium"], check=True, capture_output=True, timeout=900
        )
        found = shutil.which("chromium")
    assert found, "Chromium is missing and could not be installed (apt-get install chromium)"
    return found


def _browse(browser: str, url: str, expect: str, screenshot: Path) -> str:
    """Load `url` in headless Chromium (driven by Playwright), wait until `expect` shows, screenshot, return HTML."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=browser, args=["--no-sandbox"])
        page = chromium.new_page(viewport={"width": 1400, "height": 900})
        page.goto(url)  # the UIs poll forever, so wait for the text rather than for an idle network
        page.get_by_text(expect).first.wait_for(state="attached", timeout=60_000)
        page.screenshot(path=str(screenshot), full_page=True)
        html = page.content()
        chromium.close()
    return html


def test_browser_shows_the_run_in_both_uis(served_run, tmp_path):
    from prefect import get_client

    flow_run, _, ml, prefect = served_run
    browser = _chromium()

    async def deployment_id() -> str:
        async with get_client() as client:
            return str((await client.read_deployment_by_name("pipeline/lmforge")).id)

    url = f"{prefect.url}/deployments/deployment/{asyncio.run(deployment_id())}"
    assert "pipeline" in _browse(browser, url, "lmforge", tmp_path / "prefect-deployment.png")
    url = f"{prefect.url}/runs/flow-run/{flow_run.id}"
    assert "Completed" in _browse(browser, url, flow_run.name, tmp_path / "prefect.png")  # the run's state
    client = mlflow.MlflowClient(ml.url)
    experiment = client.get_experiment_by_name("lmforge")
    parent = next(
        r
        for r in client.search_runs([experiment.experiment_id])
        if r.data.tags.get("lmforge.stage") == "pipeline"
    )
    url = f"{ml.url}/#/experiments/{experiment.experiment_id}/runs/{parent.info.run_id}"
    html = _browse(browser, url, "pipeline-smoke", tmp_path / "mlflow.png")
    assert "pipeline/orchestration_overhead" in html and "Finished" in html  # its metrics, its status
    shots = ("prefect-deployment.png", "prefect.png", "mlflow.png")
    for shot in shots:
        assert (tmp_path / shot).stat().st_size > 10_000
    keep = os.environ.get("LMFORGE_SCREENSHOTS")  # CI can keep the screenshots
    if keep:
        for shot in shots:
            shutil.copy(tmp_path / shot, Path(keep) / shot)


def test_killed_pipeline_resumes_and_matches_an_uninterrupted_run(services, tmp_path):
    _, _, env, _ = services
    env = {k: v for k, v in env.items() if k != "LMFORGE_TRACKING_URI"}  # embedded sqlite per output dir
    train = ["train.max_steps=120", "train.checkpoint_every=20", "train.eval_every=60"]

    def command(out: Path) -> list[str]:
        return lmforge_command(
            "pipeline",
            "smoke",
            "--size",
            "recipe",
            "--no-register",
            *with_sets(smoke_overrides(out, *EVAL, *train)),
        )

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        command(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 600
    while not list(killed.glob("pretrain/*/checkpoints/step-*/COMPLETE")):
        assert proc.poll() is None, "the pipeline ended before pretraining checkpointed"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not list(killed.glob("pretrain/*/manifest.json")), "killed too late: pretraining had finished"
    tokens = next(killed.glob("tokenize/*/manifest.json"))
    stamp = tokens.stat().st_mtime_ns
    # the rerun is what `make demo` does: no Prefect server anywhere, so `lmforge pipeline` starts a temporary one
    # whose database stays in the output directory with the finished flow run in it
    alone = {k: v for k, v in env.items() if not k.startswith("PREFECT_")}
    rerun = subprocess.run(command(killed), env=alone, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert tokens.stat().st_mtime_ns == stamp  # tokenization was skipped
    with sqlite3.connect(killed / "services" / "prefect" / "prefect.db") as db:
        flows = db.execute(
            "SELECT flow.name, flow_run.state_type FROM flow_run JOIN flow ON flow.id = flow_run.flow_id"
        ).fetchall()
    assert flows == [("pipeline", "COMPLETED")], flows
    assert f"PREFECT_HOME={(killed / 'services' / 'prefect').resolve()}" in rerun.stdout
    # the resumed pretraining run is nested under the pipeline run that finished it, not the killed one
    tracking = mlflow.MlflowClient(f"sqlite:///{killed / 'mlflow.db'}")
    experiment = tracking.get_experiment_by_name("lmforge").experiment_id
    (pretrain,) = [
        r for r in tracking.search_runs([experiment]) if r.data.tags.get("lmforge.stage") == "pretrain"
    ]
    parent, earlier = (pretrain.data.tags[k] for k in ("mlflow.parentRunId", "lmforge.earlier_parent_run_id"))
    pipelines = [
        r.info.run_id for r in tracking.search_runs([experiment], order_by=["attributes.start_time"])
    ]
    assert parent != earlier and pipelines.index(earlier) < pipelines.index(parent)  # killed, then rerun
    assert tracking.get_run(parent).info.status == "FINISHED"
    # --no-register had its effect: nothing in the registry, no registration in the summary
    assert tracking.search_registered_models() == []
    assert "Registered:" not in rerun.stdout and "Stage times:" in rerun.stdout
    # the uninterrupted run: the same stages, in this process (the launch's own path is the rerun's)
    straight = tmp_path / "straight"
    switches = {name: toggle.default for name, toggle in toggles().items()} | {"register_model": False}
    pipeline(
        load_recipe("smoke", smoke_overrides(straight, *EVAL, *train)), switches, "recipe", quiet_runner()
    )
    for stage in ("pretrain", "sft"):
        (a,) = killed.glob(f"{stage}/*/hf/model.safetensors")
        (b,) = straight.glob(f"{stage}/*/hf/model.safetensors")
        assert sha256_file(a) == sha256_file(b), stage
    (ra,) = killed.glob("eval/*/report.json")
    (rb,) = straight.glob("eval/*/report.json")
    ma, mb = json.loads(ra.read_text())["metrics"], json.loads(rb.read_text())["metrics"]
    ma.pop("eval/tokens_per_s")
    mb.pop("eval/tokens_per_s")
    assert ma == mb
