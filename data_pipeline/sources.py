"""Documents from local files, the installed Python standard library, or a Hugging Face dataset.

Documents stream one at a time in a deterministic order (sources as configured, files sorted), so the corpus is
never held in memory and two runs see the same sequence. Bad input is reported by file and line: empty files
are skipped and counted; bytes that are not UTF-8 are replaced by U+FFFD and counted; a JSONL line that is not
JSON or lacks the text field is an error (or skipped and counted when `on_bad_record: skip`).
"""

from __future__ import annotations

import codecs
import fnmatch
import gzip
import hashlib
import io
import json
import logging
import os
import re
import sysconfig
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from glob import glob
from pathlib import Path
from typing import Literal

from data_pipeline.config import DataConfig
from infra.errors import UserError
from infra.mirror import working_dir
from infra.object_store import Store, is_remote, open_store

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # how surrogateescape spells a byte that is not UTF-8
# Parts of the standard library that are not the library itself: tests, build config, bundled wheels.
_STDLIB_SKIP = re.compile(
    r"(^|/)(tests?|idle_test|site-packages|config-[^/]*|ensurepip/_bundled)(/|$)|_sysconfigdata"
)


class DataError(UserError, ValueError):
    """Input the pipeline cannot use; the message names the file (and line) and what to do."""


@dataclass(frozen=True)
class Document:
    doc_id: str  # stable across runs: "<source>:<relative path>[:<line or row>]"
    text: str
    source: str = ""  # the data.sources entry it came from (per-source evaluation)


@dataclass
class ReadStats:
    """What reading the sources skipped or repaired."""

    files: int = 0
    documents: int = 0
    empty_skipped: int = 0
    bad_records_skipped: int = 0
    binary_skipped: int = 0
    binary_files: list[str] = field(default_factory=list)  # first few files skipped as binary
    replaced_bytes: int = 0
    replaced_in: list[str] = field(default_factory=list)  # first few files with non-UTF-8 bytes

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def add(self, other: ReadStats) -> None:
        """Count what another reader (one file, on another node) saw."""
        for name in (
            "files",
            "documents",
            "empty_skipped",
            "bad_records_skipped",
            "binary_skipped",
            "replaced_bytes",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.binary_files = (self.binary_files + other.binary_files)[:10]
        self.replaced_in = (self.replaced_in + other.replaced_in)[:10]


def decode_text(data: bytes, where: str, stats: ReadStats, encoding: str = "utf-8") -> str:
    """Decode `data`, dropping a leading byte-order mark and replacing each undecodable byte with U+FFFD (counted
    in `stats`)."""
    if encoding == "utf-8":
        data = data.removeprefix(codecs.BOM_UTF8)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            text = data.decode("utf-8", errors="surrogateescape")
            bad = len(_ESCAPED_BYTE.findall(text))
            text = _ESCAPED_BYTE.sub("\ufffd", text)
    else:
        text = data.decode(encoding, errors="replace").removeprefix("\ufeff")
        bad = text.count("\ufffd")
    if bad:
        stats.replaced_bytes += bad
        if len(stats.replaced_in) < 10:
            stats.replaced_in.append(where)
    return text


def binary_reason(text: str) -> str | None:
    """Why decoded text looks like a binary file (NUL characters, or over 10% undecodable bytes), else None."""
    if "\x00" in text:
        return "it contains NUL bytes"
    replaced = text.count("\ufffd")
    if replaced > max(8, len(text) // 10):
        return f"{replaced / len(text):.0%} of it is not valid text in its encoding"
    return None


def split_of(doc_id: str, val_fraction: float) -> str:
    """'val' for a stable pseudo-random `val_fraction` of documents (by hash of the id), else 'train'."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big") / 2**64
    return "val" if h < val_fraction else "train"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's own `.py` sources, sorted (no tests, no site-packages, no build config)."""
    root = stdlib_root()
    found = []
    for directory, subdirs, files in os.walk(root):
        rel = Path(directory).relative_to(root).as_posix()
        subdirs[:] = [d for d in subdirs if not _STDLIB_SKIP.search(f"{rel}/{d}/")]  # prune whole trees
        found += [
            Path(directory, f) for f in files if f.endswith(".py") and not _STDLIB_SKIP.search(f"{rel}/{f}")
        ]
    return sorted(found)


def _open_bytes(path: Path) -> bytes:
    data = path.read_bytes()  # a read error is the OS's (permissions, a vanished file), not a gzip problem
    if path.suffix != ".gz":
        return data
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as error:
        raise DataError(f"{path}: not a readable gzip file ({error}); re-compress it or remove it") from None


def _kind(path: Path) -> str:
    name = path.name.removesuffix(".gz")
    return Path(name).suffix


@dataclass(frozen=True)
class _Source:
    label: str  # prefix of document ids
    root: Path | None  # document ids are relative to it, so they do not depend on where the data lives
    files: tuple[Path, ...]
    hf_spec: str | None = None
    relative_ids: bool = False  # file globs: ids are bare relative paths (no label)
    remote: Store | None = None  # an object-store glob: `files` are this node's copies, fetched when read
    sizes: dict[Path, int] = field(default_factory=dict)  # of the remote objects


def glob_root(pattern: str) -> Path:
    """The directory part of a glob before its first wildcard ('/data/**/*.txt' -> '/data'); a plain file's
    directory for a pattern without wildcards."""
    parts = Path(pattern).parts
    for i, part in enumerate(parts):
        if any(c in part for c in "*?["):
            return Path(*parts[:i]) if i else Path(".")
    return Path(pattern).parent


def local_files(spec: str) -> list[Path]:
    """The files a local glob in `data.sources` names, sorted; refused in one line when it names none or a file
    of a type lmforge does not read."""
    matches = sorted(Path(p) for p in glob(spec, recursive=True) if Path(p).is_file())
    if not matches:
        raise DataError(f"data.sources: no files match {spec!r} (relative to {Path.cwd()}); check the glob")
    unsupported = [p for p in matches if _kind(p) not in SUFFIXES]
    if unsupported:
        raise DataError(
            f"data.sources: {unsupported[0]} has an unsupported type; use {', '.join(SUFFIXES)} (optionally .gz)"
        )
    return matches


SourceKind = Literal["stdlib", "hf", "remote", "local"]


def source_kind(spec: str) -> SourceKind:
    """What a `data.sources` entry names: `stdlib`, `hf` (a Hugging Face dataset), `remote` (a glob over object
    storage) or `local` (a glob of files)."""
    if spec == "stdlib":
        return "stdlib"
    if spec.startswith("hf:"):
        return "hf"
    return "remote" if is_remote(spec) else "local"


def check_local_sources(cfg: DataConfig) -> None:
    """`local_files` of each local source, before anything runs (the standard library, Hugging Face datasets
    and object storage are checked when read)."""
    for spec in cfg.sources:
        if source_kind(spec) == "local":
            local_files(spec)


class Corpus:
    """The configured sources as one ordered stream of documents, with a content fingerprint."""

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg
        self.stats = ReadStats()
        self._sources = [self._resolve(spec) for spec in cfg.sources]
        if not cfg.sources:
            raise DataError("data.sources is empty; list file globs, 'stdlib', or 'hf:<dataset>'")

    def _resolve(self, spec: str) -> _Source:
        kind = source_kind(spec)
        if kind == "stdlib":
            return _Source("stdlib", stdlib_root(), tuple(stdlib_files()))
        if kind == "hf":
            return _Source(spec, None, (), hf_spec=spec.removeprefix("hf:"))
        if kind == "remote":
            return self._resolve_remote(spec)
        return _Source(spec, glob_root(spec), tuple(local_files(spec)), relative_ids=True)

    def _resolve_remote(self, spec: str) -> _Source:
        """A glob over object storage (`s3://bucket/corpus/**/*.jsonl`): listed now, each file downloaded into
        this node's cache the first time it is read. Ids are relative to the glob's root, as for local files."""
        root, _, pattern = spec.partition("*")
        root = root.rsplit("/", 1)[0]
        store = open_store(root)
        pattern = spec[len(root) + 1 :]
        listing = store.listing()
        names = sorted(n for n in listing if fnmatch.fnmatch(n, pattern) and _kind(Path(n)) in SUFFIXES)
        if not names:
            raise DataError(
                f"data.sources: no objects match {spec!r} (supported: {', '.join(SUFFIXES)}); check the glob"
            )
        local = working_dir(root)
        files = tuple(local / n for n in names)
        return _Source(
            spec, local, files, relative_ids=True, remote=store, sizes={local / n: listing[n] for n in names}
        )

    @staticmethod
    def _fetch(source: _Source, path: Path) -> Path:
        """`path`, downloaded first when it belongs to an object-store source and this node lacks it."""
        if source.remote is not None and (not path.is_file() or path.stat().st_size != source.sizes[path]):
            assert source.root is not None
            source.remote.download(path.relative_to(source.root).as_posix(), path, size=source.sizes[path])
        return path

    def fingerprint(self) -> str:
        """sha256 over every file's id and content (or the dataset's own fingerprint for `hf:` sources)."""
        h = hashlib.sha256()
        for source in self._sources:
            h.update(("files" if source.relative_ids else source.label).encode() + b"\0")  # not the path
            if source.hf_spec is not None:
                h.update(_hf_dataset(source.hf_spec)._fingerprint.encode())
            for path in source.files:
                h.update(self._file_id(source, path).encode() + b"\0")
                h.update(hashlib.sha256(self._fetch(source, path).read_bytes()).digest())
        h.update(json.dumps([self.cfg.text_field, self.cfg.max_documents]).encode())
        return h.hexdigest()

    @staticmethod
    def _file_id(source: _Source, path: Path) -> str:
        rel = path.relative_to(source.root).as_posix() if source.root else path.as_posix()
        return rel if source.relative_ids else f"{source.label}:{rel}"

    def __iter__(self) -> Iterator[Document]:
        self.stats = ReadStats()
        limit = self.cfg.max_documents
        for source in self._sources:
            documents = (
                _iter_hf(source.hf_spec, self.cfg.text_field) if source.hf_spec else self._iter_files(source)
            )
            for doc in documents:
                if not doc.text.strip():
                    self.stats.empty_skipped += 1
                    continue
                self.stats.documents += 1
                yield replace(doc, source=source.label)
                if limit is not None and self.stats.documents >= limit:
                    return

    def _iter_files(self, source: _Source) -> Iterator[Document]:
        for path in source.files:
            yield from self._iter_file(source, path)

    def _iter_file(self, source: _Source, path: Path) -> Iterator[Document]:
        self._fetch(source, path)
        self.stats.files += 1
        file_id = self._file_id(source, path)
        kind = _kind(path)
        if kind == ".jsonl":
            yield from self._iter_jsonl(path, file_id)
        elif kind == ".parquet":
            yield from self._iter_parquet(path, file_id)
        else:
            read = ReadStats()  # a file skipped as binary counts as skipped, not as text with bytes replaced
            text = decode_text(_open_bytes(path), str(path), read, self.cfg.encoding)
            if (reason := binary_reason(text)) is None:
                self.stats.add(read)
                yield Document(file_id, text)
            elif self.cfg.on_bad_record == "skip":
                log.warning("%s: skipped, it looks binary (%s)", path, reason)
                self.stats.binary_skipped += 1
                if len(self.stats.binary_files) < 10:
                    self.stats.binary_files.append(str(path))
            else:
                raise DataError(
                    f"{path}: looks binary, not text ({reason}); remove it from data.sources, set "
                    "data.encoding if it is text, or set data.on_bad_record=skip to skip such files"
                )

    def files(self) -> list[tuple[int, int]]:
        """(source, file) index pairs of every file, in corpus order: the units a cluster reads in parallel."""
        if hf := [s.label for s in self._sources if s.hf_spec is not None]:
            raise DataError(
                f"data.sources {hf} are Hugging Face datasets, which data.backend=ray cannot split by file; use data.backend=processes"
            )
        return [(s, f) for s, source in enumerate(self._sources) for f in range(len(source.files))]

    def read_file(self, source_index: int, file_index: int) -> tuple[list[Document], ReadStats]:
        """One file's non-empty documents and what reading it skipped or repaired (`documents` is left to the
        caller, who applies `max_documents` in corpus order)."""
        self.stats = ReadStats()
        source = self._sources[source_index]
        documents = []
        for doc in self._iter_file(source, source.files[file_index]):
            if doc.text.strip():
                documents.append(replace(doc, source=source.label))
            else:
                self.stats.empty_skipped += 1
        return documents, self.stats

    def _iter_jsonl(self, path: Path, file_id: str) -> Iterator[Document]:
        opener = gzip.open if path.suffix == ".gz" else open
        try:
            with opener(path, "rb") as f:
                yield from self._jsonl_records(f, path, file_id)
        except (EOFError, zlib.error, gzip.BadGzipFile) as error:
            raise DataError(
                f"{path}: not a readable gzip file ({error}); re-compress it or remove it"
            ) from None

    def _jsonl_records(self, lines: Iterable[bytes], path: Path, file_id: str) -> Iterator[Document]:
        field_name = self.cfg.text_field
        for lineno, raw in enumerate(lines, start=1):
            line = decode_text(raw, f"{path}:{lineno}", self.stats, self.cfg.encoding).strip()
            if not line:
                continue
            problem = None
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                problem = f"not valid JSON ({error.msg})"
            else:
                if not isinstance(record, dict) or not isinstance(record.get(field_name), str):
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    problem = f"has no string field {field_name!r} (found: {keys}); set data.text_field"
            if problem is None:
                yield Document(f"{file_id}:{lineno}", record[field_name])
            elif self.cfg.on_bad_record == "skip":
                self.stats.bad_records_skipped += 1
            else:
                raise DataError(
                    f"{path}:{lineno}: {problem} (or set data.on_bad_record=skip to skip such lines)"
                )

    def _iter_parquet(self, path: Path, file_id: str) -> Iterator[Document]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            handle = io.BytesIO(_open_bytes(path)) if path.suffix == ".gz" else path
            parquet = pq.ParquetFile(handle)
        except (pa.ArrowException, OSError) as error:
            raise DataError(
                f"{path}: not a readable parquet file ({error}); re-export or remove it"
            ) from None
        columns = parquet.schema_arrow.names
        if self.cfg.text_field not in columns:
            raise DataError(
                f"{path}: no column {self.cfg.text_field!r} (columns: {columns}); set data.text_field"
            )
        kind = parquet.schema_arrow.field(self.cfg.text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
            raise DataError(
                f"{path}: column {self.cfg.text_field!r} holds {kind}, not text; point data.text_field at a string column"
            )
        row = 0
        try:
            for batch in parquet.iter_batches(columns=[self.cfg.text_field], batch_size=1024):
                for text in batch.column(0).to_pylist():
                    yield Document(f"{file_id}#{row}", text or "")
                    row += 1
        except (pa.ArrowException, OSError) as error:
            raise DataError(f"{path}: corrupt parquet data after row {row} ({error})") from None


def _hf_dataset(spec: str):  # noqa: ANN202 - `datasets` is optional and not typed here
    try:
        import datasets
    except ImportError:
        raise DataError(f"source hf:{spec} needs the `datasets` package: pip install datasets") from None
    name, _, split = spec.partition(":")
    return datasets.load_dataset(name, split=split or "train")


def _iter_hf(spec: str, text_field: str) -> Iterator[Document]:
    dataset = _hf_dataset(spec)
    if text_field not in dataset.column_names:
        raise DataError(
            f"hf:{spec}: no column {text_field!r} (columns: {dataset.column_names}); set data.text_field"
        )
    for row, record in enumerate(dataset):
        yield Document(f"hf:{spec}#{row}", record[text_field] or "")
