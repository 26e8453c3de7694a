"""A Hugging Face model directory given where lmforge takes a model: sharded weights read tensor by tensor, and
what lmforge cannot represent or read refused in one line (exit 2) before anything runs, naming the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from flows.cli import main
from tests.hf_checkpoints import VOCAB, write_checkpoint
from training.model.hf_interop import load_export


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 directory with a tokenizer of its vocabulary (a word-level one: not lmforge's BPE)."""
    from tokenizers import Tokenizer, models

    directory = write_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2") / "model")
    vocab = {"<|endoftext|>": 0, "<|pad|>": 1} | {f"w{i}": i for i in range(2, VOCAB)}
    Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>")).save(str(directory / "tokenizer.json"))
    return directory


def variant(source: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(source, copy)
    return copy


def refused(directory: Path | str, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()  # what writing the checkpoint printed
    assert main(["eval", "smoke", str(directory)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_sharded_weights_load_tensor_by_tensor(tmp_path: Path) -> None:
    whole = load_export(write_checkpoint("qwen2_moe", tmp_path / "whole"))
    sharded = write_checkpoint("qwen2_moe", tmp_path / "sharded", max_shard_size="20KB")
    assert (
        len(list(sharded.glob("*.safetensors"))) > 3 and (sharded / "model.safetensors.index.json").is_file()
    )
    tokens = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(load_export(sharded)(tokens).logits, whole(tokens).logits, rtol=0, atol=0)


def test_unsupported_model_type_names_the_families(qwen2: Path, tmp_path: Path, capsys) -> None:
    model = variant(qwen2, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"model_type": "gpt_neox"}))
    err = refused(model, capsys)
    assert "model_type: 'gpt_neox' is not supported" in err and "qwen2, qwen3" in err


def test_remote_code_is_refused(qwen2: Path, tmp_path: Path, capsys) -> None:
    model = variant(qwen2, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"auto_map": {"AutoModel": "modeling_x.X"}}))
    assert "trust_remote_code" in refused(model, capsys)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        (
            "rope_parameters",
            {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
            "'yarn' is not modelled",
        ),
        ("use_sliding_window", True, "use_sliding_window"),
        ("hidden_act", "gelu", "hidden_act"),
    ],
)
def test_fields_lmforge_cannot_represent_are_named(
    qwen2: Path, tmp_path: Path, capsys, field: str, value: object, named: str
) -> None:
    model = variant(qwen2, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {field: value}))
    assert named in refused(model, capsys)


def test_pickled_weights_are_never_loaded(qwen2: Path, tmp_path: Path, capsys) -> None:
    model = variant(qwen2, tmp_path)
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(b"not unpickled")
    err = refused(model, capsys)
    assert "never unpickles" in err and "safe_serialization=True" in err


def test_gguf_is_refused(qwen2: Path, tmp_path: Path, capsys) -> None:
    gguf = tmp_path / "model.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    assert "GGUF" in refused(gguf, capsys)


def test_a_missing_shard_is_named(tmp_path: Path, capsys) -> None:
    model = write_checkpoint("llama-untied", tmp_path / "model", max_shard_size="40KB")
    shard = sorted(model.glob("model-*.safetensors"))[1]
    shard.unlink()
    err = refused(model, capsys)
    assert shard.name in err and "missing" in err


def test_a_tokenizer_larger_than_the_embedding_is_refused(qwen2: Path, tmp_path: Path, capsys) -> None:
    from tokenizers import Tokenizer, models

    model = variant(qwen2, tmp_path)
    vocab = {"<|endoftext|>": 0, "<|pad|>": 1} | {f"w{i}": i for i in range(2, VOCAB + 50)}
    Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>")).save(str(model / "tokenizer.json"))
    err = refused(model, capsys)
    assert f"{VOCAB + 50} tokens but the embedding {VOCAB} rows" in err


def test_an_unfinished_lmforge_run_still_says_so(tmp_path: Path, capsys) -> None:
    run = tmp_path / "sft" / "smoke-abc"
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    (run / "config.json").write_text("{}")  # an lmforge run is never taken for a model directory
    assert "has not finished" in refused(run, capsys)


def test_a_bf16_checkpoint_is_given_back_in_bf16(qwen2: Path, tmp_path: Path) -> None:
    """The export keeps the source's weight type (config.json's dtype and the safetensors' own), with the
    source's values exactly, and transformers reloads it with lmforge's logits on those values."""
    from safetensors import safe_open

    from tests.hf_checkpoints import hf_model
    from training.stages.imported import run_import

    source = tmp_path / "bf16"
    hf_model("qwen2").to(torch.bfloat16).save_pretrained(str(source))
    shutil.copy(qwen2 / "tokenizer.json", source / "tokenizer.json")
    imported = run_import(source, tmp_path / "outputs")
    export = Path(imported.hf_export)
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    with (
        safe_open(str(export / "model.safetensors"), "pt") as theirs,
        safe_open(str(source / "model.safetensors"), "pt") as ours,
    ):
        names = ours.keys()  # a safetensors handle is not iterable
        assert {theirs.get_slice(k).get_dtype() for k in names} == {"BF16"}
        assert all(torch.equal(theirs.get_tensor(k), ours.get_tensor(k)) for k in names)
    assert imported.export_valid and imported.max_abs_logit_diff <= 1e-5


def test_the_weights_are_hashed_once_per_change(qwen2: Path, tmp_path: Path, monkeypatch) -> None:
    """Every command that takes a directory asks for its weights' digest; the bytes are read once per change (in
    this process, and across processes through the output root's record), again when a file changes."""
    import hashlib

    from training.stages import imported

    model = variant(qwen2, tmp_path)
    hashed, real = [], hashlib.sha256
    monkeypatch.setattr(imported.hashlib, "sha256", lambda *a: hashed.append(1) or real(*a))
    first = imported.weights_digest(model, tmp_path / "outputs")
    imported._digests.clear()  # another process: only the record under the output root is left
    assert imported.weights_digest(model, tmp_path / "outputs") == first and len(hashed) == 1
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # a changed byte, the same size
    weights.write_bytes(bytes(data))
    assert imported.weights_digest(model, tmp_path / "outputs") != first and len(hashed) == 2
