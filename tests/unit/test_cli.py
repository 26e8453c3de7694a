"""`lmforge model summary`: table and JSON from recipes and Hugging Face configs, one-line errors, exit codes."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from flows.cli import main
from flows.recipe import load_recipe
from training.model.accounting import count_parameters

HF_CONFIGS = Path(__file__).resolve().parents[1] / "assets" / "hf_configs"


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["model", "summary", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_summary_json_from_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "moe-small")
    expected = count_parameters(load_recipe("moe-small").model)
    assert out["parameters"]["total"] == expected.total and out["parameters"]["active"] == expected.active
    assert out["setting"]["ep_size"] == 2 and out["setting"]["precision"] == "bf16"


def test_summary_overrides_change_memory(capsys: pytest.CaptureFixture[str]) -> None:
    one = run_json(capsys, "gpt2-small-like", "--set", "parallel.zero_stage=0")
    three = run_json(capsys, "gpt2-small-like", "--set", "parallel.zero_stage=3")
    assert three["memory_per_device_bytes"]["weights"] * 8 == one["memory_per_device_bytes"]["weights"]


def test_summary_from_hf_config(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys,
        "--from-hf",
        str(HF_CONFIGS / "llama-3-8b.json"),
        "--set",
        "parallel.world_size=8",
        "--set",
        "train.micro_batch_size=1",
    )
    assert out["parameters"]["total"] == 8_030_261_248
    assert out["setting"]["world_size"] == 8


def test_summary_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "summary", "smoke"]) == 0
    out = capsys.readouterr().out
    assert "params/total" in out and "156,480" in out and "memory_per_device/optimizer" in out


def test_bad_override_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "summary", "smoke", "--set", "model.n_heads=5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lmforge: error: model: n_heads=5 must divide d_model=64") and "\n" not in err


def test_missing_hf_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["model", "summary", "--from-hf", str(tmp_path / "nope.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_console_script_is_installed() -> None:
    exe = Path(sys.executable).with_name("lmforge")
    result = subprocess.run([str(exe), "model", "summary", "smoke", "--json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["recipe"] == "smoke"


def test_the_executable_waits_for_threads_runs_exit_handlers_and_keeps_the_exit_code(tmp_path: Path) -> None:
    """`lmforge` (flows.cli.console) skips the interpreter's module teardown, not what comes before it: a
    non-daemon thread still running when the command returns, an exit handler it registered, and output still
    in the pipe's buffer all finish, and the command's exit code is the process's."""
    script = f"""
import atexit, threading, time
from pathlib import Path
import flows.cli
out = Path({str(tmp_path)!r})
def command(argv=None):
    threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("done"))).start()
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    print("buffered", end="")
    return 3
flows.cli.main = command
flows.cli.console()
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout a pipe, block-buffered
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 3 and done.stdout == "buffered", done.stderr
    assert (tmp_path / "thread").read_text() == "done" and (tmp_path / "atexit").read_text() == "ran"


@pytest.mark.slow
def test_tokenize_then_inspect(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    overrides = [
        "data.max_documents=30",
        "data.num_workers=1",
        "data.sft.max_examples=200",
        f"output_dir={tmp_path}",
    ]
    argv = ["tokenize", "smoke"] + [item for o in overrides for item in ("--set", o)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "train" in out and "tokens in" in out and "tokenizer " in out
    dataset = next((tmp_path / "tokenize").iterdir())
    assert main(["data", "inspect", str(dataset), "--samples", "1"]) == 0
    shown = capsys.readouterr().out
    assert "verified by sha256" in shown and "--- document 0" in shown and "tokens #" in shown
    assert main(argv) == 0  # a rerun finds everything done


def test_inspect_of_a_partial_dataset_says_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "train-00000.arrow").write_bytes(b"")
    assert main(["data", "inspect", str(tmp_path)]) == 2
    assert "interrupted run" in capsys.readouterr().err


def test_summary_sizes_optimizer_state_by_optimizer(capsys: pytest.CaptureFixture[str]) -> None:
    adam = run_json(capsys, "smoke")["memory_per_device_bytes"]
    muon = run_json(
        capsys,
        "smoke",
        "--set",
        "optim.name=muon",
        "--set",
        "optim.grad_clip=0",
        "--set",
        "parallel.zero_stage=1",
    )
    assert muon["memory_per_device_bytes"]["optimizer"] == adam["optimizer"] // 2  # one moment instead of two
    assert muon["setting"]["optimizer"] == "muon"


def test_fit_scaling_json_is_json_alone_on_stdout(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    n, d = np.meshgrid(np.geomspace(1e6, 1e8, 4), np.geomspace(1e8, 1e10, 4))
    loss = 1.8 + 400 / n**0.34 + 2000 / d**0.28
    table = tmp_path / "runs.parquet"
    pq.write_table(pa.table({"N": n.ravel(), "D": d.ravel(), "loss": loss.ravel()}), table)
    args = [
        "fit-scaling",
        str(table),
        "--bootstrap",
        "20",
        "--budget",
        "1e20",
        "--json",
        "--intervals",
        "points",
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    fit = json.loads(captured.out)
    assert fit["law"]["alpha"] == pytest.approx(0.34, rel=0.05) and fit["interval_method"] == "points"
    assert "wrote" in captured.err


def test_a_missing_base_run_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["sft", "smoke", "--base", str(tmp_path / "nowhere")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    (tmp_path / "unfinished").mkdir()
    assert main(["eval", "smoke", str(tmp_path / "unfinished")]) == 2
    assert "has not finished" in capsys.readouterr().err


def test_review_commands_are_absolute_and_link_the_experiments_runs(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    import mlflow

    from flows.cli_services import print_review
    from flows.recipe import load_recipe
    from infra.tracking import tracking_uri

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("LMFORGE_TRACKING_URI", raising=False)
    recipe = load_recipe("smoke", [f"output_dir={tmp_path}"])
    experiment = mlflow.MlflowClient(tracking_uri(recipe.tracking, tmp_path)).create_experiment(
        recipe.tracking.experiment
    )
    print_review(recipe, tmp_path / "services")
    out = capsys.readouterr().out
    mlflow_line = next(line for line in out.splitlines() if "MLflow:" in line)
    assert mlflow_line.split()[1] == str(Path(sys.executable).parent.resolve() / "mlflow")
    assert f"http://127.0.0.1:5000/#/experiments/{experiment}/runs" in mlflow_line
    prefect_line = next(line for line in out.splitlines() if "Prefect:" in line)
    assert f"{Path(sys.executable).parent.resolve() / 'prefect'} server start --port 4200" in prefect_line
    assert "PREFECT_UI_API_URL=http://127.0.0.1:4200/api" in prefect_line  # the UI calls this server's port
    assert "PREFECT_SERVER_ANALYTICS_ENABLED=false" in prefect_line  # no telemetry errors offline


def test_a_compressed_variant_given_as_a_run_is_named_as_such(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    variant = tmp_path / "gptq-w4g16"
    (variant / "hf").mkdir(parents=True)
    (variant / "variant.json").write_text("{}")
    assert main(["eval", "smoke", str(variant)]) == 2
    err = capsys.readouterr().err
    assert "is a finished compressed variant, not a training run" in err and "has not finished" not in err


def test_an_interrupt_says_so_and_how_to_resume(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    import flows.cli_scaling

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(flows.cli_scaling, "cmd_fit_scaling", interrupted)
    assert main(["fit-scaling", "table.csv"]) == 130
    assert capsys.readouterr().err.strip() == "lmforge: interrupted; rerun the same command to resume"


def test_job_commands_without_a_cluster_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from infra.services import free_port

    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["jobs", "list", "--address", address]) == 2
    assert main(["submit", "tokenize", "smoke", "--address", address, "--no-follow"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert all(x.startswith(f"lmforge: error: no Ray cluster answers at {address}: ") for x in lines)
    assert all("--address" in x for x in lines)  # the fix


class _Dashboard(http.server.BaseHTTPRequestHandler):
    """What a Ray dashboard whose head has no job agent yet answers: its version, and 500 to a job submission."""

    def do_GET(self) -> None:  # noqa: N802 - the handler's API
        if self.path != "/api/version" or "not-ray" in self.server.server_name:
            self.send_error(404)
            return
        self._answer(200, json.dumps({"version": "4", "ray_version": ray_version(), "ray_commit": ""}))

    def do_POST(self) -> None:  # noqa: N802
        self._answer(500, "No available agent to submit job, please try again later.")

    def _answer(self, status: int, body: str) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        return None


def ray_version() -> str:
    from importlib.metadata import version

    return version("ray")


@pytest.mark.parametrize("answer", ["not ray", "no agent"])
def test_what_a_cluster_refuses_is_one_line(capsys: pytest.CaptureFixture[str], answer: str) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Dashboard)
    server.server_name = "not-ray" if answer == "not ray" else "ray"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert main(["submit", "tokenize", "smoke", "--address", address, "--no-follow"]) == 2
    finally:
        server.shutdown()
    (line,) = capsys.readouterr().err.splitlines()
    if answer == "not ray":
        assert line.startswith(f"lmforge: error: {address} is not a Ray dashboard") and "--address" in line
    else:
        assert (
            f"the Ray cluster at {address} refused the request (Request failed with status code 500" in line
        )
        assert "retry" in line
