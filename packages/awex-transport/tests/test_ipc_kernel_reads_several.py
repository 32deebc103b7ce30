"""A CUDA IPC receiver reading from several other GPUs (``IpcOptions.kernel_reads``): Megatron TP=2 trainer ranks,
each on a GPU of its own where there are three, into a whole engine rank on the last GPU (whole rows, query-group
blocks, and row-parallel halves that land strided). Read by copy engines or by this GPU's kernels (the pieces that
go straight into place as one launch, the row-parallel halves row by row as another, or in verify mode through
the bounce ring, each span as one launch), every byte lands where it
belongs, and in verify mode the digests per origin equal what each origin digests. Two GPUs at least (the kernel
path forced, from one source GPU); three for the default to choose it."""

from __future__ import annotations

import pytest
import torch
from test_copy_digest import CONFIG, _engine, origin_digest

from awex.meta import PlanOptions, canonical_tensors, plan_transfers
from awex.meta.layouts import MegatronParallel, megatron_layout
from awex.transport.shards import LocalShards

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


# rows of the row-parallel halves 1 and 2 KiB long (the tiny model's are shorter than a row read's block)
WIDE = {**CONFIG, "hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": 8}


def _world(dest: str, sources: tuple[str, str]):
    tensors = canonical_tensors(WIDE, dtype="bfloat16")
    g = torch.Generator().manual_seed(0)
    weights = {t.name: torch.randn(t.spec.shape, generator=g).to(torch.bfloat16) for t in tensors}
    trainer_layout = megatron_layout(tensors, MegatronParallel(tp=2, vocab_pad=1), instance="trainer")
    held = {}  # each trainer piece in an allocation of its own, contiguous (as per-parameter trainer memory)

    def piece(rank):
        def view(name, box):
            held[(rank, name, box)] = weights[name][box.slices()].contiguous().to(sources[rank])
            return held[(rank, name, box)]

        return view

    trainers = [LocalShards.from_layout(trainer_layout, r, piece(r)) for r in range(2)]
    layout, mine = _engine(1, 0, tensors, device=dest)
    plan = plan_transfers([trainer_layout], [layout], PlanOptions(relay=False))
    rank = next(i for i, r in enumerate(plan.ranks) if r.instance == "eng")
    origins = {i: trainers[r.local_rank] for i, r in enumerate(plan.ranks) if r.instance == "trainer"}
    return weights, held, plan, rank, origins, mine


@pytest.mark.skipif(GPUS < 2, reason="copies from other GPUs need two CUDA GPUs at least: fewer here")
@pytest.mark.parametrize("kernel_reads", [None, True, False])
@pytest.mark.parametrize("digest", [False, True])
def test_a_receiver_reading_several_gpus_gets_every_byte(kernel_reads, digest):
    from awex.transport.ipc.executor import IpcExecutor
    from awex.transport.ipc.options import IpcOptions

    dest = f"cuda:{GPUS - 1}"
    sources = ("cuda:0", "cuda:1") if GPUS >= 3 else ("cuda:0", "cuda:0")
    weights, held, plan, rank, origins, mine = _world(dest, sources)
    executor = IpcExecutor(plan, rank, mine, origins, IpcOptions(kernel_reads=kernel_reads), digest=digest)
    by_kernel = kernel_reads if kernel_reads is not None else GPUS >= 3
    assert (executor._far_reads is not None) == by_kernel
    # the strided halves: row by row into place, or through the ring (by kernels too, in verify mode)
    assert (executor._row_reads is not None) == (by_kernel and not digest)
    assert any(r is not None for r in executor._span_reads) == (by_kernel and digest)
    assert bool(executor._spans) == (not by_kernel or digest)
    for version in range(3):
        for t in [*held.values(), *weights.values()]:  # the same bf16 sums on either side
            t.add_(1)
        executor.run(timeout=30)
        for name in mine.names():
            for box, view in mine.pairs(name):
                assert torch.equal(view.cpu(), weights[name][box.slices()]), (name, version)
        if digest:
            want = {o: origin_digest(plan, rank, shards, peer=o) for o, shards in origins.items()}
            assert executor.received_digests() == want
