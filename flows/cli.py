"""The `lmforge` command line: a recipe (path or name in configs/) plus `--set a.b=c` overrides per command.

Heavy libraries are imported inside the command that needs them, so `lmforge --help` stays instant.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from flows.logs import show_lmforge_logs
from flows.recipe import ConfigError, apply_overrides, format_validation_error, load_recipe, validate_recipe
from infra.allocator import keep_freed_memory
from infra.errors import UserError, expected_failure

if TYPE_CHECKING:
    pass


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
    from training.model.accounting import summarize

    if args.from_hf:
        from training.model.hf_interop import load_hf_config

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


def cmd_lora_merge(args: argparse.Namespace) -> int:
    """Fold a PEFT adapter into its base Hugging Face export and save the merged model."""
    from training.model.lora import merge_adapter_export

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
    from flows.cli_stages import add_stage_commands

    add_stage_commands(commands, add_set_argument)
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


def one_line(error: Exception) -> str:
    """The error's message on one line: a pydantic validation error (the pipeline's parameters, a stage's spec) as
    `field: what is wrong (got value)`, several joined by semicolons."""
    if isinstance(error, ValidationError):
        return format_validation_error(error).replace("\n", "; ")
    return str(error)


def main(argv: Sequence[str] | None = None) -> int:
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        show_lmforge_logs()
        return handler(args)
    except (UserError, ValueError) as error:  # ValueError: the libraries' validation messages
        print(f"lmforge: error: {one_line(error)}", file=sys.stderr)
        return 2
    except Exception as error:
        if (line := expected_failure(error)) is None or os.environ.get("LMFORGE_DEBUG"):
            raise  # a bug (or LMFORGE_DEBUG set): keep the traceback
        print(f"lmforge: error: {line} (LMFORGE_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        print(
            f"lmforge: {str(interrupt) or 'interrupted'}; rerun the same command to resume", file=sys.stderr
        )
        return 130


def console() -> None:
    """The `lmforge` executable: `main`, then what the interpreter does at exit up to its teardown (wait for
    non-daemon threads, run the exit handlers: MLflow, Ray and Prefect shutdown, logging's flush; flush the
    standard streams), then end the process. Tearing down every imported module one by one (torch, DeepSpeed,
    transformers) took ~2 s of each training command's exit here and does nothing a finished command needs.
    A traceback (a bug) or argparse's exit take the normal path. Large blocks are kept by the allocator
    (`infra.allocator`)."""
    keep_freed_memory()
    code = main()
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx runs first
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    console()
