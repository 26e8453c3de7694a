"""What compression costs, against one evaluation pass of the uncompressed model, one JSON line:

- `ratio_compress_vs_eval`: the compress stage's wall time (every variant of the recipe's `compress.variants` made,
  saved, exported and verified; calibration included) over one `evaluate_model` pass of the uncompressed model
  with the recipe's `eval:` settings. The frontier then evaluates each variant once more: its cost is about
  (variants + 1) evaluation passes.
- `gptq_damage_vs_rtn_w4`, `..._w3`: GPTQ's held-out loss increase over round-to-nearest's at the same width and
  group size (< 1: GPTQ loses less).
- per-variant build seconds and the uncompressed evaluation pass in seconds.

Without `--run` it trains a 2-layer model (d_model 64, 300 AdamW steps) on 200 stdlib documents in this process;
with `--run` it compresses that finished run (e.g. the demo's fine-tuned model) with its own tokenized data.

    .venv/bin/python benchmarks/compress_cost.py [--run outputs/sft/<run>] [--recipe demo]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from pathlib import Path

import torch


def small_trained_run(out: Path, recipe) -> tuple:
    """(TrainedModel, tokenized data) of a 2-layer model trained 300 steps, exported with its tokenizer."""
    from data_pipeline.loader import PackedLoader
    from data_pipeline.tokenize import run_tokenize
    from training.model.config import ModelConfig
    from training.model.export import export_hf
    from training.model.transformer import Transformer
    from training.stages.lifecycle import TrainedModel

    data = run_tokenize(recipe.data.model_copy(update={"max_documents": 200}), out)
    cfg = ModelConfig(
        vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=128, max_seq_len=128
    )
    model = Transformer(cfg, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in PackedLoader(data, "train", seq_len=128, batch_size=16, seed=0).epoch_batches(300):
        loss = model(batch.inputs, targets=batch.targets).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    verification = export_hf(model.state_dict(), cfg, data.tokenizer.path, out / "run" / "hf")
    run = TrainedModel(
        path=str(out / "run"),
        kind="pretrain",
        checkpoint="",
        hf_export=str(out / "run" / "hf"),
        export_valid=verification["valid"],
        max_abs_logit_diff=verification["max_abs_logit_diff"],
        step=300,
        final_val_loss=None,
        tokenizer_digest=data.tokenizer.digest,
        mlflow_run_id=None,
        model=cfg.model_dump(),
    )
    return run, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", help="a finished run directory to compress (default: train a small model)")
    parser.add_argument("--recipe", default="demo", help="recipe whose compress: and eval: settings to use")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from data_pipeline.loader import PackedLoader
    from data_pipeline.shards import DatasetManifest
    from data_pipeline.tokenizer import describe
    from evaluation.heldout import heldout_documents
    from evaluation.model_io import EvalModel
    from evaluation.report import build_tasks, evaluate_model
    from flows.recipe import load_recipe
    from training.compress.model_level import layer_hessians, quantize_model
    from training.model.export import mean_loss
    from training.model.hf_interop import load_export
    from training.stages.compress import run_compress
    from training.stages.lifecycle import TrainedModel

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        recipe = load_recipe(args.recipe, [f"output_dir={out}", "tracking.enabled=false"])
        if args.run:
            run = TrainedModel.load(args.run)
            data = DatasetManifest.load(next(Path(run.path).parent.parent.glob("tokenize/*")))
        else:
            run, data = small_trained_run(out, recipe)
        t0 = time.perf_counter()
        compressed = run_compress(recipe.compress_spec(), run, data)
        compress_seconds = time.perf_counter() - t0

        tok = describe(Path(run.hf_export))
        model = load_export(run.hf_export)
        cfg = recipe.eval.model_copy(update={"spectra": False})
        docs, tasks = heldout_documents(recipe.data, cfg.max_documents), build_tasks(cfg, None)
        t0 = time.perf_counter()
        evaluate_model(EvalModel("uncompressed", model, tok.load(), tok, run), cfg, docs, tasks)
        eval_seconds = time.perf_counter() - t0

        context = model.cfg.max_seq_len
        calibration = [
            b.inputs
            for b in PackedLoader(data, "train", seq_len=context, batch_size=8, seed=0).epoch_batches(4)
        ]
        heldout = list(
            PackedLoader(data, "val", seq_len=context, batch_size=8, shuffle=False).epoch_batches(16)
        )
        full = mean_loss(model, heldout)
        hessians = layer_hessians(model, calibration)
        damage = {}
        for bits in (4, 3):
            for method in ("rtn", "gptq"):
                quantized = copy.deepcopy(model)
                quantize_model(quantized, method, bits, 16, hessians if method == "gptq" else None)
                damage[(method, bits)] = mean_loss(quantized, heldout) - full
    print(
        json.dumps(
            {
                "benchmark": "compress_cost",
                "model": "small-trained" if not args.run else args.run,
                "variants": len(compressed.variants),
                "compress_seconds": round(compress_seconds, 2),
                "eval_pass_seconds": round(eval_seconds, 2),
                "ratio_compress_vs_eval": round(compress_seconds / eval_seconds, 3),
                "gptq_damage_vs_rtn_w4": round(damage[("gptq", 4)] / damage[("rtn", 4)], 3),
                "gptq_damage_vs_rtn_w3": round(damage[("gptq", 3)] / damage[("rtn", 3)], 3),
                "heldout_loss": round(full, 4),
                "build_seconds": {v.name: round(v.seconds, 2) for v in compressed.variants},
            }
        )
    )


if __name__ == "__main__":
    main()
