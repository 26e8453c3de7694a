"""Importing lmforge's lm-eval adapter adds `lmforge` to lm-eval's models without hiding lm-eval's own (a fresh
interpreter: the registry is process-global). The command line through the adapter is tested in test_eval."""

from __future__ import annotations

import subprocess
import sys

from tests.pretrain_helpers import ROOT, clean_env


def test_adapter_import_keeps_lm_evals_own_models() -> None:
    code = (
        "import evaluation.lm_eval_adapter\n"
        "from lm_eval.api.registry import get_model\n"
        "print(get_model('lmforge').__name__, get_model('hf').__name__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=clean_env()
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["LmforgeLM", "HFLM"]
