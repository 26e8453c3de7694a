"""The CLI's `Runner`: stages run in this process, each with a progress bar on stderr in its unit (training
steps, sweep trials, items such as documents or compressed variants)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from flows.runner import Direct, ItemProgress, StepProgress, TrialProgress, trial_line

if TYPE_CHECKING:
    from rich.progress import Progress


def stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


class BarRunner(Direct):
    """A `Direct` runner whose progress callbacks drive rich progress bars. A bar appears at a stage's first
    progress report, so a finished (cached) stage, or one refused before it starts, shows none."""

    def __init__(self, bar: Progress) -> None:
        super().__init__()
        self.bar = bar

    def task(self, name: str, total: int | None) -> Callable[..., None]:
        """`update(**fields)` of a bar added on its first call."""
        task: list[Any] = []

        def update(**fields: Any) -> None:
            if not task:
                task.append(self.bar.add_task(name, total=total, status=""))
            self.bar.update(task[0], **fields)

        return update

    def steps(self, name: str, total: int) -> StepProgress:
        update = self.task(name, total)

        def report(step: int, loss: float, tokens_per_s: float) -> None:
            update(completed=step, status=f"loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s")

        return report

    def trials(self, name: str) -> TrialProgress:
        update = self.task(name, None)

        def report(done: int, total: int, row: dict[str, Any]) -> None:
            update(completed=done, total=total, status=trial_line(row))

        return report

    def items(self, name: str, total: int | None) -> ItemProgress:
        update = self.task(name, total)

        def report(done: int, label: str) -> None:
            update(completed=done, status=label)

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
