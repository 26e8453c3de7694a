"""Start from your own Hugging Face model: a Qwen2 directory (q/k/v biases, tied embeddings) given to `lmforge sft
--base`, `lmforge eval` and `lmforge compress --base` as a user would, and what comes back: a Qwen2 export
transformers reloads with lmforge's logits, an adapter PEFT loads on the original directory, the lineage in MLflow."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from flows.cli import main
from tests.hf_checkpoints import hf_model
from tests.pretrain_helpers import SMOKE_SETTINGS, smoke_overrides
from training.stages.lifecycle import TrainedModel

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def qwen2_with(tokenizer_dir: Path, vocab_size: int, directory: Path) -> Path:
    """A random Qwen2 whose embedding fits the smoke tokenizer, saved with that tokenizer's files."""
    import transformers

    model = hf_model("qwen2")
    config = transformers.Qwen2Config(**{**model.config.to_dict(), "vocab_size": vocab_size})
    model = transformers.Qwen2ForCausalLM(config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise)
    model.save_pretrained(str(directory))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def own(smoke_base, tmp_path_factory) -> tuple[Path, list[str], TrainedModel]:
    """(the user's directory, the CLI's overrides, the LoRA SFT run `lmforge sft smoke --base DIR` made)."""
    _, base = smoke_base
    root = tmp_path_factory.mktemp("own")
    vocab = json.loads((Path(base.hf_export) / "config.json").read_text())["vocab_size"]
    source = qwen2_with(Path(base.hf_export), vocab, root / "Qwen2-tiny")
    sets = [a for s in smoke_overrides(root / "outputs", *SMOKE_SETTINGS) for a in ("--set", s)]
    assert main(["sft", "smoke", "--base", str(source), *sets]) == 0
    (run_dir,) = (root / "outputs" / "sft").iterdir()
    return source, sets, TrainedModel.load(run_dir)


def test_sft_from_a_qwen2_directory_exports_qwen2(own) -> None:
    from transformers import AutoModelForCausalLM

    from training.model.hf_interop import load_export

    source, _, tuned = own
    config = json.loads((Path(tuned.hf_export) / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert tuned.export_valid and tuned.max_abs_logit_diff <= 1e-5
    theirs = AutoModelForCausalLM.from_pretrained(tuned.hf_export, dtype=torch.float32)
    assert theirs.model.embed_tokens.weight.data_ptr() == theirs.lm_head.weight.data_ptr()  # tied stays tied
    tokens = torch.randint(0, config["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            load_export(tuned.hf_export)(tokens).logits, theirs(tokens).logits, rtol=0, atol=1e-5
        )
    assert tuned.source_model is not None and str(source.resolve()) in tuned.source_model


def test_the_adapter_loads_on_the_original_directory(own) -> None:
    """PEFT puts the LoRA adapter on the user's own directory (Qwen2's module names) and gives the merged export."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    source, _, tuned = own
    assert tuned.adapter is not None
    original = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(original, tuned.adapter).eval()
    merged = AutoModelForCausalLM.from_pretrained(tuned.hf_export, dtype=torch.float32).eval()
    tokens = torch.randint(0, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(adapted(tokens).logits, merged(tokens).logits, rtol=0, atol=1e-5)


def test_the_run_names_its_source_in_mlflow(own) -> None:
    import mlflow

    from flows.recipe import load_recipe
    from infra.tracking import tracking_uri

    source, sets, tuned = own
    recipe = load_recipe("smoke", sets[1::2])
    client = mlflow.MlflowClient(tracking_uri(recipe.tracking, Path(recipe.output_dir)))
    tags = client.get_run(tuned.mlflow_run_id).data.tags
    assert str(source.resolve()) in tags["source_model"] and "weights sha256:" in tags["source_model"]


def test_eval_takes_the_directory(own, capsys) -> None:
    source, sets, tuned = own
    assert main(["eval", "smoke", str(source), tuned.path, *sets]) == 0
    out = capsys.readouterr().out
    assert "imported" in out


def test_a_changed_checkpoint_is_a_new_import(own, tmp_path: Path) -> None:
    from training.stages.imported import run_import

    source, sets, _ = own
    first = run_import(source, tmp_path)
    assert run_import(source, tmp_path).path == first.path  # cached by content
    copy = tmp_path / "changed"
    shutil.copytree(source, copy)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(copy / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert run_import(copy, tmp_path).key != first.key


def test_a_registered_version_names_its_source(own, capsys) -> None:
    import mlflow

    from flows.recipe import load_recipe
    from infra.tracking import tracking_uri

    source, sets, tuned = own
    assert main(["eval", "smoke", str(source), tuned.path, "--register", *sets]) == 0
    recipe = load_recipe("smoke", sets[1::2])
    client = mlflow.MlflowClient(tracking_uri(recipe.tracking, Path(recipe.output_dir)))
    name = recipe.eval.register_name or "lmforge-smoke"
    (version,) = client.search_model_versions(f"name='{name}'")
    assert str(source.resolve()) in version.tags["source_model"]


def test_compress_takes_the_directory(own, capsys) -> None:
    source, sets, _ = own
    assert main(["compress", "smoke", "--base", str(source), *sets]) == 0
    out = capsys.readouterr().out
    assert "# Compression frontier" in out and "int4-g4" in out
