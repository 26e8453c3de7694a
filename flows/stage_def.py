"""What a stage of the DAG is, declared once: `StageDef`.

A stage names its recipe section (the pydantic model that is its spec), the stages it needs (by name, under the
role its run function receives them as), how it runs (recipe + inputs + progress -> an artifact), its progress
unit, its headline numbers, what it prints, the outputs it lists and its one-line help. Everything else is
generated from the declarations in `flows/registry.py`: the CLI subcommands, the Prefect flows and deployments,
the pipeline's parameters and its summary. Light to import: the CLI reads declarations before any heavy library.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from pydantic import BaseModel

if TYPE_CHECKING:
    from flows.recipe import Recipe
    from training.stages.lifecycle import TrainedModel

A = TypeVar("A")
Inputs = dict[str, Any]  # role -> the artifact (or list of models) a stage receives
Need = str | tuple[str, ...]  # a stage, or alternatives: the first one that is enabled


@dataclass(frozen=True)
class Toggle:
    """A pipeline switch for an optional stage: a field of the pipeline's parameters (the Prefect form) and a
    `lmforge pipeline` flag (`--<name>`, or `--no-<name>` when it is on by default)."""

    name: str  # the form's field; stages with the same toggle are switched together
    default: bool
    title: str
    description: str
    flag: str = ""  # the CLI flag's stem when it differs from `name`

    @property
    def cli_flag(self) -> str:
        stem = (self.flag or self.name).replace("_", "-")
        return f"--no-{stem}" if self.default else f"--{stem}"


@dataclass(frozen=True)
class Given:
    """A finished run the user may give instead of building one of the stage's needs: `--<flag> DIR` on the CLI
    command, a `<flag>` field of the stage's flow. `load` turns the directory (or URI) into the artifact."""

    flag: str
    role: str
    load: Callable[[Any, Any], Any]  # (a directory or URI, or a list of them when `many`; the output root)
    help: str
    many: bool = False


@dataclass(frozen=True)
class StageDef(Generic[A]):
    """One stage: one name everywhere (module, CLI command, flow, output directory, MLflow run)."""

    name: str
    help: str
    run: Callable[[Recipe, Inputs, Any], A]  # (recipe, inputs by role, progress callback or None) -> artifact
    needs: Mapping[str, Need] = field(default_factory=dict)  # role -> stage (alternatives: the first enabled)
    wants: Mapping[str, str] = field(default_factory=dict)  # role -> stage passed only when it is enabled
    section: str | None = None  # the recipe section that configures it
    config: type[BaseModel] | None = None  # the section's model, on the stage that owns it (a Recipe field)
    progress: Literal["steps", "trials", "items"] | None = None
    total: Callable[[Recipe, Inputs], int | None] | None = None  # steps or items, for progress bars
    check: Callable[[Recipe, Inputs], None] | None = None  # refuse bad input before the progress bar starts
    headline: Callable[[A], dict[str, Any]] | None = None  # published: Prefect artifact, summary
    report: Callable[[Recipe, Inputs, A], str] | None = None  # printed by its command and in the summary
    outputs: Callable[[Recipe, Inputs, A], dict[str, str]] | None = None  # the summary's `Outputs:` lines
    models: Callable[[A], dict[str, TrainedModel]] | None = None  # columns it adds to the evaluation
    collects: bool = False  # receives every enabled stage's models as input `models` (evaluation)
    refine: Callable[[Recipe, Inputs, A], Recipe] | None = (
        None  # the recipe later stages see (the fit sizes it)
    )
    when: Callable[[Recipe], bool] | None = (
        None  # skipped when false, though enabled (a baseline not asked for)
    )
    preflight: Callable[[Recipe], None] | None = None  # checked before anything in a plan runs
    toggle: Toggle | None = None  # optional in the pipeline (None: runs when something needs it)
    given: Given | None = None
    command: bool = True  # a CLI command of its own (helper steps: False)
    flow: bool = True  # a Prefect flow and deployment of its own (helper steps: False)
    tags: tuple[str, ...] = ()  # extra deployment tags (`gpu` for training stages)

    def given_from(self, source: Any, output_dir: Any) -> dict[str, Any]:
        """The finished run the user gave (`--base DIR` on `source`, the parsed flags or the flow's parameters),
        loaded under its role (a Hugging Face model directory imported under `output_dir` first); nothing when the
        stage takes none or none was given."""
        value = getattr(source, self.given.flag, None) if self.given is not None else None
        if self.given is None or not value:
            return {}
        return {self.given.role: self.given.load(value, output_dir)}

    @property
    def cli(self) -> str:
        """The CLI command's name (`fit_scaling` -> `fit-scaling`)."""
        return self.name.replace("_", "-")
