"""Imported Hugging Face checkpoints of every supported family: lmforge's model on the imported weights gives
transformers' logits (fp32, max |Δ| ≤ 1e-5) and greedy tokens, and exports back as the same family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.hf_checkpoints import FAMILIES, VOCAB, write_checkpoint
from training.model.accounting import count_parameters
from training.model.hf_interop import load_export
from training.model.sampling import generate

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: write_checkpoint(name, root / name) for name in FAMILIES}


def reference(directory: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize("name", FAMILIES)
def test_imported_logits_equal_transformers(name: str, checkpoints: dict[str, Path]) -> None:
    ours, theirs = load_export(checkpoints[name]), reference(checkpoints[name])
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens).logits, theirs(tokens).logits, rtol=0, atol=1e-5)
    assert count_parameters(ours.cfg).total == sum(p.numel() for p in theirs.parameters())


@pytest.mark.parametrize("name", FAMILIES)
def test_imported_greedy_tokens_equal_transformers(name: str, checkpoints: dict[str, Path]) -> None:
    """Prompt and continuation pass Mistral's 8-token window and the llama3 scaling's 16-token original context."""
    ours, theirs = load_export(checkpoints[name]), reference(checkpoints[name])
    prompt = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    expected = theirs.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=14, do_sample=False, eos_token_id=None
    )
    assert torch.equal(generate(ours, prompt, 14), expected)


@pytest.mark.parametrize("name", ["qwen2", "qwen2_moe", "mixtral", "olmo2"])
def test_export_is_the_source_family(name: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Out again as it came in: model_type, architectures, the same tensor names and shapes (tied stays tied),
    and transformers' logits on the export equal lmforge's."""
    from safetensors import safe_open

    from training.model.export import export_hf

    source = checkpoints[name]
    ours = load_export(source)
    out = tmp_path / "export"
    verification = export_hf(ours.state_dict(), ours.cfg, None, out)
    assert verification["valid"], verification
    before, after = (json.loads((d / "config.json").read_text()) for d in (source, out))
    assert after["model_type"] == before["model_type"]
    assert after["architectures"] == before["architectures"]
    assert after.get("tie_word_embeddings") == before.get("tie_word_embeddings")

    def shapes(directory: Path) -> dict[str, tuple[int, ...]]:
        found = {}
        for file in directory.glob("*.safetensors"):
            with safe_open(str(file), framework="pt") as handle:
                found |= {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118
        return found

    assert shapes(out) == shapes(source)
