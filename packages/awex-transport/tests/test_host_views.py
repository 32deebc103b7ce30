"""A receiving rank on a GPU whose views are in pinned host memory (``LocalShards(device=)``: a version staged on
the host): what it accepts, and the CUDA IPC executor's copies (and digests) landing there from the GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from awex.meta import Box, PlanOptions, canonical_tensors, plan_transfers
from awex.meta.layouts import VllmParallel, hf_layout, vllm_layout
from awex.transport.digest import add, region_digest
from awex.transport.rebind import rebound
from awex.transport.shards import LocalShards, ShardMismatchError

CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="copies into pinned host memory from a GPU: no GPU here"
)
CONFIG = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())


def test_views_on_one_device_for_a_rank_on_another_are_refused():
    """Views that are neither on the rank's device nor in host memory (here: meta tensors for a rank said to be on a
    GPU), or host views for a rank said to be on the host, are refused naming both."""
    views = {"w": [(Box((0,), (4,)), torch.empty(4, device="meta"))]}
    with pytest.raises(ShardMismatchError, match="pinned host memory"):
        LocalShards(views, device=torch.device("cuda", 0))
    same = LocalShards({"w": [(Box((0,), (4,)), torch.zeros(4))]}, device=torch.device("cpu"))
    assert same.device == torch.device("cpu") and not same.on_host  # the views' own device: nothing to say
    meta = LocalShards(views, device="meta")  # a device without its index names the views' own too
    assert meta.device == torch.device("meta") and not meta.on_host


@CUDA
def test_host_views_must_be_pinned():
    unpinned = {"w": [(Box((0,), (4,)), torch.zeros(4))]}
    with pytest.raises(ShardMismatchError, match="w: its view is in host memory that is not pinned"):
        LocalShards(unpinned, device=torch.device("cuda", 0))
    pinned = LocalShards({"w": [(Box((0,), (4,)), torch.zeros(4).pin_memory())]}, device=torch.device("cuda", 0))
    assert pinned.on_host and pinned.device == torch.device("cuda", 0)
    own = LocalShards({"w": [(Box((0,), (4,)), torch.zeros(4, device="cuda:0"))]}, device="cuda")
    assert not own.on_host and own.device == torch.device("cuda", 0)  # "cuda" names the views' own device


def _host_engine(tp: int, rank: int, tensors):
    layout = vllm_layout(tensors, VllmParallel(tp=tp), instance="eng")
    held: dict = {}

    def view_of(name, box):
        if (name, box) not in held:
            held[(name, box)] = torch.zeros(box.sizes, dtype=torch.bfloat16, pin_memory=True)
        return held[(name, box)]

    device = torch.device("cuda", torch.cuda.current_device())
    return layout, view_of, LocalShards.from_layout(layout, rank, view_of, device)


@CUDA
@pytest.mark.parametrize("digest", [False, True])
def test_an_ipc_receiver_copies_from_the_gpu_into_pinned_host_views(digest):
    """One process: the trainer's CUDA views are read as an opened export would be, the engine rank's views are
    pinned host tensors. Every byte lands (the whole sync replayed as a CUDA graph after the first run); in verify
    mode the digests of what landed equal the origin's, and change when a byte the origin digested changes."""
    from awex.transport.ipc.executor import IpcExecutor

    tensors = canonical_tensors(CONFIG, dtype="bfloat16")
    g = torch.Generator().manual_seed(1)
    weights = {t.name: torch.randn(t.spec.shape, generator=g).to(torch.bfloat16).cuda() for t in tensors}
    trainer_layout = hf_layout(tensors, "trainer", "trainer")
    trainer = LocalShards.from_layout(trainer_layout, 0, lambda name, box: weights[name][box.slices()])
    layout, view_of, mine = _host_engine(2, 1, tensors)
    assert mine.on_host and all(v.is_pinned() for n in mine.names() for _, v in mine.pairs(n))
    again, moved = rebound(layout, 1, view_of, mine)  # the same pinned buffers: nothing moved
    assert again is mine and moved == []
    plan = plan_transfers([trainer_layout], [layout], PlanOptions(relay=False))
    rank = next(i for i, r in enumerate(plan.ranks) if r.instance == "eng" and r.local_rank == 1)
    origin = next(i for i, r in enumerate(plan.ranks) if r.instance == "trainer")
    executor = IpcExecutor(plan, rank, mine, {origin: trainer}, digest=digest)
    for flipped in (None, None, "model.embed_tokens.weight", None):
        for w in weights.values():
            w.add_(1)
        want = (0, 0)
        for step in plan.schedule(rank):
            for t in step.bucket.transfers:
                spec = plan.tensors[t.tensor]
                want = add(want, region_digest(trainer, spec.name, spec.shape, spec.dtype, t.offsets, t.sizes))
        if flipped is not None:  # a byte this rank gets changed after the origin digested it
            weights[flipped][-1, -1:].view(torch.int16)[0] ^= 1 << 4
        executor.run(timeout=30)
        for name in mine.names():
            for box, view in mine.pairs(name):
                assert torch.equal(view, weights[name][box.slices()].cpu()), name
        if digest:
            assert (executor.received_digests() == {origin: want}) == (flipped is None), flipped
        else:
            assert executor.received_digests() is None


@CUDA
def test_quantising_on_receive_into_host_views_is_refused():
    from awex.transport.ipc.executor import IpcExecutor

    tensors = canonical_tensors(CONFIG, dtype="bfloat16")
    trainer_layout = hf_layout(tensors, "trainer", "trainer")
    layout, _, mine = _host_engine(1, 0, tensors)

    class Quantised:  # a plan that says its receivers quantise one weight on the copy
        def __init__(self, plan):
            self._plan = plan

        def __getattr__(self, name):
            return getattr(self._plan, name)

        quantized = (("model.layers.0.mlp.down_proj.weight", None, "scale", (128, 128)),)

    plan = Quantised(plan_transfers([trainer_layout], [layout], PlanOptions(relay=False)))
    with pytest.raises(ValueError, match="into views in host memory"):
        IpcExecutor(plan, 1, mine, {}, quantize=lambda *a: None)


@CUDA
def test_a_host_piece_digested_on_the_gpu_in_chunks_equals_its_digest_there(monkeypatch):
    """Verify mode with a version staged on the host: pieces in pinned host memory are read up to the GPU a few rows
    at a time and digested there; the sums are those of the whole piece on the GPU (offsets kept per chunk)."""
    from awex.transport import digest

    monkeypatch.setattr(digest, "HOST_CHUNK_BYTES", 3 * 64 * 2)  # three rows of 64 bf16 words a chunk
    g = torch.Generator().manual_seed(2)
    piece = torch.randn(10, 64, generator=g).to(torch.bfloat16).pin_memory()
    on_gpu = digest.piece_digest(piece.cuda(), (5, 64), (40, 128), 77)
    sums = torch.zeros(2, dtype=torch.int64, device="cuda")
    digest.piece_sums(piece, (5, 64), (40, 128), 77, sums)
    assert digest.digest_of(sums) == on_gpu
    piece[7, 3] += 1  # a word in the fourth chunk
    sums.zero_()
    digest.piece_sums(piece, (5, 64), (40, 128), 77, sums)
    assert digest.digest_of(sums) != on_gpu
