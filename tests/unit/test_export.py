"""Exports carry the tokenizer's special-token ids, so `transformers` generation stops where ours does."""

from __future__ import annotations

from pathlib import Path

import torch

from data_pipeline.config import END_OF_TURN
from data_pipeline.tokenizer import describe
from training.model.config import ModelConfig
from training.model.export import export_hf
from training.model.transformer import Transformer


def test_transformers_generation_stops_at_end_of_text(tokenized, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    manifest, _ = tokenized
    tok = describe(Path(manifest.tokenizer.path))
    assert tok.eos_id == 0  # special tokens come first in the vocabulary
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64)
    model = Transformer(cfg, seed=0)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: greedy decoding picks id 0, end-of-text
    assert export_hf(model.state_dict(), cfg, manifest.tokenizer.path, tmp_path / "hf")["valid"]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    end_of_turn = tok.load().token_to_id(END_OF_TURN)
    assert hf.generation_config.eos_token_id == [tok.eos_id, end_of_turn]
    assert hf.config.pad_token_id == tok.pad_id
    prompt = torch.tensor([[5, 6, 7]])
    out = hf.generate(prompt, max_new_tokens=8, do_sample=False)
    assert out[0, 3:].tolist() == [tok.eos_id]  # with Llama's default eos (2) it ran all 8 tokens


def test_linear_attention_exports_in_lmforges_layout_which_hugging_face_refuses(tokenized, tmp_path) -> None:
    """A FAVOR+ model has no Llama equivalent: its export is our config + state dict (projections included),
    verified by lmforge loading it back; Hugging Face finds no config.json, the HF mapping refuses it by name."""
    import pytest
    from transformers import AutoModelForCausalLM

    from training.model.hf_interop import build_hf_model, load_export

    manifest, _ = tokenized
    cfg = ModelConfig(
        vocab_size=describe(Path(manifest.tokenizer.path)).vocab_size,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        attention="favor",
        attention_features=12,
    )
    model = Transformer(cfg, seed=0).eval()
    record = export_hf(model.state_dict(), cfg, manifest.tokenizer.path, tmp_path / "hf")
    assert record["valid"] and record["layout"] == "lmforge" and record["max_abs_logit_diff"] == 0.0
    assert not (tmp_path / "hf" / "config.json").exists() and (tmp_path / "hf" / "tokenizer.json").is_file()
    loaded = load_export(tmp_path / "hf")
    probe = torch.randint(0, cfg.vocab_size, (2, 9))
    assert torch.equal(loaded(probe).logits, model(probe).logits)
    with pytest.raises((OSError, ValueError)):
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="model.attention=favor has no Hugging Face Llama layout"):
        build_hf_model(cfg)


def test_an_moe_export_reads_back_expert_by_expert(tmp_path) -> None:
    """transformers saves Mixtral in its per-expert checkpoint layout; lmforge's loader (what eval, compress and
    distill read) stacks it back: every weight equals the trained model's and the logits agree. A dense export
    reads back the same way."""
    from safetensors.torch import load_file

    from training.model.config import MoEConfig
    from training.model.hf_interop import load_export

    dense = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    moe = dense.model_copy(update={"moe": MoEConfig(n_experts=4, top_k=2, d_ff_expert=24)})
    for cfg in (dense, moe):
        model = Transformer(cfg, seed=0).eval()
        out = tmp_path / ("moe" if cfg.moe else "dense")
        assert export_hf(model.state_dict(), cfg, None, out)["valid"]
        loaded = load_export(out)
        for name, weight in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], weight), name
        probe = torch.randint(0, cfg.vocab_size, (2, 9))
        with torch.no_grad():
            assert torch.equal(loaded(probe).logits, model(probe).logits)
    saved = load_file(tmp_path / "moe" / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in saved  # the layout the loader must stack


def test_an_export_records_the_context_it_was_trained_at(tokenized, tmp_path) -> None:
    """A model trained on 64-token windows of a recipe allowing 128 exports max_position_embeddings 64 and a
    tokenizer whose model_max_length is 64, so evaluation windows (`EvalModel.max_len`) and generation room
    (the pyfunc's) stay inside the positions it was trained on."""
    import json

    from transformers import AutoTokenizer

    from training.model.hf_interop import load_export

    manifest, _ = tokenized
    cfg = ModelConfig(
        vocab_size=describe(Path(manifest.tokenizer.path)).vocab_size,
        d_model=32,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=128,
    )
    model = Transformer(cfg, seed=0)
    assert export_hf(model.state_dict(), cfg.trained_at(64), manifest.tokenizer.path, tmp_path / "hf")[
        "valid"
    ]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["max_position_embeddings"] == 64
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf")).model_max_length == 64
    assert load_export(tmp_path / "hf").cfg.max_seq_len == 64
    assert {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "hf").glob("*.safetensors")} == {
        "model.safetensors": 0o644  # transformers writes 0600
    }
