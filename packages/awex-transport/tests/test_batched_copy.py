"""Block tables of the batched same-GPU copy, replayed on CPU memory (the kernel itself runs in the GPU tests:
integration/tests/test_gpu_sync.py and the GPU benchmark check every received tensor bit for bit)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from awex.transport.batched_copy import (
    ALIGN,
    LOCAL_BLOCK_BYTES,
    LOCAL_WARPS,
    batchable,
    copy_blocks,
    row_blocks,
    row_copy,
    split_batchable,
    spread_evenly,
)


def replay(memory: torch.Tensor, base: int, table: torch.Tensor, block_bytes: int) -> None:
    """What the kernel does, program by program: each row copies ``bytes`` from ``base + src`` to ``base + dst``."""
    for dst, src, n in table.tolist():
        assert 0 < n <= block_bytes and dst % ALIGN == 0 and src % ALIGN == 0 and n % ALIGN == 0
        memory[base + dst : base + dst + n] = memory[base + src : base + src + n].clone()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.sampled_from([16, 32, 64, 4096]), st.integers(0, 2**31))
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
        expected[d : d + n] = memory[s : s + n]
    table = copy_blocks(list(zip(dst_at, src_at, sizes)), base, block_bytes)
    assert table.dtype == torch.int64 and table.shape[1] == 3
    assert len(table) == sum(-(-n // block_bytes) for n in sizes)
    replay(memory, base, table, block_bytes)
    assert torch.equal(memory, expected)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 6), st.integers(1, 5), st.integers(0, 3)), min_size=1, max_size=4),
    st.sampled_from([16, 32, 64, 4096]),
    st.integers(0, 2**31),
)
def test_row_blocks_copy_each_row_and_nothing_between(runs, block_bytes, seed):
    """Row by row copies (a strided destination, as a row-parallel half lands): every row's bytes arrive, the
    bytes between the destination's rows stay as they were, and no block crosses a row's end."""
    g = torch.Generator().manual_seed(seed)
    size = 8192
    memory = torch.randint(0, 256, (2 * size,), dtype=torch.uint8, generator=g)
    expected = memory.clone()
    table_runs, src_at, dst_at = [], 0, size
    for rows, row16, gap16 in runs:
        row, dstride = 16 * row16, 16 * (row16 + gap16)
        for r in range(rows):  # sources packed (a contiguous half), destinations every dstride bytes
            expected[dst_at + r * dstride : dst_at + r * dstride + row] = memory[
                src_at + r * row : src_at + (r + 1) * row
            ]
        table_runs.append((dst_at, src_at, rows, row, dstride, row))
        src_at += rows * row
        dst_at += rows * dstride
    base = 16 * int(torch.randint(0, size // 16, (1,), generator=g))
    table = row_blocks(table_runs, base, block_bytes)
    assert len(table) == sum(rows * -(-(16 * row16) // block_bytes) for rows, row16, _ in runs)
    replay(memory, base, table, block_bytes)
    assert torch.equal(memory, expected)
    with pytest.raises(ValueError, match="at least one row"):
        row_blocks([(0, 64, 0, 32, 32, 32)], 0, 32)


def test_only_cuda_copies_with_contiguous_aligned_rows_go_row_by_row():
    whole = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert row_copy(whole[:, :32], torch.ones(8, 32, dtype=torch.bfloat16)) is None  # CPU: the kernel is CUDA only
    if torch.cuda.is_available():
        whole = whole.cuda()
        half = torch.ones(8, 32, dtype=torch.bfloat16, device="cuda")
        assert row_copy(whole[:, :32], half) == (8, 64, 128, 64)
        assert row_copy(whole[:, 32:], half) == (8, 64, 128, 64)
        assert row_copy(whole[:, 4:36], half) is None  # rows 8 bytes off 16-byte words
        assert row_copy(whole[:, :32].t(), half.t()) is None  # rows not contiguous
        assert row_copy(whole[:, :32], half[:, :16].repeat(1, 2).float()) is None  # another dtype


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


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 300), st.integers(0, 300))
def test_spread_keeps_each_order_and_mixes_evenly(n, m):
    table = torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.int64), torch.full((n,), 16)], 1)
    other = torch.stack([torch.arange(m), torch.ones(m, dtype=torch.int64), torch.full((m,), 16)], 1)
    out = spread_evenly(table, other)
    assert len(out) == n + m
    mine, theirs = out[out[:, 1] == 0], out[out[:, 1] == 1]
    assert torch.equal(mine, table) and torch.equal(theirs, other)  # every row once, each in its order
    # every prefix holds the other table's rows in proportion, within one row
    seen = torch.cumsum(out[:, 1], 0).to(torch.float64)
    k = torch.arange(1, n + m + 1, dtype=torch.float64)
    assert bool(((seen - k * m / (n + m)).abs() <= 1.0 + 1e-9).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the table made there)")
def test_a_table_made_on_the_gpu_is_the_one_made_on_the_cpu():
    """copy_blocks(device=) makes on the GPU, row for row, the table the CPU makes (and spread_evenly mixes it
    there alike): the launch reads the same blocks either way."""
    g = torch.Generator().manual_seed(3)
    for block_bytes in (16, 4096, 1 << 15):
        sizes = (16 * torch.randint(1, 5000, (300,), generator=g)).tolist()
        copies = [(16 * i * 10**6, 16 * (i * 10**6 + 7), n) for i, n in enumerate(sizes)]
        here, there = copy_blocks(copies, 160, block_bytes), copy_blocks(copies, 160, block_bytes, torch.device("cuda"))
        assert there.device.type == "cuda" and torch.equal(here, there.cpu())
        other = copy_blocks(copies[:7], 0, block_bytes)
        assert torch.equal(spread_evenly(here, other), spread_evenly(there, other).cpu())
    assert copy_blocks([], 0, device=torch.device("cuda")).device.type == "cuda"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernel)")
def test_batched_copy_on_gpu_matches_plain_copies():
    from awex.transport.batched_copy import BatchedCopy

    g = torch.Generator(device="cuda").manual_seed(0)
    srcs = [
        torch.randint(-1000, 1000, (n,), dtype=torch.int16, device="cuda", generator=g)
        for n in (8, 4096, 100000, 8 * 33333)
    ]
    dsts = [torch.zeros_like(s) for s in srcs]
    copies = list(zip(dsts, srcs))
    assert all(batchable(d, s) for d, s in copies)
    BatchedCopy(copies, block_bytes=1024)()
    torch.cuda.synchronize()
    assert all(torch.equal(d, s) for d, s in copies)
    for d in dsts:  # the launch within one GPU as the executors make it: its own block and warps
        d.zero_()
    local = BatchedCopy(copies)
    assert (local.block_bytes, local.num_warps) == (LOCAL_BLOCK_BYTES, LOCAL_WARPS)
    assert local.blocks == sum(-(-s.nbytes // LOCAL_BLOCK_BYTES) for s in srcs)  # tails of 16 bytes to 32 KiB
    local()
    torch.cuda.synchronize()
    assert all(torch.equal(d, s) for d, s in copies)
    odd = (torch.zeros(7, dtype=torch.int16, device="cuda"), torch.ones(7, dtype=torch.int16, device="cuda"))
    assert not batchable(*odd)  # 14 bytes: not whole 16-byte words


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (reads over NVLink)")
def test_batched_copy_reads_another_gpu_in_the_same_launch():
    from awex.transport.batched_copy import BatchedCopy
    from awex.transport.peer_dma import enable_peer_access

    here, there = torch.device("cuda", 0), torch.device("cuda", 1)
    enable_peer_access(here, there)
    local = [
        (torch.zeros(n, dtype=torch.bfloat16, device=here), torch.randn(n, device=here).to(torch.bfloat16))
        for n in (4096, 300000)
    ]
    far = [
        (torch.zeros(n, dtype=torch.bfloat16, device=here), torch.randn(n, device=there).to(torch.bfloat16))
        for n in (8, 200000, 1 << 20)
    ]
    assert not any(batchable(d, s) for d, s in far) and all(batchable(d, s, peer=True) for d, s in far)
    with pytest.raises(ValueError, match="spread copies may read another GPU"):
        BatchedCopy(far)
    copy = BatchedCopy(local, block_bytes=4096, spread=far)
    copy()
    torch.cuda.synchronize(here)
    assert all(torch.equal(d, s) for d, s in local)
    assert all(torch.equal(d, s.to(here)) for d, s in far)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (reads over NVLink)")
def test_row_reads_land_row_parallel_halves_from_another_gpu():
    """Two halves of each row (as Megatron's row-parallel shards) read from another GPU into one whole tensor, row
    by row in one launch whose block fits the shortest row; the bytes between stay untouched until theirs land."""
    from awex.transport.batched_copy import row_reads
    from awex.transport.peer_dma import enable_peer_access

    here, there = torch.device("cuda", 0), torch.device("cuda", 1)
    enable_peer_access(here, there)
    g = torch.Generator().manual_seed(0)
    rows = []
    for out, cols in ((64, 1024), (48, 3072)):  # rows of 2 KiB and 6 KiB a half
        whole = torch.zeros(out, 2 * cols, dtype=torch.bfloat16, device=here)
        halves = [torch.randn(out, cols, generator=g).to(torch.bfloat16).to(there) for _ in range(2)]
        rows += [(whole[:, :cols], halves[0]), (whole[:, cols:], halves[1])]
    launch = row_reads(rows[::2], [s.data_ptr() for _, s in rows[::2]])
    assert launch.block_bytes == 2048 and launch.blocks == 64 + 48 * 3
    launch()
    torch.cuda.synchronize(here)
    assert all(torch.equal(d, s.to(here)) for d, s in rows[::2])
    assert all(not bool(d.any()) for d, _ in rows[1::2])  # the other halves: not written
    row_reads(rows[1::2], [s.data_ptr() for _, s in rows[1::2]])()
    torch.cuda.synchronize(here)
    assert all(torch.equal(d, s.to(here)) for d, s in rows)
