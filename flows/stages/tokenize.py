"""Stage 1, `tokenize`: documents -> byte-level BPE tokenizer -> Arrow token shards (the recipe's `data:`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from data_pipeline.config import DataConfig
from flows.stage_def import Inputs, StageDef

if TYPE_CHECKING:
    from data_pipeline.shards import DatasetManifest
    from flows.recipe import Recipe
    from flows.runner import ItemProgress


def run(recipe: Recipe, inputs: Inputs, progress: ItemProgress | None) -> DatasetManifest:
    from data_pipeline.tokenize import run_tokenize
    from flows.lineage import record_tokenize

    def report(docs: int, tokens: int) -> None:
        if progress is not None:
            progress(docs, f"{tokens:,} tokens")

    data = run_tokenize(recipe.data, recipe.output_dir, progress=report)
    record_tokenize(recipe, data)
    return data


def check_sources(recipe: Recipe) -> None:
    from data_pipeline.sources import check_local_sources

    check_local_sources(recipe.data)


def headline(data: DatasetManifest) -> dict[str, Any]:
    train, val = data.splits["train"], data.splits["val"]
    return {"tokens (train)": train.n_tokens, "tokens (val)": val.n_tokens, "directory": data.path}


def report(recipe: Recipe, inputs: Inputs, data: DatasetManifest) -> str:
    lines = [f"dataset   {data.path}"]
    for split, info in data.splits.items():
        lines.append(
            f"  {split:<5} {info.n_docs:>8,} documents {info.n_tokens:>12,} tokens in {len(info.shards)} shards"
        )
    stats, tok = data.read_stats, data.tokenizer
    lines.append(
        f"  skipped: {stats['empty_skipped']} empty, {stats['bad_records_skipped']} bad records; "
        f"{stats['replaced_bytes']} non-UTF-8 bytes replaced"
    )
    lines.append(f"tokenizer {tok.path} (vocab {tok.vocab_size}, sha256 {tok.digest[:16]})")
    return "\n".join(lines)


TOKENIZE: StageDef[DatasetManifest] = StageDef(
    name="tokenize",
    help="stage 1: train the tokenizer and write token shards",
    run=run,
    section="data",
    config=DataConfig,
    progress="items",
    preflight=check_sources,
    headline=headline,
    report=report,
    outputs=lambda recipe, inputs, data: {"token shards": data.path},
)
