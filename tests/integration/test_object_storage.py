"""Stage outputs on object storage (a real S3-protocol server on 127.0.0.1): tokenize -> pretrain -> SFT -> eval
with `output_dir: s3://...`; an `lmforge pretrain` killed after a checkpoint resumes on a node that never saw it
(its local copy wiped) with exactly the undisturbed run's losses; a rerun is a no-op; a truncated or altered object
is detected by its digest; bad storage settings end in one line (exit 2). Pretraining runs one worker here (in the
test's process where nothing is killed); 2 Ray workers on the store, one per node, are the two-node test's."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from infra import blob_cache, mirror
from infra.object_store import StorageError, open_store
from tests.pretrain_helpers import (
    SMOKE_SETTINGS,
    clean_env,
    kill_when,
    lmforge_command,
    logged_once,
    losses,
    pretrain_here,
    smoke_overrides,
    with_sets,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = [
    "train.checkpoint_every=10",
    "parallel.threads_per_worker=1",
    "tracking.enabled=false",  # MLflow with outputs on a store: the two-node test (tracking server)
    *SMOKE_SETTINGS,
]


@pytest.fixture(scope="module", autouse=True)
def own_ray_instance(s3):
    """Ray workers take their environment from the instance's start: one an earlier test started in this process
    lacks the S3 server's credentials (workers failed with "no S3 credentials"), so this module starts its own
    once the server's variables are set, and leaves none behind."""
    import ray

    ray.shutdown()
    yield
    ray.shutdown()


def run_dir_of(uri: str) -> Path:
    (run,) = (mirror.local_path(uri) / "pretrain").iterdir()
    return run


def gone(directory: Path, elsewhere: Path) -> None:
    """Move a killed run's local copy out of the way, again if a worker still exiting recreates it."""
    deadline = time.monotonic() + 60
    for attempt in itertools.count():
        if directory.exists():
            directory.rename(elsewhere / f"gone-{attempt}")  # atomic, unlike a delete racing a writer
        time.sleep(2)
        if not directory.exists():
            return
        assert time.monotonic() < deadline, f"{directory} keeps being written after the kill"


class Straight(NamedTuple):
    run_dir: Path  # this node's copy (tests that play another node wipe it)
    losses: dict[int, float]  # read when it finished, so no test depends on the copy surviving the others


@pytest.fixture(scope="module")
def straight(s3) -> Straight:
    """The undisturbed run, its outputs on the store."""
    pretrain_here("s3://lmforge/straight", *STEPS)
    run_dir = run_dir_of("s3://lmforge/straight")
    return Straight(run_dir, losses(run_dir))


def test_pipeline_on_object_storage(s3, straight: Straight, tmp_path: Path) -> None:
    from data_pipeline.tokenize import run_tokenize
    from evaluation.report import run_eval
    from flows.recipe import load_recipe
    from flows.stages.runs import load_model
    from flows.stages.sft import sft_data
    from training.stages.pretrain import run_pretrain
    from training.stages.sft import run_sft

    uri = "s3://lmforge/straight"
    recipe = load_recipe("smoke", smoke_overrides(uri, *STEPS))
    shutil.rmtree(mirror.cache_root())  # this process is another node: nothing local yet
    data = run_tokenize(recipe.data, recipe.output_dir)
    assert data.uri.startswith(uri) and not list(
        Path(data.path).glob("*.arrow")
    )  # shards stay remote until read
    base = run_pretrain(
        recipe.pretrain_spec(), data
    )  # finished on the store: pulled, verified, not retrained
    assert (
        Path(base.run_dir) == straight.run_dir
        and losses(straight.run_dir) == straight.losses
        and (Path(base.hf_export) / "config.json").is_file()
    )
    examples = sft_data(recipe, base)
    lora = run_sft(recipe.sft_spec(), base, examples)  # reads the shards through the digest-keyed cache
    report = run_eval(
        recipe.eval_spec(), [base, lora], sft_heldout=str(Path(examples.path) / "heldout.jsonl")
    )
    store = open_store(uri)
    listing = store.listing()
    stages = [Path(a.path).parent.name for a in (data, base, examples, lora, report)]
    for stage in ("tokenizer", *stages):
        assert any(k.startswith(f"{stage}/") and k.endswith("/manifest.json") for k in listing), stage
    manifest = json.loads(
        store.read_bytes(f"{Path(report.path).parent.name}/{Path(report.path).name}/manifest.json")
    )
    assert manifest["path"].startswith(uri)  # remote manifests name the store, not a node's disk
    assert (Path(report.path) / "report.md").is_file()
    assert (
        load_model(lora.uri, tmp_path).key == lora.key
    )  # `lmforge eval <recipe> s3://...` takes runs by URI


def test_killed_run_resumes_on_another_node_exactly(s3, straight: Straight, tmp_path: Path) -> None:
    uri = "s3://lmforge/killed"
    store = open_store(uri)
    args = ["pretrain", "smoke", *with_sets(smoke_overrides(uri, *STEPS))]

    def checkpointed() -> bool:
        return any(k.endswith("checkpoints/step-00000010/COMPLETE") for k in store.listing())

    kill_when(args, checkpointed, tmp_path / "killed.log")
    assert not any(k.startswith("pretrain/") and k.endswith("/manifest.json") for k in store.listing())
    gone(mirror.local_path(uri), tmp_path)  # the restart lands on a node that never saw the run
    pretrain_here(uri, *STEPS)
    run_dir = run_dir_of(uri)
    assert losses(run_dir) == straight.losses  # every step, bit for bit
    assert logged_once(run_dir, 10), "steps before the checkpoint were trained twice: a restart"

    before = store.listing()
    pretrain_here(uri, *STEPS)
    assert store.listing() == before  # a no-op: nothing trained, nothing uploaded


def test_damaged_objects_are_detected_by_digest(s3, straight: Straight, caplog) -> None:
    from data_pipeline.shards import ShardReader
    from data_pipeline.tokenize import run_tokenize
    from flows.recipe import load_recipe

    uri = "s3://lmforge/straight"
    recipe = load_recipe("smoke", smoke_overrides(uri, *STEPS))
    data = run_tokenize(recipe.data, recipe.output_dir)
    store = open_store(data.uri)
    shard = data.splits["train"].shards[0]
    original = store.read_bytes(shard.file)

    # altered, same size: the cache refuses it when a loader asks for the shard (on a node without a copy)
    shutil.rmtree(blob_cache.blob_dir(), ignore_errors=True)
    (Path(data.path) / shard.file).unlink(missing_ok=True)
    store.write_bytes(shard.file, bytes(255 - b for b in original[:64]) + original[64:])
    with pytest.raises(StorageError, match="sha256"):
        ShardReader(data, "train")
    assert not (blob_cache.blob_dir() / shard.sha256).exists()  # nothing unverified is kept

    # truncated: the finished check sees it, the stage is rebuilt and the object uploaded again
    store.write_bytes(shard.file, original[: len(original) // 2])
    shutil.rmtree(mirror.cache_root())
    with caplog.at_level("WARNING"):
        again = run_tokenize(recipe.data, recipe.output_dir)
    assert "damaged" in caplog.text and shard.file in caplog.text
    assert again.digest() == data.digest() and store.read_bytes(shard.file) == original
    assert ShardReader(again, "train").n_tokens == data.splits["train"].n_tokens


@pytest.mark.parametrize(
    "case",
    ["missing bucket", "unsupported scheme", "no credentials", "wrong secret", "unreachable endpoint"],
)
def test_bad_storage_settings_end_in_one_line(s3, case: str) -> None:
    env = clean_env()
    output = {"missing bucket": "s3://no-such-bucket/x", "unsupported scheme": "ftp://lmforge/x"}.get(
        case, "s3://lmforge/bad"
    )
    expected = {
        "missing bucket": "bucket 'no-such-bucket' does not exist",
        "unsupported scheme": "unsupported storage scheme 'ftp'",
        "no credentials": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        "wrong secret": "refused the credentials",
        "unreachable endpoint": "check the network and AWS_ENDPOINT_URL",
    }[case]
    if case == "no credentials":
        del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    if case == "wrong secret":
        env["AWS_SECRET_ACCESS_KEY"] = "wrong"
    if case == "unreachable endpoint":
        from infra.services import free_port

        env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"
        # one try of lmforge's (and of the S3 client's): the default 5 with backoff take ~13 s to give up
        env |= {"LMFORGE_STORAGE_ATTEMPTS": "1", "AWS_MAX_ATTEMPTS": "1"}
        expected = "(after 1 attempt(s)); check the network and AWS_ENDPOINT_URL"
    done = subprocess.run(
        lmforge_command(
            "tokenize", "smoke", "--set", f"output_dir={output}", "--set", "data.max_documents=5"
        ),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    error = [line for line in done.stderr.splitlines() if line.startswith("lmforge: error:")]
    assert len(error) == 1 and expected in error[0] and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "wrong" not in error[0]  # a secret is never printed


def test_ray_data_tokenizes_sources_on_the_store_like_local_processes(
    s3, small_data_cfg, tmp_path: Path
) -> None:
    """The committed corpus split into files, once on local disk and once in the bucket: Ray Data (2 actors)
    reading the bucket writes the same shards as local worker processes reading the disk."""
    import ray

    from data_pipeline.tokenize import run_tokenize
    from tests.pretrain_helpers import CORPUS

    lines = CORPUS.read_text().splitlines(keepends=True)[:120]
    store = open_store("s3://lmforge/corpus")
    (tmp_path / "corpus").mkdir()
    for part in range(3):
        data = "".join(lines[part::3]).encode()
        (tmp_path / "corpus" / f"part-{part}.jsonl").write_bytes(data)
        store.write_bytes(f"part-{part}.jsonl", data)
    cfg = small_data_cfg.model_copy(update={"max_documents": None, "num_workers": 2})
    local = run_tokenize(
        cfg.model_copy(update={"sources": (f"{tmp_path}/corpus/*.jsonl",)}), tmp_path / "out"
    )
    try:
        remote = run_tokenize(
            cfg.model_copy(update={"sources": ("s3://lmforge/corpus/*.jsonl",), "backend": "ray"}),
            "s3://lmforge/ray-data",
        )
    finally:
        ray.shutdown()
    digests = {s: [i.sha256 for i in info.shards] for s, info in remote.splits.items()}
    assert digests == {s: [i.sha256 for i in info.shards] for s, info in local.splits.items()}
    assert (
        remote.source_fingerprint == local.source_fingerprint
    )  # ids are relative to the glob, wherever it is
    assert remote.read_stats["documents"] == local.read_stats["documents"] == 120


def test_an_upload_cut_short_is_finished_by_the_rerun(s3, small_data_cfg, monkeypatch) -> None:
    """The network goes away in the middle of uploading a finished stage (after the store's retries): the stage
    fails with its one-line error and nothing is marked finished there; the rerun uploads the rest, no re-encoding."""
    from data_pipeline.tokenize import run_tokenize
    from infra.object_store import Store

    upload, shards = Store.upload, []

    def network_gone_after_one_shard(self: Store, local: Path, relative: str) -> None:
        if relative.endswith(".arrow"):
            shards.append(relative)
            if len(shards) > 1:
                raise StorageError(f"{self.url(relative)}: connection reset (after 5 attempt(s))")
        upload(self, local, relative)

    uri = "s3://lmforge/cut-short"
    monkeypatch.setattr(Store, "upload", network_gone_after_one_shard)
    with pytest.raises(StorageError, match="connection reset"):
        run_tokenize(small_data_cfg, uri)
    store = open_store(uri)
    assert not any(k.startswith("tokenize/") and k.endswith("manifest.json") for k in store.listing())
    monkeypatch.setattr(Store, "upload", upload)
    encoded: list[int] = []
    data = run_tokenize(small_data_cfg, uri, progress=lambda docs, tokens: encoded.append(docs))
    assert encoded == []  # finished here already: only the upload was left
    assert store.size(f"{Path(data.path).parent.name}/{Path(data.path).name}/manifest.json")
    for shard in data.splits["train"].shards:
        assert store.size(f"tokenize/{Path(data.path).name}/{shard.file}") == shard.bytes


def test_a_model_directory_on_the_store_is_imported_by_uri(s3, tmp_path: Path) -> None:
    """`--base s3://.../Qwen2-tiny` (a Hugging Face directory uploaded as is, no lmforge manifest): pulled to this
    node's mirror, imported like a local one (the same key), its lineage naming the URI."""
    from flows.stages.runs import load_model
    from tests.hf_checkpoints import write_checkpoint, write_tokenizer

    local = write_checkpoint("qwen2", tmp_path / "Qwen2-tiny", config={"vocab_size": 300})
    write_tokenizer("chatml", local)
    store, uri = open_store("s3://lmforge/models/Qwen2-tiny"), "s3://lmforge/models/Qwen2-tiny"
    for file in local.iterdir():
        store.upload(file, file.name)
    remote = load_model(uri, tmp_path / "outputs")
    assert (
        remote.kind == "imported" and remote.source_model is not None and remote.source_model.startswith(uri)
    )
    assert load_model(local, tmp_path / "outputs").key == remote.key
