"""Region digests (verify mode) do not depend on how memory cuts a region up, and notice what changes it."""

import pytest
import torch

from awex.meta import Box
from awex.transport import LocalShards
from awex.transport.digest import add, region_digest

SHAPE = (12, 10)


def _tensor(dtype):
    g = torch.Generator().manual_seed(1)
    return torch.randn(SHAPE, generator=g).to(dtype)


def _by_rows(t):
    return LocalShards({"w": [(Box((0, 0), (5, 10)), t[:5].clone()), (Box((5, 0), (7, 10)), t[5:].clone())]})


def _by_columns_strided(t):
    left = t[:, :4].t().contiguous().t()  # column-major memory, the same values
    return LocalShards({"w": [(Box((0, 0), (12, 4)), left), (Box((0, 4), (12, 6)), t[:, 4:].clone())]})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("region", [((0, 0), (12, 10)), ((3, 2), (6, 5)), ((11, 9), (1, 1))])
def test_a_region_has_one_digest_however_memory_holds_it(dtype, region):
    t = _tensor(dtype)
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float8_e4m3fn: "float8_e4m3fn"}[dtype]
    got = {region_digest(s, "w", SHAPE, name, *region) for s in (_by_rows(t), _by_columns_strided(t))}
    assert len(got) == 1


def test_digests_of_parts_add_up_to_the_whole():
    s = _by_rows(_tensor(torch.bfloat16))
    whole = region_digest(s, "w", SHAPE, "bfloat16", (0, 0), SHAPE)
    top = region_digest(s, "w", SHAPE, "bfloat16", (0, 0), (7, 10))
    bottom = region_digest(s, "w", SHAPE, "bfloat16", (7, 0), (5, 10))
    assert add(top, bottom) == whole


def test_a_wider_view_holding_the_plan_dtype_exactly_has_its_digest():
    t = _tensor(torch.bfloat16)
    wide = LocalShards({"w": [(Box((0, 0), SHAPE), t.float())]})
    assert region_digest(wide, "w", SHAPE, "bfloat16", (0, 0), SHAPE) == region_digest(
        _by_rows(t), "w", SHAPE, "bfloat16", (0, 0), SHAPE
    )


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t[4, 7].add_(1),  # one element
        lambda t: t.view(-1).__setitem__([3, 50], t.view(-1)[[50, 3]].clone()),  # two elements swapped
        lambda t: t.view(torch.int16).view(-1)[10:13].add_(torch.tensor([1, -2, 1], dtype=torch.int16)),
        lambda t: t.view(torch.int16).view(-1).index_add_(0, torch.tensor([0, 71]), torch.tensor([1, -1]).short()),
        lambda t: t.copy_(t.roll(1, dims=0)),  # rows moved
    ],
)
def test_a_change_changes_the_digest(change):
    t = _tensor(torch.bfloat16)
    before = region_digest(_by_rows(t), "w", SHAPE, "bfloat16", (0, 0), SHAPE)
    changed = t.clone()
    change(changed)
    assert not torch.equal(changed, t)
    assert region_digest(_by_rows(changed), "w", SHAPE, "bfloat16", (0, 0), SHAPE) != before


def test_the_same_bytes_in_another_tensor_have_another_digest():
    t = _tensor(torch.bfloat16)
    other = LocalShards({"v": [(Box((0, 0), SHAPE), t.clone())]})
    assert region_digest(other, "v", SHAPE, "bfloat16", (0, 0), SHAPE) != region_digest(
        _by_rows(t), "w", SHAPE, "bfloat16", (0, 0), SHAPE
    )
