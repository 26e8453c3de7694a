"""Tokenization throughput of the whole stage vs raw `Tokenizer.encode_batch`, and its peak memory.

Ratio = pipeline tokens/s (N worker processes, reading, encoding, writing shards, hashing) divided by raw
`encode_batch` tokens/s over the same documents in this process (the tokenizer's own thread pool). Peak RSS
(process plus workers) is measured in fresh subprocesses on the corpus (`shards` shards long) and on the
same documents three times over: bounded memory means the two peaks are about equal. Prints one JSON line.

    .venv/bin/python benchmarks/tokenize_throughput.py [--workers 2] [--vocab 4096] [--shard-tokens 100000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from data_pipeline.config import DataConfig, TokenizerConfig
from data_pipeline.sources import Corpus, stdlib_files, stdlib_root
from data_pipeline.tokenize import run_tokenize
from data_pipeline.tokenizer import run_train_tokenizer

RSS_PROBE = """
import sys
from data_pipeline.config import DataConfig
from data_pipeline.tokenize import run_tokenize
run_tokenize(DataConfig.model_validate_json(sys.argv[1]), sys.argv[2])
"""


def peak_rss_mib(cfg: DataConfig, root: Path) -> float:
    """Peak of the summed RSS of a fresh tokenize process and its workers, sampled every 20 ms.

    (ru_maxrss is not used: a child inherits its parent's peak across fork and exec.)
    """
    process = subprocess.Popen([sys.executable, "-c", RSS_PROBE, cfg.model_dump_json(), str(root)])
    parent = psutil.Process(process.pid)
    peak = 0
    while process.poll() is None:
        try:
            tree = [parent, *parent.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree))
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.02)
    if process.returncode != 0:
        raise RuntimeError(f"tokenize probe failed with exit code {process.returncode}")
    return peak / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--shard-tokens", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg = DataConfig(
        tokenizer=TokenizerConfig(vocab_size=args.vocab),
        shard_tokens=args.shard_tokens,
        num_workers=args.workers,
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = Corpus(cfg)
        tok = run_train_tokenizer(
            cfg.tokenizer, corpus, corpus.fingerprint(), root
        )  # shared by both runs, not timed
        texts = [doc.text for doc in corpus]

        tokenizer = tok.load()
        tokenizer.encode_special_tokens = True
        with_tok = {"tokenizer": cfg.tokenizer.model_copy(update={"path": tok.path})}
        raw_s, pipeline_s = [], []
        for repeat in range(args.repeats):  # interleaved, best of each: this machine's speed drifts by ±20%
            started = time.perf_counter()
            raw_tokens = sum(
                len(e.ids) + 1 for e in tokenizer.encode_batch(texts)
            )  # +1: the EOS the pipeline adds
            raw_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            manifest = run_tokenize(cfg.model_copy(update=with_tok), root / f"run{repeat}")
            pipeline_s.append(time.perf_counter() - started)
        del texts
        tokens = sum(split.n_tokens for split in manifest.splits.values())
        assert tokens == raw_tokens, (tokens, raw_tokens)
        shards = sum(len(split.shards) for split in manifest.splits.values())

        # Same documents once and three times over (copied as .txt): bounded memory means equal peaks.
        for copy in range(3):
            for path in stdlib_files():
                target = root / "copies" / str(copy) / path.relative_to(stdlib_root()).with_suffix(".txt")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
        once = cfg.model_copy(update={**with_tok, "sources": (str(root / "copies" / "0" / "**" / "*.txt"),)})
        thrice = cfg.model_copy(update={**with_tok, "sources": (str(root / "copies" / "**" / "*.txt"),)})
        rss_once, rss_thrice = peak_rss_mib(once, root / "once"), peak_rss_mib(thrice, root / "thrice")

    print(
        json.dumps(
            {
                "benchmark": "tokenize_throughput",
                "workers": args.workers,
                "tokens": tokens,
                "shards": shards,
                "raw_encode_batch_tokens_per_s": round(raw_tokens / min(raw_s)),
                "pipeline_tokens_per_s": round(tokens / min(pipeline_s)),
                "ratio_pipeline_vs_raw": round(min(raw_s) / min(pipeline_s), 3),
                "goal_ratio": 0.8,
                "peak_rss_mib_corpus_x1": round(rss_once, 1),
                "peak_rss_mib_corpus_x3": round(rss_thrice, 1),
                "rss_ratio_x3_vs_x1": round(rss_thrice / rss_once, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
