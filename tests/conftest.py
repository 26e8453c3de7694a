"""Shared test setup: one torch thread per process (2 threads were 2.5-3.7x slower on this machine)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# What a user's shell may point at their real services (the README suggests exporting them after `lmforge up`):
# tests start their own, so none of these may leak in.
ISOLATED_ENV = (
    "LMFORGE_TRACKING_URI",
    "MLFLOW_TRACKING_URI",
    "PREFECT_API_URL",
    "PREFECT_API_AUTH_STRING",
    "PREFECT_HOME",
    "RAY_ADDRESS",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
    # object storage: a user's own cloud credentials never reach a test (tests/s3_server.py sets its own)
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "LMFORGE_CACHE",
)
for _name in ISOLATED_ENV:
    os.environ.pop(_name, None)


@pytest.fixture(autouse=True)
def _isolated_tracking_uri():
    """`mlflow.set_tracking_uri` / `set_registry_uri` in one test (they also write MLFLOW_TRACKING_URI and
    MLFLOW_REGISTRY_URI) must not reach the next."""
    yield
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.environ.pop("MLFLOW_REGISTRY_URI", None)
    import sys

    if "mlflow" in sys.modules:
        from mlflow.tracking._model_registry import utils as registry
        from mlflow.tracking._tracking_service import utils

        utils._tracking_uri = None
        registry._registry_uri = None


@pytest.fixture(scope="module", autouse=True)
def _ray_ends_with_its_module():
    """A private Ray instance a module's tests started (they share it) is shut down with the module: the sweep
    tests' stayed up, idle, beside every later module of the run."""
    from infra.ray_cluster import released

    with released():
        yield


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="session")
def small_data_cfg():
    """The first 40 stdlib documents, a 512-token BPE, small shards: seconds to tokenize."""
    from data_pipeline.config import DataConfig, TokenizerConfig

    return DataConfig(
        max_documents=40,
        val_fraction=0.1,
        shard_tokens=20_000,
        num_workers=1,
        tokenizer=TokenizerConfig(vocab_size=512, min_frequency=2),
    )


@pytest.fixture(scope="session")
def tokenized(small_data_cfg, tmp_path_factory):
    """(manifest, output root) of the small stdlib dataset, built once per test session."""
    from data_pipeline.tokenize import run_tokenize

    root = tmp_path_factory.mktemp("outputs")
    return run_tokenize(small_data_cfg, root), root


SHARED = Path(os.environ.get("LMFORGE_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def shared_file(relative: str) -> Path:
    """A reference file under ../shared/: missing data fails the test when CI=true and skips it elsewhere."""
    path = SHARED / relative
    if not path.is_file():
        message = f"reference data {path} is missing (set LMFORGE_SHARED to the shared/ checkout)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def smoke_base(tmp_path_factory):
    """(recipe, pretrained model) of the smoke recipe, 1 worker, fp32, ZeRO-0, 20 steps: trained once per session."""
    from data_pipeline.tokenize import run_tokenize
    from flows.recipe import load_recipe
    from tests.pretrain_helpers import SMOKE_SETTINGS, smoke_overrides
    from training.stages.pretrain import run_pretrain

    out = tmp_path_factory.mktemp("smoke")
    recipe = load_recipe("smoke", smoke_overrides(out, *SMOKE_SETTINGS))
    return recipe, run_pretrain(recipe.pretrain_spec(), run_tokenize(recipe.data, recipe.output_dir))


@pytest.fixture(scope="session")
def smoke_lora(smoke_base):
    """(SFT examples, LoRA fine-tune) of the session's smoke model."""
    from flows.stages.sft import sft_data
    from training.stages.sft import run_sft

    recipe, base = smoke_base
    examples = sft_data(recipe, base)
    return examples, run_sft(recipe.sft_spec(), base, examples)


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3-protocol server (moto) with a bucket `lmforge`; this process's environment points at it (with a
    node cache of its own) for the session, and subprocesses inherit that."""
    from tests.s3_server import s3_server

    base = tmp_path_factory.mktemp("s3")
    with s3_server(base / "moto.log") as server, pytest.MonkeyPatch.context() as patch:
        for name, value in server.env(base / "cache").items():
            patch.setenv(name, value)
        yield server


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With `-m slow` (make test's second run), a test module whose text never names the mark is not imported:
    collecting the unit and parity modules for their 5 slow tests imported TRL, curvlinops and the rest (~2.7 s)."""
    name = collection_path.name
    if config.option.markexpr == "slow" and name.startswith("test_") and name.endswith(".py"):
        return "slow" not in collection_path.read_text() or None
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """With `pytest -n 2 --dist loadgroup` (make test-fast), a module's tests share one worker, so its
    module-scoped fixtures are built once (a module may split independent tests off with `pytest.mark.xdist_group`)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Wall time per test directory (setup, call and teardown of every test in it), so a CI log says where the
    suite's time goes beside the slowest tests."""
    totals: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                folder = report.nodeid.split("::")[0].rsplit("/", 1)[0]
                totals[folder] = totals.get(folder, 0.0) + report.duration
    if totals:
        terminalreporter.write_sep("=", "time per directory")
        for folder, seconds in sorted(totals.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{seconds:8.1f} s  {folder}")
