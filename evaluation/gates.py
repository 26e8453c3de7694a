"""Registry gates: the conditions under which a model version gets the `candidate` alias."""

from __future__ import annotations

from evaluation.config import EvalConfig
from evaluation.report import EvalReport
from training.stage import TrainedModel


def gate_results(
    report: EvalReport, candidate: str, base: str | None, ref: TrainedModel, cfg: EvalConfig
) -> dict[str, bool]:
    """export_verified always; beats_base (SFT held-out response loss, else held-out text loss) when configured."""
    gates = {"export_verified": bool(ref.export_valid)}
    if cfg.gate_below_base and base is not None and base != candidate:
        for metric in ("sft-heldout-em/response_loss", "heldout/all/loss"):
            ours, theirs = report.value(metric, candidate), report.value(metric, base)
            if ours is not None and theirs is not None:
                gates[f"beats_base:{metric}"] = ours < theirs
                break
    return gates
