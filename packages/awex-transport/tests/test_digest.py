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


def _definition(piece, offsets, shape, key):
    """The digest by its definition (awex.transport.digest's docstring), element by element position, in int64:
    the oracle both fast paths are held to."""
    from math import prod

    from awex.transport.checksum import MASK, MIX_A, POS, SEED, mix
    from awex.transport.digest import MOD

    if piece.dim() == 0:
        piece, offsets, shape = piece.reshape(1), (0,), (1,)
    t = piece.contiguous()
    if t.element_size() == 1:
        words = t.view(torch.uint8).to(torch.int64).unsqueeze(-1)
    else:
        words = (t.view(torch.int16).to(torch.int64) & 0xFFFF).reshape(*t.shape, t.element_size() // 2)
    n = words.shape[-1]
    g = torch.zeros((), dtype=torch.int64)
    for d, size in enumerate(t.shape):
        at = torch.arange(offsets[d], offsets[d] + size, dtype=torch.int64) * prod(shape[d + 1 :])
        g = g.unsqueeze(-1) + at if d else at
    pos = g.reshape(t.shape).unsqueeze(-1) * n + torch.arange(n, dtype=torch.int64)
    p = (((pos + key + SEED) & MASK) * POS) & MASK
    h = mix(p ^ words, MIX_A)
    weighted = sum(int(a) * (int(b) | 1) for a, b in zip(h.view(-1).tolist(), p.view(-1).tolist()))  # Python ints
    return int(h.sum()) % MOD, weighted % MOD


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
def test_the_torch_path_hashes_as_the_definition(dtype, what, shape, cut, offsets, monkeypatch):
    import awex.transport.digest as digest

    t = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    key = digest.salt("model.w")
    want = _definition(cut(t), offsets, shape, key)
    assert digest.piece_digest_torch(cut(t), offsets, shape, key) == want
    monkeypatch.setattr(digest, "SPAN", 8)  # long rows in several spans, short ones several at a time
    assert digest.piece_digest_torch(cut(t), offsets, shape, key) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA only (none here)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("what,shape,cut,offsets", PIECES, ids=[p[0] for p in PIECES])
def test_the_kernel_hashes_as_the_definition(dtype, what, shape, cut, offsets):
    from awex.transport.digest import piece_digest_kernel, salt

    t = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    key = salt("model.w")
    want = _definition(cut(t), offsets, shape, key)
    assert piece_digest_kernel(cut(t.cuda()), offsets, shape, key) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA only (none here)")
def test_the_kernel_on_rows_longer_than_a_program_and_many_short_rows():
    from awex.transport.digest import piece_digest_kernel, salt

    g = torch.Generator().manual_seed(5)
    for shape, cut, offsets in [
        ((3, 70001), lambda t: t[1:], (1, 0)),  # rows of many spans, a ragged last span
        ((5000, 24), lambda t: t[:, 8:], (0, 8)),  # many rows shorter than a block
    ]:
        t = torch.randn(shape, generator=g).to(torch.bfloat16)
        want = _definition(cut(t), offsets, shape, salt("x"))
        assert piece_digest_kernel(cut(t.cuda()), offsets, shape, salt("x")) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the batched kernel runs on CUDA only (none here)")
def test_a_batch_of_regions_has_each_regions_digest():
    """Regions of every kind of piece (whole, rows, strided rows, column-major, 3-d, bytes, unaligned, a view of
    another dtype) laid out once and digested in a few launches: each region's digest is the definition's, and
    again after the views' bytes changed (the batch reads them anew)."""
    from awex.transport.digest_batch import batch

    g = torch.Generator().manual_seed(7)
    full = {
        "a": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "b": torch.randn(4, 6, 40, generator=g).to(torch.bfloat16),
        "c": torch.randn(30, 20, generator=g).to(torch.float8_e4m3fn),
        "d": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "e": torch.randn(70001, generator=g).to(torch.bfloat16),
    }
    cuda = {k: v.cuda() for k, v in full.items()}
    cuda["b"] = cuda["b"].transpose(1, 2).contiguous().transpose(1, 2)  # strided rows
    cuda["c"] = cuda["c"].t().contiguous().t()  # column-major bytes
    shards = LocalShards(
        {
            "a": [(Box((0, 0), (64, 20)), cuda["a"][:, :20]), (Box((0, 20), (64, 28)), cuda["a"][:, 20:])],
            "b": [(Box((0, 0, 0), (4, 6, 40)), cuda["b"])],
            "c": [(Box((0, 0), (30, 20)), cuda["c"])],
            "d": [(Box((0, 0), (33, 7)), cuda["d"].float())],  # read as bfloat16 (converted each time)
            "e": [(Box((1,), (70000,)), cuda["e"][1:])],  # one word past alignment
        }
    )
    dtypes = {"a": "bfloat16", "b": "bfloat16", "c": "float8_e4m3fn", "d": "bfloat16", "e": "bfloat16"}
    regions = [
        ("a", (64, 48), (0, 0), (64, 48)),
        ("a", (64, 48), (5, 17), (30, 9)),
        ("b", (4, 6, 40), (1, 2, 3), (3, 3, 30)),
        ("c", (30, 20), (0, 0), (30, 20)),
        ("d", (33, 7), (3, 0), (20, 7)),
        ("e", (70001,), (1,), (70000,)),
    ]
    laid_out = batch(shards, [(n, shape, dtypes[n], o, s) for n, shape, o, s in regions])

    def expected():
        out = []
        for n, shape, o, s in regions:
            box = full[n][tuple(slice(a, a + b) for a, b in zip(o, s))]
            out.append(_definition(box, o, shape, salt(n)))
        return out

    from awex.transport.digest import salt

    assert laid_out.sums() == expected()
    for k in ("a", "c", "e"):
        full[k].view(-1).view(torch.uint8)[6:18] += 3
        cuda[k].copy_(full[k])
    assert laid_out.sums() == expected()


def test_words_trading_their_first_hashes_still_change_the_second_sum():
    """Two words whose ``p ^ w`` trade places (``w1 -> w2 ^ d``, ``w2 -> w1 ^ d`` where the two position keys differ
    by ``d``) leave the first sum as it was, by construction; the second, weighted by position, must still see it."""
    from awex.transport.checksum import MASK, POS, SEED
    from awex.transport.digest import piece_digest_torch, salt

    key, shape = salt("w"), (1 << 32,)  # a long 1-d tensor: any position is some element's
    inverse = pow(POS, -1, 1 << 32)

    def element_at(p):  # the element whose (one-word) position key is p
        return (p * inverse - key - SEED) & MASK

    p1 = 0x12345678
    d = 0x0000BEEF
    o1, o2 = element_at(p1), element_at(p1 ^ d)
    assert (((o2 + key + SEED) & MASK) * POS) & MASK == p1 ^ d

    def word(value):
        return torch.tensor([value], dtype=torch.int32).to(torch.int16)

    def total(w1, w2):
        a = piece_digest_torch(word(w1), (o1,), shape, key)
        b = piece_digest_torch(word(w2), (o2,), shape, key)
        return add(a, b)

    w1, w2 = 0x1234, 0x0F0F
    before, after = total(w1, w2), total(w2 ^ d, w1 ^ d)
    assert before[0] == after[0]  # the trade cancels in the first sum
    assert before[1] != after[1]
