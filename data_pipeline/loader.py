"""Packed, shuffled, rank-sharded batches over memory-mapped token shards, resumable to the exact batch.

The split's shards form one token stream in which every document already ends with end-of-text. Window w covers
tokens [w·T, w·T + T + 1): inputs are its first T tokens, targets the last T, so every token is a target once.
Windows are shuffled by a permutation drawn from (seed, epoch), dealt to data-parallel ranks round-robin with the
tail dropped so every optimiser step gets a full global batch, and cut into batches. The position (epoch, batch) is
the whole state: a loader restored from `state_dict()` yields exactly the batches the uninterrupted one would have.

Optimiser step s of an epoch consumes permutation positions [s·G, (s+1)·G) (G the global batch, whatever the
number of ranks and micro-batches), so a position saved at a step boundary on one layout continues on another.

Shape letters: B batch, T sequence length.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from data_pipeline.shards import DatasetManifest, ShardReader
from data_pipeline.sources import DataError

# targets with this value carry no loss (padding, prompt tokens in SFT); torch's convention
IGNORE_INDEX = -100


class Batch(NamedTuple):
    """What every loader yields: next-token inputs and targets, both (B, T) int64."""

    inputs: Tensor
    targets: Tensor  # IGNORE_INDEX where a position carries no loss

    def n_targets(self) -> int:
        """Positions that carry loss (what a token-normalised loss divides by)."""
        return int((self.targets != IGNORE_INDEX).sum())


class EpochSampler:
    """Which items each rank sees, batch by batch, across epochs; deterministic from (seed, epoch).
    `accumulation`: micro-batches per rank per optimiser step (an epoch holds whole steps)."""

    def __init__(
        self,
        n_items: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool,
        accumulation: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
        self.n_items, self.batch_size, self.rank, self.world_size = n_items, batch_size, rank, world_size
        self.seed, self.shuffle, self.accumulation = seed, shuffle, accumulation
        self.global_batch = batch_size * world_size * accumulation
        self.batches_per_epoch = n_items // self.global_batch * accumulation
        self.per_rank = self.batches_per_epoch * batch_size
        if self.batches_per_epoch == 0:
            raise DataError(
                f"{n_items} items cannot fill one step ({accumulation} batch(es) of {batch_size} on each of "
                f"{world_size} ranks); use more data, a smaller batch or a shorter sequence length"
            )
        self.epoch = 0
        self.batch = 0
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def order(self, epoch: int) -> np.ndarray:
        """This rank's items for `epoch`, in the order it visits them."""
        if epoch != self._order_epoch:
            items = np.arange(self.n_items, dtype=np.int64)
            if self.shuffle:
                items = np.random.default_rng([self.seed, epoch]).permutation(items)
            self._order = items[self.rank : self.per_rank * self.world_size : self.world_size]
            self._order_epoch = epoch
        return self._order

    def next_indices(self) -> np.ndarray:
        start = self.batch * self.batch_size
        indices = self.order(self.epoch)[start : start + self.batch_size]
        self.batch += 1
        if self.batch == self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
        return indices

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "batch": self.batch,
            "seed": self.seed,
            "n_items": self.n_items,
            "global_batch": self.global_batch,
            "batch_size": self.batch_size,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a saved position; any rank of any layout with the same data and global batch can (the
        position is a step boundary, which is the same place in the epoch's permutation on every layout)."""
        mine = self.state_dict()
        fixed = ("seed", "n_items", "global_batch")
        different = {k: (state.get(k), mine[k]) for k in fixed if state.get(k) != mine[k]}
        if different:
            described = ", ".join(f"{k}: saved {a} vs now {b}" for k, (a, b) in different.items())
            raise DataError(
                f"loader state does not fit this loader ({described}); resume with the same data and batch"
            )
        consumed = int(state["batch"]) * int(state["batch_size"]) * int(state["world_size"])
        same_layout = (state["batch_size"], state["world_size"]) == (self.batch_size, self.world_size)
        if not same_layout and consumed % self.global_batch:
            raise DataError(
                f"loader state at item {consumed} of epoch {state['epoch']} lies between two optimiser steps of "
                f"{self.global_batch}; resume it on the layout it was saved on (world size {state['world_size']}, "
                f"micro-batch {state['batch_size']})"
            )
        self.epoch, self.batch = int(state["epoch"]), consumed // (self.batch_size * self.world_size)


class SampledLoader:
    """Batches drawn in an EpochSampler's order; subclasses say how indices become a batch (`batch_of`)."""

    sampler: EpochSampler

    def batch_of(self, indices: np.ndarray) -> Batch:
        raise NotImplementedError

    @property
    def batches_per_epoch(self) -> int:
        return self.sampler.batches_per_epoch

    def next_batch(self) -> Batch:
        return self.batch_of(self.sampler.next_indices())

    def __iter__(self) -> Iterator[Batch]:
        """Endless: epochs follow one another with fresh shuffles."""
        while True:
            yield self.next_batch()

    def epoch_batches(self, max_batches: int | None = None) -> Iterator[Batch]:
        """One pass over epoch 0 in a fixed order (for evaluation); does not move the loader's position."""
        order = self.sampler.order(0)
        size = self.sampler.batch_size
        n = self.batches_per_epoch if max_batches is None else min(max_batches, self.batches_per_epoch)
        for b in range(n):
            yield self.batch_of(order[b * size : (b + 1) * size])

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


class PackedLoader(SampledLoader):
    """Packed batches from one split of a tokenized dataset (every position carries loss)."""

    def __init__(
        self,
        manifest: DatasetManifest,
        split: str = "train",
        *,
        seq_len: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        tokenizer_digest: str | None = None,
        accumulation: int = 1,
    ) -> None:
        if tokenizer_digest is not None:
            manifest.check_tokenizer(tokenizer_digest)
        self.seq_len = seq_len
        self.reader = ShardReader(manifest, split)
        n_windows = max(0, (self.reader.n_tokens - 1) // seq_len)
        self.sampler = EpochSampler(n_windows, batch_size, rank, world_size, seed, shuffle, accumulation)

    def batch_of(self, windows: np.ndarray) -> Batch:
        rows = np.stack([self.reader.slice(int(w) * self.seq_len, self.seq_len + 1) for w in windows])
        tokens = torch.from_numpy(rows.astype(np.int64))
        return Batch(tokens[:, :-1], tokens[:, 1:])

    def state_dict(self) -> dict[str, Any]:
        return {**self.sampler.state_dict(), "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seq_len") != self.seq_len:
            raise DataError(
                f"loader state is for seq_len={state.get('seq_len')}, this loader uses {self.seq_len}"
            )
        self.sampler.load_state_dict(state)


class MixedLoader:
    """Each batch of `main` with a batch of `replay` stacked under it (rows of the same length): fine-tuning data
    with pretraining windows replayed beside it, every target of both in the step's token-mean loss. Its state is
    both loaders' positions, so a resumed run sees the same rows."""

    def __init__(self, main: SampledLoader, replay: SampledLoader) -> None:
        self.main, self.replay = main, replay

    def next_batch(self) -> Batch:
        a, b = self.main.next_batch(), self.replay.next_batch()
        return Batch(torch.cat([a.inputs, b.inputs]), torch.cat([a.targets, b.targets]))

    def state_dict(self) -> dict[str, Any]:
        return {"main": self.main.state_dict(), "replay": self.replay.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.main.load_state_dict(state["main"])
        self.replay.load_state_dict(state["replay"])
