"""Load a finished run (its verified Hugging Face export) for evaluation, with the tokenizer it was trained with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from data_pipeline.sources import DataError
from data_pipeline.tokenizer import TokenizerRef, describe
from training.model.hf_interop import load_export
from training.model.transformer import Transformer
from training.stages.lifecycle import TrainedModel


@dataclass
class EvalModel:
    """A model ready to score: our Transformer in eval mode plus its tokenizer."""

    name: str
    model: Transformer
    tokenizer: Tokenizer
    tokenizer_ref: TokenizerRef
    ref: TrainedModel  # the run it came from

    @property
    def max_len(self) -> int:
        return self.model.cfg.max_seq_len


def load_for_eval(ref: TrainedModel, name: str, tokenizer_digest: str | None = None) -> EvalModel:
    """Load `ref`'s export; refuse when its tokenizer is not the one it was trained with (or `tokenizer_digest`)."""
    if not ref.hf_export or not ref.export_valid:
        raise DataError(
            f"{ref.run_dir}: no verified Hugging Face export to evaluate (rerun the stage to export it)"
        )
    tok = describe(Path(ref.hf_export))
    for expected, what in (
        (ref.tokenizer_digest, "it was trained with"),
        (tokenizer_digest, "the evaluation asks for"),
    ):
        if expected and tok.digest != expected:
            raise DataError(
                f"{ref.hf_export}: its tokenizer {tok.digest[:16]}... is not the tokenizer {what} "
                f"({expected[:16]}...); evaluate the checkpoint with its own tokenizer files"
            )
    return EvalModel(name, load_export(ref.hf_export), tok.load(), tok, ref)
