"""A reward model: a language model's decoder with a scalar head, read at each row's last non-pad token (the rule
transformers' `LlamaForSequenceClassification` applies, so its export scores the same), and the Bradley–Terry
loss over (chosen, rejected) rows as TRL's `RewardTrainer` defines it (optional margin and reward centring)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.model.checkpoint_files import read_state_dict
from training.model.export import copy_tokenizer_files, fresh_staging, publish_export, verified
from training.model.hf_interop import build_hf_model, load_hf_config, to_hf_state_dict
from training.model.transformer import ModelOutput, Transformer, router_loss

READING_POSITION = (
    "the last token of the conversation as the tokenizer's chat template renders it (apply_chat_template, "
    "no generation prompt): after the answer's end-of-turn token and what the template writes after it"
)


class RewardModel(nn.Module):
    """tokens (B, T) -> rewards as `ModelOutput.logits` (B, 1); rows are right-padded with `pad_id`."""

    def __init__(self, lm: Transformer, pad_id: int, seed: int = 0) -> None:
        super().__init__()
        self.cfg = lm.cfg
        self.pad_id = pad_id
        self.model = lm.model  # the decoder and its weights; the LM head is dropped
        self.score = nn.Linear(lm.cfg.d_model, 1, bias=False)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            values = torch.empty(self.score.weight.shape).normal_(0.0, lm.cfg.init_std, generator=generator)
            self.score.weight.copy_(values)

    def forward(self, tokens: Tensor, targets: Tensor | None = None, logits_grad: bool = True) -> ModelOutput:
        """The engines' call (`training/engine.py`); a reward model has no next-token loss: `targets` and
        `logits_grad` change nothing."""
        hidden, stats = self.model(tokens)
        last = last_token(tokens, self.pad_id)
        rewards = self.score(hidden[torch.arange(tokens.shape[0], device=tokens.device), last])  # (B, 1)
        return ModelOutput(logits=rewards, aux_loss=router_loss(self.cfg, stats), router_stats=stats)


def last_token(tokens: Tensor, pad_id: int) -> Tensor:
    """Each row's last non-pad position (transformers: the argmax of position x non-pad)."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    return (positions * (tokens != pad_id)).argmax(-1)


def bradley_terry(
    chosen: Tensor, rejected: Tensor, margin: Tensor | None = None, centring: float = 0.0
) -> Tensor:
    """−log σ(r_chosen − r_rejected − margin), averaged, plus `centring`·mean((r_chosen + r_rejected)²) (TRL's
    `center_rewards_coefficient`, Eisenstein et al. 2023), which keeps rewards near zero."""
    delta = chosen - rejected - (margin if margin is not None else 0.0)
    loss = -F.logsigmoid(delta).mean()
    if centring:
        loss = loss + centring * torch.mean((chosen + rejected) ** 2)
    return loss


def probe_rows(cfg_vocab: int, pad_id: int, length: int, seed: int = 0) -> Tensor:
    """Two right-padded rows of random ids (pad excluded) that end at different positions: what an export must
    score as the model does."""
    ids = torch.randint(0, cfg_vocab, (2, length), generator=torch.Generator().manual_seed(seed))
    ids[ids == pad_id] = (pad_id + 1) % cfg_vocab
    ids[1, length // 2 :] = pad_id
    return ids


def export_reward_model(model: RewardModel, tokenizer_dir: Path, out: Path) -> dict:
    """A Hugging Face sequence-classification model (`LlamaForSequenceClassification` or Mixtral's, one label,
    the tokenizer's pad id), verified: transformers' scores of probe rows equal ours (`export.verified`)."""
    from transformers import AutoModelForSequenceClassification

    cfg = model.cfg
    hf_model = build_hf_model(cfg, "SequenceClassification", num_labels=1, pad_token_id=model.pad_id)
    # the logit multiplier belongs to the LM head, which a reward model does not have
    state = to_hf_state_dict(model.state_dict(), cfg.model_copy(update={"output_mult": 1.0}))
    hf_model.load_state_dict(state, strict=True)
    hf_model.config.reward_position = READING_POSITION  # said where a client reads the config
    staging = fresh_staging(out)
    hf_model.save_pretrained(str(staging), safe_serialization=True)
    copy_tokenizer_files(tokenizer_dir, staging, cfg.max_seq_len)
    loaded = AutoModelForSequenceClassification.from_pretrained(
        str(staging), dtype=torch.float32, attn_implementation="eager"
    )
    rows = probe_rows(cfg.vocab_size, model.pad_id, min(32, cfg.max_seq_len))
    with torch.no_grad():
        difference = float((model.eval()(rows).logits - loaded.eval()(input_ids=rows).logits).abs().max())
    return publish_export(staging, out, verified(difference, loaded, staging, "huggingface"))


def load_reward_model(export_dir: Path) -> RewardModel:
    """A reward model from its sequence-classification export (`export_reward_model`'s), in eval mode."""
    pad_id = json.loads((export_dir / "config.json").read_text())["pad_token_id"]
    model = RewardModel(Transformer(load_hf_config(export_dir), seed=None), pad_id)
    model.load_state_dict(read_state_dict(export_dir, torch.float32), strict=True)
    return model.eval()
