"""Log a finished model to MLflow as a pyfunc (text in, text out) and register it, setting an alias only when
the evaluation gates pass. An export that failed verification is never registered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from infra.tracking import TrackingConfig, tracking_uri

PYFUNC_CODE = Path(__file__).with_name("pyfunc_model.py")
SKIPPED_TAG = "lmforge.gates_skipped"


class RegisteredVersion(BaseModel):
    name: str
    version: str
    model_uri: str
    alias: str | None  # set when every gate passed
    gates: dict[str, bool]  # the gates checked, and whether each passed
    skipped: list[str] = []  # declared gates that could not be checked (a metric the report lacks)


def log_pyfunc(
    uri: str, run_id: str, hf_export: str | Path, name: str = "model", requirements: tuple[str, ...] = ()
) -> str:
    """Log the export as a pyfunc model into `run_id` (`requirements`: packages beyond torch, transformers,
    safetensors and tokenizers that loading it needs, e.g. torchao for a quantized export); returns its URI."""
    import mlflow
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    signature = ModelSignature(
        inputs=Schema([ColSpec("string")]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema([ParamSpec("max_new_tokens", "long", 32)]),
    )
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(
            name=name,
            python_model=str(PYFUNC_CODE),
            artifacts={"hf_model": str(hf_export)},
            signature=signature,
            input_example=["def "],
            pip_requirements=["torch", "transformers", "safetensors", "tokenizers", *requirements],
        )
    return info.model_uri


def register(
    tracking: TrackingConfig,
    output_dir: str | Path,
    ref: Any,
    registered_name: str,
    alias: str,
    gates: dict[str, bool],
    report_dir: str | Path | None = None,
    description: str = "",
    tags: dict[str, str] | None = None,
    skipped: list[str] = (),
    requirements: tuple[str, ...] = (),
) -> RegisteredVersion:
    """Log `ref`'s export as a pyfunc into its own MLflow run, register a version, attach the eval report,
    and point `alias` at it when every gate passes."""
    import mlflow

    if not ref.export_valid or not ref.hf_export:
        raise ValueError(
            f"{ref.run_dir}: its Hugging Face export failed verification (max |Δlogit| {ref.max_abs_logit_diff}); "
            "it is not registered — rerun the stage to re-export"
        )
    if ref.mlflow_run_id is None:
        raise ValueError("tracking is disabled (tracking.enabled=false); nothing to register into")
    uri = tracking_uri(tracking, output_dir)
    client = mlflow.MlflowClient(uri, registry_uri=uri)  # never a registry some earlier call set process-wide
    existing = _version_of(client, registered_name, ref.run_dir)
    if existing is not None:  # a rerun of a finished pipeline: the same model is already registered
        aliases = [a for a in existing.aliases if a == alias]
        gates = {
            k.removeprefix("gate."): v == "true" for k, v in existing.tags.items() if k.startswith("gate.")
        }
        skipped = existing.tags.get(SKIPPED_TAG, "")
        return RegisteredVersion(
            name=registered_name,
            version=str(existing.version),
            model_uri=existing.source,
            alias=aliases[0] if aliases else None,
            gates=gates,
            skipped=skipped.split(",") if skipped else [],
        )
    if report_dir is not None:
        client.log_artifacts(ref.mlflow_run_id, str(report_dir), "eval_report")
    model_uri = log_pyfunc(uri, ref.mlflow_run_id, ref.hf_export, requirements=requirements)
    mlflow.set_registry_uri(uri)
    version = mlflow.register_model(model_uri, registered_name)
    for gate, passed in gates.items():
        client.set_model_version_tag(registered_name, version.version, f"gate.{gate}", str(passed).lower())
    client.set_model_version_tag(registered_name, version.version, "lmforge.run_dir", ref.run_dir)
    for key, value in {**(tags or {}), **({SKIPPED_TAG: ",".join(skipped)} if skipped else {})}.items():
        client.set_model_version_tag(registered_name, version.version, key, value)
    if description:
        client.update_model_version(registered_name, version.version, description=description)
    passed = bool(gates) and all(gates.values())
    if passed:
        client.set_registered_model_alias(registered_name, alias, version.version)
    return RegisteredVersion(
        name=registered_name,
        version=str(version.version),
        model_uri=model_uri,
        alias=alias if passed else None,
        gates=gates,
        skipped=list(skipped),
    )


def _version_of(client: Any, name: str, run_dir: str) -> Any:
    """The registered version of `name` made from `run_dir`, if any."""
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name='{name}'")
    except MlflowException:
        return None
    found = next((v for v in versions if v.tags.get("lmforge.run_dir") == run_dir), None)
    # search results carry no aliases: read the version itself
    return client.get_model_version(name, found.version) if found is not None else None
