"""Static checks of the Prefect side: prefect.yaml matches the flows, parameter models render and validate,
the service bind rules."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from flows.deployments import PREFECT_YAML, render
from flows.pipeline import FLOWS, PipelineParams
from infra.services import ServiceError, check_bind

ROOT = Path(__file__).resolve().parents[2]


def test_prefect_yaml_declares_every_flow():
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    entry_flows = {}
    for deployment in spec["deployments"]:
        module, name = deployment["entrypoint"].split(":")
        obj = getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), name)
        entry_flows[obj.name] = deployment
        assert deployment["work_pool"]["name"] == "lmforge"
        obj.validate_parameters(deployment["parameters"])  # the declared defaults are valid parameters
    assert set(entry_flows) == set(FLOWS)


def test_the_committed_prefect_yaml_is_the_generated_one():
    assert PREFECT_YAML.read_text() == render(), "prefect.yaml is stale: run `python -m flows.deployments`"


def test_pipeline_parameters_render_as_a_form():
    from prefect.utilities.callables import parameter_schema

    schema = parameter_schema(FLOWS["pipeline"].fn)
    props = schema.model_dump()["definitions"]["PipelineParams"]["properties"]
    fields = {"recipe", "overrides", "size", "budget", "sft", "dpo", "distill", "compress", "register_model"}
    assert fields <= set(props)
    assert props["size"]["enum"] == ["fit", "recipe"]
    assert "DPO" in props["dpo"]["title"] and "student" in props["distill"]["description"]  # described fields
    assert "frontier" not in props["compress"]["title"] and "GPTQ" in props["compress"]["description"]
    for name in (
        "sft",
        "dpo",
        "distill",
        "compress",
    ):  # each optional stage is also a flow (and a deployment)
        params = parameter_schema(FLOWS[name].fn).model_dump()["definitions"]
        assert {"recipe", "overrides", "teacher" if name == "distill" else "base"} <= set(
            next(iter(params.values()))["properties"]
        )


def test_invalid_pipeline_parameters_are_refused():
    with pytest.raises(ValueError, match="did you mean"):
        PipelineParams(recipe="smoke", overrides=["train.max_stepz=3"])
    with pytest.raises(ValueError, match="is neither a file nor a name in"):
        PipelineParams(recipe="no-such-recipe")
    with pytest.raises(ValueError, match="greater than 0"):
        PipelineParams(recipe="smoke", budget=-1.0)


@pytest.mark.parametrize("service", ["prefect", "mlflow", "ray"])
def test_non_loopback_bind_without_auth_is_refused(service):
    check_bind(service, "127.0.0.1", env={})
    with pytest.raises(ServiceError, match=f"refusing to bind {service} to 0.0.0.0 without authentication"):
        check_bind(service, "0.0.0.0", env={"RAY_AUTH_MODE": "disabled"})


def test_bind_with_auth_configured_is_allowed():
    check_bind("prefect", "0.0.0.0", env={"PREFECT_SERVER_API_AUTH_STRING": "admin:s3cret"})
    check_bind("ray", "10.0.0.5", env={"RAY_AUTH_MODE": "token"})
    auth = {"MLFLOW_FLASK_SERVER_SECRET_KEY": "k", "MLFLOW_AUTH_CONFIG_PATH": "/etc/auth.ini"}
    with pytest.raises(ServiceError):  # the default admin password is refused
        check_bind("mlflow", "0.0.0.0", env=auth)
    check_bind("mlflow", "0.0.0.0", env={**auth, "MLFLOW_AUTH_ADMIN_PASSWORD": "long-and-random"})


def test_pipeline_flags_reach_the_flow_and_unknown_parameters_are_refused():
    from pydantic import ValidationError

    from flows.cli import build_parser
    from flows.cli_services import pipeline_params

    args = build_parser().parse_args(["pipeline", "smoke", "--no-register", "--no-sft", "--size", "recipe"])
    params = pipeline_params(args)
    FLOWS["pipeline"].validate_parameters({"params": params})  # what `lmforge pipeline` hands the flow
    assert (params.register_model, params.sft, params.size) == (False, False, "recipe")
    assert params.switches()["register_model"] is False
    assert (params.dpo, params.distill) == (False, False)  # optional stages are off unless asked for
    switches = pipeline_params(
        build_parser().parse_args(["pipeline", "smoke", "--dpo", "--distill"])
    ).switches()
    assert (switches["dpo"], switches["distill"], switches["sft"]) == (True, True, True)
    with pytest.raises(ValidationError, match="register"):
        PipelineParams(recipe="smoke", register=False)  # a misspelt flag is an error, not a silent default


def test_the_rung_multiple_sizes_the_final_model_for_a_multiple_of_the_largest_swept_budget():
    from flows.cli import build_parser
    from flows.cli_services import pipeline_params
    from flows.scaling import target_budget

    assert target_budget(PipelineParams(recipe="demo").load()) == 2.4e12  # the demo's default: 3x 8e11
    args = build_parser().parse_args(["pipeline", "demo", "--rung-multiple", "10"])
    assert target_budget(pipeline_params(args).load()) == 8e12
    assert target_budget(PipelineParams(recipe="demo", budget=5e12).load()) == 5e12


def test_a_registering_pipeline_refuses_attention_without_a_llama_layout(capsys) -> None:
    """Registering and compressing need a Hugging Face layout: refused in one line before anything starts; the
    same recipe without them is accepted."""
    from flows.cli import main
    from flows.recipe import load_recipe
    from flows.registry import pipeline_stages, preflight

    for extra in ([], ["--compress", "--no-register"]):
        assert main(["pipeline", "smoke", "--set", "model.attention=favor", *extra]) == 2
        message = capsys.readouterr().err.strip()
        assert "\n" not in message and "model.attention=favor has no Hugging Face layout" in message
    linear = load_recipe("smoke", ["model.attention=linear"])
    preflight(linear, pipeline_stages({"register_model": False}, "fit"))


def test_a_pipeline_whose_sources_match_no_file_is_refused_before_anything_starts(tmp_path, capsys) -> None:
    """Tokenization is no target of the pipeline but what every target needs: its sources are checked with the
    targets', before a Prefect server, an MLflow store or the output directory exist; the UI's form the same."""
    from flows.cli import main

    out = tmp_path / "out"
    missing = f"data.sources=[{tmp_path}/corpus/*.jsonl]"
    assert main(["pipeline", "smoke", "--set", missing, "--set", f"output_dir={out}"]) == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and f"no files match '{tmp_path}/corpus/*.jsonl'" in message, message
    assert not out.exists()
    with pytest.raises(ValueError, match="no files match"):
        PipelineParams(recipe="smoke", overrides=[missing])


def test_a_sweep_with_no_trial_is_refused_before_anything_starts(tmp_path, capsys) -> None:
    """Budgets too small for any size's `sweep.min_steps`: one line naming each pair left out, before tokenizing."""
    from flows.cli import main

    out = tmp_path / "out"
    assert main(["pipeline", "smoke", "--set", "sweep.budgets=[1e5]", "--set", f"output_dir={out}"]) == 2
    message = capsys.readouterr().err.strip()
    assert (
        "\n" not in message and "sweep has no trials" in message and "1 steps < sweep.min_steps=10" in message
    )
    assert not out.exists()


def test_a_validation_error_of_the_pipelines_parameters_is_one_line_naming_each_field() -> None:
    """What `lmforge pipeline --budget -5` prints after `lmforge: error: ` (pydantic's own message is four lines)."""
    from pydantic import ValidationError

    from flows.cli import one_line

    with pytest.raises(ValidationError) as one:
        PipelineParams(recipe="smoke", budget=-5.0)
    assert one_line(one.value) == "budget: Input should be greater than 0 (got -5.0)"
    with pytest.raises(ValidationError) as two:
        PipelineParams(recipe="smoke", budget=-5.0, rung_multiple=0.0)
    assert one_line(two.value) == (
        "budget: Input should be greater than 0 (got -5.0); rung_multiple: Input should be greater than 0 (got 0.0)"
    )


def test_a_corrupt_services_file_is_one_line_naming_it(tmp_path, capsys):
    from flows.cli import main

    (tmp_path / "services.json").write_text('[{"name": "mlflow", "pid"')
    for command in (["down", "--state-dir", str(tmp_path)], ["up", "--state-dir", str(tmp_path)]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip()
        assert f"{tmp_path / 'services.json'}: unreadable" in err and "delete the file" in err
        assert len(err.splitlines()) == 1


def test_a_missing_pairs_file_is_refused_before_anything_trains(tmp_path, capsys):
    from flows.cli import main

    out = tmp_path / "outputs"
    assert (
        main(["dpo", "smoke", "--set", "data.preference.source=/nope.jsonl", "--set", f"output_dir={out}"])
        == 2
    )
    assert "data.preference.source: /nope.jsonl does not exist" in capsys.readouterr().err
    assert not out.exists()  # no tokenizer, no pretraining, no SFT first
    with pytest.raises(ValueError, match="/nope.jsonl does not exist"):
        PipelineParams(recipe="smoke", dpo=True, overrides=["data.preference.source=/nope.jsonl"])


def test_a_ray_port_in_rays_worker_range_is_refused_before_anything_starts(tmp_path, capsys):
    from flows.cli import main

    assert (
        main(
            ["up", "--state-dir", str(tmp_path / "state"), "--outputs", str(tmp_path), "--ray-port", "12345"]
        )
        == 2
    )
    assert "--ray-port 12345 lies in Ray's worker-port range 10002-19999" in capsys.readouterr().err
    assert not (tmp_path / "state" / "services.json").exists()  # nothing was started


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ray-port", "70000"], "--ray-port 70000 is not a port (1-65535)"),
        (["--mlflow-port", "-1"], "--mlflow-port -1 is not a port (1-65535)"),
        (["--ray-dashboard-port", "6379"], "--ray-dashboard-port and --ray-port are both 6379"),
    ],
)
def test_impossible_ports_are_refused_before_anything_starts(tmp_path, capsys, flags, message):
    from flows.cli import main

    assert main(["up", "--state-dir", str(tmp_path / "state"), "--outputs", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "state" / "services.json").exists()  # nothing was started


def test_artifact_tables_put_a_metric_per_model_in_columns_at_four_digits() -> None:
    from flows.stage_report import table

    assert table({"heldout/loss": {"pretrain": 2.8509123456789, "lora": 2.61}, "exact": {"lora": 0.25}}) == [
        "| | pretrain | lora |",
        "|---|---|---|",
        "| heldout/loss | 2.851 | 2.61 |",
        "| exact |  | 0.25 |",
    ]
    assert table({"val loss": 5.454821109771, "steps": 20, "gates": {"bpb": True}}) == [
        "| | |",
        "|---|---|",
        "| val loss | 5.455 |",
        "| steps | 20 |",
        "| gates | bpb True |",
    ]


def test_the_terminal_report_prints_losses_at_four_digits_and_parameter_counts_whole() -> None:
    from types import SimpleNamespace

    from flows.stages.pretrain import report
    from flows.stages.runs import describe_tuned

    model = SimpleNamespace(
        path="p",
        checkpoint="c",
        step=20,
        final_val_loss=2.2572557348757982,
        hf_export="h",
        export_valid=True,
        max_abs_logit_diff=1.1444091796875e-05,
        mlflow_run_id="r",
    )
    lines = report(SimpleNamespace(tracking=SimpleNamespace(enabled=False)), {}, model).splitlines()
    assert "val loss   2.2573" in lines and "hf export  h (verified: True, max |Δlogit| 1.1e-05)" in lines
    tuned = SimpleNamespace(
        path="p",
        kind="lora",
        base_run_dir=None,
        summary={"sft/trainable_params": 43776.0, "sft/trainable_fraction": 0.28866},
        adapter=None,
        hf_export="h",
        export_valid=True,
        mlflow_run_id="r",
    )
    lines = describe_tuned(tuned).splitlines()
    assert (
        f"  {'sft/trainable_params':<36} 43,776" in lines
        and f"  {'sft/trainable_fraction':<36} 0.2887" in lines
    )


def test_up_starts_services_side_by_side_and_a_failure_stops_every_one_that_started(
    tmp_path, capsys, monkeypatch
):
    """Prefect and MLflow (stand-ins: real processes of their own) come up while Ray fails after them: both are
    stopped, nothing stays recorded, and the error is one line."""
    import subprocess
    import threading
    import time

    from flows.cli import main
    from infra import services

    both_running = threading.Barrier(2, timeout=10)  # proves the two start at the same time
    started: list[subprocess.Popen] = []

    def fake(name: str):
        def start(*args, **kwargs) -> services.Running:
            proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
            started.append(proc)
            both_running.wait()
            return services.Running.of(name, proc.pid, f"http://{name}", "")

        return start

    def ray_fails(*args, **kwargs):
        time.sleep(0.5)
        raise services.ServiceError("ray: the process exited with 1; see ray.log")

    monkeypatch.setattr(services, "start_prefect", fake("prefect"))
    monkeypatch.setattr(services, "start_mlflow", fake("mlflow"))
    monkeypatch.setattr(services, "start_ray", ray_fails)
    state = tmp_path / "state"
    assert main(["up", "--state-dir", str(state), "--outputs", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == "lmforge: error: ray: the process exited with 1; see ray.log"
    assert len(started) == 2 and all(proc.wait(timeout=15) is not None for proc in started)  # both stopped
    assert services.load_state(state) == []


def test_zero_workers_is_refused_not_ignored(capsys) -> None:
    """`--workers 0` named the recipe's own worker count before (0 is falsy); now it is the bad value it is."""
    from flows.cli import main

    assert main(["tokenize", "smoke", "--workers", "0"]) == 2
    err = capsys.readouterr().err
    assert "parallel.world_size" in err and "(got 0)" in err and len(err.strip().splitlines()) == 1
