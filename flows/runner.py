"""How the DAG's stages are called: the `Runner` protocol and `Direct`, the plain in-process runner the Prefect
and CLI runners specialise (a task per call and published artifacts; progress bars). Progress comes as training
steps, sweep trials, or items of a list (compressed variants, evaluated models). Light to import: the CLI
loads it before any heavy library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from flows.recipe import Recipe

T = TypeVar("T")
StepProgress = Callable[[int, float, float], None]  # (step, loss, tokens/s)
TrialProgress = Callable[[int, int, dict[str, Any]], None]  # (finished, total, row)
ItemProgress = Callable[[int, str], None]  # (items finished, the one now starting)


class Runner(Protocol):
    """How each stage is called and how its headline numbers are shown."""

    def __call__(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T: ...

    def steps(self, name: str, total: int) -> StepProgress | None: ...

    def trials(self, name: str) -> TrialProgress | None: ...

    def items(self, name: str, total: int) -> ItemProgress | None: ...

    def publish(
        self, stage: str, recipe: Recipe, numbers: dict[str, Any], run_id: str | None = None
    ) -> None: ...


class Direct:
    """Call each stage in this process, print training progress at every tenth of a run and each finished sweep
    trial; publish nothing. The Prefect and CLI runners change what differs."""

    def __call__(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return fn(*args, **kwargs)

    def steps(self, name: str, total: int) -> StepProgress | None:
        return every_tenth(total, name)

    def trials(self, name: str) -> TrialProgress | None:
        return print_trial

    def items(self, name: str, total: int) -> ItemProgress | None:
        def report(done: int, label: str) -> None:
            print(f"{name} {done}/{total}: {label}")

        return report

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
