"""DPO and distillation against TRL (a test-only extra): the same export, pairs, β and optimiser give the same
tokenisation, per-sequence log-probabilities, step-0 loss (ln 2) and losses after three steps as TRL's
`DPOTrainer`; every loss type equals TRL's on a trained policy; the distillation divergence equals
`GKDTrainer.generalized_jsd_loss`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from data_pipeline.chat import own_layout
from data_pipeline.config import END_OF_TURN
from data_pipeline.loader import IGNORE_INDEX, Batch
from data_pipeline.preference import Pair, PreferenceLoader, derive_pairs
from data_pipeline.sft import sft_examples
from data_pipeline.sources import split_of
from flows.stages.dpo import preference_data, reference_logps
from training.config import PreferenceLoss
from training.engine import PlainEngine
from training.model.config import ModelConfig
from training.model.hf_interop import load_export
from training.model.transformer import Transformer
from training.stages.distill import DistillObjective, generalized_jsd
from training.stages.dpo import PreferenceObjective, run_dpo, sequence_logps

pytestmark = [pytest.mark.parity, pytest.mark.slow]
BETA = 0.1
STEPS = 3


def test_generalized_jsd_equals_trls(generator: torch.Generator) -> None:
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    student = torch.randn(3, 7, 13, generator=generator) * 2
    teacher = torch.randn(3, 7, 13, generator=generator) * 2
    labels = torch.randint(0, 13, (3, 7), generator=generator)
    labels[0, :3] = IGNORE_INDEX
    mask = labels != IGNORE_INDEX
    for beta in (0.0, 0.5, 1.0):
        for temperature in (1.0, 2.0):
            theirs = GKDTrainer.generalized_jsd_loss(
                student, teacher, labels, beta=beta, temperature=temperature
            )
            ours = generalized_jsd(student[mask], teacher[mask], beta, temperature).mean()
            assert abs(float(ours) - float(theirs)) < 1e-6, (beta, temperature)


def test_distillation_objective_is_alpha_ce_plus_the_divergence(generator: torch.Generator) -> None:
    """The loop's objective: α·CE + (1-α)·D over the loss-carrying tokens, D = T²·KL(teacher‖student) (TRL's
    β = 0 term, scaled) or TRL's generalised JSD."""
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64, max_seq_len=16)
    student, teacher = Transformer(cfg, seed=1), Transformer(cfg, seed=2)
    engine = PlainEngine(student, torch.optim.SGD(student.parameters(), lr=0.0), 1, 0.0)
    inputs = torch.randint(0, 64, (2, 12), generator=generator)
    targets = torch.randint(0, 64, (2, 12), generator=generator)
    targets[:, :4] = IGNORE_INDEX  # an SFT-like batch: loss on the last tokens only
    batch = Batch(inputs, targets)
    with torch.no_grad():
        s, t = student(inputs).logits, teacher(inputs).logits
    ce = torch.nn.functional.cross_entropy(s.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    for loss, beta, scale in (("kl", 0.0, 4.0), ("jsd", 0.5, 1.0), ("jsd", 1.0, 1.0)):
        objective = DistillObjective(teacher, loss, alpha=0.3, temperature=2.0, jsd_beta=beta)
        with torch.no_grad():
            ours = objective(engine, batch)
        divergence = GKDTrainer.generalized_jsd_loss(s, t, targets, beta=beta, temperature=2.0)
        expected = 0.3 * ce + 0.7 * scale * divergence
        assert abs(float(ours.loss) - float(expected)) < 1e-6, loss
    assert objective.units(batch) == 16


@pytest.fixture(scope="module")
def dpo_setup(smoke_lora, smoke_base, tmp_path_factory):
    """24 short user-supplied pairs, the fine-tuned smoke model, and our 3-step full DPO run on them."""
    recipe, _ = smoke_base
    _, tuned = smoke_lora
    conversations = [c for c in sft_examples(recipe.data.sft) if len(own_layout(c)[0]) < 160][:24]
    pairs = [p for p in derive_pairs(conversations, "shuffled", seed=0) if p.chosen != p.rejected]
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": p.prompt[0]["content"], "chosen": p.chosen, "rejected": p.rejected}) + "\n"
            for p in pairs
        )
    )
    settings = [
        f"data.preference.source={path}",
        "data.preference.heldout_fraction=0.25",
        "dpo.method=full",
        f"dpo.loss.beta={BETA}",
        "dpo.optim={lr: 1.0e-3, schedule: constant, warmup_steps: 0, weight_decay: 0.0, grad_clip: 0.0, betas: [0.9, 0.999]}",
        f"dpo.train.max_steps={STEPS}",
        f"dpo.train.eval_every={STEPS}",
        f"dpo.train.checkpoint_every={STEPS}",
    ]
    recipe = recipe.override(*settings)
    data = preference_data(recipe, tuned)
    reference = reference_logps(recipe, tuned, data)
    n_train = data.counts["train"]
    recipe = recipe.override(f"dpo.train.micro_batch_size={n_train}")  # one batch = every pair, order-free
    ours = run_dpo(recipe.dpo_spec(), tuned, data, reference)
    train_pairs = [p for p in pairs if split_of(json.dumps(p.as_json(), sort_keys=True), 0.25) == "train"]
    assert len(train_pairs) == n_train
    return tuned, data, reference, ours, train_pairs


def trl_trainer(export: str, pairs: list[Pair], out: Path):
    """TRL's DPOTrainer on the export, the pairs as text (the prompt's chat template rendered, answers ending
    in the end-of-turn marker, which is the tokenizer's EOS here), the same optimiser and β."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    tokenizer = PreTrainedTokenizerFast.from_pretrained(export)
    tokenizer.eos_token = END_OF_TURN
    rows = [
        {
            "prompt": own_layout(p.prompt)[0] + "<|assistant|>\n",
            "chosen": p.chosen + END_OF_TURN,
            "rejected": p.rejected + END_OF_TURN,
        }
        for p in pairs
    ]
    args = DPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=len(pairs),
        max_steps=STEPS,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        optim="adamw_torch",
        beta=BETA,
        loss_type=["sigmoid"],
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        dataloader_num_workers=0,
        bf16=False,
        fp16=False,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    return DPOTrainer(
        model=model,
        ref_model=reference,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )


def test_dpo_matches_trls_dpo_trainer(dpo_setup, tmp_path: Path) -> None:
    tuned, data, reference, ours, train_pairs = dpo_setup
    trainer = trl_trainer(tuned.hf_export, train_pairs, tmp_path)

    # the same token sequences (prompt + answer) on both sides
    ours_rows = PreferenceLoader(data, "train", batch_size=1, shuffle=False)
    ours_seqs = {
        tuple(ours_rows._row(side, i)[0].tolist())
        for side in ("chosen", "rejected")
        for i in range(len(ours_rows))
    }
    theirs_seqs = {
        tuple(row["prompt_ids"] + row[f"{side}_ids"])
        for row in trainer.train_dataset
        for side in ("chosen", "rejected")
    }
    assert ours_seqs == theirs_seqs

    # per-sequence log-probabilities: the HF export under TRL's collation vs our reference cache
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)
    hf_logps, _ = sequence_logps(logits[:, :-1], labels[:, 1:])
    by_sequence = {}
    for row, logp in zip(batch["input_ids"], hf_logps, strict=True):
        by_sequence[tuple(t for t in row.tolist() if t != trainer.processing_class.pad_token_id)] = float(
            logp
        )
    cached = reference.array("train")
    for i in range(len(ours_rows)):
        for s, side in enumerate(("chosen", "rejected")):
            sequence = tuple(t for t in ours_rows._row(side, i)[0].tolist())
            assert abs(by_sequence[sequence] - float(cached[i, s])) < 1e-5 * max(
                1.0, abs(float(cached[i, s]))
            )

    # the losses step by step: ln 2 at step 0, then equal under the same AdamW
    losses: list[float] = []
    compute_loss = trainer.compute_loss

    def recorded(*args, **kwargs):
        loss = compute_loss(*args, **kwargs)
        losses.append(float(loss.detach()))
        return loss

    trainer.compute_loss = recorded
    trainer.train()
    records = [json.loads(line) for line in (Path(ours.path) / "metrics.jsonl").read_text().splitlines()]
    mine = [r["train/loss"] for r in records if "train/loss" in r]
    assert abs(mine[0] - math.log(2)) < 1e-6 and abs(losses[0] - math.log(2)) < 1e-6
    assert mine == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert losses[-1] < losses[0] - 1e-3  # the steps did something
    theirs = {k: v for k, v in trainer.state.log_history[0].items() if k.startswith(("rewards/", "logps/"))}
    step1 = next(r for r in records if r["step"] == 1 and "train/loss" in r)
    for key in ("rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"):
        assert step1[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key

    # every loss type on the trained policy (non-zero log-ratios): TRL's loss vs ours on the same weights
    policy = load_export(tuned.hf_export)
    policy.load_state_dict({k: v for k, v in trainer.model.state_dict().items()}, strict=False)
    engine = PlainEngine(policy.eval(), torch.optim.SGD(policy.parameters(), lr=0.0), 1, 0.0)
    all_pairs = PreferenceLoader(data, "train", batch_size=len(ours_rows), shuffle=False, reference=cached)
    pair_batch = all_pairs.next_batch()
    trainer.model.eval()
    for loss_type in ("sigmoid", "ipo", "hinge", "sigmoid_norm"):
        trainer.loss_types, trainer.loss_weights = [loss_type], [1.0]
        with torch.no_grad():
            theirs_loss = float(trainer.compute_loss(trainer.model, batch))
            ours_loss = float(
                PreferenceObjective(PreferenceLoss(type=loss_type, beta=BETA))(engine, pair_batch).loss
            )
        assert ours_loss == pytest.approx(theirs_loss, rel=1e-5, abs=1e-6), loss_type
