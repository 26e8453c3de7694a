"""An lm-evaluation-harness model over lmforge models. From the shell, lm-eval's own CLI with this model
registered (lm-eval has no plugin entry point for models):

    python -m evaluation.lm_eval_adapter run --model lmforge --model_args pretrained=<hf export> --tasks ...

In Python: `import evaluation.lm_eval_adapter` and `--model lmforge` / `get_model("lmforge")` resolve, as do
lm-eval's own models (`hf`, ...); or pass `LmforgeLM(eval_model)` to `lm_eval.simple_evaluate`.

It scores with the same batched code as lmforge's own tasks, so harness and built-in numbers agree.
Offline use: local task YAMLs (`dataset_path: json`, `dataset_kwargs.data_files`) through `TaskManager(include_path=)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401 - lm-eval lists its own models only into an empty registry: fill it first
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from evaluation.model_io import EvalModel
from evaluation.scoring import generate_text, rolling_windows, score_continuations
from training.model.hf_interop import load_export


@register_model("lmforge")
class LmforgeLM(LM):
    def __init__(
        self, model: EvalModel | None = None, pretrained: str | None = None, batch_size: Any = 16, **_: Any
    ) -> None:
        super().__init__()
        if model is None:
            if pretrained is None:
                raise ValueError("LmforgeLM needs an EvalModel or pretrained=<hugging face export directory>")
            from data_pipeline.tokenizer import describe

            tok = describe(Path(pretrained))
            model = EvalModel(Path(pretrained).name, load_export(pretrained), tok.load(), tok, None)
        self.em = model
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 16

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        from evaluation.tasks import _split_encode

        return _split_encode(self.em, context, continuation)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*r.args) for r in requests]
        return [(s.logprob, s.greedy) for s in score_continuations(self.em.model, pairs, self.batch_size)]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        results = []
        for r in requests:
            windows = rolling_windows(
                self.em.tokenizer.encode(r.args[0]).ids, self.em.tokenizer_ref.eos_id, self.em.max_len
            )
            results.append(
                sum(s.logprob for s in score_continuations(self.em.model, windows, self.batch_size))
            )
        return results

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        outputs = []
        for r in requests:
            context, kwargs = r.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            ids, _ = generate_text(
                self.em.model,
                self.em.tokenizer.encode(context).ids or [self.em.tokenizer_ref.eos_id],
                int(kwargs.get("max_gen_toks", 32)),
                self.em.tokenizer_ref.eos_id,
                temperature,
            )
            text = self.em.tokenizer.decode(ids)
            for stop in until:
                text = text.split(stop)[0]
            outputs.append(text)
        return outputs


def run_lm_eval(
    em: EvalModel, tasks: list[str], include_path: str | None, limit: int | None, batch_size: int
) -> dict[str, dict[str, float]]:
    """Run harness tasks offline on one model; {task: {metric: value}} (numbers only)."""
    import os

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or not set(tasks) <= set(manager.all_tasks):  # lm-eval's own tasks too: ~9 s to index
        manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    results = simple_evaluate(
        model=LmforgeLM(em, batch_size=batch_size),
        tasks=tasks,
        task_manager=manager,
        limit=limit,
        log_samples=False,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
    )
    return {
        task: {
            k.split(",")[0]: float(v)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        for task, metrics in results["results"].items()
    }


def main() -> None:
    """lm-eval's command line with `--model lmforge` available."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
