"""Fine-tuning end to end: LoRA adapters that PEFT loads on the Hugging Face export, merged = unmerged, frozen
base weights, full SFT, held-out improvement, and refusal of data made with another tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data_pipeline.config import DataConfig, SFTConfig, TokenizerConfig
from data_pipeline.sft import run_sft_data
from data_pipeline.sources import DataError
from data_pipeline.tokenize import run_tokenize
from data_pipeline.tokenizer import describe
from flows.recipe import load_recipe
from flows.stages import sft_data
from tests.pretrain_helpers import SMOKE_SETTINGS, cli, smoke_overrides
from training.finetune import build_model, run_sft
from training.stage import TrainedModel

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def base(smoke_base) -> tuple[TrainedModel, Path]:
    recipe, ref = smoke_base
    return ref, Path(recipe.output_dir)


def finetune(out: Path, base: TrainedModel, *extra: str) -> TrainedModel:
    recipe = load_recipe("smoke", smoke_overrides(out, *SMOKE_SETTINGS, *extra))
    return run_sft(recipe.sft_spec(), base, sft_data(recipe, base))


@pytest.fixture(scope="module")
def lora_run(smoke_lora) -> TrainedModel:
    return smoke_lora[1]


def test_lora_improves_heldout_loss_and_logs(lora_run: TrainedModel) -> None:
    summary = lora_run.summary
    assert summary["sft/heldout_loss_after"] < summary["sft/heldout_loss_before"] - 0.05
    assert 0.0 <= summary["sft/exact_match_after"] <= 1.0
    assert 0.0 < summary["sft/trainable_fraction"] < 0.2
    lora = build_model(TrainedModel.load(lora_run.base_run_dir), load_recipe("smoke").sft_spec())
    assert summary["sft/trainable_params"] == sum(
        p.numel() for n, p in lora.named_parameters() if "lora_" in n
    )


def test_adapter_loads_with_peft_on_the_hf_export(
    base: tuple[TrainedModel, Path], lora_run: TrainedModel
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from training.parallel import fp32_state_dict

    ref, out = base
    recipe = load_recipe("smoke", smoke_overrides(out, *SMOKE_SETTINGS))
    ours = build_model(ref, recipe.sft_spec())
    ours.load_state_dict(fp32_state_dict(Path(lora_run.checkpoint), False), strict=True)
    hf_base = AutoModelForCausalLM.from_pretrained(ref.hf_export, dtype=torch.float32)
    theirs = PeftModel.from_pretrained(hf_base, lora_run.adapter)
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ours.eval()(tokens).logits
        torch.testing.assert_close(theirs.eval()(tokens).logits, expected, rtol=0, atol=1e-5)
        assert (
            expected - hf_base.eval()(tokens).logits
        ).abs().max() == 0  # PEFT injected into hf_base in place
        merged_dir = out / "merged"
        result = cli("lora", "merge", lora_run.adapter, "--out", str(merged_dir))
        assert result.returncode == 0, result.stderr[-2000:]
        merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32)
        torch.testing.assert_close(merged.eval()(tokens).logits, expected, rtol=1e-5, atol=1e-5)


def test_base_weights_stay_frozen(base: tuple[TrainedModel, Path], lora_run: TrainedModel) -> None:
    from training.parallel import fp32_state_dict

    ref, _ = base
    before = fp32_state_dict(Path(ref.checkpoint), False)
    after = fp32_state_dict(Path(lora_run.checkpoint), False)
    frozen = {
        k.replace("base_model.model.", "").replace(".base_layer", ""): v
        for k, v in after.items()
        if "lora_" not in k
    }
    assert frozen.keys() == before.keys()
    assert all(torch.equal(frozen[k], before[k]) for k in before)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in after.items())


def test_full_sft(base: tuple[TrainedModel, Path]) -> None:
    ref, out = base
    full = finetune(out, ref, "finetune.method=full", "finetune.optim.lr=1e-3")
    assert full.adapter is None and full.export_valid
    assert full.summary["sft/heldout_loss_after"] < full.summary["sft/heldout_loss_before"]


def test_sft_data_from_another_tokenizer_is_refused(base: tuple[TrainedModel, Path], tmp_path: Path) -> None:
    ref, out = base
    other_cfg = DataConfig(max_documents=20, num_workers=1, tokenizer=TokenizerConfig(vocab_size=300))
    other = run_tokenize(other_cfg, tmp_path)
    data = run_sft_data(SFTConfig(max_examples=100), describe(Path(other.tokenizer.path)), 128, tmp_path)
    recipe = load_recipe("smoke", smoke_overrides(out, *SMOKE_SETTINGS))
    with pytest.raises(DataError) as info:
        run_sft(recipe.sft_spec(), ref, data)
    assert ref.tokenizer_digest[:16] in str(info.value) and data.tokenizer_digest[:16] in str(info.value)
