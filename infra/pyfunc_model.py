"""The MLflow pyfunc flavour of an lmforge model (MLflow "models from code"): text in, generated text out.

Logged with the Hugging Face export as its artifact, so a reviewer needs only MLflow, torch and transformers:
`mlflow.pyfunc.load_model(uri).predict(["def "])` returns a list of continuations.
"""

from __future__ import annotations

from typing import Any

import mlflow
from mlflow.pyfunc import PythonModel


class TextGenerator(PythonModel):
    def load_context(self, context: Any) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = context.artifacts["hf_model"]
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def predict(self, context, model_input, params=None):  # untyped: MLflow reads type hints as a schema
        """Greedy continuations of a list of prompts (or a one-column DataFrame), each stopping where the export's
        generation config says (end of text, end of turn); `max_new_tokens` param (within the trained context)."""
        import torch

        params = params or {}
        if hasattr(model_input, "iloc"):  # a DataFrame from the signature's column
            prompts = [str(v) for v in model_input.iloc[:, 0]]
        elif isinstance(model_input, str):
            prompts = [model_input]
        else:
            prompts = [str(p) for p in model_input]
        context = self.model.config.max_position_embeddings  # the context the model was trained at
        max_new = min(int(params.get("max_new_tokens", 32)), context - 1)
        eos = self.tokenizer.eos_token_id
        outputs = []
        for prompt in prompts:
            ids = self.tokenizer(prompt, return_tensors="pt").input_ids
            if ids.shape[1] == 0:
                ids = torch.tensor([[eos]])
            ids = ids[:, -(context - max_new) :]
            with torch.inference_mode():
                out = self.model.generate(  # the export's generation config: stops at end-of-text or -turn
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False
                )
            outputs.append(self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        return outputs


mlflow.models.set_model(TextGenerator())
