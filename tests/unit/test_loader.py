"""Packed loader: windows, deterministic shuffles, disjoint ranks, exact mid-epoch resume, refused mismatches."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from data_pipeline.loader import EpochSampler, MixedLoader, PackedLoader
from data_pipeline.shards import DatasetManifest, ShardReader
from data_pipeline.sources import DataError

SEQ = 32


def loader(manifest: DatasetManifest, **kw: object) -> PackedLoader:
    return PackedLoader(manifest, "train", **{"seq_len": SEQ, "batch_size": 4, "seed": 0, **kw})


def test_batches_are_shifted_windows_of_the_stream(tokenized: tuple[DatasetManifest, Path]) -> None:
    manifest, _ = tokenized
    data = loader(manifest, shuffle=False)
    inputs, targets = data.next_batch()
    assert inputs.shape == targets.shape == (4, SEQ) and inputs.dtype == torch.int64
    stream = np.concatenate(ShardReader(manifest, "train").arrays).astype(np.int64)
    for row in range(4):
        window = stream[row * SEQ : row * SEQ + SEQ + 1]
        assert inputs[row].tolist() == window[:-1].tolist() and targets[row].tolist() == window[1:].tolist()


def test_windows_cross_shard_boundaries(tokenized: tuple[DatasetManifest, Path]) -> None:
    manifest, _ = tokenized
    reader = ShardReader(manifest, "train")
    boundary = int(reader.starts[1])
    stream = np.concatenate(reader.arrays)
    assert reader.slice(boundary - 5, 10).tolist() == stream[boundary - 5 : boundary + 5].tolist()


def test_shuffle_is_deterministic_per_seed_and_epoch(tokenized: tuple[DatasetManifest, Path]) -> None:
    manifest, _ = tokenized
    a, b, c = loader(manifest), loader(manifest), loader(manifest, seed=1)
    first = [a.next_batch()[0] for _ in range(3)]
    assert all(torch.equal(x, b.next_batch()[0]) for x in first)
    assert not torch.equal(first[0], c.next_batch()[0])
    assert not np.array_equal(a.sampler.order(0), a.sampler.order(1))


def test_ranks_are_disjoint_and_cover_the_epoch() -> None:
    samplers = [EpochSampler(103, batch_size=5, rank=r, world_size=3, seed=7, shuffle=True) for r in range(3)]
    seen = [np.concatenate([s.next_indices() for _ in range(s.batches_per_epoch)]) for s in samplers]
    assert all(len(x) == len(seen[0]) == 30 for x in seen)
    union = np.concatenate(seen)
    assert len(set(union.tolist())) == len(union)  # no window on two ranks
    per_rank = 103 // 3
    assert set(union.tolist()) <= set(np.random.default_rng([7, 0]).permutation(103)[: per_rank * 3].tolist())


@pytest.mark.parametrize("crosses_epoch", [False, True])
def test_resume_yields_exactly_the_uninterrupted_batches(
    tokenized: tuple[DatasetManifest, Path], crosses_epoch: bool
) -> None:
    manifest, _ = tokenized

    def make() -> PackedLoader:
        return PackedLoader(manifest, "val", seq_len=SEQ, batch_size=4, rank=1, world_size=2, seed=3)

    straight = make()
    stop_after = straight.batches_per_epoch + 2 if crosses_epoch else 3
    reference = [straight.next_batch() for _ in range(stop_after + 6)]
    interrupted = make()
    for _ in range(stop_after):
        interrupted.next_batch()
    state = interrupted.state_dict()
    assert state["epoch"] == int(crosses_epoch)
    resumed = make()
    resumed.load_state_dict(state)
    for expected in reference[stop_after:]:
        got = resumed.next_batch()
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_a_mixed_loader_stacks_both_batches_and_resumes_both(tokenized: tuple[DatasetManifest, Path]) -> None:
    """SFT's replay: each batch is the main loader's rows over the replayed ones, and a restored state continues
    both streams where they stood (the replay at another pace: two rows a batch against four)."""
    manifest, _ = tokenized

    def make() -> MixedLoader:
        return MixedLoader(loader(manifest, seed=1), loader(manifest, batch_size=2, seed=2))

    main, replay, straight = loader(manifest, seed=1), loader(manifest, batch_size=2, seed=2), make()
    for _ in range(3):
        got, a, b = straight.next_batch(), main.next_batch(), replay.next_batch()
        assert torch.equal(got.inputs, torch.cat([a.inputs, b.inputs])) and got.targets.shape == (6, SEQ)
    state = straight.state_dict()
    reference = [straight.next_batch() for _ in range(4)]
    resumed = make()
    resumed.load_state_dict(state)
    assert all(torch.equal(resumed.next_batch().targets, expected.targets) for expected in reference)


def test_state_from_another_configuration_is_refused(tokenized: tuple[DatasetManifest, Path]) -> None:
    manifest, _ = tokenized
    state = loader(manifest).state_dict()
    with pytest.raises(DataError, match="global_batch: saved 4 vs now 8"):
        loader(manifest, batch_size=8).load_state_dict(state)
    with pytest.raises(DataError, match="global_batch: saved 4 vs now 8"):
        loader(manifest, accumulation=2).load_state_dict(state)
    with pytest.raises(DataError, match="seq_len=32"):
        PackedLoader(manifest, seq_len=16, batch_size=4).load_state_dict(state)


def test_data_from_another_tokenizer_is_refused(tokenized: tuple[DatasetManifest, Path]) -> None:
    manifest, _ = tokenized
    other = "f" * 64
    with pytest.raises(DataError) as info:
        loader(manifest, tokenizer_digest=other)
    assert manifest.tokenizer.digest[:16] in str(info.value) and other[:16] in str(info.value)


def test_validation_pass_is_fixed_and_leaves_position(tokenized: tuple[DatasetManifest, Path]) -> None:
    manifest, _ = tokenized
    val = PackedLoader(manifest, "val", seq_len=SEQ, batch_size=2, shuffle=False)
    one, two = list(val.epoch_batches(3)), list(val.epoch_batches(3))
    assert len(one) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(one, two, strict=True))
    assert val.state_dict()["batch"] == 0


def test_too_little_data_for_a_batch(tokenized: tuple[DatasetManifest, Path]) -> None:
    manifest, _ = tokenized
    with pytest.raises(DataError, match="cannot fill one step"):
        PackedLoader(manifest, "val", seq_len=SEQ, batch_size=100_000)


# world size: (micro-batch, accumulation) making up the same global batch of 8 sequences
LAYOUTS = {1: (8, 1), 2: (2, 2), 4: (1, 2), 8: (1, 1)}


def ranks_of(manifest: DatasetManifest, world: int) -> tuple[list[PackedLoader], int]:
    micro, accumulation = LAYOUTS[world]
    ranks = [
        loader(manifest, batch_size=micro, rank=r, world_size=world, accumulation=accumulation, seed=3)
        for r in range(world)
    ]
    return ranks, accumulation


def step_rows(ranks: list[PackedLoader], accumulation: int) -> Counter:
    """The sequences (token ids) one optimiser step trains on, over all ranks and micro-batches."""
    rows: Counter = Counter()
    for rank in ranks:
        for _ in range(accumulation):
            rows.update(tuple(row) for row in rank.next_batch().inputs.tolist())
    return rows


def test_a_run_continues_on_other_layouts_with_the_same_sequences(
    tokenized: tuple[DatasetManifest, Path],
) -> None:
    """Saved at step boundaries and resumed on 2 -> 1 -> 4 -> 2 -> 8 workers (within an epoch and across its
    end): every step trains on exactly the sequences of the uninterrupted 2-worker run's same step."""
    manifest, _ = tokenized
    ranks, accumulation = ranks_of(manifest, 2)
    per_epoch = ranks[0].batches_per_epoch // accumulation
    assert per_epoch >= 6
    straight = [step_rows(ranks, accumulation) for _ in range(per_epoch + 4)]
    assert all(sum(rows.values()) == 8 for rows in straight)

    ranks, accumulation = ranks_of(manifest, 2)
    resumed, step = [], 0
    for world, until in [(2, 2), (1, 3), (4, 5), (2, per_epoch - 1), (8, per_epoch + 4)]:
        state = ranks[0].state_dict()  # every rank holds the same position at a step boundary
        ranks, accumulation = ranks_of(manifest, world)
        for rank in ranks:
            rank.load_state_dict(state)
        resumed += [step_rows(ranks, accumulation) for _ in range(until - step)]
        step = until
    assert resumed == straight


def test_a_position_between_steps_cannot_move_to_another_layout(
    tokenized: tuple[DatasetManifest, Path],
) -> None:
    manifest, _ = tokenized
    ranks, _ = ranks_of(manifest, 4)
    ranks[0].next_batch()  # half of a step
    with pytest.raises(DataError, match="between two optimiser steps of 8"):
        ranks_of(manifest, 2)[0][0].load_state_dict(ranks[0].state_dict())
