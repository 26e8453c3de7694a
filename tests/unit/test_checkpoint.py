"""Checkpoint directory protocol: only complete checkpoints count; debris of a crashed save is never selected."""

from __future__ import annotations

from pathlib import Path

from training import checkpoint as ckpt


def save(root: Path, step: int, keep: int = 2) -> Path:
    staging = ckpt.prepare_staging(root, step)
    (staging / "weights.bin").write_bytes(bytes([step]))
    return ckpt.commit(root, step, {"step": step}, keep)


def test_commit_renames_and_marks_complete(tmp_path: Path) -> None:
    final = save(tmp_path, 10)
    assert final.name == "step-00000010" and (final / ckpt.COMPLETE).is_file()
    assert ckpt.read_meta(final) == {"step": 10}
    assert ckpt.latest_checkpoint(tmp_path) == final


def test_a_crash_mid_save_leaves_the_previous_checkpoint_selected(tmp_path: Path) -> None:
    good = save(tmp_path, 10)
    # a crash before the rename leaves a staging directory; a crash after it, a directory without the marker
    ckpt.prepare_staging(tmp_path, 20)
    (ckpt.staging_dir(tmp_path, 20) / "weights.bin").write_bytes(b"partial")
    incomplete = ckpt.step_dir(tmp_path, 30)
    incomplete.mkdir()
    (incomplete / "weights.bin").write_bytes(b"partial")
    assert ckpt.latest_checkpoint(tmp_path) == good
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [10]
    save(tmp_path, 20)  # the next save cleans the debris
    assert not incomplete.exists() and not ckpt.staging_dir(tmp_path, 20).exists()
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [10, 20]


def test_only_the_last_k_are_kept(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        save(tmp_path, step, keep=2)
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [3, 4]


def test_rng_round_trip() -> None:
    import random

    import torch

    state = ckpt.rng_state()
    a = (random.random(), torch.rand(3))
    ckpt.set_rng_state(state)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


def test_a_damaged_newest_checkpoint_falls_back_to_the_intact_one(tmp_path: Path, caplog) -> None:
    good = save(tmp_path, 10)
    newest = save(tmp_path, 20)
    (newest / "weights.bin").write_bytes(b"X")  # same size, other bytes
    with caplog.at_level("WARNING"):
        assert ckpt.latest_checkpoint(tmp_path) == good
    assert f"checkpoint {newest} is damaged ({newest / 'weights.bin'}: bytes differ" in caplog.text
    (newest / "meta.json").unlink()
    assert ckpt.damage(newest) == f"{newest / 'meta.json'}: missing"
    save(tmp_path, 20)  # resuming from step 10 saves step 20 again over the damaged one
    assert ckpt.latest_checkpoint(tmp_path) == newest and ckpt.damage(newest) is None


def legacy(root: Path, step: int) -> Path:
    """A checkpoint as lmforge wrote them before checksums: a torch file and a `COMPLETE` marker without digests."""
    import json

    import torch

    staging = ckpt.prepare_staging(root, step)
    torch.save({"step": step, "weights": torch.arange(4096.0)}, staging / "rank-0.pt")
    final = ckpt.commit(root, step, {"step": step, "loop": {"step": step}}, keep=5)
    (final / ckpt.COMPLETE).write_text(json.dumps({"step": step}))
    return final


def test_a_truncated_checkpoint_from_before_checksums_is_damaged_and_all_damaged_restarts_loudly(
    tmp_path: Path, caplog
) -> None:
    from training.loop import LoopSetup, resume

    root = tmp_path / "checkpoints"
    good, newest = legacy(root, 10), legacy(root, 20)
    assert ckpt.latest_checkpoint(root) == newest and ckpt.damage(good) is None
    state = newest / "rank-0.pt"
    state.write_bytes(state.read_bytes()[:1000])
    assert (
        ckpt.damage(newest) == f"{state}: truncated (1000 bytes, no zip directory; written before checksums)"
    )
    with caplog.at_level("WARNING"):
        assert ckpt.latest_checkpoint(root) == good  # instead of torch's PytorchStreamReader traceback
    (good / "rank-0.pt").write_bytes(b"")
    setup = LoopSetup(run_dir=tmp_path, rank=0, world_size=1, flops_per_token=1, peak_flops=1.0, meta={})
    with caplog.at_level("WARNING"):
        assert resume(None, None, setup).step == 0  # type: ignore[arg-type] - nothing is loaded
    assert f"every checkpoint under {root} is damaged: training restarts from step 0" in caplog.text
