"""How the DAG's stages are called: the `Runner` protocol and `Direct`, the plain in-process runner the Prefect
and CLI runners specialise (a task per call and published artifacts; progress bars). A runner times each stage,
gives it the progress callback its unit asks for (training steps, sweep trials, or items of a list) and publishes
its headline numbers with its MLflow link. Light to import: the CLI loads it before any heavy library.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from infra.ray_cluster import released

if TYPE_CHECKING:
    from flows.recipe import Recipe
    from flows.stage_def import Inputs, StageDef

StepProgress = Callable[[int, float, float], None]  # (step, loss, tokens/s)
TrialProgress = Callable[[int, int, dict[str, Any]], None]  # (finished, total, row)
ItemProgress = Callable[[int, str], None]  # (items finished, the one now starting)


class Runner(Protocol):
    """Calls a stage (cached, timed, with progress) and shows its headline numbers."""

    times: dict[str, float]  # seconds per stage called, in call order

    def __call__(self, stage: StageDef[Any], recipe: Recipe, inputs: Inputs) -> Any: ...


class Direct:
    """Call each stage in this process, print training progress at every tenth of a run and each finished sweep
    trial; publish nothing. The Prefect and CLI runners change what differs."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def __call__(self, stage: StageDef[Any], recipe: Recipe, inputs: Inputs) -> Any:
        started = time.perf_counter()
        artifact = self.call(stage, recipe, inputs)
        self.times[stage.name] = time.perf_counter() - started
        return artifact

    def call(self, stage: StageDef[Any], recipe: Recipe, inputs: Inputs) -> Any:
        """Run the stage and publish its headline numbers (inside the Prefect task, which the artifact joins)."""
        artifact = self.run(stage, recipe, inputs)
        if stage.headline is not None:
            run_id = getattr(artifact, "mlflow_run_id", None)
            self.publish(stage.name, recipe, stage.headline(artifact), run_id)
        return artifact

    def run(self, stage: StageDef[Any], recipe: Recipe, inputs: Inputs) -> Any:
        """Check the inputs (bad settings end in one line before any progress bar starts), then run; a Ray
        instance the stage starts ends with it (`infra.ray_cluster.released`)."""
        if stage.check is not None:
            stage.check(recipe, inputs)
        total = stage.total(recipe, inputs) if stage.total is not None else None
        progress: Any = None
        if stage.progress == "steps":
            progress = self.steps(stage.name, total or 0)
        elif stage.progress == "trials":
            progress = self.trials(stage.name)
        elif stage.progress == "items":
            progress = self.items(stage.name, total)
        with released():
            return stage.run(recipe, inputs, progress)

    def steps(self, name: str, total: int) -> StepProgress | None:
        return every_tenth(total, name)

    def trials(self, name: str) -> TrialProgress | None:
        return print_trial

    def items(self, name: str, total: int | None) -> ItemProgress | None:
        def report(done: int, label: str) -> None:
            print(f"{name} {done}/{total or '?'}: {label}")

        return report if total is not None else None

    def publish(self, stage: str, recipe: Recipe, numbers: dict[str, Any], run_id: str | None = None) -> None:
        pass


def every_tenth(total: int, name: str) -> StepProgress:
    """A training progress callback that prints at every tenth of the run."""
    mark = max(1, total // 10)

    def report(step: int, loss: float, tokens_per_s: float) -> None:
        if step % mark == 0 or step == total:
            print(f"{name} step {step}/{total}: loss {loss:.4f}, {tokens_per_s:,.0f} tokens/s")

    return report


def trial_line(row: dict[str, Any]) -> str:
    """One finished sweep run: size, its largest budget, status and validation loss there."""
    loss = f", val loss {row['loss']:.4f}" if row.get("loss") is not None else ""
    size = (
        f"depth {row.get('depth')} width {row.get('width')}"
        if row.get("width")
        else f"depth {row.get('depth')}"
    )
    return f"{size} C={row.get('budget', 0):.3g} {row.get('status')}{loss}"


def print_trial(done: int, total: int, row: dict[str, Any]) -> None:
    print(f"sweep trial {done}/{total}: {trial_line(row)}")
