"""Finished runs: those a user gives instead of having a stage build them (`--base DIR`, `--teacher DIR`,
`eval RUN ...`), each loaded or refused in one line naming the fix; a Hugging Face model directory is imported as
a run first (`training/stages/imported.py`); and how a trained run is described."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.config import ConfigError
from infra.object_store import is_remote
from training.compress.config import VARIANT_FILE

if TYPE_CHECKING:
    from flows.recipe import Recipe
    from training.stages.lifecycle import TrainedModel


def load_model(run_dir: str | Path, output_dir: str | Path) -> TrainedModel:
    """A finished, intact training run by directory, or a Hugging Face model directory imported as one under
    `output_dir`; one line naming the fix when it is missing, unfinished, damaged or not representable. An
    object-store URI of a run, or of a model directory, is pulled to this node first."""
    from infra.mirror import local_path, pull_plain
    from infra.object_store import open_store
    from training.model.checkpoint_files import refuse_gguf
    from training.stages.imported import is_hf_directory, run_import
    from training.stages.lifecycle import TrainedModel

    if is_remote(run_dir) and is_remote_hf_directory(str(run_dir)):
        local = pull_plain(open_store(str(run_dir)), local_path(str(run_dir)))
        return run_import(local, output_dir, origin=str(run_dir))
    if not is_remote(run_dir):
        refuse_gguf(Path(run_dir))
    if not is_remote(run_dir) and not Path(run_dir).is_dir():
        raise ConfigError(
            f"{run_dir}: no such run directory; give a training run's directory (outputs/<stage>/<name>-<hash>) "
            "or a Hugging Face model directory"
        )
    if not is_remote(run_dir) and is_hf_directory(run_dir):
        return run_import(run_dir, output_dir)
    if not is_remote(run_dir) and (Path(run_dir) / VARIANT_FILE).is_file():
        raise ConfigError(
            f"{run_dir} is a finished compressed variant, not a training run: give a training run's directory "
            "(outputs/<stage>/<name>-<hash>); the variant's hf/ export loads in transformers (with torchao), and "
            "the compress stage's frontier evaluates it"
        )
    return TrainedModel.load(run_dir)


def init_model(recipe: Recipe) -> TrainedModel | None:
    """`pretrain.init_from` as a finished run (a Hugging Face directory imported once), or None."""
    source = recipe.pretrain.init_from
    return None if source is None else load_model(source, recipe.output_dir)


def in_model_tokens(recipe: Recipe, given: Mapping[str, Any]) -> Recipe:
    """The recipe with `data.tokenizer.path` at the tokenizer of the model it starts from, when it names none:
    `pretrain.init_from`'s, or a given model's that came from a Hugging Face directory (`source_model`). Continued
    pretraining, SFT's replay windows and the evaluation's held-out text then read the corpus in the model's own
    tokens."""
    if recipe.data.tokenizer.path is not None:
        return recipe
    models = [init_model(recipe)]
    for value in given.values():
        for item in value if isinstance(value, list) else [value]:
            model = item[1] if isinstance(item, tuple) else item  # the evaluation's (name, model) pairs
            models.append(model if getattr(model, "source_model", None) else None)
    model = next((m for m in models if m is not None), None)
    return recipe if model is None else recipe.override({"data.tokenizer.path": exported(model)})


def is_remote_hf_directory(uri: str) -> bool:
    """An object-store URI of a Hugging Face model directory (a config.json, no lmforge manifest)."""
    from infra.object_store import open_store

    store = open_store(uri)
    return store.size("config.json") is not None and store.size("manifest.json") is None


def load_models(run_dirs: Sequence[str], output_dir: str | Path) -> list[tuple[str, TrainedModel]]:
    """Finished runs (or Hugging Face directories), each named by its kind (the evaluation's columns)."""
    models = [load_model(run, output_dir) for run in run_dirs]
    return [(model.kind, model) for model in models]


def load_teacher(source: str | Path, output_dir: str | Path) -> Any:
    """A distillation teacher: a finished lmforge run directory, or a Hugging Face model directory (checked as an
    import is, read in place)."""
    from training.stages.distill import teacher_from_export
    from training.stages.imported import check_source, is_hf_directory

    if (Path(source) / "manifest.json").is_file():
        return load_model(source, output_dir)
    if is_hf_directory(source):
        check_source(Path(source))
    return teacher_from_export(source)


def exported(model: TrainedModel) -> str:
    """The run's Hugging Face export (its tokenizer files too), or one line naming the fix."""
    if not Path(model.hf_export).is_dir():
        raise ConfigError(
            f"{model.path} has no Hugging Face export (and so no tokenizer files) to start from; rerun its "
            "stage to export it"
        )
    return model.hf_export


def describe_tuned(model: TrainedModel) -> str:
    """A tuned run's directory, origin, headline numbers, adapter and export."""
    origin = f", from {model.base_run_dir}" if model.base_run_dir else ""
    lines = [f"run        {model.path} ({model.kind}{origin})"]
    lines += [
        f"  {key:<36} {value:,.0f}" if key.endswith("_params") else f"  {key:<36} {value:.4f}"
        for key, value in model.summary.items()
    ]
    if model.adapter:
        lines.append(f"adapter    {model.adapter}  (PeftModel.from_pretrained(<base hf export>, adapter))")
    lines.append(f"hf export  {model.hf_export} (verified: {model.export_valid})")
    lines.append(f"mlflow run {model.mlflow_run_id}")
    return "\n".join(lines)
