"""The `lmforge` command line: a recipe (path or name in configs/) plus `--set a.b=c` overrides per command.

Heavy libraries are imported inside the command that needs them, so `lmforge --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from flows.recipe import ConfigError, apply_overrides, load_recipe, validate_recipe


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
    )
    if args.json:
        print(json.dumps({"recipe": recipe.name, **summary}, indent=2))
    else:
        print_summary(recipe.name, summary)
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
    return parser


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set", action="append", default=[], metavar="A.B=VALUE", help="override a recipe field (repeatable)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except (ConfigError, ValueError) as error:
        print(f"lmforge: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
