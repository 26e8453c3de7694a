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
from tests.pretrain_helpers import cli, smoke_overrides
from training.finetune import build_model, run_sft
from training.pretrain import CheckpointRef, run_pretrain

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SFT = [
    "data.sft.max_examples=300",
    "finetune.train.max_steps=24",
    "finetune.train.eval_every=24",
    "finetune.optim.lr=1e-2",
]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[CheckpointRef, Path]:
    out = tmp_path_factory.mktemp("ft")
    recipe = load_recipe("smoke", smoke_overrides(out, *SFT))
    return run_pretrain(recipe, run_tokenize(recipe.data, recipe.output_dir)), out


def finetune(out: Path, base: CheckpointRef, *extra: str) -> CheckpointRef:
    recipe = load_recipe("smoke", smoke_overrides(out, *SFT, *extra))
    data = run_sft_data(recipe.data.sft, describe(Path(base.hf_export)), recipe.finetune.train.seq_len, out)
    return run_sft(recipe, base, data)


@pytest.fixture(scope="module")
def lora_run(base: tuple[CheckpointRef, Path]) -> CheckpointRef:
    ref, out = base
    return finetune(out, ref)


def test_lora_improves_heldout_loss_and_logs(lora_run: CheckpointRef) -> None:
    summary = lora_run.summary
    assert summary["sft/heldout_loss_after"] < summary["sft/heldout_loss_before"] - 0.05
    assert 0.0 <= summary["sft/exact_match_after"] <= 1.0
    assert 0.0 < summary["sft/trainable_fraction"] < 0.2
    lora = build_model(CheckpointRef.load(lora_run.base_run_dir), load_recipe("smoke").finetune)
    assert summary["sft/trainable_params"] == sum(
        p.numel() for n, p in lora.named_parameters() if "lora_" in n
    )


def test_adapter_loads_with_peft_on_the_hf_export(
    base: tuple[CheckpointRef, Path], lora_run: CheckpointRef
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from training.parallel import fp32_state_dict

    ref, out = base
    recipe = load_recipe("smoke", smoke_overrides(out, *SFT))
    ours = build_model(ref, recipe.finetune)
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


def test_base_weights_stay_frozen(base: tuple[CheckpointRef, Path], lora_run: CheckpointRef) -> None:
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


def test_full_sft(base: tuple[CheckpointRef, Path]) -> None:
    ref, out = base
    full = finetune(out, ref, "finetune.method=full", "finetune.optim.lr=1e-3")
    assert full.adapter is None and full.export_valid
    assert full.summary["sft/heldout_loss_after"] < full.summary["sft/heldout_loss_before"]


def test_sft_data_from_another_tokenizer_is_refused(base: tuple[CheckpointRef, Path], tmp_path: Path) -> None:
    ref, out = base
    other_cfg = DataConfig(max_documents=20, num_workers=1, tokenizer=TokenizerConfig(vocab_size=300))
    other = run_tokenize(other_cfg, tmp_path)
    data = run_sft_data(SFTConfig(max_examples=100), describe(Path(other.tokenizer.path)), 128, tmp_path)
    recipe = load_recipe("smoke", smoke_overrides(out, *SFT))
    with pytest.raises(DataError) as info:
        run_sft(recipe, ref, data)
    assert ref.tokenizer_digest[:16] in str(info.value) and data.tokenizer_digest[:16] in str(info.value)
