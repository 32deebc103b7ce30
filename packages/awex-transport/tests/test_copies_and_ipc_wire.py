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
