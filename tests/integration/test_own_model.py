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
from tests.hf_checkpoints import hf_model, write_tokenizer
from tests.pretrain_helpers import SMOKE_SETTINGS, smoke_overrides
from training.stages.lifecycle import TrainedModel

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def model_with_tokenizer(family: str, style: str, directory: Path) -> Path:
    """A random `family` checkpoint saved with a tokenizer of its own (`style`: its special tokens and chat
    template, not lmforge's), its embedding the tokenizer's size and its config naming the tokenizer's ids."""
    from data_pipeline.tokenizer import describe

    tok = describe(write_tokenizer(style, directory))
    ids = {"vocab_size": tok.vocab_size, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    hf_model(family, seed=3, **ids).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> tuple[Path, list[str], TrainedModel]:
    """(the user's directory, the CLI's overrides, the LoRA SFT run `lmforge sft smoke --base DIR` made)."""
    root = tmp_path_factory.mktemp("own")
    source = model_with_tokenizer("qwen2", "chatml", root / "Qwen2-tiny")
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


def test_the_export_keeps_the_models_tokenizer_and_chat_template(own) -> None:
    """The tuned model ends its turns as the source's template does: its generation stops at `<|im_end|>`, its
    tokenizer files and chat template are the source's, and its SFT data was masked on the template's answers."""
    from transformers import AutoTokenizer, GenerationConfig

    from data_pipeline.sft import SFTManifest, read_rows

    source, _, tuned = own
    theirs = AutoTokenizer.from_pretrained(tuned.hf_export)
    assert theirs.chat_template == AutoTokenizer.from_pretrained(str(source)).chat_template is not None
    im_end = theirs.convert_tokens_to_ids("<|im_end|>")
    assert im_end in GenerationConfig.from_pretrained(tuned.hf_export).eos_token_id
    (data_dir,) = (Path(tuned.path).parents[1] / "sft_data").iterdir()
    rows = read_rows(Path(SFTManifest.load(data_dir).path) / "train.arrow")
    ids, mask = rows.column("input_ids")[0].values.to_numpy(), rows.column("loss_mask")[0].values.to_numpy()
    assert theirs.decode(ids[:12]).startswith("<|im_start|>system\n") and ids[mask == 1][-1] == im_end


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


def test_auto_peft_loads_the_adapter_even_after_a_move(own, tmp_path: Path) -> None:
    """`AutoPeftModelForCausalLM.from_pretrained(adapter)` (the base from the adapter's own config) gives the merged
    export's logits; with the outputs moved elsewhere, `lmforge lora merge` still finds the base beside it."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    _, _, tuned = own
    assert tuned.adapter is not None
    auto = AutoPeftModelForCausalLM.from_pretrained(tuned.adapter, dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(tuned.hf_export, dtype=torch.float32).eval()
    tokens = torch.randint(0, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(auto(tokens).logits, merged(tokens).logits, rtol=0, atol=1e-5)
    outputs = Path(tuned.path).parents[1]
    moved = outputs.with_name("moved-outputs")
    outputs.rename(moved)  # the whole output directory moves (and comes back for the other tests)
    try:
        adapter = moved / Path(tuned.adapter).relative_to(outputs)
        assert main(["lora", "merge", str(adapter), "--out", str(tmp_path / "merged")]) == 0
    finally:
        moved.rename(outputs)
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, merged(tokens).logits, rtol=0, atol=1e-5)


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


@pytest.fixture(scope="module")
def continued(tmp_path_factory) -> tuple[Path, list[str], TrainedModel]:
    """(a Llama 3 directory with its own tokenizer, the CLI's overrides, the run `lmforge pretrain smoke --set
    pretrain.init_from=DIR` made: 10 steps, a checkpoint every 5)."""
    root = tmp_path_factory.mktemp("continued")
    source = model_with_tokenizer("llama3-tied", "llama3", root / "Llama-tiny")
    settings = [f"pretrain.init_from={source}", "train.max_steps=10", "train.checkpoint_every=5"]
    sets = [a for s in smoke_overrides(root / "outputs", *settings) for a in ("--set", s)]
    assert main(["pretrain", "smoke", *sets]) == 0
    (run_dir,) = (root / "outputs" / "pretrain").iterdir()
    return source, sets, TrainedModel.load(run_dir)


def test_continued_pretraining_starts_from_the_directory(continued) -> None:
    """The run is the directory's model (its architecture, Llama 3 rope scaling included), on the corpus in the
    directory's own tokens, and its first validation loss (step 0, before any update) is the one transformers
    measures for the directory's weights on the same batches."""
    from transformers import AutoModelForCausalLM

    from data_pipeline.loader import PackedLoader
    from data_pipeline.shards import DatasetManifest
    from data_pipeline.tokenizer import describe
    from flows.recipe import load_recipe
    from training.model.config import ModelConfig
    from training.model.export import ENGINE_TOLERANCE, mean_loss
    from training.stages.lifecycle import read_metrics

    source, sets, run = continued
    cfg = ModelConfig(**run.model)
    assert cfg.vocab_size == describe(source).vocab_size and cfg.rope_scaling is not None
    assert run.tokenizer_digest == describe(source).digest and str(source.resolve()) in (
        run.source_model or ""
    )
    recipe = load_recipe("smoke", sets[1::2])
    (data_dir,) = (Path(recipe.output_dir) / "tokenize").iterdir()
    data = DatasetManifest.load(data_dir)
    assert data.tokenizer.digest == run.tokenizer_digest
    loader = PackedLoader(
        data,
        "val",
        shuffle=False,
        seq_len=recipe.train.seq_len,
        batch_size=recipe.train.micro_batch_size,
        tokenizer_digest=data.tokenizer.digest,
    )
    theirs = AutoModelForCausalLM.from_pretrained(
        str(source), dtype=torch.float32, attn_implementation="eager"
    )
    expected = mean_loss(theirs.eval(), loader.epoch_batches(recipe.train.eval_batches_per_rank(1)))
    first = next(m for m in read_metrics(run.path) if "val/loss" in m)
    assert first["step"] == 0
    assert abs(first["val/loss"] - expected) <= ENGINE_TOLERANCE[recipe.parallel.precision] * expected
    exported = json.loads((Path(run.hf_export) / "config.json").read_text())
    assert exported["model_type"] == "llama" and exported["rope_parameters"]["rope_type"] == "llama3"


def test_continued_pretraining_resumes_exactly(continued, tmp_path: Path) -> None:
    """Killed right after its step-5 checkpoint, the run goes on from there and ends bit for bit where the
    uninterrupted one did (the same key: the import is keyed by content, not by where it was written)."""
    from tests.pretrain_helpers import losses, stopped_copy

    source, sets, run = continued
    out = tmp_path / "outputs"
    stopped_copy(Path(run.path), out / "pretrain", 5)
    moved = [f"output_dir={out}" if s.startswith("output_dir=") else s for s in sets]
    assert main(["pretrain", "smoke", *moved]) == 0
    (resumed,) = (out / "pretrain").iterdir()
    assert resumed.name == Path(run.path).name
    assert losses(resumed) == losses(Path(run.path))


def test_preference_reward_and_rl_stages_take_the_directory(own, tmp_path: Path) -> None:
    """`--base DIR` on DPO, the reward model and RL: each trains from the directory's weights in its chat format
    and gives a Qwen2 model back (the reward model as Qwen2ForSequenceClassification), naming its source."""
    source, sets, _ = own
    short = ["dpo.train.max_steps=4", "reward_model.train.max_steps=4", "rl.train.max_steps=2"]
    extra = [a for s in short for a in ("--set", s)]
    for stage, architecture in (
        ("dpo", "Qwen2ForCausalLM"),
        ("reward_model", "Qwen2ForSequenceClassification"),
        ("rl", "Qwen2ForCausalLM"),
    ):
        assert main([stage.replace("_", "-"), "smoke", "--base", str(source), *sets, *extra]) == 0
        (run_dir,) = (Path(tuned_root(sets)) / stage).iterdir()
        run = TrainedModel.load(run_dir)
        config = json.loads((Path(run.hf_export) / "config.json").read_text())
        assert config["architectures"] == [architecture] and str(source.resolve()) in (run.source_model or "")


def tuned_root(sets: list[str]) -> str:
    """The output directory the CLI overrides name."""
    return next(s.removeprefix("output_dir=") for s in sets if s.startswith("output_dir="))
