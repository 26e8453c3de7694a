"""Evaluation of trained smoke models side by side, the lm-evaluation-harness adapter run through `lm_eval`
itself, the MLflow pyfunc model and registry gates."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from data_pipeline.config import END_OF_TURN
from evaluation.gates import gate_results
from evaluation.lm_eval_adapter import run_lm_eval
from evaluation.model_io import load_for_eval
from evaluation.report import EvalReport, run_eval
from evaluation.scoring import generate_text
from evaluation.tasks import load_task, run_task, stdlib_import_task
from infra.registry import register
from infra.tracking import tracking_uri
from tests.pretrain_helpers import SMOKE_SETTINGS, clean_env, cli, smoke_overrides, with_sets

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def trained(smoke_base, smoke_lora):
    """The session's smoke model and its LoRA fine-tune, evaluated side by side by `lmforge eval`."""
    recipe, base = smoke_base
    examples, lora = smoke_lora
    heldout = Path(examples.path) / "heldout.jsonl"
    sets = with_sets(smoke_overrides(Path(recipe.output_dir), *SMOKE_SETTINGS))
    result = cli("eval", "smoke", base.run_dir, lora.run_dir, "--sft-heldout", str(heldout), *sets)
    assert result.returncode == 0, result.stderr[-3000:]
    path = re.search(r"^report +(\S+)/report.md", result.stdout, re.M).group(1)
    assert "| metric | pretrain | lora |" in result.stdout
    return recipe, base, lora, heldout, EvalReport.load(path)


def test_report_compares_models_side_by_side(trained):
    recipe, base, lora, _, report = trained
    assert list(report.models) == ["pretrain", "lora"]
    from evaluation.heldout import heldout_documents

    held = report.metrics["heldout/all/bits_per_byte"]
    n_bytes = sum(len(d.text.encode()) for d in heldout_documents(recipe.data, recipe.eval.max_documents))
    for name in (
        "pretrain",
        "lora",
    ):  # bits per byte = nats per token x tokens / (ln 2 x bytes), bytes counted here
        assert report.metrics["heldout/all/bytes"][name] == n_bytes
        tokens, loss = report.metrics["heldout/all/tokens"][name], report.metrics["heldout/all/loss"][name]
        assert held[name] == pytest.approx(loss * tokens / (math.log(2) * n_bytes), rel=1e-12)
    loss = report.metrics["heldout/all/loss"]["pretrain"]
    assert report.metrics["heldout/all/perplexity"]["pretrain"] == pytest.approx(math.exp(loss))
    # fine-tuning on the SFT set lowers its held-out response loss
    rl = report.metrics["sft-heldout-em/response_loss"]
    assert rl["lora"] < rl["pretrain"]
    stops = report.metrics["sft-heldout-em/stop_rate"]  # each model's share of held-out prompts it ends
    assert set(stops) == {"pretrain", "lora"} and all(0.0 <= v <= 1.0 for v in stops.values())
    assert report.metrics["lora/mean_effective_rank"]["lora"] <= recipe.sft.lora.r
    assert report.metrics["eval/tokens_per_s"]["pretrain"] > 0
    assert set(report.samples) == {"pretrain", "lora"} and len(report.samples["lora"]) == len(
        recipe.eval.prompts
    )
    out = Path(report.out_dir)
    table = (out / "report.md").read_text()
    assert "| metric | pretrain | lora |" in table and "heldout/all/bits_per_byte" in table
    for name in ("metrics.png", "effective_rank.png", "lora_spectra.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert EvalReport.load(out) == report
    assert run_eval(recipe.eval_spec(), [base, lora], sft_heldout=trained[3]) == report  # cached


def test_evaluation_windows_stay_inside_the_trained_context(trained):
    """The smoke model trains on 64-token windows of a recipe allowing 128: its export says 64 and evaluation
    scores 64-token windows (positions past the trained context score worse, which made held-out numbers
    pessimistic); the LoRA fine-tune trained on 128-token windows, so it is evaluated at 128."""
    recipe, base, lora, _, _ = trained
    assert recipe.model.max_seq_len == 128 and recipe.train.seq_len == 64 and recipe.sft.train.seq_len == 128
    assert load_for_eval(base, "pretrain").max_len == 64
    assert load_for_eval(lora, "lora").max_len == 128


def test_eval_run_is_in_mlflow(trained):
    recipe, _, _, _, report = trained
    client = mlflow.MlflowClient(tracking_uri(recipe.tracking, recipe.output_dir))
    run = client.get_run(report.mlflow_run_id)
    assert run.data.metrics["lora/heldout/all/bits_per_byte"] == pytest.approx(
        report.metrics["heldout/all/bits_per_byte"]["lora"]
    )
    assert {a.path for a in client.list_artifacts(report.mlflow_run_id, "eval")} >= {
        "eval/report.json",
        "eval/report.md",
        "eval/metrics.png",
    }


def mc_task_yaml(path: Path, name: str, data: Path) -> None:
    """An lm-eval multiple-choice task over a JSONL file of {prompt, choices, answer}."""
    path.write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\ndoc_to_choice: "{{choices}}"\n'
        'target_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )


def test_lm_eval_harness_runs_a_local_task_and_agrees_with_ours(trained, tmp_path):
    _, _, lora, _, _ = trained
    items = [
        {"prompt": f"from {m} import", "choices": [" join", " sleep", " dumps_everything"], "answer": i}
        for i, m in enumerate(
            ["os.path", "time", "json"] * 4
        )  # choices of different lengths: acc_norm != acc
    ]
    data = tmp_path / "items.jsonl"
    data.write_text("\n".join(json.dumps({**it, "answer": it["answer"] % 3}) for it in items))
    mc_task_yaml(tmp_path / "stdlib_mc.yaml", "lmforge_stdlib_mc", data)
    recipe = trained[0]  # the report's built-in multiple-choice items, as an lm-eval task too
    report_items = stdlib_import_task(recipe.eval.builtin_questions, seed=recipe.eval.seed).items
    report_data = tmp_path / "report_items.jsonl"
    report_data.write_text(
        "\n".join(
            json.dumps({"prompt": i.prompt, "choices": list(i.choices), "answer": i.answer})
            for i in report_items
        )
    )
    mc_task_yaml(tmp_path / "report_mc.yaml", "lmforge_report_mc", report_data)
    em = load_for_eval(lora, "lora")
    harness = run_lm_eval(em, ["lmforge_stdlib_mc"], str(tmp_path), None, 8)["lmforge_stdlib_mc"]
    ours = run_task(em, load_task(data), batch_size=8, max_new_tokens=4)
    assert harness["acc"] == pytest.approx(ours["acc"])
    assert harness["acc_norm"] == pytest.approx(ours["acc_norm"])  # lm-eval's definition: per character
    assert run_lm_eval(em, ["lmforge_stdlib_mc"], str(tmp_path), None, 8)["lmforge_stdlib_mc"] == harness

    # lm-eval's own command line, with the model registered by the adapter, on the exported model
    export = Path(trained[1].hf_export)  # the pretrained base
    command = [sys.executable, "-m", "evaluation.lm_eval_adapter", "run", "--model", "lmforge"]
    command += ["--model_args", f"pretrained={export}", "--tasks", "lmforge_stdlib_mc"]
    command += ["--include_path", str(tmp_path), "--output_path", str(tmp_path / "cli")]
    result = subprocess.run(command, capture_output=True, text=True, env=clean_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (saved,) = (tmp_path / "cli").rglob("results_*.json")
    assert "acc_norm,none" in json.loads(saved.read_text())["results"]["lmforge_stdlib_mc"]

    # independent of our scorer: lm-eval's own `hf` model on the same export, per request and per metric
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from evaluation.scoring import score_continuations
    from evaluation.tasks import _split_encode

    base = load_for_eval(trained[1], "pretrain")
    hf = simple_evaluate(
        model="hf",
        model_args=f"pretrained={export},dtype=float32,device=cpu",
        tasks=["lmforge_stdlib_mc", "lmforge_report_mc"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        batch_size=8,
        log_samples=True,
    )
    for sample in hf["samples"]["lmforge_stdlib_mc"]:
        item = items[sample["doc_id"]]
        theirs = [float(response[0][0]) for response in sample["resps"]]
        pairs = [_split_encode(base, item["prompt"], choice) for choice in item["choices"]]
        assert theirs == pytest.approx(
            [s.logprob for s in score_continuations(base.model, pairs, 8)], abs=1e-4
        )
    ours_base = run_task(base, load_task(data), batch_size=8, max_new_tokens=4)
    assert hf["results"]["lmforge_stdlib_mc"]["acc,none"] == pytest.approx(ours_base["acc"])
    assert hf["results"]["lmforge_stdlib_mc"]["acc_norm,none"] == pytest.approx(ours_base["acc_norm"])
    # and the report's own built-in task, scored by lm-eval's `hf` model: the report's numbers exactly
    report, n = trained[4], len(report_items)
    for metric in ("acc", "acc_norm"):
        theirs = hf["results"]["lmforge_report_mc"][f"{metric},none"]
        assert report.metrics[f"stdlib-import-mc/{metric}"]["pretrain"] == pytest.approx(theirs, abs=0.1 / n)


def test_pyfunc_model_generates_and_registry_gates(trained):
    recipe, base, lora, _, report = trained
    gates, skipped = gate_results(report, "lora", "pretrain", lora, recipe.eval)
    declared = [g.metric for g in recipe.eval.gates]
    assert list(gates) == ["export_verified", *declared] and skipped == []
    for gate in recipe.eval.gates:  # each declared metric compared with the base in its direction
        ours, theirs = report.value(gate.metric, "lora"), report.value(gate.metric, "pretrain")
        assert gates[gate.metric] == gate.passes(ours, theirs)
    assert gates["sft-heldout-em/response_loss"] is True  # the fine-tune lowered it (asserted above)
    gates = {"export_verified": True, "sft-heldout-em/response_loss": True}  # what the alias test below needs
    version = register(
        recipe.tracking, recipe.output_dir, lora, "lmforge-test", "candidate", gates, report.out_dir
    )
    assert version.alias == "candidate"
    again = register(  # a rerun of a finished pipeline finds the version and reports its alias
        recipe.tracking, recipe.output_dir, lora, "lmforge-test", "candidate", gates, report.out_dir
    )
    assert (again.version, again.alias) == (version.version, "candidate")
    uri = tracking_uri(recipe.tracking, recipe.output_dir)
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model("models:/lmforge-test@candidate")
    outputs = model.predict(["def ", "import os"])
    assert isinstance(outputs, list) and len(outputs) == 2 and all(isinstance(o, str) for o in outputs)
    em = load_for_eval(lora, "lora")
    ours, _ = generate_text(em.model, em.tokenizer.encode("def ").ids, 32, em.tokenizer_ref.eos_id)
    end_of_turn = em.tokenizer.token_to_id(END_OF_TURN)  # the export's generation config stops there too
    ours = ours[: ours.index(end_of_turn) + 1] if end_of_turn in ours else ours
    assert outputs[0] == em.tokenizer.decode(ours)  # the pyfunc (transformers) generates what our model does
    assert model.metadata.signature.params.to_dict()[0]["name"] == "max_new_tokens"
    client = mlflow.MlflowClient(uri)
    assert client.get_model_version("lmforge-test", version.version).tags["gate.export_verified"] == "true"
    assert "eval_report" in {a.path for a in client.list_artifacts(lora.mlflow_run_id)}
    # a failing gate registers a version but moves no alias; an unverified export is never registered
    failed = register(
        recipe.tracking, recipe.output_dir, base, "lmforge-test", "candidate", {"beats_base": False}
    )
    assert failed.alias is None
    assert str(client.get_model_version_by_alias("lmforge-test", "candidate").version) == version.version
    with pytest.raises(ValueError, match="failed verification"):
        register(
            recipe.tracking,
            recipe.output_dir,
            base.model_copy(update={"export_valid": False}),
            "lmforge-test",
            "candidate",
            {},
        )
