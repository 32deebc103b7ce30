"""Copies that digest what they write (verify mode over CUDA IPC, ``awex.transport.copy_digest``): the block table
replayed on CPU with torch's hashing equals the digest of the pieces; on a GPU the kernel copies every byte and its
sums equal the digest kernel's of the destination, a CUDA IPC receiver's digests per origin equal what its origin
digests of the same regions in its own memory, and a byte that differs from the origin's changes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from awex.meta import PlanOptions, canonical_tensors, plan_transfers
from awex.meta.layouts import VllmParallel, hf_layout, vllm_layout
from awex.transport.checksum import MASK, SEED
from awex.transport.copy_digest import Hashed, contiguous_positions, digest_blocks
from awex.transport.digest import MOD, _hash_into, add, piece_digest_torch, region_digest, salt
from awex.transport.shards import LocalShards

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel runs on CUDA GPUs: none here")
CONFIG = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())


def _replay(memory: torch.Tensor, table: torch.Tensor, unit: int) -> tuple[int, int]:
    """What the kernel does with one sums row, program by program, in torch's int64 hashing: copy each block's
    words, then hash what the destination holds at the block's positions."""
    words = memory.view(torch.int16 if unit == 2 else torch.uint8)
    sums = torch.zeros(2, dtype=torch.int64)
    low = 0xFFFF if unit == 2 else 0xFF
    for dst, src, n, pos, _ in table.tolist():
        words[dst : dst + n] = words[src : src + n].clone()
        _hash_into(sums, words[dst : dst + n].to(torch.int64) & low, torch.arange(n, dtype=torch.int64) + pos)
    return int(sums[0]) % MOD, int(sums[1]) % MOD


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_blocks_replayed_hash_as_the_digest_of_the_destination_pieces(dtype):
    g = torch.Generator().manual_seed(3)
    shape = (96, 80)
    src = torch.randint(0, 255, shape, generator=g).to(dtype)
    memory = torch.zeros(3 * src.nbytes, dtype=torch.uint8)
    whole = memory[: src.nbytes].view(dtype).view(shape)  # the source lives at the start of the memory
    whole.copy_(src)
    dst = memory[src.nbytes : 2 * src.nbytes].view(dtype).view(shape)
    key, unit = salt("w"), 1 if dtype == torch.uint8 else 2
    pieces = [(0, 40), (40, 96)]  # two slices of dim 0: each contiguous at contiguous positions
    copies = []
    for lo, hi in pieces:
        pos = contiguous_positions(dst[lo:hi], (lo, 0), shape, key)
        assert pos is not None
        d, s = dst[lo:hi], whole[lo:hi]
        copies.append((d.data_ptr(), s.data_ptr(), d.nbytes, Hashed(pos, 0)))
    table = digest_blocks(copies, memory.data_ptr(), unit, block_bytes=1024)
    assert len(table) == sum(-(-(hi - lo) * 80 * src.element_size() // 1024) for lo, hi in pieces)
    got = _replay(memory, table, unit)
    assert torch.equal(dst, src)
    want = (0, 0)
    for lo, hi in pieces:
        want = add(want, piece_digest_torch(src[lo:hi], (lo, 0), shape, key))
    assert got == want
    whole.view(-1)[5] += 1  # another byte in the source: another digest
    assert _replay(memory, table, unit) != want


def test_positions_are_contiguous_only_for_whole_rows_of_the_canonical_tensor():
    t = torch.zeros(8, 6, dtype=torch.bfloat16)
    key = salt("x")
    assert contiguous_positions(t, (0, 0), (8, 6), key) == (key + SEED) & MASK
    assert contiguous_positions(t[2:5], (2, 0), (8, 6), key) == (2 * 6 + key + SEED) & MASK
    assert contiguous_positions(t[:, :3].contiguous(), (0, 0), (8, 6), key) is None  # rows 3 of 6: positions jump
    assert contiguous_positions(t[:, :3], (0, 0), (8, 6), key) is None  # not contiguous in memory
    wide = torch.zeros(4, 5, dtype=torch.float32)  # two 16-bit words per element
    assert contiguous_positions(wide[1:], (1, 0), (4, 5), key) == (2 * 5 + key + SEED) & MASK


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_the_kernel_copies_and_digests_what_it_wrote(dtype):
    from awex.transport.copy_digest import DigestingCopy
    from awex.transport.digest import piece_digest

    g = torch.Generator().manual_seed(5)
    shapes = [(1000, 96), (3, 48), (4096, 8)]  # each a multiple of 16 bytes
    srcs = [torch.randint(0, 255, s, generator=g).to(dtype).cuda() for s in shapes]
    dsts = [torch.zeros_like(s) for s in srcs]
    sums = torch.zeros(2, 2, dtype=torch.int64, device="cuda")
    copies = []
    for i, (d, s) in enumerate(zip(dsts, srcs)):
        lo = 1 if i == 0 else 0  # a slice of dim 0 of a larger canonical tensor
        shape = (d.shape[0] + lo, *d.shape[1:])
        copies.append((d, s, Hashed(contiguous_positions(d, (lo, 0), shape, salt(f"t{i}")), i % 2)))
    run = DigestingCopy(copies, sums)
    for _ in range(2):  # the caller zeroes the sums before each run
        sums.zero_()
        run()
        torch.cuda.synchronize()
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
        want = [(0, 0), (0, 0)]
        for i, d in enumerate(dsts):
            lo = 1 if i == 0 else 0
            digest = piece_digest(d, (lo, 0), (d.shape[0] + lo, *d.shape[1:]), salt(f"t{i}"))
            want[i % 2] = add(want[i % 2], digest)
        assert [(a % MOD, b % MOD) for a, b in sums.tolist()] == want


def _engine(tp: int, rank: int, tensors, device: str = "cuda"):
    layout = vllm_layout(tensors, VllmParallel(tp=tp), instance="eng")
    held = {t.name: torch.zeros(t.spec.shape, dtype=torch.bfloat16, device=device) for t in tensors}
    return layout, LocalShards.from_layout(layout, rank, lambda name, box: held[name][box.slices()])


def origin_digest(plan, rank: int, origin: LocalShards, peer: int | None = None) -> tuple[int, int]:
    """What the origin (``origin``: its views; sync rank ``peer`` where ``rank`` has several) digests of the regions
    it sends sync rank ``rank``."""
    total = (0, 0)
    for step in plan.schedule(rank):
        if peer is not None and step.peer != peer:
            continue
        for t in step.bucket.transfers:
            spec = plan.tensors[t.tensor]
            total = add(total, region_digest(origin, spec.name, spec.shape, spec.dtype, t.offsets, t.sizes))
    return total


@CUDA
def test_an_ipc_receivers_digests_equal_its_origins_and_change_with_a_byte():
    """One process: the trainer's views are this process's memory (the executor reads them as it would an opened
    export). A TP=2 engine rank gets whole rows (digested as they are copied) and column halves (after)."""
    from awex.transport.ipc.executor import IpcExecutor

    tensors = canonical_tensors(CONFIG, dtype="bfloat16")
    g = torch.Generator().manual_seed(0)
    weights = {t.name: torch.randn(t.spec.shape, generator=g).to(torch.bfloat16).cuda() for t in tensors}
    trainer_layout = hf_layout(tensors, "trainer", "trainer")
    trainer = LocalShards.from_layout(trainer_layout, 0, lambda name, box: weights[name][box.slices()])
    layout, mine = _engine(2, 1, tensors)
    plan = plan_transfers([trainer_layout], [layout], PlanOptions(relay=False))  # as CUDA IPC plans
    rank = next(i for i, r in enumerate(plan.ranks) if r.instance == "eng" and r.local_rank == 1)
    origin = next(i for i, r in enumerate(plan.ranks) if r.instance == "trainer")
    executor = IpcExecutor(plan, rank, mine, {origin: trainer}, digest=True)
    assert 0 < executor.digest.fused_bytes < executor.bytes_received  # both kinds of piece are in this plan
    o_proj = next(n for n in weights if n.endswith("o_proj.weight"))  # column halves: digested after the copy
    for flipped in (None, None, "model.embed_tokens.weight", o_proj, None):
        for w in weights.values():
            w.add_(1)
        want = origin_digest(plan, rank, trainer)
        if flipped is not None:  # a bit of what this rank gets changed after the origin digested it
            weights[flipped][-1, -1:].view(torch.int16)[0] ^= 1 << 4
        executor.run(timeout=30)
        got = executor.received_digests()
        assert executor.received_digests() is None  # once per run
        assert (got == {origin: want}) == (flipped is None), (flipped, got, want)
        assert all(
            torch.equal(view, weights[name][box.slices()]) for name in mine.names() for box, view in mine.pairs(name)
        )
