"""Compressed variants on a tiny random model: each method's storage loads back bit for bit (lmforge and Hugging
Face), sizes are what the format says, pruning zeroes what its rule says, and bad settings are refused naming the
setting or the layer."""

from __future__ import annotations

import pytest
import torch

from training.compress.config import VariantConfig
from training.compress.model_level import linear_layers, model_bytes
from training.compress.prune import n_m_mask
from training.compress.quantize import pack_codes, unpack_codes
from training.compress.variants import build_variant, load_variant, lowrank_ranks, save_variant, weight_files
from training.model.config import ModelConfig
from training.model.export import export_hf, probe_tokens
from training.model.transformer import Transformer

CFG = ModelConfig(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=2,
    n_kv_heads=2,
    d_ff=64,
    max_seq_len=16,
    tie_embeddings=True,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, its verified Hugging Face export, calibration batches)."""
    model = Transformer(CFG, seed=0).eval()
    export = tmp_path_factory.mktemp("tiny") / "hf"
    assert export_hf(model.state_dict(), CFG, None, export)["valid"]
    g = torch.Generator().manual_seed(0)
    return model, export, [torch.randint(0, 64, (4, 16), generator=g) for _ in range(3)]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_codes_pack_to_their_bit_width_and_back(bits):
    codes = torch.randint(0, 2**bits, (5, 24), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.numel() == -(-codes.numel() * bits // 8)
    assert torch.equal(unpack_codes(packed, bits, (5, 24)), codes)


@pytest.mark.parametrize(
    "settings",
    [
        {"method": "int8-weight"},
        {"method": "int8-dynamic"},
        {"method": "int4", "group_size": 16},
        {"method": "rtn", "bits": 3, "group_size": 8},
        {"method": "gptq", "bits": 4, "group_size": 16},
        {"method": "lowrank", "rank": 4},
        {"method": "magnitude", "sparsity": 0.3},
        {"method": "wanda", "pattern": "2:4"},
    ],
)
def test_a_variant_saves_verifies_and_loads_back_exactly(tiny, tmp_path, settings):
    model, export, calibration = tiny
    variant = VariantConfig(**settings)
    compressed, _ = build_variant(model, variant, lambda: calibration)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the base is left as it was
    verification = save_variant(compressed, variant, export, tmp_path / variant.name)
    assert verification["valid"], verification
    back = load_variant(tmp_path / variant.name, variant.method)
    tokens = probe_tokens(CFG)
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, compressed(tokens).logits)
    assert model_bytes(back) == model_bytes(compressed)


def test_sizes_follow_the_storage_format(tiny, tmp_path):
    """4-bit codes weigh half a byte per weight on disk (plus group scales and zero points); in memory torchao
    holds one int8 per weight; int8 weight-only one byte per weight plus a scale and a zero point per row."""
    model, export, calibration = tiny
    layers = linear_layers(model)
    weights = sum(layer.weight.numel() for layer in layers.values())
    rows = sum(layer.weight.shape[0] for layer in layers.values())
    rest = model_bytes(model) - 4 * weights  # embeddings (tied head once) and norms, kept in fp32
    variant = VariantConfig(method="rtn", bits=4, group_size=16)
    compressed, _ = build_variant(model, variant, lambda: calibration)
    save_variant(compressed, variant, export, tmp_path / "rtn")
    groups = weights // 16
    (packed,) = weight_files(tmp_path / "rtn")
    assert packed.name == "packed.safetensors"
    payload = weights // 2 + groups * 4 + groups * 1  # codes, fp32 scales, int8 zero points
    header = 8 + int.from_bytes(packed.read_bytes()[:8], "little")  # safetensors: length, JSON header, data
    assert packed.stat().st_size - header == payload + rest
    assert model_bytes(compressed) == rest + weights + groups * 8  # int8 codes, fp32 scales and zero points
    int8, _ = build_variant(model, VariantConfig(method="int8-weight"), lambda: calibration)
    assert model_bytes(int8) == rest + weights + rows * 5  # an fp32 scale and an int8 zero point per row


def test_pruning_zeroes_what_its_rule_says(tiny):
    model, _, calibration = tiny
    pruned, details = build_variant(
        model, VariantConfig(method="magnitude", sparsity=0.25), lambda: calibration
    )
    for name, layer in linear_layers(pruned).items():
        original = linear_layers(model)[name].weight
        zero = layer.weight == 0
        assert zero.float().mean() == pytest.approx(0.25, abs=1 / original.numel())
        assert original.abs()[zero].max() <= original.abs()[~zero].min()  # the smallest magnitudes went
    assert details["density"] == pytest.approx(0.75, abs=0.01)
    two_four, _ = build_variant(model, VariantConfig(method="magnitude", pattern="2:4"), lambda: calibration)
    for layer in linear_layers(two_four).values():
        assert ((layer.weight != 0).reshape(layer.weight.shape[0], -1, 4).sum(-1) == 2).all()
    assert torch.equal(
        n_m_mask(torch.tensor([[4.0, 1.0, 3.0, 2.0]])), torch.tensor([[True, False, True, False]])
    )


def test_wanda_ranks_by_weight_times_input_norm(tiny):
    """torchao's Wanda, fed our calibration batches, prunes exactly the lowest |W_ij|·‖X_j‖₂² of each layer
    (torchao's observer keeps the squared norm and compares across the whole layer; the paper uses ‖X_j‖₂ within
    each output row)."""
    model, _, calibration = tiny
    inputs: dict[str, list[torch.Tensor]] = {}
    layers = linear_layers(model)
    hooks = [
        layer.register_forward_hook(
            lambda m, a, o, n=name: inputs.setdefault(n, []).append(a[0].reshape(-1, a[0].shape[-1]))
        )
        for name, layer in layers.items()
    ]
    with torch.no_grad():
        for tokens in calibration:
            model(tokens)
    for hook in hooks:
        hook.remove()
    pruned, _ = build_variant(model, VariantConfig(method="wanda", sparsity=0.5), lambda: calibration)
    for name, layer in linear_layers(pruned).items():
        squared_norms = torch.cat(inputs[name]).square().sum(dim=0)
        score = layers[name].weight.abs() * squared_norms
        kept = layer.weight != 0
        assert kept.float().mean() == pytest.approx(0.5, abs=0.01)
        assert score[~kept].max() <= score[kept].min() * (1 + 1e-5)


def test_lowrank_ranks_and_bounds(tiny):
    model, _, calibration = tiny
    ranks = lowrank_ranks(model, {"energy": 0.5})
    assert all(r is None or r < 32 for r in ranks.values())
    factored, details = build_variant(model, VariantConfig(method="lowrank", rank=3), lambda: calibration)
    for info in details["layers"].values():  # Eckart–Young: the error is exactly the discarded spectrum
        assert info["error"] == pytest.approx(info["bound"], rel=1e-5)
    budget = lowrank_ranks(model, {"budget": 0.3})
    stored = sum(
        (r * sum(layer.weight.shape) if r else layer.weight.numel())
        for (name, layer), r in zip(linear_layers(model).items(), budget.values(), strict=True)
    )
    assert stored <= 0.3 * sum(layer.weight.numel() for layer in linear_layers(model).values()) * 1.5
    with pytest.raises(
        ValueError, match=r"model.layers.0.self_attn.q_proj: lowrank rank 40 is above min\(m, n\) = 32"
    ):
        build_variant(model, VariantConfig(method="lowrank", rank=40), lambda: calibration)


def test_bad_settings_are_refused_naming_the_problem(tiny):
    model, _, calibration = tiny
    with pytest.raises(ValueError, match=r"5-bit quantization is not supported; use one of \(2, 3, 4, 8\)"):
        VariantConfig(method="gptq", bits=5)
    with pytest.raises(ValueError, match=r"pruning sparsity 1.0 is outside \[0, 1\)"):
        VariantConfig(method="magnitude", sparsity=1.0)
    with pytest.raises(ValueError, match="bits is not a setting of lowrank"):
        VariantConfig(method="lowrank", bits=4)
    with pytest.raises(ValueError, match="2:4 pruning zeroes exactly half"):
        VariantConfig(method="wanda", pattern="2:4", sparsity=0.3)
    with pytest.raises(ValueError, match="group size 24 does not divide its 32 input columns"):
        build_variant(model, VariantConfig(method="gptq", group_size=24), lambda: calibration)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj: group size 24"):
        build_variant(model, VariantConfig(method="int4", group_size=24), lambda: calibration)


def test_a_damaged_variant_is_rebuilt_not_read(tiny, tmp_path):
    """A finished stage whose packed codes were truncated afterwards is damaged; the stage rebuilds that variant."""
    from training.stages.compress import VariantRecord, record_of

    model, export, calibration = tiny
    variant = VariantConfig(method="gptq", bits=3, group_size=16)
    compressed, _ = build_variant(model, variant, lambda: calibration)
    save_variant(compressed, variant, export, tmp_path / variant.name)
    record = record_of(variant.name, variant.method, variant.settings(), tmp_path / variant.name, 0, 0.0, {})
    assert set(record.files) == {"packed.safetensors"} and record.damage() is None
    packed = tmp_path / variant.name / "packed.safetensors"
    packed.write_bytes(packed.read_bytes()[:100])
    assert "truncated or replaced" in VariantRecord.model_validate_json(record.model_dump_json()).damage()


def test_the_registered_variant_is_the_smallest_served_export_and_ties_go_to_the_lower_loss():
    """rtn and gptq at 4 bits serve exports of equal bytes: GPTQ's lower loss wins; int8 serves fewer bytes
    than a 4-bit export stored as int8 codes plus scales, though lmforge's own packed 4-bit file is smaller."""
    from evaluation.config import LOSS
    from evaluation.frontier import choose

    def row(name: str, disk: int, served: int, loss: float) -> dict:
        return {
            "name": name,
            "disk_bytes": disk,
            "served_bytes": served,
            "export_valid": True,
            "relative": {LOSS: loss},
        }

    reference = row("uncompressed", 1000, 1000, 0.0)
    rtn, gptq = row("rtn-w4g16", 470, 580, 0.0101), row("gptq-w4g16", 470, 580, 0.0062)
    assert choose([reference, rtn, gptq], tolerance=0.02) == "gptq-w4g16"
    assert choose([reference, rtn, gptq, row("int8-weight", 530, 530, 0.0)], tolerance=0.02) == "int8-weight"
    assert choose([reference, rtn, gptq], tolerance=0.005) is None
