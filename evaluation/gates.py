"""Registry gates: the conditions under which a model version gets the `candidate` alias."""

from __future__ import annotations

from evaluation.config import EvalConfig
from evaluation.report import EvalReport
from training.stages.lifecycle import TrainedModel


def gate_results(
    report: EvalReport, candidate: str, base: str | None, ref: TrainedModel, cfg: EvalConfig
) -> tuple[dict[str, bool], list[str]]:
    """(checked gates -> passed, declared gates not checked): `export_verified` always, then each of the
    recipe's gates for the candidate's kind (`eval.dpo_gates` for a preference-tuned model, else `eval.gates`)
    comparing the candidate with its base, when both were measured."""
    gates = {"export_verified": bool(ref.export_valid)}
    skipped = []
    for gate in cfg.gates_for(ref.kind):
        ours = report.value(gate.metric, candidate)
        theirs = report.value(gate.metric, base) if base is not None and base != candidate else None
        if ours is None or theirs is None:
            skipped.append(gate.metric)
        else:
            gates[gate.metric] = gate.passes(ours, theirs)
    return gates, skipped


def describe_gates(gates: dict[str, bool], skipped: list[str]) -> str:
    """One line: which gates were checked and how each went, and which declared ones could not be."""
    line = "checked " + ", ".join(f"{name} {'pass' if ok else 'FAIL'}" for name, ok in gates.items())
    return line + (f"; not checked (not measured): {', '.join(skipped)}" if skipped else "")
