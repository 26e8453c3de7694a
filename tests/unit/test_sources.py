"""Reading documents: formats, order, stable splits, and every kind of bad input named by file and line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_pipeline.config import DataConfig
from data_pipeline.sources import Corpus, DataError, split_of, stdlib_files


def cfg(*sources: str, **kw: object) -> DataConfig:
    return DataConfig(sources=sources, **kw)


def write_mixed(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha text")
    (tmp_path / "b.md").write_text("# beta\n")
    (tmp_path / "c.jsonl").write_text('{"text": "gamma 1"}\n\n{"text": "gamma 2", "id": 3}\n')
    # mtime=0: gzip headers carry the write time, which would make two copies differ across a second boundary
    record = json.dumps({"body": "x", "text": "delta"}) + "\n"
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(record.encode(), mtime=0))
    pq.write_table(pa.table({"text": ["eps 0", None, "eps 2"]}), tmp_path / "e.parquet")
    (tmp_path / "f.txt.gz").write_bytes(gzip.compress(b"zeta", mtime=0))


def test_reads_every_format_in_sorted_order(tmp_path: Path) -> None:
    write_mixed(tmp_path)
    corpus = Corpus(cfg(str(tmp_path / "*")))
    docs = list(corpus)
    assert [d.text for d in docs] == [
        "alpha text",
        "# beta\n",
        "gamma 1",
        "gamma 2",
        "delta",
        "eps 0",
        "eps 2",
        "zeta",
    ]
    assert docs[2].doc_id.endswith("c.jsonl:1") and docs[3].doc_id.endswith("c.jsonl:3")
    assert docs[6].doc_id.endswith("e.parquet#2")
    assert corpus.stats.empty_skipped == 1  # the null parquet row
    assert [d.doc_id for d in Corpus(cfg(str(tmp_path / "*")))] == [d.doc_id for d in docs]


def test_max_documents_and_fingerprint(tmp_path: Path) -> None:
    write_mixed(tmp_path)
    pattern = str(tmp_path / "*")
    assert len(list(Corpus(cfg(pattern, max_documents=3)))) == 3
    before = Corpus(cfg(pattern)).fingerprint()
    assert before == Corpus(cfg(pattern)).fingerprint()
    (tmp_path / "a.txt").write_text("alpha text changed")
    assert Corpus(cfg(pattern)).fingerprint() != before


def test_stdlib_corpus_is_the_library_without_tests() -> None:
    files = stdlib_files()
    names = {f.name for f in files}
    assert {"json", "os.py"} & ({f.parent.name for f in files} | names)
    assert not any("/test/" in f.as_posix() or "site-packages" in f.as_posix() for f in files)
    assert files == sorted(files) and len(files) > 300
    first = next(iter(Corpus(cfg("stdlib"))))
    assert first.doc_id.startswith("stdlib:") and first.text.strip()


def test_empty_glob_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no files match .*nothing-\*\.txt"):
        Corpus(cfg(str(tmp_path / "nothing-*.txt")))


def test_unsupported_type(tmp_path: Path) -> None:
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match=r"x\.csv has an unsupported type"):
        Corpus(cfg(str(tmp_path / "*")))


def test_empty_files_are_skipped_and_counted(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("  \n")
    (tmp_path / "c.txt").write_text("kept")
    corpus = Corpus(cfg(str(tmp_path / "*.txt")))
    assert [d.text for d in corpus] == ["kept"] and corpus.stats.empty_skipped == 2


def test_non_utf8_bytes_are_replaced_and_counted(tmp_path: Path) -> None:
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe then ok")
    corpus = Corpus(cfg(str(tmp_path / "*.txt")))
    assert [d.text for d in corpus] == ["ok \ufffd\ufffd then ok"]
    assert corpus.stats.replaced_bytes == 2 and corpus.stats.replaced_in == [str(tmp_path / "bad.txt")]


def test_jsonl_line_that_is_not_json_names_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text('{"text": "fine"}\n{oops\n')
    with pytest.raises(DataError, match=r"x\.jsonl:2: not valid JSON .*on_bad_record=skip"):
        list(Corpus(cfg(str(tmp_path / "x.jsonl"))))


def test_jsonl_line_without_the_field(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text('{"body": "no text here"}\n')
    with pytest.raises(DataError, match=r"x\.jsonl:1: has no string field 'text' \(found: \['body'\]\)"):
        list(Corpus(cfg(str(tmp_path / "x.jsonl"))))


def test_bad_jsonl_lines_can_be_skipped_and_counted(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n{oops\n[1]\n{"text": "b"}\n')
    corpus = Corpus(cfg(str(tmp_path / "x.jsonl"), on_bad_record="skip"))
    assert [d.text for d in corpus] == ["a", "b"] and corpus.stats.bad_records_skipped == 2


def test_corrupt_parquet_names_the_file(tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": ["a"] * 100}), tmp_path / "t.parquet")
    data = (tmp_path / "t.parquet").read_bytes()
    (tmp_path / "t.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"t\.parquet: not a readable parquet file"):
        list(Corpus(cfg(str(tmp_path / "t.parquet"))))


def test_parquet_without_the_column(tmp_path: Path) -> None:
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"no column 'text' \(columns: \['body'\]\)"):
        list(Corpus(cfg(str(tmp_path / "t.parquet"))))


def test_split_is_stable_and_close_to_the_fraction() -> None:
    ids = [f"doc-{i}" for i in range(4000)]
    val = [i for i in ids if split_of(i, 0.1) == "val"]
    assert 0.08 < len(val) / len(ids) < 0.12
    assert val == [i for i in ids if split_of(i, 0.1) == "val"]
    assert all(split_of(i, 0.0) == "train" for i in ids[:100])


def test_ids_and_fingerprint_do_not_depend_on_where_the_data_lives(tmp_path: Path) -> None:
    for place in ("a", "b/deeper"):
        (tmp_path / place).mkdir(parents=True)
        write_mixed(tmp_path / place)
    one, two = Corpus(cfg(str(tmp_path / "a" / "*"))), Corpus(cfg(str(tmp_path / "b" / "deeper" / "*")))
    assert [d.doc_id for d in one] == [d.doc_id for d in two]
    assert [d.doc_id for d in one][0] == "a.txt"
    assert one.fingerprint() == two.fingerprint()


def test_binary_file_in_a_text_glob_is_refused_or_skipped_by_name(tmp_path: Path) -> None:
    (tmp_path / "good.txt").write_text("plain words")
    (tmp_path / "x.txt").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00" + bytes(range(256)) * 20)
    with pytest.raises(
        DataError, match=r"x\.txt: looks binary, not text \(it contains NUL bytes\); remove it"
    ):
        list(Corpus(cfg(str(tmp_path / "*.txt"))))
    corpus = Corpus(cfg(str(tmp_path / "*.txt"), on_bad_record="skip"))
    assert [d.text for d in corpus] == ["plain words"]
    assert corpus.stats.binary_skipped == 1 and corpus.stats.binary_files == [str(tmp_path / "x.txt")]
    assert corpus.stats.replaced_bytes == 0 and corpus.stats.replaced_in == []  # skipped, not "repaired"
    (tmp_path / "x.txt").write_bytes(bytes(range(128, 256)) * 4)  # no NULs, none of it UTF-8
    with pytest.raises(DataError, match=r"looks binary, not text \(100% of it is not valid text"):
        list(Corpus(cfg(str(tmp_path / "*.txt"))))


def test_encoding_and_byte_order_marks(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes("café crème".encode("latin-1"))
    assert [d.text for d in Corpus(cfg(str(tmp_path / "a.txt"), encoding="latin-1"))] == ["café crème"]
    (tmp_path / "b.jsonl").write_bytes(b"\xef\xbb\xbf" + b'{"text": "first"}\n{"text": "second"}\n')
    (tmp_path / "c.txt").write_bytes(b"\xef\xbb\xbfbom text")
    for mode in ("error", "skip"):
        corpus = Corpus(cfg(str(tmp_path / "b.jsonl"), str(tmp_path / "c.txt"), on_bad_record=mode))
        assert [d.text for d in corpus] == ["first", "second", "bom text"]
        assert corpus.stats.bad_records_skipped == 0
    with pytest.raises(ValueError, match="unknown encoding 'utf-9'"):
        cfg("x", encoding="utf-9")


@pytest.mark.parametrize("name", ["t.txt.gz", "t.jsonl.gz"])
@pytest.mark.parametrize("damage", ["truncated", "not gzip"])
def test_damaged_gzip_names_the_file(tmp_path: Path, name: str, damage: str) -> None:
    data = gzip.compress(b'{"text": "some words here"}\n' * 200, mtime=0)
    (tmp_path / name).write_bytes(data[: len(data) // 2] if damage == "truncated" else b"plain, not gzip")
    with pytest.raises(DataError, match=rf"{name}: not a readable gzip file"):
        list(Corpus(cfg(str(tmp_path / name))))


@pytest.mark.parametrize("column", [pa.array([1, 2]), pa.array([["a"], ["b"]])])
def test_parquet_text_column_of_another_type_is_named(tmp_path: Path, column: pa.Array) -> None:
    pq.write_table(pa.table({"text": column}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"p\.parquet: column 'text' holds (int64|list<.*string>), not text"):
        list(Corpus(cfg(str(tmp_path / "p.parquet"))))


def test_vocab_too_small_for_the_byte_alphabet_is_refused() -> None:
    from data_pipeline.config import MIN_VOCAB, TokenizerConfig

    with pytest.raises(
        ValueError, match=rf"vocab_size=200 cannot hold the 256 bytes .* at least {MIN_VOCAB}"
    ):
        TokenizerConfig(vocab_size=200)
    assert TokenizerConfig(vocab_size=MIN_VOCAB).vocab_size == MIN_VOCAB


def test_split_of_known_ids_is_pinned() -> None:
    """The train/validation split of a document must never move between versions (it would leak validation
    text into training): these ids' hash positions are 0.0602, 0.5407, 0.8509, 0.9893."""
    assert split_of("e.parquet#2", 0.06) == "train" and split_of("e.parquet#2", 0.061) == "val"
    assert split_of("x.txt", 0.5) == "train" and split_of("x.txt", 0.541) == "val"
    assert split_of("os.py", 0.85) == "train" and split_of("os.py", 0.851) == "val"
    assert split_of("stdlib:os.py", 0.95) == "train"
