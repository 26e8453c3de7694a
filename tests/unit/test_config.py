"""Recipes validate; every bad-config rule fails before anything runs, in one line that names the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.recipe import CONFIG_DIR, ConfigError, apply_overrides, load_recipe, parse_override
from training.model.config import ModelConfig

RECIPES = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def test_recipes_exist() -> None:
    assert {"smoke", "demo", "gpt2-small-like", "moe-small"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_validates(name: str) -> None:
    recipe = load_recipe(name)
    assert recipe.name == name
    assert recipe.train.grad_accum_steps(recipe.parallel.world_size) >= 1


def bad(overrides: list[str], recipe: str = "smoke") -> str:
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe, overrides)
    message = str(info.value)
    assert "\n" not in message, f"expected a single line, got:\n{message}"
    return message


def test_d_model_not_divisible_by_n_heads() -> None:
    message = bad(["model.n_heads=5"])
    assert message.startswith("model:") and "n_heads=5 must divide d_model=64" in message
    assert "head_dim would be 12.8" in message


def test_n_heads_not_divisible_by_n_kv_heads() -> None:
    message = bad(["model.n_kv_heads=3"])
    assert "n_kv_heads=3 must divide n_heads=4" in message


def test_odd_head_dim_with_rope() -> None:
    message = bad(["model.d_model=36", "model.n_heads=4", "model.n_kv_heads=4"])
    assert "head_dim=d_model/n_heads=9 must be even for RoPE" in message


def test_top_k_larger_than_n_experts() -> None:
    message = bad(["model.moe.n_experts=2", "model.moe.top_k=3", "model.moe.d_ff_expert=32"])
    assert message.startswith("model.moe:") and "top_k=3 must be <= n_experts=2" in message


def test_unknown_key_suggests_the_closest_field() -> None:
    message = bad(["model.d_modle=64"])
    assert message.startswith("model.d_modle: unknown key; did you mean 'd_model'?")


def test_unknown_top_level_section() -> None:
    assert bad(["trian.max_steps=3"]).startswith("trian: unknown key; did you mean 'train'?")


def test_wrong_type() -> None:
    message = bad(["model.d_model=wide"])
    assert message.startswith("model.d_model:") and "'wide'" in message


def test_negative_size() -> None:
    message = bad(["model.n_layers=-2"])
    assert message.startswith("model.n_layers:") and "greater than 0" in message


def test_unknown_precision_lists_choices() -> None:
    message = bad(["parallel.precision=fp8"])
    assert message.startswith("parallel.precision:") and "'bf16'" in message


def test_zero_stage_out_of_range() -> None:
    assert bad(["parallel.zero_stage=4"]).startswith("parallel.zero_stage:")


def test_ep_size_must_divide_experts() -> None:
    message = bad(["parallel.ep_size=2", "parallel.world_size=2", "model.moe.n_experts=3"], "moe-small")
    assert "parallel.ep_size=2 must divide model.moe.n_experts=3" in message


def test_ep_size_must_divide_world_size() -> None:
    assert "ep_size=2 must divide world_size=3" in bad(["parallel.world_size=3"], "moe-small")


def test_ep_size_without_experts() -> None:
    assert "needs MoE layers" in bad(["parallel.ep_size=2", "parallel.world_size=2"])


def test_batch_arithmetic() -> None:
    message = bad(["train.global_batch_size=10"])
    assert "train.global_batch_size=10 must be a multiple of train.micro_batch_size=4" in message


def test_seq_len_beyond_context() -> None:
    assert "train.seq_len=256 exceeds model.max_seq_len=128" in bad(["train.seq_len=256"])


def test_vocab_mismatch() -> None:
    message = bad(["data.tokenizer.vocab_size=1024"])
    assert "data.tokenizer.vocab_size=1024 exceeds model.vocab_size=512" in message


def test_depth_clashes_with_explicit_width() -> None:
    assert "depth=2 derives n_heads" in bad(["model.n_heads=8"], "demo")


def test_several_problems_one_line_each() -> None:
    with pytest.raises(ConfigError) as info:
        load_recipe("smoke", ["model.d_model=-1", "train.max_steps=0"])
    lines = str(info.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["model.d_model", "train.max_steps"]


def test_missing_recipe_lists_available() -> None:
    with pytest.raises(ConfigError, match="available: .*smoke"):
        load_recipe("no-such-recipe")


def test_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_recipe(path)


def test_overrides_parse_yaml_types() -> None:
    assert parse_override("optim.lr=0.001") == (["optim", "lr"], 1e-3)
    assert (
        load_recipe("smoke", ["optim.lr=1e-3"]).optim.lr == 1e-3
    )  # YAML 1.1 reads 1e-3 as text; pydantic converts
    assert parse_override("model.tie_embeddings=true") == (["model", "tie_embeddings"], True)
    data = apply_overrides({"model": {"d_model": 64}}, ["model.moe.top_k=1", "name=x"])
    assert data == {"model": {"d_model": 64, "moe": {"top_k": 1}}, "name": "x"}
    with pytest.raises(ConfigError, match="section.field=value"):
        parse_override("train.max_steps")


def test_override_changes_the_recipe_and_its_digest() -> None:
    base, changed = load_recipe("smoke"), load_recipe("smoke", ["train.max_steps=7"])
    assert changed.train.max_steps == 7
    assert base.digest() != changed.digest() and base.digest() == load_recipe("smoke").digest()


def test_configs_are_frozen() -> None:
    recipe = load_recipe("smoke")
    with pytest.raises(Exception, match="frozen"):
        recipe.model.d_model = 8  # type: ignore[misc]


def test_depth_dial_scales_width_with_depth() -> None:
    small, large = ModelConfig.from_depth(2), ModelConfig.from_depth(8)
    assert (small.d_model, small.n_layers, small.n_heads) == (128, 2, 2)
    assert (large.d_model, large.n_layers, large.n_heads) == (512, 8, 8)
    assert large.d_ff % 32 == 0 and large.d_ff >= 8 * large.d_model / 3
    gqa = ModelConfig.from_depth(4, kv_ratio=2, vocab_size=1000)
    assert gqa.n_kv_heads * 2 == gqa.n_heads and gqa.vocab_size == 1000


def test_depth_dial_in_a_recipe_can_be_switched_off() -> None:
    explicit = ["model.depth=null", "model.d_model=64", "model.n_layers=2", "model.n_heads=2"]
    recipe = load_recipe("demo", [*explicit, "model.n_kv_heads=2", "model.d_ff=128"])
    assert recipe.model.d_model == 64


def test_expert_parallel_needs_top_k_of_two_or_more() -> None:
    assert "top-1 gate does not renormalise" in bad(["model.moe.top_k=1"], "moe-small")


def test_an_override_that_is_not_yaml_is_one_line_naming_the_fix() -> None:
    message = bad(["data.sources=[*.txt]"])
    assert "not valid YAML" in message and "data.sources=['*.txt']" in message
    assert load_recipe("smoke", ["data.sources=['*.txt']"]).data.sources == ("*.txt",)


def test_muon_with_clipping_under_zero_is_refused():
    message = bad(["optim.name=muon", "parallel.zero_stage=1"])
    assert "clips Muon's orthogonalised update" in message and "optim.grad_clip=0" in message
    assert "sft.optim.grad_clip=0" in bad(["sft.optim.name=muon", "parallel.zero_stage=2"])
    load_recipe("smoke", ["optim.name=muon", "optim.grad_clip=0", "parallel.zero_stage=1"])
    load_recipe("smoke", ["optim.name=muon", "parallel.zero_stage=0"])  # ZeRO-0: clipping precedes Muon


@pytest.mark.parametrize("name", ["soap", "shampoo", "kron", "kfac"])
def test_matrix_optimisers_under_zero_are_refused(name: str) -> None:
    message = bad([f"optim.name={name}", "parallel.zero_stage=2"])
    assert "flat 1-D partitions" in message and "parallel.zero_stage=0" in message
    finetune = bad([f"sft.optim.name={name}", "parallel.zero_stage=1"])
    assert finetune.startswith("sft.optim.name=") or "sft.optim.name=" in finetune


@pytest.mark.parametrize("name", ["soap", "kfac"])
def test_a_spec_built_without_a_recipe_refuses_a_matrix_optimiser_under_zero(name: str) -> None:
    """The libraries' own check, not only the recipe's: a spec built directly (a notebook, a benchmark) is
    refused too, and μP with a matrix optimiser where the spec holds the model."""
    from pydantic import ValidationError

    from training.config import ParallelConfig, PretrainSpec

    spec = load_recipe("smoke").pretrain_spec()
    fields = {**dict(spec), "optim": spec.optim.model_copy(update={"name": name})}
    with pytest.raises(ValidationError, match="flat 1-D partitions"):
        PretrainSpec(**{**fields, "parallel": ParallelConfig(zero_stage=2)})
    with pytest.raises(ValidationError, match="μP's per-width learning rates"):
        PretrainSpec(**{**fields, "model": load_recipe("demo").model})
    PretrainSpec(**fields)  # ZeRO-0, no μP: accepted


def test_matrix_settings_need_a_matrix_optimiser_and_kfac_refuses_fp16() -> None:
    assert "a setting of the matrix optimisers" in bad(["optim.matrix_lr=0.01"])
    assert "loss scale" in bad(["optim.name=kfac", "parallel.precision=fp16"])
    assert "μP" in bad(["optim.name=soap", "model.mup.base_width=32"])
    assert load_recipe("smoke", ["optim.name=kfac", "optim.damping=0.01"]).optim.damping == 0.01


def test_a_file_uri_output_dir_is_its_absolute_path() -> None:
    """`output_dir=file:///abs` writes to /abs (it made a relative directory named `file:`); a relative one is
    refused naming the form."""
    assert load_recipe("smoke", ["output_dir=file:///tmp/lmforge-out"]).output_dir == "/tmp/lmforge-out"
    with pytest.raises(ValueError, match="a file:// URI needs an absolute path"):
        load_recipe("smoke", ["output_dir=file://outputs"])


def test_elastic_worker_counts_keep_the_global_batch() -> None:
    from training.config import ParallelConfig, TrainConfig, worker_counts

    def counts(world: int, min_workers: int | None, global_batch: int | None = 8, ep: int = 1) -> list[int]:
        train = TrainConfig(micro_batch_size=2, global_batch_size=global_batch)
        parallel = ParallelConfig(world_size=world, min_workers=min_workers, ep_size=ep, zero_stage=2)
        return worker_counts(train, parallel)

    # 4 micro-batches of 2 per step split over 4, 2 or 1 workers, not 3
    assert counts(4, 1) == [4, 2, 1] and counts(4, 2) == [4, 2] and counts(4, None) == [4]
    # without a set global batch the run's batch follows its workers: another count would be another run
    assert counts(4, 1, global_batch=None) == [4]
    assert counts(4, 1, ep=2) == [4, 2]  # the experts split into groups of ep_size
    assert "min_workers=5 exceeds parallel.world_size=4" in bad(
        ["parallel.world_size=4", "parallel.min_workers=5"]
    )
    moe = ["parallel.min_workers=1", "parallel.zero_stage=0"]  # moe-small: 2 workers, ep_size 2
    assert "needs parallel.zero_stage 1 or 2" in bad(moe, "moe-small")


def test_an_expert_parallel_checkpoint_without_partitions_is_refused_on_another_layout(tmp_path) -> None:
    from training.parallel.reshard import LayoutError, check_layout_change

    (tmp_path / "state").mkdir()
    for rank in range(2):  # fp32 ZeRO-0 with experts spread: each rank's torch optimiser state, whole
        (tmp_path / "state" / f"expp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
    two, one = {"world_size": 2, "ep_size": 2}, {"world_size": 1, "ep_size": 1}
    with pytest.raises(LayoutError, match="rerun with parallel.world_size=2 parallel.ep_size=2") as info:
        check_layout_change(tmp_path / "state", two, one)
    assert "\n" not in str(info.value) and "fp32 ZeRO-0" in str(info.value)
    check_layout_change(tmp_path / "state", {"world_size": 2, "ep_size": 1}, one)  # dense: loads whole
    for rank in range(2):
        (tmp_path / "state" / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
    check_layout_change(tmp_path / "state", two, one)  # ZeRO 1-2 / bf16 partitions: resharded
    (tmp_path / "state" / "zero_pp_rank_0_mp_rank_00_model_states.pt").touch()
    with pytest.raises(LayoutError, match="not ZeRO-3"):
        check_layout_change(tmp_path / "state", two, one)


def test_a_recipe_extends_its_base_key_by_key(tmp_path: Path) -> None:
    """`base:` merges mappings key by key, replaces lists and values, keeps the child's own name; a chain works,
    a loop or a base that is not one recipe's name is refused in one line."""
    (tmp_path / "wide.yaml").write_text("base: demo\nsweep: {seeds: [0, 1], budgets: [4.0e+11]}\n")
    (tmp_path / "wider.yaml").write_text("base: wide.yaml\noptim: {lr: 4.0e-3}\n")
    demo, wider = load_recipe("demo"), load_recipe(tmp_path / "wider.yaml")
    assert wider.name == "wider" and wider.optim.lr == 4.0e-3 and wider.optim.schedule == demo.optim.schedule
    assert wider.sweep.seeds == [0, 1] and wider.sweep.budgets == [4.0e11]  # lists replaced
    assert wider.sweep.sizes == demo.sweep.sizes and wider.model == demo.model  # the rest inherited
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"bases form a loop \(a.yaml -> b.yaml -> a.yaml\)"):
        load_recipe(tmp_path / "a.yaml")
    (tmp_path / "two.yaml").write_text("base: [demo, smoke]\n")
    with pytest.raises(ConfigError, match="base must name one recipe"):
        load_recipe(tmp_path / "two.yaml")
