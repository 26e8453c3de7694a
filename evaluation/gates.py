"""Registry gates: the conditions under which a model version gets the `candidate` alias."""

from __future__ import annotations

from evaluation.config import EvalConfig
from evaluation.report import EvalReport
from training.stages.lifecycle import TrainedModel


def gate_results(
    report: EvalReport, candidate: str, base: str | None, ref: TrainedModel, cfg: EvalConfig
) -> tuple[dict[str, bool], list[str]]:
    """(checked gates -> passed, declared gates not checked): `export_verified` always, then each of the
    recipe's gates for the candidate's kind (`eval.dpo_gates` for a preference-tuned model, `eval.rl_gates` for an
    RL one, else `eval.gates`) comparing the candidate with its base, when both were measured; then the same for
    every tuned model before it on its lineage that the report scored with its own base (`<model> vs <base>/` in
    front of the metric), so a stage that forgot is not passed on by a later one gated only against it."""
    gates = {"export_verified": bool(ref.export_valid)}
    skipped: list[str] = []
    pairs = [(candidate, base, ref.kind, "")]
    model, seen = base, {candidate}
    while model in report.models and model not in seen:
        seen.add(model)
        info = report.models[model]
        parent = report.column(info.get("base_run_dir"))
        if parent is not None:
            pairs.append((model, parent, info["kind"], f"{model} vs {parent}/"))
        model = parent
    for ours_name, base_name, kind, prefix in pairs:
        for gate in cfg.gates_for(kind):
            ours = report.value(gate.metric, ours_name)
            theirs = report.value(gate.metric, base_name) if base_name not in (None, ours_name) else None
            if ours is None or (theirs is None and gate.at_least is None):
                skipped.append(prefix + gate.metric)
            else:
                gates[prefix + gate.metric] = gate.passes(ours, theirs)
    return gates, skipped


def describe_gates(gates: dict[str, bool], skipped: list[str]) -> str:
    """One line: which gates were checked and how each went, and which declared ones could not be."""
    line = "checked " + ", ".join(f"{name} {'pass' if ok else 'FAIL'}" for name, ok in gates.items())
    return line + (f"; not checked (not measured): {', '.join(skipped)}" if skipped else "")
