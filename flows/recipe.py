"""A recipe: one YAML file plus `--set a.b=c` overrides, validated once into a frozen pydantic tree.

Cross-slice rules live here (expert parallelism vs experts, batch arithmetic, sequence length vs context);
each slice checks its own fields. Every failure becomes a `ConfigError` with one line per problem that names
the field and the fix, raised before anything runs. The recipe lives at the edge: it composes the per-stage
specs (`pretrain_spec()`, `sft_spec()`, ...) that the libraries receive, and `override()` derives recipes.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from evaluation.config import EvalSpec, FrontierSpec
from infra.config import Change, ConfigError, apply_overrides, parse_override
from infra.tracking import TrackingConfig
from training.compress.config import CompressSpec
from training.config import (
    DistillSpec,
    DPOSpec,
    OptimConfig,
    ParallelConfig,
    PretrainSpec,
    SFTSpec,
    SweepSpec,
    TrainConfig,
    check_batch,
    check_context,
    check_matrix_optimizer,
)
from training.model.config import ModelConfig

__all__ = ["ConfigError", "Recipe", "apply_overrides", "load_recipe", "parse_override", "validate_recipe"]

S = TypeVar("S", bound=BaseModel)
log = logging.getLogger(__name__)
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class RecipeCore(BaseModel):
    """The whole configuration of a pipeline run, less the stages' sections: the model and how pretraining runs
    (its optimiser, run, parallelism, tracking). `Recipe` adds one field per stage section from the registry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    # stage outputs go to <output_dir>/<stage>/<name>-<hash>/: a path, or s3:// gs:// abfs:// (infra/object_store.py);
    # a cluster sets its default once with $LMFORGE_OUTPUT_DIR (docker/compose.yaml points it at the MinIO bucket)
    output_dir: str = Field(default_factory=lambda: os.environ.get("LMFORGE_OUTPUT_DIR") or "outputs")
    model: ModelConfig
    optim: OptimConfig = OptimConfig()
    parallel: ParallelConfig = ParallelConfig()
    train: TrainConfig = TrainConfig()
    tracking: TrackingConfig = TrackingConfig()

    @field_validator("output_dir")
    @classmethod
    def _local_uri_is_a_path(cls, value: str) -> str:
        """`file:///abs` is the local path /abs (it was a relative directory named `file:`)."""
        if value.startswith("file://"):
            path = value.removeprefix("file://")
            if not path.startswith("/"):
                raise ValueError(
                    f"output_dir={value}: a file:// URI needs an absolute path (file:///abs/path)"
                )
            return path
        return value

    @model_validator(mode="after")
    def _check_across_slices(self) -> RecipeCore:
        moe, par = self.model.moe, self.parallel
        if par.ep_size > 1 and moe is None:
            raise ValueError(
                f"parallel.ep_size={par.ep_size} needs MoE layers; set model.moe or parallel.ep_size=1"
            )
        if moe is not None and moe.n_experts % par.ep_size:
            raise ValueError(
                f"parallel.ep_size={par.ep_size} must divide model.moe.n_experts={moe.n_experts} "
                "(each rank holds n_experts/ep_size experts)"
            )
        if moe is not None and par.ep_size > 1 and moe.top_k == 1:
            raise ValueError(
                "parallel.ep_size>1 runs DeepSpeed's MoE layer, whose top-1 gate does not renormalise the routing "
                "weight (ours does); use model.moe.top_k>=2 or parallel.ep_size=1"
            )
        for path, section in self.training_sections():
            optim, at = section.optim, f"{path}optim"
            check_matrix_optimizer(at, optim, par, mup=self.model.mup is not None)
            if optim.name == "muon" and optim.grad_clip > 0 and par.zero_stage >= 1:
                raise ValueError(
                    f"{at}.name=muon with {at}.grad_clip={optim.grad_clip} under ZeRO-{par.zero_stage}: "
                    "DeepSpeed clips Muon's orthogonalised update by its global norm, which shrinks every step (~30x "
                    f"on the smoke model); set {at}.grad_clip=0 (Muon's update has a fixed scale) or "
                    "parallel.zero_stage=0"
                )
            check_batch(section.train, par, f"{path}train")
            check_context(section.train, self.model.max_seq_len, f"{path}train")
        try:
            self.student()
        except ValidationError as error:
            problem = format_validation_error(error).replace("\n", "; ")
            raise ValueError(f"distill.student: {problem}") from None
        if self.data.tokenizer.vocab_size > self.model.vocab_size:
            raise ValueError(
                f"data.tokenizer.vocab_size={self.data.tokenizer.vocab_size} exceeds "
                f"model.vocab_size={self.model.vocab_size}; the embedding must cover every token id"
            )
        return self

    def training_sections(self) -> list[tuple[str, Any]]:
        """(field path prefix, slice with `optim` and `train`): pretraining's (the recipe's own) and every training
        stage's section, so the cross-slice rules reach a new stage's section without being listed here."""
        sections: list[tuple[str, Any]] = [("", self)]
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(getattr(value, "optim", None), OptimConfig) and hasattr(value, "train"):
                sections.append((f"{name}.", value))
        return sections

    # ---- the per-stage specs the libraries receive -----------------------------------------------------

    def spec(self, kind: type[S], **fields: Any) -> S:
        """A stage's spec: `fields` (its recipe section, unpacked) over the recipe's own fields of the same names
        (name, output_dir, parallel, tracking, ...), so no spec repeats a section's fields."""
        shared = {name: getattr(self, name) for name in kind.model_fields if name in type(self).model_fields}
        return kind.model_validate({**shared, **fields})

    def section_spec(self, section: str, kind: type[S]) -> S:
        """The spec of the stage whose recipe section is `section` (e.g. `sft` -> SFTSpec)."""
        return self.spec(kind, **dict(getattr(self, section)))

    def pretrain_spec(self) -> PretrainSpec:
        # the sweep's downstream probe, so the rung is measured like every point
        return self.spec(PretrainSpec, probe=self.sweep.probe)

    def sft_spec(self) -> SFTSpec:
        return self.section_spec("sft", SFTSpec)

    def dpo_spec(self) -> DPOSpec:
        return self.section_spec("dpo", DPOSpec)

    def student(self) -> ModelConfig:
        """The distillation student: the recipe's model with `distill.student`'s changes (`depth` derives the
        widths again)."""
        model = self.model.model_dump(mode="json")
        if "depth" in self.distill.student:
            model = {
                k: v
                for k, v in model.items()
                if k not in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")
            }
        return ModelConfig.model_validate({**model, **self.distill.student})

    def distill_spec(self) -> DistillSpec:
        return self.spec(DistillSpec, **dict(self.distill), model=self.student())

    def sweep_spec(self) -> SweepSpec:
        return self.spec(SweepSpec, base=self.pretrain_spec())

    def eval_spec(self) -> EvalSpec:
        return self.spec(EvalSpec)

    def compress_spec(self) -> CompressSpec:
        return self.spec(CompressSpec)

    def frontier_spec(self) -> FrontierSpec:
        return self.spec(FrontierSpec)

    def override(self, *changes: Change) -> RecipeCore:
        """This recipe with `a.b=c` strings or {"a.b": value} mappings applied, validated again."""
        return validate_recipe(apply_overrides(self.model_dump(mode="json"), changes))

    def digest(self) -> str:
        """sha256 of the canonical JSON of the resolved recipe, less where runs are recorded (used in run tags)."""
        canonical = json.dumps(
            self.model_dump(mode="json", exclude={"tracking"}), sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(canonical.encode()).hexdigest()


def recipe_model() -> type[RecipeCore]:
    """`RecipeCore` plus each stage's recipe section (`data`, `sweep`, `sft`, `dpo`, ...), as the stages declare
    them: a new stage's section needs no edit here."""
    from flows.registry import STAGES

    sections: Any = {}
    for stage in STAGES.values():
        if stage.config is not None and stage.section is not None:
            sections.setdefault(stage.section, (stage.config, stage.config()))
    return create_model("Recipe", __base__=RecipeCore, **sections)


Recipe = recipe_model()


def resolve_recipe_path(recipe: str | Path) -> Path:
    """A path to a YAML file, or the name of one in `configs/` (`demo` -> `configs/demo.yaml`)."""
    path = Path(recipe)
    if path.is_file():
        return path
    named = CONFIG_DIR / f"{recipe}.yaml"
    if named.is_file():
        return named
    available = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(
        f"recipe {str(recipe)!r} is neither a file nor a name in {CONFIG_DIR} (available: {available})"
    )


def format_validation_error(error: ValidationError) -> str:
    """One line per pydantic error: `field.path: what is wrong (and how to fix it)`."""
    lines = []
    for item in error.errors():
        loc = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = _unknown_key_message(error.title, item["loc"])
        elif item["type"] == "missing":
            message = "required field is missing"
        elif "input" in item and item["type"] not in ("value_error", "assertion_error"):
            message = f"{message} (got {item['input']!r})"
        lines.append(f"{loc}: {message}" if loc else message)
    return "\n".join(lines)


def _unknown_key_message(model_name: str, loc: tuple[int | str, ...]) -> str:
    """Name the unknown key and suggest the closest valid ones from the model that rejected it."""
    model: type[BaseModel] | None = Recipe if model_name == "Recipe" else None
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if model else None
        annotation = field.annotation if field else None
        candidates = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type)]
        model = next((a for a in candidates if issubclass(a, BaseModel)), None)
    valid = sorted(model.model_fields) if model else []
    if model is ModelConfig:
        valid += ["depth", "aspect_ratio", "head_dim", "kv_ratio"]
    close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown key{hint} (valid keys: {', '.join(valid)})" if valid else f"unknown key{hint}"


# Recipe sections that were renamed so that each stage has one name everywhere: old name -> new name.
RENAMED_SECTIONS = {"finetune": "sft"}


def renamed_sections(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with old section names moved to their new ones, each named in a deprecation line on stderr. Old
    names win over new ones where both set a field: after a recipe file is renamed, only overrides still use them."""
    for old, new in RENAMED_SECTIONS.items():
        if isinstance(data.get(old), dict):
            log.warning("recipe section %r is now %r; rename it (read as %r this time)", old, new, new)
            data = {k: v for k, v in data.items() if k != old} | {new: merged(data.get(new) or {}, data[old])}
    return data


def merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`, nested mappings merged key by key."""
    out = dict(base)
    for key, value in top.items():
        out[key] = (
            merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def validate_recipe(data: dict[str, Any]) -> Recipe:
    """Validate plain data into a Recipe, turning pydantic's report into a one-line-per-problem ConfigError."""
    try:
        return Recipe.model_validate(renamed_sections(data))
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None


def load_recipe(recipe: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (path or name in configs/), apply `a.b=c` overrides and validate everything once."""
    path = resolve_recipe_path(recipe)
    data = recipe_data(path)
    data.setdefault("name", path.stem)
    return validate_recipe(apply_overrides(renamed_sections(data), overrides or []))


def recipe_data(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe file's mapping; with `base: <recipe>` it is merged over that recipe's (mappings key by key, lists
    and values replaced; the base's name is not inherited)."""
    if path.resolve() in chain:
        loop = " -> ".join(p.name for p in (*chain, path.resolve()))
        raise ConfigError(f"{path}: its bases form a loop ({loop}); remove one `base:`")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({error})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a YAML mapping with sections name, model, optim, ...")
    if "base" not in data:
        return data
    base = data.pop("base")
    if not isinstance(base, str):
        raise ConfigError(
            f"{path}: base must name one recipe (a file or a name in {CONFIG_DIR}), got {base!r}"
        )
    beside = path.parent / base  # a file next to this one, else a path or a name in configs/
    below = recipe_data(beside if beside.is_file() else resolve_recipe_path(base), (*chain, path.resolve()))
    below.pop("name", None)
    return merged(renamed_sections(below), renamed_sections(data))
