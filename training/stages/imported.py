"""A Hugging Face model directory as a finished lmforge run, so every stage that takes a model takes it (`--base`,
`--teacher`, `lmforge eval DIR`, `pretrain.init_from`).

`run_import(source, root) -> TrainedModel` (kind `imported`) is a cached step keyed by the source's config, weight
and tokenizer digests, so a changed checkpoint is a new run: it checks what lmforge cannot represent or read (one
line naming the field or file and the fix), loads the weights into lmforge's model and writes them as a verified
export of the same family (`<run>/hf`, transformers' logits on it compared with lmforge's) with the source's
tokenizer files. `source_model` names the directory and its digests; every run tuned from it carries it on.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from data_pipeline.sources import DataError
from data_pipeline.tokenizer import TokenizerRef, describe, file_digest
from infra.object_store import is_remote
from infra.steps import Step, run_step
from infra.storage import atomic_write_json
from training.model.checkpoint_files import weight_files
from training.model.export import export_hf
from training.model.families import UnsupportedModel
from training.model.hf_interop import load_export, load_hf_config
from training.stages.lifecycle import TrainedModel

log = logging.getLogger(__name__)

IMPORT_VERSION = 1  # bump when the same source would import differently
DIGESTS = ".weights_digests.json"
_digests: dict[str, str] = {}  # this process's: stamp of the weight files -> their digest


def is_hf_directory(path: str | Path) -> bool:
    """A local Hugging Face model directory (a config.json), as opposed to an lmforge run (a manifest.json, or the
    run.json / spec.json of one that has not finished)."""
    path = Path(path)
    lmforge = ("manifest.json", "run.json", "spec.json")
    return (path / "config.json").is_file() and not any((path / name).exists() for name in lmforge)


def file_stamp(file: Path) -> list[str | int]:
    """What changes when a file's bytes may have: its path, size and times."""
    stat = file.stat()
    return [str(file.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def weights_digest(source: Path, root: str | Path | None = None) -> str:
    """sha256 over the weight files' names and bytes (streamed: the files may be larger than memory), hashed once per
    (files, sizes, modification times): remembered in this process and, for a local output root, in
    `<root>/import/.weights_digests.json` (a 16 GB checkpoint takes ~30 s to hash; every command that takes the
    directory asks for its digest)."""
    files = weight_files(source)
    stamp = json.dumps([file_stamp(f) for f in files])
    if stamp in _digests:
        return _digests[stamp]
    cache = Path(root) / "import" / DIGESTS if root is not None and not is_remote(root) else None
    known = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    if stamp not in known:
        digest = hashlib.sha256()
        for file in files:
            digest.update(file.name.encode())
            with file.open("rb") as handle:
                while chunk := handle.read(1 << 24):
                    digest.update(chunk)
        known[stamp] = digest.hexdigest()
        if cache is not None:
            atomic_write_json(cache, known)
    _digests[stamp] = known[stamp]
    return known[stamp]


def check_source(source: Path) -> TokenizerRef:
    """Refuse, before anything runs, what lmforge cannot represent or read (one line each); the source's
    tokenizer."""
    try:
        cfg = load_hf_config(source)
    except UnsupportedModel as error:
        raise DataError(f"{source}: {error}") from None
    weight_files(source)
    tokenizer = describe(source)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise DataError(
            f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but the embedding {cfg.vocab_size} rows; "
            "give the tokenizer the model was trained with"
        )
    return tokenizer


def run_import(source: str | Path, root: str | Path, origin: str | None = None) -> TrainedModel:
    """The Hugging Face directory `source` as a finished `imported` run under `<root>/import/`; `origin` names
    where it came from when `source` is this node's copy (an object-store URI)."""
    source = Path(source).resolve()
    tokenizer = check_source(source)
    config = {
        "config_sha256": file_digest(source / "config.json"),
        "weights_sha256": weights_digest(source, root),
        "tokenizer_sha256": tokenizer.digest,
    }
    step = Step("import", source.name, IMPORT_VERSION, config, TrainedModel)
    lineage = f"{origin or source} (config sha256:{config['config_sha256'][:12]}, weights sha256:{config['weights_sha256'][:12]})"
    return run_step(root, step, lambda out, key: build(source, out, lineage))


def build(source: Path, out: Path, lineage: str) -> TrainedModel:
    model = load_export(source)
    export_dir = out / "hf"
    verification = export_hf(model.state_dict(), model.cfg, source, export_dir)  # with the source's tokenizer
    tokenizer = describe(export_dir)
    return TrainedModel(
        path=str(out),
        kind="imported",
        checkpoint=str(export_dir.resolve()),
        hf_export=str(export_dir.resolve()),
        export_valid=bool(verification["valid"]),
        max_abs_logit_diff=verification["max_abs_logit_diff"],
        step=0,
        final_val_loss=None,
        tokenizer_digest=tokenizer.digest,
        mlflow_run_id=None,
        model=model.cfg.model_dump(mode="json"),
        source_model=lineage,
    )
