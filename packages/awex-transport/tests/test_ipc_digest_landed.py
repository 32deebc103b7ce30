"""Verify mode over CUDA IPC, copies from other GPUs (``awex.transport.ipc.digesting``): a copy cut into runs of
rows (to fit the bounce ring) is digested part by part and adds up to the digest of the whole; streams of copies
are cut into groups of about equal bytes, each digested as soon as it landed; on two GPUs a receiver's digests per
origin equal what its origin digests of the same regions, with most bytes digested while later ones still moved,
and a byte that differs from the origin's changes them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_copy_digest import CONFIG, _engine, origin_digest

from awex.meta import PlanOptions, canonical_tensors, plan_transfers
from awex.meta.layouts import hf_layout
from awex.transport.digest import add, piece_digest_torch, salt
from awex.transport.ipc.digesting import ReceivedDigests, byte_groups
from awex.transport.ipc.spans import rows_within
from awex.transport.shards import LocalShards

TWO_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="copies from another GPU need two CUDA GPUs: fewer here"
)


def test_a_copy_cut_into_runs_of_rows_is_digested_as_the_whole():
    g = torch.Generator().manual_seed(3)
    full = {"a": torch.randn(40, 24, generator=g).to(torch.bfloat16), "b": torch.randn(9, 6, 5, generator=g).half()}
    mine = {
        "a": full["a"].clone()[3:40, 8:20],
        "b": full["b"][2:9].clone().transpose(1, 2).contiguous().transpose(1, 2),
    }
    starts = {"a": (3, 8), "b": (2, 0, 0)}
    digests = ReceivedDigests(torch.device("cpu"), origins=[5, 7])
    for i, (name, view) in enumerate(mine.items()):
        spec = SimpleNamespace(name=name, dtype=str(view.dtype).removeprefix("torch."), shape=full[name].shape)
        digests.note(view, (5, 7)[i], spec, starts[name], ())
        parts = [d for d, _ in rows_within(view, view, 100)]
        assert len(parts) > 2 and all(p.data_ptr() != view.data_ptr() for p in parts[1:])
        digests.split(view, parts)
    assert digests.group([]) is None  # on CPU nothing is digested as it lands: all of it by read()
    want = {o: piece_digest_torch(mine[n], starts[n], tuple(full[n].shape), salt(n)) for o, n in ((5, "a"), (7, "b"))}
    assert digests.read() == want
    mine["b"][4, 1, 2] += 1  # a value of one part changes: that origin's digest changes
    digests.zero()  # as every run does first
    got = digests.read()
    assert got[5] == want[5] and got[7] != want[7]
    assert add(*got.values()) != add(*want.values())


@pytest.mark.parametrize("sizes", [[5, 1, 1, 1, 9, 2, 2, 3], [1] * 20, [100], [], [3, 3]])
def test_streams_are_cut_into_groups_of_about_equal_bytes_in_order(sizes):
    items = [(torch.empty(n, dtype=torch.uint8), i) for i, n in enumerate(sizes)]
    groups = byte_groups(items, 4)
    assert [i for g in groups for _, i in g] == list(range(len(sizes)))  # each once, in order
    assert len(groups) <= 4 and all(groups)
    total = sum(sizes)
    for k, grp in enumerate(groups[:-1]):  # a group closes once the run reached its share of the bytes
        done = sum(d.nbytes for g in groups[: k + 1] for d, _ in g)
        assert done * 4 >= total * (k + 1)
        assert (done - grp[-1][0].nbytes) * 4 < total * (k + 1)


@TWO_GPUS
@pytest.mark.parametrize("options", [{}, {"bounce_bytes": 4096, "bounce_buffers": 2}])
def test_copies_from_another_gpu_are_digested_as_they_land(options):
    """Trainer weights on GPU 0, a TP=2 engine rank on GPU 1 (whole rows and column halves): the receiver's digest
    per origin is what the origin digests of those regions, taken mostly while the copies still moved, and a bit
    flipped in what it reads after the origin's digest changes it (the copies that landed early included)."""
    from awex.transport.ipc.executor import IpcExecutor
    from awex.transport.ipc.options import IpcOptions

    tensors = canonical_tensors(CONFIG, dtype="bfloat16")
    g = torch.Generator().manual_seed(0)
    weights = {t.name: torch.randn(t.spec.shape, generator=g).to(torch.bfloat16).to("cuda:0") for t in tensors}
    trainer_layout = hf_layout(tensors, "trainer", "trainer")
    trainer = LocalShards.from_layout(trainer_layout, 0, lambda name, box: weights[name][box.slices()])
    layout, mine = _engine(2, 1, tensors, device="cuda:1")
    plan = plan_transfers([trainer_layout], [layout], PlanOptions(relay=False))
    rank = next(i for i, r in enumerate(plan.ranks) if r.instance == "eng" and r.local_rank == 1)
    origin = next(i for i, r in enumerate(plan.ranks) if r.instance == "trainer")
    executor = IpcExecutor(plan, rank, mine, {origin: trainer}, IpcOptions(**options), digest=True)
    assert executor.digest.landed_bytes > executor.bytes_received // 2  # most of it digested as it landed
    o_proj = next(n for n in weights if n.endswith("o_proj.weight"))  # column halves: cut into runs of rows
    for flipped in (None, None, "model.embed_tokens.weight", o_proj, None):
        for w in weights.values():
            w.add_(1)
        want = origin_digest(plan, rank, trainer)
        if flipped is not None:
            weights[flipped][-1, -1:].view(torch.int16)[0] ^= 1 << 4
        executor.run(timeout=30)
        got = executor.received_digests()
        assert (got == {origin: want}) == (flipped is None), (flipped, got, want)
        assert all(
            torch.equal(view, weights[name][box.slices()].to("cuda:1"))
            for name in mine.names()
            for box, view in mine.pairs(name)
        )
