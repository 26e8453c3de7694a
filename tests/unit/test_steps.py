"""The cached-step protocol: keys from config and upstream digests, manifest last, reruns are no-ops."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.config import ConfigError, override
from infra.steps import Artifact, Step, run_step
from training.config import TrainConfig


class Note(Artifact):
    text: str


def step(config: dict, deps: dict | None = None) -> Step[Note]:
    return Step("notes", "n", 1, config, Note, deps or {})


def test_finished_step_is_returned_without_building(tmp_path: Path) -> None:
    calls = []

    def build(out: Path, key: str) -> Note:
        calls.append(key)
        (out / "body.txt").write_text("hi")
        return Note(path=str(out), text="hi")

    first = run_step(tmp_path, step({"a": 1}), build)
    again = run_step(tmp_path, step({"a": 1}), build)
    assert again == first and len(calls) == 1
    assert first.key == step({"a": 1}).digest() and Path(first.path).name == f"n-{first.key[:12]}"
    assert step({"a": 1}).finished(tmp_path) == first and step({"a": 2}).finished(tmp_path) is None


def test_a_failed_build_leaves_no_manifest_and_is_built_again(tmp_path: Path) -> None:
    def broken(out: Path, key: str) -> Note:
        (out / "partial.txt").write_text("half")
        raise RuntimeError("crash")

    with pytest.raises(RuntimeError):
        run_step(tmp_path, step({}), broken)
    assert step({}).finished(tmp_path) is None
    seen = []

    def resume(out: Path, key: str) -> Note:
        seen.append((out / "partial.txt").read_text())  # the build sees what the crash left and may resume it
        return Note(path=str(out), text="done")

    assert run_step(tmp_path, step({}), resume).text == "done" and seen == ["half"]


def test_upstream_artifacts_key_by_digest_not_path(tmp_path: Path) -> None:
    here, moved = Note(path="/a/x", key="k1", text=""), Note(path="/b/y", key="k1", text="")
    other = Note(path="/a/x", key="k2", text="")
    assert step({}, {"up": here}).directory(tmp_path) == step({}, {"up": moved}).directory(tmp_path)
    assert step({}, {"up": here}).directory(tmp_path) != step({}, {"up": other}).directory(tmp_path)


def test_override_revalidates_with_the_config_type() -> None:
    train = override(TrainConfig(), "max_steps=7", {"seed": 3})
    assert (train.max_steps, train.seed) == (7, 3)
    with pytest.raises(ValueError, match="greater than 0"):
        override(TrainConfig(), {"max_steps": 0})
    with pytest.raises(ConfigError, match="section.field=value"):
        override(TrainConfig(), "max_steps")


def test_loading_a_missing_or_unfinished_run_says_which(tmp_path: Path) -> None:
    from infra.errors import UserError

    with pytest.raises(UserError, match=r"nowhere: no such directory"):
        Note.load(tmp_path / "nowhere")
    (tmp_path / "half").mkdir()
    with pytest.raises(UserError, match=r"half: no manifest.json, so it has not finished: rerun the command"):
        Note.load(tmp_path / "half")
    (tmp_path / "half" / "manifest.json").write_text('{"path": "x"}')
    with pytest.raises(UserError, match=r"manifest.json: not a Note manifest"):
        Note.load(tmp_path / "half")


@pytest.mark.parametrize(
    ("change", "rekeys"),
    [
        ("train.max_steps=30", {"pretrain"}),  # SFT follows through the base's digest, not its own key
        ("optim.lr=1e-3", {"pretrain"}),
        ("model.n_layers=3", {"pretrain"}),  # SFT gets the model from its base (by digest)
        ("sft.optim.lr=1e-3", {"sft"}),
        ("sft.lora.r=8", {"sft"}),
        ("eval.max_documents=7", set()),  # evaluation and other sections never re-key training
        ("parallel.threads_per_worker=1", set()),  # nor settings that cannot change the weights
        ("parallel.max_failures=3", set()),
        ("parallel.placement=strict_spread", set()),
        # another worker count continues the run when its global batch stays (pretraining's is set); where the
        # global batch is the micro-batch times the workers (SFT's), it is another run
        ("parallel.world_size=2", {"sft"}),
        ("tracking.experiment=other", set()),
        ("sweep.min_steps=50", set()),
    ],
)
def test_a_changed_setting_rekeys_exactly_the_stages_it_determines(change: str, rekeys: set[str]) -> None:
    from flows.recipe import load_recipe
    from infra.storage import digest_of

    def keys(recipe) -> dict[str, str]:
        return {
            "pretrain": digest_of(recipe.pretrain_spec().key()),
            "sft": digest_of(recipe.sft_spec().key()),
        }

    before, after = keys(load_recipe("smoke")), keys(load_recipe("smoke", [change]))
    assert {stage for stage in before if before[stage] != after[stage]} == rekeys


def slow_build(out: Path, key: str) -> Note:
    """A build that takes long enough for a second one of the same key to start meanwhile; counts itself."""
    import os
    import time

    with open(out.parent / "builds.log", "a") as log:
        log.write(f"{os.getpid()}\n")
    time.sleep(0.5)
    (out / "body.txt").write_text("hi")
    return Note(path=str(out), text="hi")


def build_in_process(root: str) -> str:
    return run_step(Path(root), step({"concurrent": True}), slow_build).key


def test_two_builds_of_one_key_at_once_build_it_once(tmp_path: Path) -> None:
    """Threads of one process and separate processes race for the same step: the lock lets one build and the
    others find it finished (without the lock both would build into the same directory)."""
    import multiprocessing
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        keys = list(pool.map(build_in_process, [str(tmp_path / "threads")] * 2))
    assert (
        len(set(keys)) == 1 and len((tmp_path / "threads" / "notes" / "builds.log").read_text().split()) == 1
    )
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        keys = pool.map(build_in_process, [str(tmp_path / "processes")] * 2)
    assert (
        len(set(keys)) == 1
        and len((tmp_path / "processes" / "notes" / "builds.log").read_text().split()) == 1
    )


def test_relocated_rebases_the_run_and_its_root_and_nothing_beside_them(tmp_path: Path) -> None:
    """A manifest written under /old/outputs and read from a moved copy: paths into its own directory and into the
    old output root follow the move; a sibling of the root that shares its prefix (`outputs-old`) and paths outside
    it stay as written."""
    from infra.steps import relocated

    old = "/old/outputs/sft/run-1"
    here = tmp_path / "new" / "outputs" / "sft" / "run-1"
    here.mkdir(parents=True)
    manifest = {
        "path": old,
        "checkpoint": f"{old}/checkpoints/step-10",
        "base": "/old/outputs/pretrain/base-2/hf",
        "root": "/old/outputs",
        "sibling": "/old/outputs-old/pretrain/base-2/hf",
        "prefix": "/old/outputs/sft/run-10/hf",
        "outside": "/data/corpus.jsonl",
    }
    moved = relocated(manifest, here)
    new_root = str(tmp_path / "new" / "outputs")
    assert (
        moved["path"] == str(here.resolve())
        and moved["checkpoint"] == f"{here.resolve()}/checkpoints/step-10"
    )
    assert moved["base"] == f"{new_root}/pretrain/base-2/hf" and moved["root"] == new_root
    assert (
        moved["prefix"] == f"{new_root}/sft/run-10/hf"
    )  # another run of the root, not this one's name prefix
    assert moved["sibling"] == manifest["sibling"] and moved["outside"] == manifest["outside"]
