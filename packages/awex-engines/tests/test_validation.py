"""Validation reads the checkpoint box by box and compares in chunks; any differing element is a mismatch."""

import pytest
import torch

pytest.importorskip("safetensors", reason="validation reads safetensors checkpoints")

from safetensors.torch import save_file  # noqa: E402

from awex.engines import validation  # noqa: E402
from awex.meta import Box  # noqa: E402
from awex.transport import LocalShards  # noqa: E402


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(validation, "_CHUNK", 7)  # several chunks per box
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(10, 6, generator=g), "b": torch.randn(5, generator=g)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path, tensors


def test_received_boxes_equal_to_the_checkpoint_pass(checkpoint):
    path, t = checkpoint
    box = Box((3, 2), (5, 3))
    shards = LocalShards({"a": [(box, t["a"][3:8, 2:5].clone())], "b": [(Box((0,), (5,)), t["b"].clone())]})
    report = validation.validate_shards(shards, validation.load_checkpoint(path))
    assert (report.tensors_checked, report.tensors_mismatched) == (2, 0)


@pytest.mark.parametrize("row", [0, 4])  # in the first and in the last chunk
def test_one_differing_element_is_a_mismatch_with_its_size(checkpoint, row):
    path, t = checkpoint
    box = Box((3, 2), (5, 3))
    got = t["a"][3:8, 2:5].clone()
    got[row, 2] += 0.5
    report = validation.validate_shards(LocalShards({"a": [(box, got)]}), validation.load_checkpoint(path))
    assert report.tensors_mismatched == 1 and report.to_json()["mismatched"] == ["a"]
    assert report.per_tensor["a"]["max_abs_diff"] == pytest.approx(0.5)
    with pytest.raises(validation.ValidationError):
        validation.validate_shards(LocalShards({"a": [(box, got)]}), validation.load_checkpoint(path), strict=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_boxes_of_3d_tensors_in_narrow_dtypes_are_read_exactly(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(validation, "_CHUNK", 5)
    w = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(3)).to(dtype)  # e.g. experts x rows x cols
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    box = Box((1, 2, 3), (2, 3, 4))
    got = w[1:3, 2:5, 3:7].clone()
    ckpt = validation.load_checkpoint(tmp_path)
    assert validation.validate_shards(LocalShards({"w": [(box, got)]}), ckpt).tensors_mismatched == 0
    got[1, 2, 3] = torch.tensor(7.0).to(dtype)
    assert validation.validate_shards(LocalShards({"w": [(box, got)]}), ckpt).tensors_mismatched == 1


@pytest.mark.parametrize(
    "box, got, reason",
    [
        # (4, 8) sorts below the reference's (10, 6) but its columns lie outside it: compared by dimension
        (Box((0, 0), (4, 8)), torch.zeros(4, 8), "does not lie inside"),
        (Box((0,), (6,)), torch.zeros(6), "does not lie inside"),  # another rank
    ],
)
def test_a_box_that_does_not_fit_the_reference_is_a_mismatch_not_an_error(checkpoint, box, got, reason):
    path, _ = checkpoint
    shards = LocalShards({"a": [(box, got)]})
    report = validation.validate_shards(shards, validation.load_checkpoint(path))
    assert report.tensors_mismatched == 1 and reason in report.per_tensor["a"]["reason"]
    with pytest.raises(validation.ValidationError, match="differ"):
        validation.validate_shards(shards, validation.load_checkpoint(path), strict=True)
