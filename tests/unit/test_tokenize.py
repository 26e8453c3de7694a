"""Tokenizer and shards: AutoTokenizer round trip, determinism across workers, idempotent reruns, exact resume."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from data_pipeline.config import DataConfig, TokenizerConfig
from data_pipeline.shards import DatasetManifest, ShardReader
from data_pipeline.sources import Corpus, DataError
from data_pipeline.tokenize import run_tokenize
from data_pipeline.tokenizer import CHAT_TEMPLATE, EOS, corpus_tokenizer, describe, train_bpe
from infra.storage import MANIFEST, sha256_file


def shard_digests(manifest: DatasetManifest) -> dict[str, list[str]]:
    return {split: [s.sha256 for s in info.shards] for split, info in manifest.splits.items()}


def test_manifest_describes_the_shards(tokenized: tuple[DatasetManifest, Path]) -> None:
    manifest, _ = tokenized
    reader = ShardReader(manifest, "train", verify=True)
    assert reader.n_tokens == manifest.splits["train"].n_tokens > 0
    assert len(reader.document_lengths()) == manifest.splits["train"].n_docs
    assert manifest.dtype == "uint16" and manifest.splits["val"].n_docs > 0
    assert len(manifest.splits["train"].shards) > 1  # small shard_tokens: the stream really spans shards
    eos = manifest.tokenizer.eos_id
    ends = reader.document_lengths().cumsum()
    assert all(reader.slice(int(end) - 1, 1)[0] == eos for end in ends)  # every document ends with EOS


def test_tokenizer_loads_in_transformers_and_round_trips(tokenized: tuple[DatasetManifest, Path]) -> None:
    from transformers import AutoTokenizer

    manifest, _ = tokenized
    ours = describe(Path(manifest.tokenizer.path)).load()
    theirs = AutoTokenizer.from_pretrained(manifest.tokenizer.path)
    text = "def f(x):\n    return x ** 2  # ünïcode ✓\n"
    assert theirs(text)["input_ids"] == ours.encode(text).ids
    assert theirs.decode(ours.encode(text).ids) == text
    assert theirs.eos_token == EOS and theirs.eos_token_id == manifest.tokenizer.eos_id
    assert theirs.pad_token_id == manifest.tokenizer.pad_id
    assert theirs.chat_template == CHAT_TEMPLATE


def test_special_token_strings_in_documents_stay_plain_text(tokenized: tuple[DatasetManifest, Path]) -> None:
    manifest, _ = tokenized
    tokenizer = corpus_tokenizer(manifest.tokenizer.path)
    ids = tokenizer.encode(f"a {EOS} b").ids
    assert manifest.tokenizer.eos_id not in ids and tokenizer.decode(ids) == f"a {EOS} b"


def test_tokenizer_training_is_deterministic(small_data_cfg: DataConfig) -> None:
    texts = [d.text for d in Corpus(small_data_cfg.model_copy(update={"max_documents": 10}))]
    assert (
        train_bpe(texts, small_data_cfg.tokenizer).to_str()
        == train_bpe(texts, small_data_cfg.tokenizer).to_str()
    )


@pytest.mark.slow
def test_shards_are_identical_for_any_worker_count(
    small_data_cfg: DataConfig, tokenized: tuple[DatasetManifest, Path], tmp_path: Path
) -> None:
    manifest, _ = tokenized
    two = run_tokenize(small_data_cfg.model_copy(update={"num_workers": 2}), tmp_path)
    assert shard_digests(two) == shard_digests(manifest)
    assert two.tokenizer.digest == manifest.tokenizer.digest


def test_rerun_of_a_finished_stage_does_nothing(
    small_data_cfg: DataConfig, tokenized: tuple[DatasetManifest, Path]
) -> None:
    manifest, root = tokenized
    stamp = (Path(manifest.path) / MANIFEST).stat().st_mtime_ns
    again = run_tokenize(
        small_data_cfg, root, progress=lambda d, t: pytest.fail("re-tokenized a finished stage")
    )
    assert again == manifest and (Path(manifest.path) / MANIFEST).stat().st_mtime_ns == stamp


class Interrupt(Exception):
    pass


def test_interrupted_run_resumes_to_identical_shards(
    small_data_cfg: DataConfig, tokenized: tuple[DatasetManifest, Path], tmp_path: Path
) -> None:
    manifest, _ = tokenized

    def die_after_some(docs: int, tokens: int) -> None:
        if tokens > 60_000:
            raise Interrupt

    with pytest.raises(Interrupt):
        run_tokenize(small_data_cfg, tmp_path, progress=die_after_some)
    partial = tmp_path / "tokenize" / Path(manifest.path).name
    written = sorted(p.name for p in partial.glob("train-*.arrow"))
    assert written and len(written) < len(manifest.splits["train"].shards)
    with pytest.raises(DataError, match="interrupted run"):  # a partial dataset is never read as complete
        DatasetManifest.load(partial)
    # what a kill can leave behind: a half-written temp file and a renamed shard whose sidecar never landed
    (partial / "train-00099.arrow.tmp").write_bytes(b"half")
    last = partial / written[-1]
    last.with_suffix(".json").unlink()
    seen: list[int] = []
    resumed = run_tokenize(small_data_cfg, tmp_path, progress=lambda d, t: seen.append(d))
    assert shard_digests(resumed) == shard_digests(manifest)
    assert seen[-1] < manifest.splits["train"].n_docs + manifest.splits["val"].n_docs  # did not start over
    assert not list(partial.glob("*.tmp"))


def test_corrupted_shard_is_not_kept_on_resume(
    small_data_cfg: DataConfig, tokenized: tuple[DatasetManifest, Path], tmp_path: Path
) -> None:
    manifest, _ = tokenized
    copy = tmp_path / "tokenize" / Path(manifest.path).name
    shutil.copytree(manifest.path, copy)
    shutil.copytree(Path(manifest.tokenizer.path).parent, tmp_path / "tokenizer")
    (copy / MANIFEST).unlink()
    shard = copy / "train-00000.arrow"
    shard.write_bytes(shard.read_bytes()[:-10] + b"0123456789")  # same size, different bytes
    resumed = run_tokenize(small_data_cfg, tmp_path)
    assert shard_digests(resumed) == shard_digests(manifest)
    on_disk = {  # the files themselves, not the digests their sidecars claim
        split: [sha256_file(Path(resumed.path) / s.file) for s in info.shards]
        for split, info in resumed.splits.items()
    }
    assert on_disk == shard_digests(manifest)


def test_truncated_shard_is_refused_by_name(tokenized: tuple[DatasetManifest, Path], tmp_path: Path) -> None:
    manifest, _ = tokenized
    copy = tmp_path / "copy"
    shutil.copytree(manifest.path, copy)
    shard = copy / "train-00001.arrow"
    shard.write_bytes(shard.read_bytes()[:100])
    broken = manifest.model_copy(update={"path": str(copy)})
    with pytest.raises(
        DataError, match=r"shard .*train-00001\.arrow: 100 bytes, .* when written \(truncated"
    ):
        ShardReader(broken, "train")


def test_shard_overwritten_in_place_is_refused_before_training(tokenized, tmp_path: Path) -> None:
    """Same size and modification time, different bytes, after an earlier run had verified the shard (bit rot, or a
    rewrite that restored the time stamp): the loader refuses by name."""
    from data_pipeline.loader import PackedLoader

    manifest, _ = tokenized
    copy = tmp_path / "copy"
    shutil.copytree(manifest.path, copy)
    moved = manifest.model_copy(update={"path": str(copy)})
    PackedLoader(moved, seq_len=32, batch_size=2)  # verified once, recorded
    assert set(json.loads((copy / ".verified.json").read_text())) >= {
        s.file for s in moved.splits["train"].shards
    }
    shard = copy / "train-00001.arrow"
    tokens = shard_tokens(shard)
    data = bytearray(shard.read_bytes())
    window = tokens[100:108].tobytes()  # eight token ids inside the values buffer, not the Arrow metadata
    at = data.find(window)
    assert at > 0 and data.find(window, at + 1) == -1
    data[at : at + len(window)] = tokens[200:208].tobytes()  # other valid ids, size unchanged
    written = shard.stat()
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(written.st_atime_ns, written.st_mtime_ns))
    assert shard.stat().st_mtime_ns == written.st_mtime_ns
    changed = shard_tokens(shard)  # still a well-formed Arrow file: only the digest can tell
    assert len(changed) == len(tokens) and (changed != tokens).any()
    with pytest.raises(DataError, match=r"shard .*train-00001\.arrow: bytes differ from the sha256"):
        PackedLoader(moved, seq_len=32, batch_size=2)


def shard_tokens(path: Path):  # noqa: ANN201 - a numpy array
    import pyarrow as pa

    with pa.memory_map(str(path), "r") as source:
        return pa.ipc.open_file(source).get_batch(0).column("tokens").values.to_numpy().copy()


def test_empty_corpus_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    cfg = DataConfig(sources=(str(tmp_path / "*.txt"),), num_workers=1)
    with pytest.raises(DataError, match="no text"):
        run_tokenize(cfg, tmp_path / "out")


def test_manifest_is_json_with_digests(tokenized: tuple[DatasetManifest, Path]) -> None:
    manifest, _ = tokenized
    data = json.loads((Path(manifest.path) / MANIFEST).read_text())
    assert data["tokenizer"]["digest"] == manifest.tokenizer.digest
    assert all(len(s["sha256"]) == 64 for s in data["splits"]["train"]["shards"])


def test_long_document_is_encoded_in_pieces_with_the_same_ids(tokenized) -> None:
    from data_pipeline.tokenizer import corpus_tokenizer, pieces

    manifest, _ = tokenized
    tokenizer = corpus_tokenizer(manifest.tokenizer.path)
    text = " ".join(
        f"word{i % 97}, (x+{i})  then\tmore text:{i}" for i in range(2000)
    )  # ~70k chars, one line
    parts = pieces(text, limit=1000)
    assert len(parts) > 50 and "".join(parts) == text and max(map(len, parts)) <= 1000
    whole = tokenizer.encode(text).ids
    assert [i for p in parts for i in tokenizer.encode(p).ids] == whole


def test_a_single_document_corpus_warns_that_validation_is_empty(tmp_path: Path, caplog) -> None:
    (tmp_path / "one.txt").write_text("a single long line of text " * 400)
    cfg = DataConfig(
        sources=(str(tmp_path / "one.txt"),),
        num_workers=1,
        val_fraction=0.05,
        tokenizer=TokenizerConfig(vocab_size=300),
    )
    with caplog.at_level("WARNING"):
        manifest = run_tokenize(cfg, tmp_path / "out")
    assert manifest.splits["val"].n_docs == 0
    assert "the validation split is empty (1 document(s), val_fraction=0.05)" in caplog.text


def test_a_copied_or_moved_output_tree_reads_its_own_files(
    small_data_cfg: DataConfig, tokenized, tmp_path
) -> None:
    """Manifests record absolute paths; read from a copy (or after a move) they point into the copy, so the copy's
    shards and tokenizer are the ones loaded and verified, never the original's."""
    from data_pipeline.loader import PackedLoader

    manifest, root = tokenized
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    relative = Path(manifest.path).relative_to(root)
    loaded = DatasetManifest.load(copy / relative)
    found = run_tokenize(
        small_data_cfg, copy, progress=lambda d, t: pytest.fail("re-tokenized a finished copy")
    )
    for read in (loaded, found):
        assert Path(read.path) == (copy / relative).resolve()
        assert Path(read.tokenizer.path).is_relative_to(copy.resolve())
        assert read.digest() == manifest.digest()
    moved = tmp_path / "moved"
    copy.rename(moved)
    shard = moved / relative / "train-00000.arrow"
    shard.write_bytes(shard.read_bytes()[:100])  # damage in the moved tree is seen there
    with pytest.raises(DataError, match=r"moved/.*train-00000\.arrow: 100 bytes"):
        PackedLoader(DatasetManifest.load(moved / relative), seq_len=32, batch_size=2)
