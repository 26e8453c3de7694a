"""The stage registry and its resolver: the only list of lmforge's stages, and the one walk over their needs.

`STAGES` holds every `StageDef` in the DAG's order. `plan(targets, recipe, runner)` enables the targets and,
transitively, what they need (alternatives resolve to the first enabled stage, else the first one that is on by
default), then `Plan.get(name)` builds each stage once, depth first, through the `Runner` (which caches, times,
shows progress and publishes). The CLI subcommands, the Prefect flows and deployments, the pipeline's parameters
and its summary are all generated from `STAGES`; a stage declared elsewhere joins them with `declare`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from flows.stage_def import Inputs, Need, StageDef, Toggle
from flows.stages import compress, distill, dpo, evaluate, pretrain, reward_model, rl, scaling, sft, tokenize

if TYPE_CHECKING:
    from flows.recipe import Recipe
    from flows.runner import Runner

STAGES: dict[str, StageDef[Any]] = {
    stage.name: stage
    for stage in (
        tokenize.TOKENIZE,
        scaling.SWEEP,
        scaling.FIT,
        pretrain.PRETRAIN,
        scaling.RUNG,
        sft.SFT_DATA,
        sft.SFT,
        dpo.PREFERENCE_DATA,
        dpo.REFERENCE_LOGPS,
        dpo.DPO,
        reward_model.REWARD_MODEL,
        rl.RL_PROMPTS,
        rl.RL,
        distill.DISTILL,
        distill.STUDENT_BASELINE,
        evaluate.EVAL,
        compress.COMPRESS,
        compress.FRONTIER,
        evaluate.REGISTER,
    )
}


@contextmanager
def declared(stage: StageDef[Any], after: str | None = None) -> Iterator[StageDef[Any]]:
    """`stage` in the registry (after stage `after`, default last) for the duration of the block."""
    if stage.name in STAGES:
        raise ValueError(f"a stage named {stage.name!r} is declared already")
    saved = dict(STAGES)
    order = list(saved.items())
    at = len(order) if after is None else [name for name, _ in order].index(after) + 1
    order.insert(at, (stage.name, stage))
    STAGES.clear()
    STAGES.update(order)
    try:
        yield stage
    finally:
        STAGES.clear()
        STAGES.update(saved)


def toggles() -> dict[str, Toggle]:
    """The pipeline's switches by name, in DAG order (stages sharing one, like compress and its frontier, once)."""
    found: dict[str, Toggle] = {}
    for stage in STAGES.values():
        if stage.toggle is not None:
            found.setdefault(stage.toggle.name, stage.toggle)
    return found


def on_by_default(name: str) -> bool:
    toggle = STAGES[name].toggle
    return toggle is None or toggle.default


def pick(need: Need, enabled: Iterable[str]) -> str:
    """The stage a need resolves to: itself, or of alternatives the first enabled, else the first on by default."""
    if isinstance(need, str):
        return need
    enabled = set(enabled)
    return next((n for n in need if n in enabled), None) or next(n for n in need if on_by_default(n))


def enable(targets: Iterable[str], given: Iterable[str] = ()) -> set[str]:
    """The targets and everything they need, transitively; `given` stages are supplied, so their own needs are
    not. A target's toggle brings the stages that share it (compress brings its frontier)."""
    unknown = [t for t in targets if t not in STAGES]
    if unknown:
        raise ValueError(f"no stage named {unknown}; stages: {', '.join(STAGES)}")
    enabled = set(targets)
    for target in list(enabled):
        toggle = STAGES[target].toggle
        if toggle is not None:
            enabled |= {
                s.name for s in STAGES.values() if s.toggle is not None and s.toggle.name == toggle.name
            }
    given = set(given)
    enabled |= given
    pending = [n for n in enabled if n not in given]
    while pending:
        for need in STAGES[pending.pop()].needs.values():
            name = pick(need, enabled)
            if name not in enabled:
                enabled.add(name)
                pending.append(name)
    return enabled


def preflight(recipe: Recipe, enabled: Iterable[str]) -> None:
    """Refuse, before anything runs, a recipe an enabled stage cannot take (one line naming the fix)."""
    for name in enabled:
        check = STAGES[name].preflight
        if check is not None:
            check(recipe)


class Plan:
    """Builds enabled stages on demand, each once, and remembers what they made and with which recipe."""

    def __init__(
        self, recipe: Recipe, runner: Runner, enabled: set[str], given: Mapping[str, Any] | None = None
    ) -> None:
        self.recipe = recipe  # refined by stages that size later ones (the fit)
        self.runner = runner
        self.enabled = enabled
        self.done: dict[str, Any] = dict(given or {})
        self.ran: dict[str, tuple[Recipe, Inputs]] = {}
        preflight(recipe, enabled)

    def skipped(self, name: str) -> bool:
        when = STAGES[name].when
        return name not in self.enabled or (when is not None and not when(self.recipe))

    def get(self, name: str) -> Any:
        """The stage's artifact, building what it needs first."""
        if name in self.done:
            return self.done[name]
        stage = STAGES[name]
        inputs: Inputs = {role: self.get(pick(need, self.enabled)) for role, need in stage.needs.items()}
        inputs |= {role: self.get(want) for role, want in stage.wants.items() if not self.skipped(want)}
        if stage.collects:  # the models given (`lmforge eval RUN ...`), else every enabled stage's
            inputs["models"] = self.done["models"] if "models" in self.done else self.models()
        recipe = self.recipe
        artifact = self.runner(stage, recipe, inputs)
        if stage.refine is not None:
            self.recipe = stage.refine(recipe, inputs, artifact)
        self.done[name] = artifact
        self.ran[name] = (recipe, inputs)
        return artifact

    def models(self) -> list[tuple[str, Any]]:
        """(column name, model) of every enabled stage that makes models, in DAG order."""
        columns = []
        for stage in STAGES.values():
            if stage.models is not None and not self.skipped(stage.name):
                columns += list(stage.models(self.get(stage.name)).items())
        return columns

    def run(self, targets: Iterable[str] | None = None) -> None:
        """Build `targets` (default: every enabled stage), in DAG order."""
        wanted = set(self.enabled if targets is None else targets)
        for name in STAGES:
            if name in wanted and not self.skipped(name):
                self.get(name)

    def summary(self) -> dict[str, Any]:
        """What each stage that ran reports (headline numbers, printed text), the outputs, the stage times."""
        headlines, reports, outputs = {}, {}, {}
        for name, (recipe, inputs) in self.ran.items():
            stage, artifact = STAGES[name], self.done[name]
            if stage.headline is not None:
                headlines[name] = stage.headline(artifact)
            if stage.report is not None:
                reports[name] = stage.report(recipe, inputs, artifact)
            if stage.outputs is not None:
                outputs |= stage.outputs(recipe, inputs, artifact)
        return {
            "stages": headlines,
            "reports": reports,
            "outputs": outputs,
            "stage_seconds": dict(self.runner.times),
        }


def plan(
    targets: Iterable[str], recipe: Recipe, runner: Runner, given: Mapping[str, Any] | None = None
) -> Plan:
    """A plan for `targets` and what they need. `given` supplies finished artifacts instead of building them, by a
    target's role (`base`, `teacher`; `models` for the evaluation) or by stage name (`sft_data`)."""
    from flows.stages.runs import in_model_tokens

    targets = list(targets)
    recipe = in_model_tokens(recipe, given or {})
    unsupplied = enable(targets)
    by_stage: dict[str, Any] = {}
    for role, artifact in (given or {}).items():
        owner = next((STAGES[t] for t in targets if role in STAGES[t].needs), None)
        if owner is not None:
            by_stage[pick(owner.needs[role], unsupplied)] = artifact
        else:  # a stage by name, or a collecting stage's models
            by_stage[role] = artifact
    return Plan(recipe, runner, enable(targets, [s for s in by_stage if s in STAGES]), by_stage)


def resolve(target: str, recipe: Recipe, runner: Runner, given: Mapping[str, Any] | None = None) -> Plan:
    """Build `target` (and the stages sharing its toggle) with everything they need; the plan holds the results."""
    made = plan([target], recipe, runner, given)
    made.run(name for name in made.enabled if name == target or shares_toggle(name, target))
    return made


def shares_toggle(name: str, target: str) -> bool:
    toggle, other = STAGES[name].toggle, STAGES[target].toggle
    return toggle is not None and other is not None and toggle.name == other.name


SPINE = ("pretrain", "eval")  # raw text to an evaluated model, whatever else is switched on


def pipeline_stages(switches: Mapping[str, bool], size: str) -> set[str]:
    """The pipeline's targets: its spine, every switched-on stage and, when the fit sizes the model, the rung."""
    on = {
        s.name
        for s in STAGES.values()
        if s.toggle is not None and switches.get(s.toggle.name, s.toggle.default)
    }
    return on | set(SPINE) | ({"rung"} if size == "fit" else set())


def pipeline(
    recipe: Recipe,
    switches: Mapping[str, bool],
    size: str,
    runner: Runner,
    on_data: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Raw text to an evaluated, registered model: every enabled stage in DAG order; returns the summary.
    `on_data` sees the token shards as soon as they exist (the pipeline flow logs them as an MLflow input)."""
    made = plan(pipeline_stages(switches, size), recipe, runner)
    data = made.get("tokenize")
    if on_data is not None:
        on_data(data)
    made.run()
    return made.summary()
