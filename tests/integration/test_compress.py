"""The compress stage on the session's fine-tuned smoke model: variants, the frontier (table, plot, nested MLflow
runs), a rerun that is a no-op, the registry's alias on a variant served through MLflow, bad input; and GPTQ
against round-to-nearest on held-out loss of a model trained long enough for quantization to matter."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from data_pipeline.sft import SFTManifest
from flows.registry import resolve
from flows.runner import Direct
from tests.pretrain_helpers import SMOKE_SETTINGS, cli, smoke_overrides, with_sets

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def compress_run(smoke_base, smoke_lora, tmp_path_factory):
    """(recipe, fine-tuned base, variants, frontier, SFT held-out file) in an output directory of its own."""
    recipe, _ = smoke_base
    examples, tuned = smoke_lora
    out = tmp_path_factory.mktemp("compress")
    recipe = recipe.override(*smoke_overrides(out, *SMOKE_SETTINGS))
    heldout = str(Path(examples.path) / "heldout.jsonl")
    made = resolve("compress", recipe, Direct(), {"base": tuned, "sft_data": examples})
    variants, front = made.done["compress"], made.done["frontier"]
    return recipe, tuned, variants, front, heldout


def test_every_variant_is_on_the_frontier(compress_run) -> None:
    recipe, tuned, variants, front, heldout = compress_run
    names = [v.name for v in recipe.compress.variants]
    assert [row["name"] for row in front.rows] == ["uncompressed", *names]
    reference, rows = front.rows[0], {row["name"]: row for row in front.rows[1:]}
    assert reference["disk_bytes"] == sum(
        f.stat().st_size for f in Path(tuned.hf_export).glob("*.safetensors")
    )
    assert all(row["export_valid"] for row in front.rows)
    for name in (
        "int8-weight",
        "int4-g4",
        "rtn-w4g4",
        "gptq-w4g4",
    ):  # quantized: smaller on disk and in memory
        assert rows[name]["size_ratio"] < 0.75 and rows[name]["memory_bytes"] < reference["memory_bytes"]
    unpacked = sum(f.stat().st_size for f in Path(rows["gptq-w4g4"]["hf_export"]).glob("*.safetensors"))
    assert rows["gptq-w4g4"]["disk_bytes"] < 0.8 * unpacked  # 4-bit codes packed (the export holds int8 ones)
    assert rows["magnitude-2of4"]["details"]["density"] == pytest.approx(0.5)
    for row in front.rows:
        m = row["metrics"]
        assert {"heldout/all/loss", "heldout/all/bits_per_byte", "stdlib-import-mc/acc"} <= set(m)
        assert "sft-heldout-em/exact_match" in m and row["generate_tokens_per_s"] > 0
        assert not [k for k in m if k.startswith("favor/")]  # the report's analysis, not a variant's quality
        assert row["relative"]["heldout/all/loss"] == pytest.approx(
            m["heldout/all/loss"] / reference["metrics"]["heldout/all/loss"] - 1
        )
    table = (Path(front.path) / "frontier.md").read_text()
    assert all(f"| {name} |" in table or f"| **{name}** |" in table for name in names)
    assert (Path(front.path) / "frontier.png").stat().st_size > 10_000
    calibration = json.loads((Path(variants.path) / "calibration.json").read_text())
    assert (
        calibration["sequences"] == 8 and calibration["seq_len"] == 128 and len(calibration["sha256"]) == 64
    )
    # a rerun is a no-op: same directories, nothing rebuilt
    again = resolve(
        "compress", recipe, Direct(), {"base": tuned, "sft_data": SFTManifest.load(Path(heldout).parent)}
    ).done
    assert again["compress"].path == variants.path and again["frontier"].path == front.path


def test_mlflow_has_one_nested_run_per_variant(compress_run) -> None:
    from mlflow import MlflowClient

    from infra.tracking import tracking_uri

    recipe, tuned, variants, front, _ = compress_run
    client = MlflowClient(tracking_uri(recipe.tracking, recipe.output_dir))
    parent = client.get_run(front.mlflow_run_id)
    assert (
        parent.data.tags["lmforge.stage"] == "compress"
        and parent.data.tags["lmforge.base_run_id"] == tuned.mlflow_run_id
    )
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "frontier")} >= {
        "frontier/frontier.md",
        "frontier/frontier.png",
    }
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'", max_results=50
    )
    by_name = {run.data.tags["lmforge.variant"]: run for run in children}
    assert set(by_name) == {row["name"] for row in front.rows}
    gptq = by_name["gptq-w4g4"]
    assert gptq.data.params["method"] == "gptq" and gptq.data.params["bits"] == "4"
    assert "relative/heldout/all/bits_per_byte" in gptq.data.metrics
    files = {a.path for a in client.list_artifacts(gptq.info.run_id, "variant")}
    assert {"variant/packed.safetensors", "variant/hf", "variant/variant.json"} <= files


def test_the_smallest_good_variant_is_registered_and_serves(compress_run) -> None:
    import mlflow

    from flows.registration import register_compressed
    from infra.tracking import tracking_uri

    recipe, _, variants, front, _ = compress_run
    loose = front.model_copy(update={"chosen": None})
    assert (
        register_compressed(recipe, loose, variants) is None
    )  # nothing within tolerance: nothing registered
    assert front.chosen is not None
    chosen = front.record(front.chosen)
    fits = [
        r
        for r in front.rows[1:]
        if r["relative"]["heldout/all/loss"] <= front.tolerance and r["export_valid"]
    ]
    # what the registry serves is each variant's Hugging Face export, whatever lmforge itself loads (a low-rank
    # variant's factors, a packed int4 file): its sizes are the export's files, measured here
    for row in front.rows[1:]:
        exported = sum(f.stat().st_size for f in Path(row["hf_export"]).glob("*.safetensors"))
        assert row["served_bytes"] == exported, row["name"]
    lowrank = next(r for r in front.rows if r.get("method") == "lowrank")
    assert lowrank["served_bytes"] != lowrank["disk_bytes"]  # dense in the export, factors on disk
    # chosen by what the registry serves (the Hugging Face export), equal sizes by the lower loss
    smallest = min(r["served_bytes"] for r in fits)
    assert chosen["served_bytes"] == smallest
    tied = [r for r in fits if r["served_bytes"] == smallest]
    assert chosen["relative"]["heldout/all/loss"] == min(r["relative"]["heldout/all/loss"] for r in tied)
    version = register_compressed(recipe, front, variants)
    assert version.alias == "compressed" and all(version.gates.values())
    uri = tracking_uri(recipe.tracking, recipe.output_dir)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    model = mlflow.pyfunc.load_model(f"models:/{version.name}@compressed")
    (text,) = model.predict(["def "], params={"max_new_tokens": 8})
    assert isinstance(text, str)
    again = register_compressed(recipe, front, variants)
    assert again.version == version.version  # registering twice finds the version it made


def test_bad_input_is_refused_in_one_line(compress_run, tmp_path: Path) -> None:
    recipe, tuned, _, _, _ = compress_run
    sets = with_sets(smoke_overrides(Path(recipe.output_dir), *SMOKE_SETTINGS))
    cases = {
        "gptq-w4g32: model.layers.0.mlp.down_proj: group size 32 does not divide its 172 input columns": [
            "--set",
            "compress.variants=[{method: gptq, group_size: 32}]",
        ],
        "the calibration sample needs 100000 windows of the model's 128-token context": [
            "--set",
            "compress.calibration.sequences=100000",
        ],
        "compress.variants.0: 5-bit quantization is not supported": [
            "--set",
            "compress.variants=[{method: rtn, bits: 5}]",
        ],
        "compress.variants.0: pruning sparsity 1.0 is outside [0, 1)": [
            "--set",
            "compress.variants=[{method: wanda, sparsity: 1.0}]",
        ],
    }
    for message, extra in cases.items():
        result = cli("compress", "smoke", "--base", tuned.path, *sets, *extra)
        assert result.returncode == 2, result.stderr[-2000:]
        assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr
    no_export = tmp_path / "run"  # a copy of the run without its export (a copy reads its own files)
    shutil.copytree(tuned.path, no_export, ignore=shutil.ignore_patterns("hf"))
    result = cli("compress", "smoke", "--base", str(no_export), *sets)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"{no_export}/hf" in result.stderr


@pytest.fixture(scope="module")
def trained_small(tokenized):
    """A 2-layer model trained 300 AdamW steps on the small stdlib dataset (where 3-bit weights cost loss),
    with calibration and held-out batches."""
    from data_pipeline.loader import PackedLoader
    from training.model.config import ModelConfig
    from training.model.transformer import Transformer

    data, _ = tokenized
    cfg = ModelConfig(
        vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=128, max_seq_len=64
    )
    model = Transformer(cfg, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in PackedLoader(data, "train", seq_len=64, batch_size=16, seed=0).epoch_batches(300):
        loss = model(batch.inputs, targets=batch.targets).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    calibration = [
        b.inputs for b in PackedLoader(data, "train", seq_len=64, batch_size=8, seed=1).epoch_batches(8)
    ]
    heldout = list(PackedLoader(data, "val", seq_len=64, batch_size=8, shuffle=False).epoch_batches(16))
    return model.eval(), calibration, heldout


@pytest.mark.parametrize("bits", [3, 2])
def test_gptq_beats_round_to_nearest_on_heldout_loss(trained_small, bits: int) -> None:
    from training.compress.model_level import layer_hessians, quantize_model
    from training.model.export import mean_loss

    model, calibration, heldout = trained_small
    full = mean_loss(model, heldout)
    rtn, gptq = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(rtn, "rtn", bits, 16)
    quantize_model(gptq, "gptq", bits, 16, layer_hessians(model, calibration))
    rtn_damage, gptq_damage = mean_loss(rtn, heldout) - full, mean_loss(gptq, heldout) - full
    assert rtn_damage > 0.005  # quantization at this width really costs loss here
    assert gptq_damage < 0.85 * rtn_damage
