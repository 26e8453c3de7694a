"""The `lmforge` command line: a recipe (path or name in configs/) plus `--set a.b=c` overrides per command.

Heavy libraries are imported inside the command that needs them, so `lmforge --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.recipe import ConfigError, apply_overrides, load_recipe, validate_recipe
from flows.runner import Direct, trial_line
from infra.errors import UserError, expected_failure

if TYPE_CHECKING:
    from rich.progress import Progress

    from flows.runner import ItemProgress, StepProgress, TrialProgress
    from training.stage import TrainedModel


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def human_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def cmd_model_summary(args: argparse.Namespace) -> int:
    """Parameters, FLOPs per token and memory per device for a recipe or a Hugging Face config.json."""
    from training.accounting import summarize

    if args.from_hf:
        from training.hf_interop import load_hf_config

        model = load_hf_config(args.from_hf).model_dump(mode="json")
        base = {
            "name": f"hf:{args.from_hf}",
            "model": model,
            "data": {"tokenizer": {"vocab_size": model["vocab_size"]}},
        }
        recipe = validate_recipe(apply_overrides(base, args.set))
    elif args.recipe:
        recipe = load_recipe(args.recipe, args.set)
    else:
        raise ConfigError("give a recipe (path or name in configs/) or --from-hf path/to/config.json")
    par, train = recipe.parallel, recipe.train
    summary = summarize(
        recipe.model,
        precision=par.precision,
        zero_stage=par.zero_stage,
        world_size=par.world_size,
        micro_batch=train.micro_batch_size,
        seq_len=train.seq_len,
        activation_checkpointing=par.activation_checkpointing,
        ep_size=par.ep_size,
        optimizer=recipe.optim.name,
    )
    if args.json:
        print(json.dumps({"recipe": recipe.name, **summary}, indent=2))
    else:
        print_summary(recipe.name, summary)
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    """Stage 1 from the command line: tokenizer, token shards and SFT examples, with a progress bar."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from data_pipeline.tokenize import run_tokenize
    from flows.stages import sft_examples

    recipe = load_recipe(args.recipe, args.set)
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[rate]}"),
    )
    with Progress(*columns, transient=False, console=stderr_console()) as progress:
        task = progress.add_task("tokenizing", total=None, rate="")
        started = time.perf_counter()

        def report(docs: int, tokens: int) -> None:
            rate = tokens / max(time.perf_counter() - started, 1e-9)
            progress.update(
                task, description=f"{docs:,} documents, {tokens:,} tokens", rate=f"{rate:,.0f} tokens/s"
            )

        manifest = run_tokenize(recipe.data, recipe.output_dir, progress=report)
        progress.update(task, description="SFT examples")
        sft = sft_examples(recipe, manifest.tokenizer.path)  # at finetune.train.seq_len, as SFT needs
    print(f"dataset   {manifest.path}")
    for split, info in manifest.splits.items():
        print(
            f"  {split:<5} {info.n_docs:>8,} documents {info.n_tokens:>12,} tokens in {len(info.shards)} shards"
        )
    stats = manifest.read_stats
    print(
        f"  skipped: {stats['empty_skipped']} empty, {stats['bad_records_skipped']} bad records; "
        f"{stats['replaced_bytes']} non-UTF-8 bytes replaced"
    )
    print(
        f"tokenizer {manifest.tokenizer.path} (vocab {manifest.tokenizer.vocab_size}, sha256 {manifest.tokenizer.digest[:16]})"
    )
    print(f"sft       {sft.path} {sft.counts}")
    return 0


def stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


class BarRunner(Direct):
    """The CLI's `Runner`: stages run in this process, each training stage and the sweep with a progress bar."""

    def __init__(self, bar: Progress) -> None:
        self.bar = bar

    def steps(self, name: str, total: int) -> StepProgress:
        task = self.bar.add_task(name, total=total, status="starting")

        def report(step: int, loss: float, tokens_per_s: float) -> None:
            self.bar.update(task, completed=step, status=f"loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s")

        return report

    def trials(self, name: str) -> TrialProgress:
        task = self.bar.add_task(name, total=None, status="")

        def report(done: int, total: int, row: dict[str, Any]) -> None:
            self.bar.update(task, completed=done, total=total, status=trial_line(row))

        return report

    def items(self, name: str, total: int) -> ItemProgress:
        task = self.bar.add_task(name, total=total, status="")

        def report(done: int, label: str) -> None:
            self.bar.update(task, completed=done, status=label)

        return report


@contextmanager
def bar_runner() -> Iterator[BarRunner]:
    """A `BarRunner` whose bars (on stderr) live for the duration of the block."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (
        TextColumn("{task.description}"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=stderr_console()) as bar:
        yield BarRunner(bar)


def cmd_pretrain(args: argparse.Namespace) -> int:
    """Stage 2 from the command line: tokenize (cached), then pretrain with a progress bar."""
    from flows.stages import pretrained

    workers = [f"parallel.world_size={args.workers}"] if args.workers else []
    recipe = load_recipe(args.recipe, [*args.set, *workers])  # validated with the worker count it runs with
    with bar_runner() as run:
        ref = pretrained(recipe, run)
    print(f"run        {ref.path}")
    print(f"checkpoint {ref.checkpoint} (step {ref.step})")
    print(f"val loss   {ref.final_val_loss}")
    print(f"hf export  {ref.hf_export} (verified: {ref.export_valid}, max |Δlogit| {ref.max_abs_logit_diff})")
    print(f"mlflow run {ref.mlflow_run_id}")
    if recipe.tracking.enabled:
        from infra.tracking import tracking_uri

        print(
            f"browse it: .venv/bin/mlflow ui --backend-store-uri {tracking_uri(recipe.tracking, recipe.output_dir)} --port 5000"
        )
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    """Stage 3: fine-tune a pretraining run (given, or this recipe's, trained first if needed), full or LoRA."""
    from flows.stages import finetuned, load_model

    recipe = load_recipe(args.recipe, args.set)
    base = load_model(args.base) if args.base else None
    with bar_runner() as run:
        ref, _ = finetuned(recipe, run, base)
    print_tuned(ref)
    return 0


def cmd_dpo(args: argparse.Namespace) -> int:
    """Preference tuning: pairs, the reference's log-probabilities, DPO from a fine-tuned run (given, or this
    recipe's, trained first if needed)."""
    from flows.stages import load_model, preference_tuned

    recipe = load_recipe(args.recipe, args.set)
    base = load_model(args.base) if args.base else None
    with bar_runner() as run:
        ref, pairs = preference_tuned(recipe, run, base)
    print(f"pairs      {pairs.path} ({', '.join(f'{k} {v}' for k, v in pairs.counts.items())})")
    print_tuned(ref)
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    """Distillation: a student learns from a teacher (a run or a Hugging Face export; default this recipe's
    pretrained model), plus the same student from scratch on the same tokens."""
    from flows.stages import distilled, load_teacher

    recipe = load_recipe(args.recipe, args.set)
    teacher = load_teacher(args.teacher) if args.teacher else None
    with bar_runner() as run:
        student, baseline = distilled(recipe, run, teacher)
    print_tuned(student)
    if baseline is not None:
        print(
            f"baseline   {baseline.path} (the same student from scratch): val loss {baseline.final_val_loss:.4f}"
        )
    return 0


def cmd_compress(args: argparse.Namespace) -> int:
    """Compression: quantized, low-rank and pruned variants of a run (given, or this recipe's fine-tuned model,
    trained first if needed), each evaluated; prints the frontier table."""
    from flows.stages import compressed, load_model

    recipe = load_recipe(args.recipe, args.set)
    base = load_model(args.base) if args.base else None
    with bar_runner() as run:
        variants, front = compressed(recipe, run, base)
    print((Path(front.path) / "frontier.md").read_text())
    print(f"variants   {variants.path}")
    print(f"frontier   {front.path}/frontier.png")
    print(f"mlflow run {front.mlflow_run_id}")
    return 0


def print_tuned(ref: TrainedModel) -> None:
    """A tuned run's directory, origin, headline numbers, adapter and export."""
    origin = f", from {ref.base_run_dir}" if ref.base_run_dir else ""
    print(f"run        {ref.path} ({ref.kind}{origin})")
    for key, value in ref.summary.items():
        print(f"  {key:<36} {value:.4f}")
    if ref.adapter:
        print(f"adapter    {ref.adapter}  (PeftModel.from_pretrained(<base hf export>, adapter))")
    print(f"hf export  {ref.hf_export} (verified: {ref.export_valid})")
    print(f"mlflow run {ref.mlflow_run_id}")


def cmd_lora_merge(args: argparse.Namespace) -> int:
    """Fold a PEFT adapter into its base Hugging Face export and save the merged model."""
    from training.lora import merge_adapter_export

    out = merge_adapter_export(Path(args.adapter), Path(args.out), args.base)
    print(f"merged model: {out}")
    return 0


def cmd_data_inspect(args: argparse.Namespace) -> int:
    """Print a dataset's manifest, a histogram of document lengths and a few decoded documents."""
    import numpy as np

    from data_pipeline.shards import DatasetManifest, ShardReader
    from data_pipeline.tokenizer import describe

    manifest = DatasetManifest.load(args.directory)
    print(json.dumps(manifest.model_dump(mode="json", exclude={"config"}), indent=2)[: args.max_chars])
    reader = ShardReader(manifest, args.split, verify="always")
    lengths = reader.document_lengths()
    print(
        f"\n{args.split}: {len(lengths):,} documents, {reader.n_tokens:,} tokens (all shards verified by sha256)"
    )
    edges = np.unique(np.geomspace(max(1, lengths.min()), lengths.max() + 1, num=12).astype(int))
    counts, _ = np.histogram(lengths, bins=edges)
    width = max(counts.max(), 1)
    for lo, hi, count in zip(edges[:-1], edges[1:], counts, strict=True):
        print(f"  {lo:>8,}-{hi - 1:<8,} tokens {'#' * int(40 * count / width):<40} {count:,}")
    tokenizer = describe(Path(manifest.tokenizer.path)).load()
    ends = np.concatenate([[0], np.cumsum(lengths)])
    for i in range(min(args.samples, len(lengths))):
        text = tokenizer.decode(reader.slice(int(ends[i]), int(min(lengths[i], 80))).tolist())
        print(f"\n--- document {i} ({lengths[i]:,} tokens) ---\n{text}")
    return 0


def print_summary(name: str, summary: dict[str, dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    params, flops = summary["parameters"], summary["flops_per_token"]
    memory, setting = summary["memory_per_device_bytes"], summary["setting"]
    table = Table(title=f"lmforge model summary: {name}", show_header=True, header_style="bold")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for key in ("embedding", "attention", "mlp", "experts", "router", "norms", "lm_head", "total", "active"):
        if params[key] or key in ("total", "active"):
            table.add_row(f"params/{key}", f"{human_count(params[key])}  ({params[key]:,})")
    table.add_section()
    for key, value in flops.items():
        table.add_row(f"flops_per_token/{key}", f"{human_count(value)}FLOP")
    table.add_section()
    described = ", ".join(f"{k}={v}" for k, v in setting.items())
    for key, value in memory.items():
        table.add_row(f"memory_per_device/{key}", human_bytes(value))
    table.add_row(
        "kv_cache (batch 1, max_seq_len)", human_bytes(summary["kv_cache_bytes"]["batch_1_max_seq_len"])
    )
    table.caption = described
    Console().print(table)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmforge", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="inspect model architectures").add_subparsers(
        dest="action", required=True
    )
    summary = model.add_parser(
        "summary", help="parameters, FLOPs and memory per device, from a recipe or HF config"
    )
    summary.add_argument("recipe", nargs="?", help="recipe path or name in configs/ (e.g. demo)")
    summary.add_argument(
        "--from-hf", metavar="CONFIG_JSON", help="a Hugging Face Llama or Mixtral config.json"
    )
    summary.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_set_argument(summary)
    summary.set_defaults(handler=cmd_model_summary)

    tokenize = commands.add_parser(
        "tokenize", help="stage 1: train the tokenizer, write token shards and SFT examples"
    )
    tokenize.add_argument("recipe", help="recipe path or name in configs/")
    add_set_argument(tokenize)
    tokenize.set_defaults(handler=cmd_tokenize)

    pretrain = commands.add_parser("pretrain", help="stage 2: DeepSpeed pretraining (resumes automatically)")
    pretrain.add_argument("recipe", help="recipe path or name in configs/")
    pretrain.add_argument("--workers", type=int, help="Ray Train workers (default: parallel.world_size)")
    add_set_argument(pretrain)
    pretrain.set_defaults(handler=cmd_pretrain)

    sft = commands.add_parser(
        "sft", help="stage 3: supervised fine-tuning, LoRA or full (--set finetune.method=full)"
    )
    sft.add_argument("recipe", help="recipe path or name in configs/")
    sft.add_argument(
        "--base", help="a pretraining run directory (default: this recipe's run, trained if missing)"
    )
    add_set_argument(sft)
    sft.set_defaults(handler=cmd_sft)

    dpo = commands.add_parser(
        "dpo", help="preference tuning (DPO, IPO, hinge, length-normalised) of a fine-tuned model"
    )
    dpo.add_argument("recipe", help="recipe path or name in configs/")
    dpo.add_argument(
        "--base",
        help="a fine-tuned (or pretrained) run directory (default: this recipe's, trained if missing)",
    )
    add_set_argument(dpo)
    dpo.set_defaults(handler=cmd_dpo)

    compress = commands.add_parser(
        "compress",
        help="quantized (torchao, GPTQ), low-rank and pruned variants with a size-quality frontier",
    )
    compress.add_argument("recipe", help="recipe path or name in configs/")
    compress.add_argument(
        "--base",
        help="a finished run directory (default: this recipe's fine-tuned model, trained if missing)",
    )
    add_set_argument(compress)
    compress.set_defaults(handler=cmd_compress)

    distill = commands.add_parser(
        "distill", help="knowledge distillation of a teacher into a smaller student"
    )
    distill.add_argument("recipe", help="recipe path or name in configs/")
    distill.add_argument(
        "--teacher",
        help="an lmforge run directory or a Hugging Face export (default: this recipe's pretrained model)",
    )
    add_set_argument(distill)
    distill.set_defaults(handler=cmd_distill)

    lora = commands.add_parser("lora", help="LoRA adapters").add_subparsers(dest="action", required=True)
    merge = lora.add_parser("merge", help="merge an adapter into its base and save a Hugging Face model")
    merge.add_argument("adapter", help="a PEFT adapter directory")
    merge.add_argument("--out", required=True, help="where to write the merged model")
    merge.add_argument(
        "--base", help="the base Hugging Face model (default: the adapter's base_model_name_or_path)"
    )
    merge.set_defaults(handler=cmd_lora_merge)

    data = commands.add_parser("data", help="inspect datasets").add_subparsers(dest="action", required=True)
    inspect = data.add_parser("inspect", help="manifest, token-length histogram and decoded samples")
    inspect.add_argument("directory", help="a tokenize output directory (holds manifest.json)")
    inspect.add_argument("--split", default="train", choices=["train", "val"])
    inspect.add_argument("--samples", type=int, default=3, help="documents to decode")
    inspect.add_argument("--max-chars", type=int, default=4000, help="truncate the printed manifest")
    inspect.set_defaults(handler=cmd_data_inspect)

    from flows.cli_eval import add_eval_command
    from flows.cli_jobs import add_job_commands
    from flows.cli_scaling import add_scaling_commands
    from flows.cli_services import add_service_commands

    add_scaling_commands(commands, add_set_argument)
    add_service_commands(commands, add_set_argument)
    add_eval_command(commands, add_set_argument)
    add_job_commands(commands, add_set_argument)
    return parser


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set", action="append", default=[], metavar="A.B=VALUE", help="override a recipe field (repeatable)"
    )


# Offline-friendly defaults, unless the user set them: MLflow's telemetry (which logs errors without a network)
# and Ray's usage stats stay off.
QUIET_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true", "RAY_USAGE_STATS_ENABLED": "0"}


def main(argv: Sequence[str] | None = None) -> int:
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except (UserError, ValueError) as error:  # ValueError: the libraries' validation messages
        print(f"lmforge: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if (line := expected_failure(error)) is None or os.environ.get("LMFORGE_DEBUG"):
            raise  # a bug (or LMFORGE_DEBUG set): keep the traceback
        print(f"lmforge: error: {line} (LMFORGE_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        print(f"lmforge: {interrupt or 'interrupted'}; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
