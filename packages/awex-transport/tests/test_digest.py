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


def _digest_by_rows(piece, offsets, shape, key):
    """What the CUDA kernel computes, in torch on CPU: the same rows (awex.transport.digest._rows), each word
    read at its row's memory offset plus its column times the step, hashed at its row's position plus its column."""
    from awex.transport.checksum import MASK, MIX_A, MIX_B, POS, SEED, mix
    from awex.transport.digest import MOD, _rows

    words, pos, mem, row, step = _rows(piece, offsets, shape)
    flat = words.as_strided((words.untyped_storage().nbytes() // words.element_size() - words.storage_offset(),), (1,))
    a = b = 0
    for p0, m0 in zip(pos.tolist(), mem.tolist()):
        w = flat[m0 : m0 + (row - 1) * step + 1 : step].to(torch.int64)
        w &= 0xFF if words.element_size() == 1 else 0xFFFF
        p = (((torch.arange(row) + p0 + key + SEED) & MASK) * POS) & MASK
        a += int(mix(p ^ w, MIX_A).sum())
        b += int(mix(p ^ (w << 16), MIX_B).sum())
    return a % MOD, b % MOD


PIECES = [  # (what, canonical shape, piece maker from a tensor of that shape, offsets of the piece)
    ("whole", (12, 10), lambda t: t, (0, 0)),
    ("rows", (12, 10), lambda t: t[3:7], (3, 0)),
    ("columns", (12, 10), lambda t: t[:, 4:9], (0, 4)),
    ("box", (12, 10), lambda t: t[2:9, 1:6], (2, 1)),
    ("column-major", (12, 10), lambda t: t.t().contiguous().t()[:, 2:], (0, 2)),
    ("3-d inner slice", (4, 6, 8), lambda t: t[1:3, :, 2:5], (1, 0, 2)),
    ("3-d whole rows", (4, 6, 8), lambda t: t[1:3, 2:5, :], (1, 2, 0)),
    ("1-d", (50,), lambda t: t[7:31], (7,)),
    ("0-d", (), lambda t: t, ()),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("what,shape,cut,offsets", PIECES, ids=[p[0] for p in PIECES])
def test_the_kernels_rows_hash_as_the_definition(dtype, what, shape, cut, offsets):
    from awex.transport.digest import piece_digest_torch, salt

    t = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    piece = cut(t)
    key = salt("model.w")
    assert _digest_by_rows(piece, offsets, shape, key) == piece_digest_torch(piece, offsets, shape, key)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA only (none here)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("what,shape,cut,offsets", PIECES, ids=[p[0] for p in PIECES])
def test_the_kernel_hashes_as_the_definition(dtype, what, shape, cut, offsets):
    from awex.transport.digest import piece_digest_kernel, piece_digest_torch, salt

    t = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    key = salt("model.w")
    want = piece_digest_torch(cut(t), offsets, shape, key)
    assert piece_digest_kernel(cut(t.cuda()), offsets, shape, key) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA only (none here)")
def test_the_kernel_on_rows_longer_than_a_program_and_many_short_rows():
    from awex.transport.digest import piece_digest_kernel, piece_digest_torch, salt

    g = torch.Generator().manual_seed(5)
    for shape, cut, offsets in [
        ((3, 70001), lambda t: t[1:], (1, 0)),  # rows of many spans, a ragged last span
        ((5000, 24), lambda t: t[:, 8:], (0, 8)),  # many rows shorter than a block
    ]:
        t = torch.randn(shape, generator=g).to(torch.bfloat16)
        want = piece_digest_torch(cut(t), offsets, shape, salt("x"))
        assert piece_digest_kernel(cut(t.cuda()), offsets, shape, salt("x")) == want
