"""Secrets come from the environment and never reach logs, files or MLflow (checked with a canary value)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from flows.recipe import ConfigError, load_recipe
from infra.secrets import REDACTED, from_env, redact, strip_credentials
from tests.pretrain_helpers import clean_env, lmforge_command, smoke_overrides, with_sets

CANARY = "canary-7f3a9c1e5b"


def test_redaction_rules():
    got = redact(
        {"tracking.uri": f"http://bob:{CANARY}@host:5000", "a.api_key": CANARY, "lr": 0.1, "x.password": ""}
    )
    assert got == {
        "tracking.uri": f"http://bob:{REDACTED}@host:5000",
        "a.api_key": REDACTED,
        "lr": 0.1,
        "x.password": "",
    }
    assert strip_credentials("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"
    secret = ["hf_token", "MLFLOW_TRACKING_PASSWORD", "aws.secret_access_key", "auth-string", "s.credentials"]
    harmless = [
        "data.shard_tokens",
        "eval.max_new_tokens",
        "data.tokenizer.path",
        "train.passes",
        "tokens_per_s",
    ]
    masked = redact(dict.fromkeys(secret + harmless, "v"))
    assert [k for k, v in masked.items() if v == REDACTED] == secret


def test_recipes_refuse_credentials():
    with pytest.raises(
        ConfigError, match="tracking.uri carries a password; put credentials in MLFLOW_TRACKING_USERNAME"
    ):
        load_recipe("smoke", [f"tracking.uri=http://admin:{CANARY}@127.0.0.1:5000"])
    with pytest.raises(ConfigError, match="look like secrets"):
        load_recipe("smoke", [f'tracking.tags={{"deploy_token": "{CANARY}"}}'])


def test_secret_file_indirection(tmp_path, monkeypatch):
    (tmp_path / "pw").write_text(CANARY + "\n")
    monkeypatch.delenv("MY_PASSWORD", raising=False)
    monkeypatch.setenv("MY_PASSWORD_FILE", str(tmp_path / "pw"))
    assert from_env("MY_PASSWORD") == CANARY


@pytest.mark.integration
@pytest.mark.slow
def test_canary_never_reaches_logs_files_or_mlflow(tmp_path):
    env = {
        **clean_env(),
        "MLFLOW_TRACKING_PASSWORD": CANARY,
        "AWS_SECRET_ACCESS_KEY": CANARY,
        "PREFECT_API_AUTH_STRING": f"admin:{CANARY}",
    }
    sets = smoke_overrides(tmp_path, "train.max_steps=4", "train.eval_every=4", "train.checkpoint_every=4")
    result = subprocess.run(
        lmforge_command("pretrain", "smoke", *with_sets(sets)),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert CANARY not in result.stdout + result.stderr
    leaked = [p for p in Path(tmp_path).rglob("*") if p.is_file() and CANARY.encode() in p.read_bytes()]
    assert not leaked, leaked  # includes mlflow.db (params, tags) and every artifact
    assert (tmp_path / "mlflow.db").is_file()
