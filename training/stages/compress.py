"""The compress stage: `run_compress(spec, base, data) -> Compressed`, one trained model into several compressed
variants (`training/compress/variants.py`), each saved with a verified export and measured for size.

Calibration (GPTQ's Hessians, Wanda's input norms) is a fixed sample of the recipe's own token shards: `sequences`
windows of the model's context from the train split, drawn with `seed`, recorded by the sha256 of their token
ids. The step is cached by the base's and the data's digests and the variant list; a variant whose directory
already holds a verified export is kept when an interrupted stage runs again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from data_pipeline.loader import PackedLoader
from data_pipeline.shards import DatasetManifest
from data_pipeline.sources import DataError
from infra.steps import Artifact, Step, run_step
from infra.storage import atomic_write_json, damaged_file, sha256_file
from training.compress.config import VARIANT_FILE, CalibrationConfig, CompressSpec
from training.compress.model_level import model_bytes
from training.compress.variants import (
    FACTORS,
    PACKED,
    build_variant,
    check_shapes,
    save_variant,
    weight_files,
)
from training.model.export import export_damage, read_verification
from training.model.hf_interop import load_export, load_hf_config, no_llama_layout
from training.stages.lifecycle import TrainedModel

log = logging.getLogger(__name__)
COMPRESS_VERSION = 2  # 2: served (Hugging Face export) bytes recorded


class VariantRecord(BaseModel):
    """One compressed model on disk: where, how made, its export's verification and its size."""

    model_config = ConfigDict(frozen=True)

    name: str
    method: str
    settings: dict[str, Any]
    path: str
    hf_export: str
    export_valid: bool
    max_abs_logit_diff: float
    disk_bytes: int  # the files holding its weights (factors for low-rank, else the export's safetensors)
    served_bytes: int = 0  # its Hugging Face export's weights: what the registry serves and clients download
    memory_bytes: int  # its parameters as lmforge holds them
    seconds: float  # time to make it (calibration included), not to export it
    details: dict[str, Any] = {}
    files: dict[str, dict[str, Any]] = {}  # lmforge's own storage (packed codes, factors): bytes and sha256
    mlflow_run_id: str | None = None  # set by the frontier (its nested run), for the registry

    def damage(self) -> str | None:
        """A damaged export or own-storage file (missing, truncated, altered), else None."""
        return export_damage(self.hf_export) or damaged_file(Path(self.path), self.files)

    @property
    def run_dir(self) -> str:  # what the registry tags a version with
        return self.path


class Compressed(Artifact):
    """The variants of one model, beside the uncompressed reference (`reference`, method "none")."""

    base_run_dir: str
    base_kind: str
    base_mlflow_run_id: str | None
    tokenizer_digest: str
    parameters: int
    calibration: dict[str, Any]
    reference: VariantRecord
    variants: list[VariantRecord]

    def damage(self) -> str | None:
        return next((p for r in (self.reference, *self.variants) if (p := r.damage())), None)


def calibration_size(data: DatasetManifest, cfg: CalibrationConfig, context: int) -> int:
    """Tokens the calibration sample reads; refused when the train split is shorter."""
    needed = cfg.sequences * context + 1
    have = data.splits["train"].n_tokens
    if have < needed:
        raise DataError(
            f"the calibration sample needs {cfg.sequences} windows of the model's {context}-token context "
            f"({needed:,} tokens) but the train split holds {have:,}; lower compress.calibration.sequences or "
            "tokenize more text"
        )
    return needed


def calibration_batches(data: DatasetManifest, cfg: CalibrationConfig, context: int) -> list[torch.Tensor]:
    """The calibration sample as token batches (B, context)."""
    calibration_size(data, cfg, context)
    loader = PackedLoader(data, "train", seq_len=context, batch_size=cfg.batch_size, seed=cfg.seed)
    rows = [b.inputs for b in loader.epoch_batches(-(-cfg.sequences // cfg.batch_size))]
    return list(torch.cat(rows)[: cfg.sequences].split(cfg.batch_size))


def served_bytes(export: Path) -> int:
    """Bytes of a Hugging Face export's weight files."""
    return sum(f.stat().st_size for f in export.glob("*.safetensors"))


def record_of(
    name: str, method: str, settings: dict, out: Path, memory: int, seconds: float, details: dict
) -> VariantRecord:
    verification = read_verification(out / "hf")
    return VariantRecord(
        name=name,
        method=method,
        settings=settings,
        path=str(out.resolve()),
        hf_export=str((out / "hf").resolve()),
        export_valid=bool(verification["valid"]),
        max_abs_logit_diff=float(verification["max_abs_logit_diff"]),
        disk_bytes=sum(f.stat().st_size for f in weight_files(out)),
        served_bytes=served_bytes(out / "hf"),
        files=own_storage_records(out),
        memory_bytes=memory,
        seconds=seconds,
        details=details,
    )


def own_storage_records(out: Path) -> dict[str, dict[str, Any]]:
    """{name: {bytes, sha256}} of the variant's own storage files (the export keeps its own records)."""
    return {
        path.name: {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
        for path in (out / FACTORS, out / PACKED)
        if path.is_file()
    }


def check(spec: CompressSpec, base: TrainedModel, data: DatasetManifest) -> None:
    """Refuse bad input before any work, in one line each: no verified export, data in another tokenizer,
    settings the model's shapes cannot take, a calibration sample the shards cannot fill."""
    if not base.hf_export or not base.export_valid or not Path(base.hf_export).is_dir():
        raise DataError(
            f"{base.path}: no verified Hugging Face export to compress ({base.hf_export or 'none'}); rerun its "
            "stage to export it"
        )
    data.check_tokenizer(base.tokenizer_digest)
    cfg = load_hf_config(base.hf_export)
    if not cfg.has_llama_layout:
        raise DataError(f"{base.path}: {no_llama_layout(cfg)}; compressed variants are Hugging Face exports")
    try:
        check_shapes(cfg, spec.compress.variants)
    except ValueError as error:
        raise DataError(str(error)) from None
    calibration_size(data, spec.compress.calibration, cfg.max_seq_len)


def run_compress(
    spec: CompressSpec,
    base: TrainedModel,
    data: DatasetManifest,
    progress: Callable[[int, str], None] | None = None,
) -> Compressed:
    """Make (or return) every variant of `base`'s export; `progress(done, name)` hears each one start."""
    check(spec, base, data)
    cfg = spec.compress
    config = cfg.model_dump(mode="json", exclude={"tolerance", "alias", "generate_tokens"})
    step = Step("compress", spec.name, COMPRESS_VERSION, config, Compressed, {"model": base, "data": data})
    return run_step(spec.output_dir, step, lambda out, key: _compress(spec, base, data, out, progress))


def expert_share(model: nn.Module) -> float:
    """The fraction of `model`'s weights held by MoE experts (stacked tensors no variant method compresses)."""
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return experts / sum(p.numel() for p in model.parameters())


def _compress(
    spec: CompressSpec,
    base: TrainedModel,
    data: DatasetManifest,
    out: Path,
    progress: Callable[[int, str], None] | None,
) -> Compressed:
    cfg = spec.compress
    export = Path(base.hf_export)
    model = load_export(export)
    if share := expert_share(model):
        log.warning(
            "%s: the MoE experts (%.0f%% of the weights) stay in full precision: the variants compress the "
            "attention and dense layers only",
            spec.name,
            100 * share,
        )
    context = model.cfg.max_seq_len
    batches = calibration_batches(data, cfg.calibration, context)
    ids = torch.cat(batches).numpy().astype("int64").tobytes()
    calibration = {
        **cfg.calibration.model_dump(),
        "split": "train",
        "seq_len": context,
        "tokens": cfg.calibration.sequences * context,
        "sha256": hashlib.sha256(ids).hexdigest(),
    }
    atomic_write_json(out / "calibration.json", calibration)
    reference = VariantRecord(
        name="uncompressed",
        method="none",
        settings={},
        path=str(export.resolve()),
        hf_export=str(export.resolve()),
        export_valid=base.export_valid,
        max_abs_logit_diff=float(base.max_abs_logit_diff or 0.0),
        disk_bytes=served_bytes(export),
        served_bytes=served_bytes(export),
        memory_bytes=model_bytes(model),
        seconds=0.0,
    )
    records = []
    for i, variant in enumerate(cfg.variants):
        if progress is not None:
            progress(i, variant.name)
        directory = out / variant.name
        done = directory / VARIANT_FILE
        if done.is_file():  # made before an interruption (kept unless damaged since)
            record = VariantRecord.model_validate_json(done.read_text())
            if record.damage() is None:
                records.append(record)
                continue
        t0 = time.perf_counter()
        try:
            compressed, details = build_variant(model, variant, lambda: batches)
        except ValueError as error:  # a setting the model's shapes cannot take (the message names the layer)
            raise DataError(f"compress.variants {variant.name}: {error}") from None
        seconds = time.perf_counter() - t0
        save_variant(compressed, variant, export, directory)
        record = record_of(
            variant.name,
            variant.method,
            variant.settings(),
            directory,
            model_bytes(compressed),
            seconds,
            details,
        )
        atomic_write_json(done, json.loads(record.model_dump_json()))
        log.info(
            "%s: %s bytes on disk (%.2fx), built in %.1fs",
            variant.name,
            f"{record.disk_bytes:,}",
            record.disk_bytes / reference.disk_bytes,
            seconds,
        )
        records.append(record)
    if progress is not None:
        progress(len(cfg.variants), "done")
    return Compressed(
        path=str(out.resolve()),
        base_run_dir=base.path,
        base_kind=base.kind,
        base_mlflow_run_id=base.mlflow_run_id,
        tokenizer_digest=base.tokenizer_digest,
        parameters=sum(p.numel() for p in model.parameters()),
        calibration=calibration,
        reference=reference,
        variants=records,
    )
