"""`compress`: quantized (torchao int8/int4, RTN, GPTQ), low-rank and pruned variants of the last tuned model
(the recipe's `compress:`), each exported and verified; `frontier` evaluates every variant against the
uncompressed model and picks the smallest within tolerance (the register stage registers it)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.stage_def import Given, Inputs, StageDef, Toggle
from flows.stages.evaluate import needs_llama_layout
from flows.stages.runs import load_model
from flows.stages.sft import heldout
from training.compress.config import CompressConfig

if TYPE_CHECKING:
    from evaluation.frontier import Frontier
    from flows.recipe import Recipe
    from flows.runner import ItemProgress
    from training.stages.compress import Compressed

COMPRESSING = Toggle(
    "compress",
    False,
    "Compress",
    "quantize (torchao int8/int4, GPTQ), factorise and prune the final model (compress.variants), evaluate every "
    "variant and register the smallest within compress.tolerance under compress.alias",
)
BASE = ("rl", "dpo", "sft", "pretrain")  # the model the registry takes


def check(recipe: Recipe, inputs: Inputs) -> None:
    from training.stages.compress import check

    check(recipe.compress_spec(), inputs["base"], inputs["data"])


def run(recipe: Recipe, inputs: Inputs, progress: ItemProgress | None) -> Compressed:
    from training.stages.compress import run_compress

    return run_compress(recipe.compress_spec(), inputs["base"], inputs["data"], progress=progress)


COMPRESS: StageDef[Compressed] = StageDef(
    name="compress",
    help="quantized (torchao, GPTQ), low-rank and pruned variants with a size-quality frontier",
    run=run,
    needs={"base": BASE, "data": "tokenize"},
    section="compress",
    config=CompressConfig,
    progress="items",
    total=lambda recipe, inputs: len(recipe.compress.variants),
    check=check,
    outputs=lambda recipe, inputs, variants: {"compressed variants": variants.path},
    preflight=needs_llama_layout("compress"),
    toggle=COMPRESSING,
    given=Given(
        "base", "base", load_model, "a finished run directory (default: this recipe's fine-tuned model)"
    ),
)


def run_frontier(recipe: Recipe, inputs: Inputs, progress: ItemProgress | None) -> Frontier:
    from evaluation.frontier import run_frontier

    sft = heldout(inputs["sft_data"]) if "sft_data" in inputs else None
    return run_frontier(recipe.frontier_spec(), inputs["variants"], inputs["base"], sft, progress=progress)


def frontier_headline(front: Frontier) -> dict[str, Any]:
    """Each variant's size ratio and held-out bits-per-byte change, and the registrable one."""
    from evaluation.config import BPB

    numbers: dict[str, Any] = {
        row["name"]: f"{row['served_ratio']:.2f}x served ({row['size_ratio']:.2f}x stored), "
        f"{100 * row['relative'].get(BPB, 0.0):+.2f}% bits/byte"
        for row in front.rows[1:]
    }
    return {**numbers, "chosen (within tolerance)": front.chosen or "none"}


def frontier_report(recipe: Recipe, inputs: Inputs, front: Frontier) -> str:
    table = (Path(front.path) / "frontier.md").read_text()
    return f"{table}\nfrontier   {front.path}/frontier.png\nmlflow run {front.mlflow_run_id}"


FRONTIER: StageDef[Frontier] = StageDef(
    name="frontier",
    help="every compressed variant evaluated against the uncompressed model: the size-quality frontier",
    run=run_frontier,
    needs={"variants": "compress", "base": BASE},
    wants={"sft_data": "sft_data"},
    section="compress",
    progress="items",
    total=lambda recipe, inputs: len(inputs["variants"].variants) + 1,
    headline=frontier_headline,
    report=frontier_report,
    outputs=lambda recipe, inputs, front: {"frontier": str(Path(front.path) / "frontier.md")},
    toggle=COMPRESSING,
    command=False,
    flow=False,
)
