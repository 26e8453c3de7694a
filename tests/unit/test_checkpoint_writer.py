"""The checkpoint writer's pieces: tensors replaced without changing the containers around them, views cloned
and nothing else, digests computed while writing equal to the file's."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from training.parallel.checkpoint_writer import map_tensors, without_views, write_file


def test_containers_keep_their_types() -> None:
    state = {"shapes": [OrderedDict(w=torch.Size([2, 3]))], "pair": (torch.ones(1), 2), "note": "x"}
    out = map_tensors(lambda t: t * 2, state)
    assert (
        type(out["shapes"][0]) is OrderedDict and type(out["shapes"][0]["w"]) is torch.Size
    )  # ZeRO-3 reads .numel()
    assert type(out["pair"]) is tuple and out["pair"][0].item() == 2.0 and out["note"] == "x"


def test_only_views_into_larger_storages_are_cloned() -> None:
    whole, flat = torch.randn(4, 3), torch.randn(10)
    out = without_views({"whole": whole, "view": flat[2:5], "transposed": whole.t()})
    assert out["whole"].data_ptr() == whole.data_ptr()
    assert out["transposed"].data_ptr() == whole.data_ptr()  # a full storage, other strides: saved as it is
    assert out["view"].data_ptr() != flat.data_ptr() and torch.equal(out["view"], flat[2:5])
    assert out["view"].untyped_storage().nbytes() == 3 * 4


def test_digest_while_writing_is_the_files(tmp_path) -> None:
    path = tmp_path / "state.pt"
    _, record = write_file(
        {"big": torch.randn(600_000), "small": torch.arange(3)}, str(path)
    )  # > 1 MiB chunk
    data = path.read_bytes()
    assert record == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["small"], torch.arange(3))
