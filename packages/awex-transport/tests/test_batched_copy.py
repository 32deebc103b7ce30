"""Block tables of the batched same-GPU copy, replayed on CPU memory (the kernel itself runs in the GPU tests:
integration/tests/test_gpu_sync.py and the GPU benchmark check every received tensor bit for bit)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from awex.transport.batched_copy import ALIGN, batchable, contiguous_runs, copy_blocks, split_batchable


def replay(memory: torch.Tensor, base: int, table: torch.Tensor, block_bytes: int) -> None:
    """What the kernel does, program by program: each row copies ``bytes`` from ``base + src`` to ``base + dst``."""
    for dst, src, n in table.tolist():
        assert 0 < n <= block_bytes and dst % ALIGN == 0 and src % ALIGN == 0 and n % ALIGN == 0
        memory[base + dst: base + dst + n] = memory[base + src: base + src + n].clone()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.sampled_from([16, 32, 64, 4096]),
       st.integers(0, 2**31))
def test_blocks_copy_exactly_the_bytes_of_each_copy(sizes16, block_bytes, seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [16 * n for n in sizes16]
    total = sum(sizes)
    memory = torch.randint(0, 256, (2 * total + 64,), dtype=torch.uint8, generator=g)
    # sources in the first half, destinations in the second, in a shuffled order; base somewhere in between
    src_at, at = [], 0
    for n in sizes:
        src_at.append(at)
        at += n
    order = torch.randperm(len(sizes), generator=g).tolist()
    dst_at, at = [0] * len(sizes), total + 32
    for i in order:
        dst_at[i] = at
        at += sizes[i]
    base = 16 * int(torch.randint(0, (2 * total + 64) // 16, (1,), generator=g))
    expected = memory.clone()
    for d, s, n in zip(dst_at, src_at, sizes):
        expected[d:d + n] = memory[s:s + n]
    table = copy_blocks(list(zip(dst_at, src_at, sizes)), base, block_bytes)
    assert table.dtype == torch.int64 and table.shape[1] == 3
    assert len(table) == sum(-(-n // block_bytes) for n in sizes)
    replay(memory, base, table, block_bytes)
    assert torch.equal(memory, expected)


def test_block_size_must_keep_16_byte_words():
    with pytest.raises(ValueError, match="multiple of 16"):
        copy_blocks([(0, 64, 32)], 0, 24)
    with pytest.raises(ValueError, match="at least one byte"):
        copy_blocks([(0, 64, 0)], 0, 32)
    assert copy_blocks([], 0).shape == (0, 3)


def test_only_contiguous_aligned_cuda_copies_are_batchable():
    a, b = torch.zeros(64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    assert not batchable(a, b)  # CPU: the kernel is CUDA only
    yes, no = split_batchable([(a, b)])
    assert yes == [] and len(no) == 1


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=2, max_size=4), st.data())
def test_contiguous_runs_copy_exactly_a_strided_block(shape, data):
    """Cut a block out of a bigger tensor on both sides (a different block each side): copying each run equals
    copying the block, and nothing outside it is written."""
    def block_of(big_shape):
        starts = [data.draw(st.integers(0, b - n)) for b, n in zip(big_shape, shape)]
        return tuple(slice(a, a + n) for a, n in zip(starts, shape))
    grow = [data.draw(st.lists(st.integers(0, 3), min_size=len(shape), max_size=len(shape))) for _ in range(2)]
    dst_big = torch.zeros([n + g for n, g in zip(shape, grow[0])], dtype=torch.int32)
    src_big = torch.arange(int(torch.tensor([n + g for n, g in zip(shape, grow[1])]).prod()),
                           dtype=torch.int32).view([n + g for n, g in zip(shape, grow[1])])
    dsl, ssl = block_of(dst_big.shape), block_of(src_big.shape)
    dst, src = dst_big[dsl], src_big[ssl]
    runs = contiguous_runs(dst, src, min_bytes=1)
    assert runs is not None  # the last dimension is contiguous on both sides
    assert all(d.is_contiguous() and s.is_contiguous() for d, s in runs)
    assert sum(d.numel() for d, _ in runs) == dst.numel()
    expected = dst_big.clone()
    expected[dsl] = src
    for d, s in runs:
        d.copy_(s)
    assert torch.equal(dst_big, expected)


def test_contiguous_runs_leave_small_or_many_pieces_strided():
    a, b = torch.zeros(64, 64, dtype=torch.bfloat16), torch.zeros(64, 128, dtype=torch.bfloat16)
    assert len(contiguous_runs(a, b[:, :64], min_bytes=128)) == 64  # rows of 128 bytes
    assert contiguous_runs(a, b[:, :64], min_bytes=256) is None
    assert contiguous_runs(a, b[:, :64], min_bytes=1, max_runs=63) is None
    assert contiguous_runs(a[:, :8], b[:, :16][:, ::2], min_bytes=1) is None  # no contiguous piece on one side


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernel)")
def test_batched_copy_on_gpu_matches_plain_copies():
    from awex.transport.batched_copy import BatchedCopy

    g = torch.Generator(device="cuda").manual_seed(0)
    srcs = [torch.randint(-1000, 1000, (n,), dtype=torch.int16, device="cuda", generator=g)
            for n in (8, 4096, 100000, 8 * 33333)]
    dsts = [torch.zeros_like(s) for s in srcs]
    copies = list(zip(dsts, srcs))
    assert all(batchable(d, s) for d, s in copies)
    BatchedCopy(copies, block_bytes=1024)()
    torch.cuda.synchronize()
    assert all(torch.equal(d, s) for d, s in copies)
    odd = (torch.zeros(7, dtype=torch.int16, device="cuda"), torch.ones(7, dtype=torch.int16, device="cuda"))
    assert not batchable(*odd)  # 14 bytes: not whole 16-byte words
    # a column block of a matrix (one tensor-parallel half) goes as its rows
    wide = torch.randn(256, 1024, device="cuda").to(torch.bfloat16)
    half = torch.zeros(256, 512, dtype=torch.bfloat16, device="cuda")
    yes, no = split_batchable([(half, wide[:, 512:])])
    assert no == [] and len(yes) == 256
    BatchedCopy(yes)()
    torch.cuda.synchronize()
    assert torch.equal(half, wide[:, 512:])
