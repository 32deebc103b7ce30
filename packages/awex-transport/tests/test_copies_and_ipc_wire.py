"""Merged copies equal the copies they replace; IPC exports cross process boundaries as plain data."""

from __future__ import annotations

import json

import pytest
import torch

from awex.meta import Box
from awex.transport import LocalShards
from awex.transport.copies import merge_copies
from awex.transport.ipc import ExportedView, IpcExport, export_shards


def _apply(copies):
    for d, s in copies:
        d.copy_(s)


@pytest.mark.parametrize("seed", range(5))
def test_merged_copies_write_exactly_what_the_separate_copies_write(seed):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(64, 16, generator=g)
    a, b = torch.zeros(48, 16), torch.zeros(48, 16)
    groups, rows, skip = 4, 6, 10  # a Megatron-like fused source: `rows` useful rows every `skip`
    copies = []
    for dst in (a, b):
        pieces = [(dst[i * rows:(i + 1) * rows], src[i * skip:i * skip + rows]) for i in range(groups)]
        pieces += [(dst[30:31], src[63:64]), (dst[40:48, 2:5], src[0:8, 0:3])]  # irregular tail
        copies.append(pieces)
    _apply(copies[0])
    merged = merge_copies(copies[1])
    _apply(merged)
    assert torch.equal(a, b)
    assert len(merged) == 3  # the regular run became one strided copy


def test_ipc_export_round_trips_through_json_without_pickle():
    handle = bytes(range(64))
    export = IpcExport(storages=((0, handle, 4096, 0, b"ref", 8, b"evt", True),), pointers=(1234,),
                       views=(ExportedView("w", Box((0, 0), (4, 8)), 0, 16, (8, 1), "bfloat16"),))
    wire = json.loads(json.dumps(export.to_wire()))
    assert IpcExport.from_wire(wire) == export
    with pytest.raises(ValueError, match="malformed IPC export"):
        IpcExport.from_wire({"storages": []})


def test_ipc_export_needs_cuda_views():
    shards = LocalShards({"w": [(Box((0,), (4,)), torch.zeros(4))]})
    with pytest.raises(ValueError, match="CUDA IPC needs CUDA views"):
        export_shards(shards)


@pytest.mark.parametrize("branches", [1, 2, 3, 5])
def test_local_copies_dealt_to_branches_once_each_in_order_and_balanced(branches):
    from awex.transport.ipc import _balance

    g = torch.Generator().manual_seed(branches)
    sizes = [int(x) for x in torch.randint(1, 1000, (40,), generator=g)]
    copies = [(torch.zeros(n), torch.zeros(n)) for n in sizes]
    dealt = _balance(copies, branches)
    assert len(dealt) == branches
    seen = [id(d) for part in dealt for d, _ in part]
    assert sorted(seen) == sorted(id(d) for d, _ in copies)  # every copy exactly once
    order = {id(d): i for i, (d, _) in enumerate(copies)}
    for part in dealt:
        idx = [order[id(d)] for d, _ in part]
        assert idx == sorted(idx)  # plan order kept within a branch
    loads = [sum(d.numel() for d, _ in part) for part in dealt]
    assert max(loads) - min(loads) <= max(sizes)


def test_mapped_shards_find_the_region_an_address_lies_in():
    from awex.transport.ipc import MappedShards

    shards = MappedShards({"w": [(Box((0,), (4,)), torch.zeros(4))]}, [(5000, 6000), (1000, 2000)])
    assert shards.regions == ((1000, 2000), (5000, 6000))
    assert shards.region_of(1000) == (1000, 2000)
    assert shards.region_of(1999) == (1000, 2000)
    assert shards.region_of(5500) == (5000, 6000)
    for outside in (999, 2000, 4999, 6000):
        assert shards.region_of(outside) is None


def test_waiting_on_the_gpu_has_a_deadline():
    import time

    from awex.transport.deadline import wait_event

    class Event:
        def __init__(self, done_after: int):
            self.polls, self.done_after = 0, done_after

        def query(self) -> bool:
            self.polls += 1
            return self.polls > self.done_after

    done = Event(3)
    wait_event(done, time.monotonic() + 5, lambda: AssertionError("must not time out"))
    assert done.polls == 4
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="late"):
        wait_event(Event(10**9), started + 0.05, lambda: TimeoutError("late"))
    assert 0.05 <= time.monotonic() - started < 2
