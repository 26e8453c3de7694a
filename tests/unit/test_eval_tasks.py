"""Evaluation building blocks on a tiny random model: scoring against transformers, task files and their
errors, truncation reporting, the tokenizer check, effective rank."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from data_pipeline.sources import DataError
from data_pipeline.tokenizer import describe
from evaluation.model_io import EvalModel, load_for_eval
from evaluation.scoring import generate_greedy, generate_text, rolling_windows, score_continuations
from evaluation.spectra import effective_rank
from evaluation.tasks import Task, load_task, run_task, stdlib_import_task
from training.model.config import ModelConfig
from training.model.export import export_hf
from training.model.hf_interop import load_export
from training.model.sampling import greedy_each
from training.model.transformer import Transformer
from training.stages.lifecycle import TrainedModel

CFG = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32)


@pytest.fixture(scope="module")
def export(tokenized, tmp_path_factory) -> tuple[Path, TrainedModel]:
    manifest, _ = tokenized
    cfg = ModelConfig(vocab_size=manifest.tokenizer.vocab_size, **CFG)
    model = Transformer(cfg, seed=3)
    out = tmp_path_factory.mktemp("export") / "hf"
    verification = export_hf(model.state_dict(), cfg, manifest.tokenizer.path, out)
    ref = TrainedModel(
        path=str(out.parent),
        kind="pretrain",
        checkpoint="",
        hf_export=str(out),
        export_valid=verification["valid"],
        max_abs_logit_diff=verification["max_abs_logit_diff"],
        step=0,
        final_val_loss=None,
        tokenizer_digest=manifest.tokenizer.digest,
        mlflow_run_id=None,
        key="x",
        model=cfg.model_dump(),
    )
    return out, ref


@pytest.fixture(scope="module")
def em(export) -> EvalModel:
    return load_for_eval(export[1], "tiny")


def test_continuation_scores_equal_transformers(export, em):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(export[0]), dtype=torch.float32).eval()
    requests = [
        ([5, 9, 200], [17, 4]),
        ([7], [300, 301, 302]),
        (list(range(1, 40)), [11]),
    ]  # the last is truncated
    scored = score_continuations(em.model, requests, batch_size=2)
    for (context, cont), s in zip(requests, scored, strict=True):
        seq = (context + cont)[-(em.max_len + 1) :]
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([seq[:-1]])).logits[0].float(), -1)
        want = sum(float(logp[len(seq) - 1 - len(cont) + j, t]) for j, t in enumerate(cont))
        assert s.logprob == pytest.approx(want, abs=1e-4)
        assert s.n_tokens == len(cont)
    assert [s.truncated for s in scored] == [False, False, True]


def test_rolling_windows_predict_every_token_once():
    windows = rolling_windows(list(range(10, 30)), start_id=0, window=8)
    predicted = [t for _, cont in windows for t in cont]
    assert predicted == list(range(10, 30))
    assert all(len(ctx) == 1 and len(cont) <= 8 for ctx, cont in windows)


def test_load_export_roundtrip(export, em):
    again = load_export(export[0])
    tokens = torch.randint(0, 100, (1, 8))
    torch.testing.assert_close(again(tokens).logits, em.model(tokens).logits, rtol=0, atol=0)


def test_tokenizer_mismatch_is_refused(export, tmp_path):
    path, ref = export
    copy = tmp_path / "hf"
    shutil.copytree(path, copy)
    data = json.loads((copy / "tokenizer.json").read_text())
    data["added_tokens"].append({**data["added_tokens"][-1], "id": 99999, "content": "<|other|>"})
    (copy / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match="is not the tokenizer it was trained with"):
        load_for_eval(ref.model_copy(update={"hf_export": str(copy)}), "x")
    with pytest.raises(DataError, match="no verified Hugging Face export"):
        load_for_eval(ref.model_copy(update={"export_valid": False}), "x")


def test_multiple_choice_and_generation_tasks(em, tmp_path):
    mc = tmp_path / "mc.jsonl"
    mc.write_text(
        "\n".join(
            json.dumps({"prompt": "x =", "choices": [" 1", " 2", " 3"], "answer": i % 3}) for i in range(6)
        )
    )
    result = run_task(em, load_task(mc), batch_size=4, max_new_tokens=4)
    assert result["n"] == 6 and 0 <= result["acc"] <= 1 and result["truncated"] == 0
    # the model's favourite choice is the same for every item, so accuracy is exactly 1/3
    assert result["acc"] == pytest.approx(1 / 3)
    gen = tmp_path / "gen.jsonl"
    gen.write_text(
        json.dumps({"prompt": "a" * 200, "target": " b"}) + "\n" + json.dumps({"prompt": "c", "target": " d"})
    )
    result = run_task(em, load_task(gen), batch_size=4, max_new_tokens=4)
    assert (
        result["n"] == 2 and result["truncated"] == 1
    )  # the 200-character prompt exceeds the 32-token context
    assert math.isfinite(result["response_loss"]) and result["response_loss"] > 0


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_batched_greedy_generation_gives_each_prompts_own_ids(attention):
    """Prompts of 1 to 40 tokens (40: cut to the context's room), two to a left-padded batch, longest first: each
    prompt's ids, stop and truncation flag as generated alone, in the prompts' order (linear attention: one at a
    time)."""
    # weights drawn wide, so that every token of the context moves the next one
    model = Transformer(ModelConfig(vocab_size=64, attention=attention, init_std=0.5, **CFG), seed=3).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (5, 1, 40, 12, 7)]
    eos = generate_text(model, prompts[3], 8, None)[0][2]  # a token one prompt generates third
    alone = [generate_text(model, p, 8, eos) for p in prompts]
    assert generate_greedy(model, prompts, 8, eos, batch_size=2) == alone
    assert [cut for _, cut in alone] == [False, False, True, False, False] and len(alone[3][0]) == 2


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_greedy_continuations_with_budgets_of_their_own_are_each_prompts_alone(attention):
    """Prompts of 25, 20, 10 and 3 tokens given 7, 8, 12 and 25 new tokens (SFT's exact match: each reference's
    length) in a 32-token context: a batch closes where the next prompt's budget would not fit beside its longest;
    each continuation is the prompt's alone, cut at its budget and before the stop token. A prompt that does not fit
    with its budget is refused."""
    model = Transformer(ModelConfig(vocab_size=64, attention=attention, init_std=0.5, **CFG), seed=3).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (20, 3, 25, 10)]
    budgets = [8, 25, 7, 12]
    eos = generate_text(model, prompts[3], 12, None)[0][4]  # a token one prompt generates fifth
    alone = [generate_text(model, p, b, eos)[0] for p, b in zip(prompts, budgets, strict=True)]
    assert greedy_each(model, prompts, budgets, eos, batch_size=4) == alone
    assert [len(ids) for ids in alone] != budgets  # one stopped early
    with pytest.raises(ValueError, match="do not fit in 32"):
        greedy_each(model, [prompts[2]], [8], eos)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (
            ['{"prompt": "a", "choices": [" x", " y"], "answer": 0}', "{not json"],
            r"bad\.jsonl:2: not valid JSON",
        ),
        (
            ['{"prompt": "a", "choices": [" x"], "answer": 0}'],
            r"bad\.jsonl:1: \"choices\" must be a list of at least two",
        ),
        (
            ['{"prompt": "a", "choices": [" x", " y"], "answer": 5}'],
            r"bad\.jsonl:1: \"answer\" must be the index",
        ),
        (
            ['{"prompt": "a", "target": " b"}', '{"prompt": "a", "choices": [" x", " y"], "answer": 0}'],
            r"bad\.jsonl:2: a mc item in a gen task",
        ),
        (['{"text": "a"}'], r"bad\.jsonl:1: each line needs a string \"prompt\""),
        (["", "  "], r"has no items"),
    ],
)
def test_malformed_task_files_name_file_and_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(DataError, match=message):
        load_task(path)


def test_builtin_stdlib_task_is_deterministic_and_well_formed():
    a, b = stdlib_import_task(30, seed=1), stdlib_import_task(30, seed=1)
    assert a == b and isinstance(a, Task) and len(a.items) == 30
    for item in a.items:
        assert item.prompt.startswith("from ") and len(set(item.choices)) == 4
    assert stdlib_import_task(30, seed=2) != a


def test_the_stdlib_names_are_parsed_once_per_python_installation(tmp_path, monkeypatch):
    """The parse (~2 s) is kept in the cache directory for later processes; a damaged copy is parsed again."""
    from evaluation import tasks

    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path))
    parses, parse = [], tasks._parse_public_names
    monkeypatch.setattr(tasks, "_parse_public_names", lambda: parses.append(1) or parse())
    tasks._kept_names().parent.mkdir(parents=True)
    tasks._kept_names().write_text('{"os": ')  # what a crash mid-write would leave, without the atomic write
    try:
        tasks.stdlib_public_names.cache_clear()
        parsed = tasks.stdlib_public_names()
        tasks.stdlib_public_names.cache_clear()  # as a new process
        assert tasks.stdlib_public_names() == parsed and len(parses) == 1
        assert "json" in parsed and "dumps" in parsed["json"] and not any(m.startswith("_") for m in parsed)
    finally:
        tasks.stdlib_public_names.cache_clear()


def test_effective_rank():
    assert effective_rank(torch.ones(8)) == pytest.approx(8.0)
    assert effective_rank(torch.tensor([1.0, 0, 0, 0])) == pytest.approx(1.0)
    w = torch.randn(16, 4) @ torch.randn(4, 16)
    assert effective_rank(torch.linalg.svdvals(w)) <= 4 + 1e-6


def test_describe_of_export_matches_training_tokenizer(export, tokenized):
    assert describe(export[0]).digest == tokenized[0].tokenizer.digest


def test_expert_load_shares_sum_to_one_per_layer():
    from evaluation.spectra import expert_load, load_imbalance, weight_spectra
    from training.model.config import MoEConfig

    cfg = ModelConfig(vocab_size=64, **CFG, moe=MoEConfig(n_experts=4, top_k=2, d_ff_expert=32))
    model = Transformer(cfg, seed=1).eval()
    load = expert_load(model, [torch.randint(0, 64, (2, 16)) for _ in range(3)])
    assert len(load) == cfg.n_layers
    for shares in load.values():
        assert len(shares) == 4 and sum(shares) == pytest.approx(1.0)
        assert 1.0 <= load_imbalance(shares) <= 4.0
    spectra = weight_spectra(model)
    assert any(".experts." in k for k in spectra) and all(v["effective_rank"] > 0 for v in spectra.values())


def test_an_rl_models_reward_gate_passes_only_on_a_gain_beyond_its_draws_noise() -> None:
    """The held-out reward rose in both cases; the gate reads the lower end of the gain's paired 95% interval
    against the base's 0, so a rise inside the noise (the demo's, with one completion a prompt) does not pass."""
    from types import SimpleNamespace

    from evaluation.config import EvalConfig
    from evaluation.gates import gate_results
    from evaluation.report import EvalReport, rl_metrics

    base = SimpleNamespace(path="/runs/sft", kind="lora", base_run_dir=None, summary={}, export_valid=True)
    for low, passes in ((0.018, True), (-0.046, False)):
        summary = {
            "rl/heldout_reward_before": -0.248,
            "rl/heldout_reward_after": -0.242,
            "rl/heldout_reward_gain_low": low,
            "rl/heldout_kl": 0.04,
        }
        rl = SimpleNamespace(
            path="/runs/rl", kind="rl-full", base_run_dir="/runs/sft", summary=summary, export_valid=True
        )
        columns = rl_metrics([base, rl], ["lora", "rl-full"])
        assert columns["lora"]["rl/heldout_reward_gain_low"] == 0.0
        metrics = {
            metric: {name: values[metric] for name, values in columns.items()}
            for metric in columns["rl-full"]
        }
        gates, _ = gate_results(
            EvalReport.model_construct(models={}, metrics=metrics), "rl-full", "lora", rl, EvalConfig()
        )
        assert gates["rl/heldout_reward_gain_low"] is passes, (low, gates)


def test_gates_compare_in_each_metrics_direction_and_name_what_was_not_measured() -> None:
    from types import SimpleNamespace

    from evaluation.config import EvalConfig, Gate
    from evaluation.gates import describe_gates, gate_results
    from evaluation.report import EvalReport

    assert Gate(metric="heldout/all/bits_per_byte", tolerance=0.02).passes(1.02, 1.0)
    assert not Gate(metric="heldout/all/bits_per_byte", tolerance=0.02).passes(1.03, 1.0)
    assert not Gate(metric="x/response_loss", improve=True).passes(2.0, 2.0)
    assert Gate(metric="stdlib-import-mc/acc", tolerance=0.1).passes(0.36, 0.40)
    assert not Gate(metric="stdlib-import-mc/acc").passes(0.37, 0.40)

    report = EvalReport.model_construct(
        models={},
        metrics={
            "heldout/all/bits_per_byte": {"pretrain": 2.0, "lora": 2.2},
            "stdlib-import-mc/acc": {"pretrain": 0.4, "lora": 0.45},
        },
    )
    cfg = EvalConfig()
    ref = SimpleNamespace(export_valid=True, kind="lora")
    gates, skipped = gate_results(report, "lora", "pretrain", ref, cfg)
    assert gates == {
        "export_verified": True,
        "heldout/all/bits_per_byte": False,
        "stdlib-import-mc/acc": True,
    }
    assert skipped == ["sft-heldout-em/response_loss", "sft-heldout-em/stop_rate"]
    assert describe_gates(gates, skipped) == (
        "checked export_verified pass, heldout/all/bits_per_byte FAIL, stdlib-import-mc/acc pass; "
        "not checked (not measured): sft-heldout-em/response_loss, sft-heldout-em/stop_rate"
    )
    # a preference-tuned candidate: the log-prob margin must grow, accuracy must not fall, response loss within 5%
    report = EvalReport.model_construct(
        models={},
        metrics={
            "preference-heldout/accuracy": {"lora": 0.80, "dpo-full": 0.90},
            "preference-heldout/logp_margin": {"lora": 10.0, "dpo-full": 9.0},
            "sft-heldout-em/response_loss": {"lora": 2.0, "dpo-full": 2.12},
            "heldout/all/bits_per_byte": {"lora": 2.0, "dpo-full": 2.01},
            "sft-heldout-em/stop_rate": {"lora": 0.95, "dpo-full": 0.85},
        },
    )
    dpo = SimpleNamespace(export_valid=True, kind="dpo-full")
    gates, skipped = gate_results(report, "dpo-full", "lora", dpo, cfg)
    assert (
        gates
        == {
            "export_verified": True,
            "preference-heldout/logp_margin": False,  # a margin must grow
            "preference-heldout/accuracy": True,
            "sft-heldout-em/stop_rate": False,  # ends its turn on 85% of the prompts: below 90%, whatever the base's
            "sft-heldout-em/response_loss": False,  # 6% worse
            "heldout/all/bits_per_byte": True,
        }
    )
    assert skipped == []


def test_the_gates_walk_the_candidates_lineage() -> None:
    """An RL model tuned from a LoRA SFT that forgot the pretraining text: against its own base it passes, but the
    SFT before it is gated against the pretrained model by the SFT's gates, and fails. Without replay the demo's
    SFT read 9.6% more bits per byte than its base, the RL model 0.6% more than the SFT (README)."""
    from types import SimpleNamespace

    from evaluation.config import EvalConfig
    from evaluation.gates import gate_results
    from evaluation.report import EvalReport

    models = {
        "pretrain": {"run_dir": "/runs/pretrain", "kind": "pretrain", "base_run_dir": None},
        "lora": {"run_dir": "/runs/sft", "kind": "lora", "base_run_dir": "/runs/pretrain"},
        "rl-full": {"run_dir": "/runs/rl", "kind": "rl-full", "base_run_dir": "/runs/sft"},
    }
    report = EvalReport.model_construct(
        models=models,
        metrics={
            "heldout/all/bits_per_byte": {"pretrain": 1.8115, "lora": 1.9857, "rl-full": 1.9985},
            "sft-heldout-em/response_loss": {"pretrain": 3.438, "lora": 2.630, "rl-full": 2.652},
            "stdlib-import-mc/acc": {"pretrain": 0.35, "lora": 0.34, "rl-full": 0.33},
            "rl/heldout_reward_gain_low": {"lora": 0.0, "rl-full": 0.018},
            "sft-heldout-em/stop_rate": {"pretrain": 0.0, "lora": 0.95, "rl-full": 0.92},
        },
    )
    rl = SimpleNamespace(export_valid=True, kind="rl-full")
    gates, skipped = gate_results(report, "rl-full", "lora", rl, EvalConfig())
    assert gates == {
        "export_verified": True,
        "rl/heldout_reward_gain_low": True,
        "sft-heldout-em/stop_rate": True,
        "lora vs pretrain/sft-heldout-em/stop_rate": True,  # the pretrained model's 0 is no bar
        "sft-heldout-em/response_loss": True,
        "heldout/all/bits_per_byte": True,  # +0.6% against the SFT
        "lora vs pretrain/sft-heldout-em/response_loss": True,
        "lora vs pretrain/heldout/all/bits_per_byte": False,  # +9.6% against the pretrained model
        "lora vs pretrain/stdlib-import-mc/acc": True,
    }
    assert skipped == []
    # replayed (the demo's SFT now: 1.8285), the whole lineage passes
    report.metrics["heldout/all/bits_per_byte"] |= {"lora": 1.8285, "rl-full": 1.8521}
    assert all(gate_results(report, "rl-full", "lora", rl, EvalConfig())[0].values())


def test_the_gates_walk_the_whole_lineage_not_one_step() -> None:
    """`rl --base <a DPO run>`: RL from DPO from a LoRA SFT from the pretrained model. The SFT two steps above the
    candidate's base still meets its own gates against the pretrained model (and fails the one it forgot on)."""
    from types import SimpleNamespace

    from evaluation.config import EvalConfig
    from evaluation.gates import gate_results
    from evaluation.report import EvalReport

    models = {
        "pretrain": {"run_dir": "/runs/pretrain", "kind": "pretrain", "base_run_dir": None},
        "lora": {"run_dir": "/runs/sft", "kind": "lora", "base_run_dir": "/runs/pretrain"},
        "dpo-full": {"run_dir": "/runs/dpo", "kind": "dpo-full", "base_run_dir": "/runs/sft"},
        "rl-full": {"run_dir": "/runs/rl", "kind": "rl-full", "base_run_dir": "/runs/dpo"},
    }
    bits = {"pretrain": 1.81, "lora": 1.99, "dpo-full": 1.99, "rl-full": 1.99}
    report = EvalReport.model_construct(models=models, metrics={"heldout/all/bits_per_byte": bits})
    rl = SimpleNamespace(export_valid=True, kind="rl-full")
    gates, skipped = gate_results(report, "rl-full", "dpo-full", rl, EvalConfig())
    assert gates["heldout/all/bits_per_byte"] and gates["dpo-full vs lora/heldout/all/bits_per_byte"]
    assert gates["lora vs pretrain/heldout/all/bits_per_byte"] is False  # +10% against the pretrained model
    assert "lora vs pretrain/sft-heldout-em/response_loss" in skipped  # not measured here, named
