"""The rdma transport (``awex.transport.pull.rdma``) on Mooncake's transfer engine over TCP (this machine has no RDMA
NIC): receivers read exactly their ranges of the senders' registered buffers; what a receiver refuses before any
byte moves; a killed sender fails the read at once, a frozen one at the deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from staged_world import assert_holds_step, rank_views, world

from awex.transport.base import TransferError, TransferTimeout
from awex.transport.pull.rdma import BufferInfo, RdmaReceiver, RdmaSender, _Engine, read_ranges
from awex.transport.pull.staging import segment_layout

try:
    import mooncake.engine  # noqa: F401

    HAVE_MOONCAKE = True
except ImportError:  # also: its libraries (libibverbs1, libnuma1) missing
    HAVE_MOONCAKE = False

pytestmark = pytest.mark.skipif(
    not HAVE_MOONCAKE,
    reason="Mooncake's transfer engine is not installed (pip install 'awex-transport[rdma-cpu]'; Debian's libibverbs1)",
)


def _engine() -> _Engine:
    return _Engine.get("127.0.0.1", "tcp")


def test_reads_cover_each_needed_region_once_and_merge_adjacent_ranges():
    _, dests, plan = world()
    for layout in dests:
        for r in range(layout.world_size):
            rank = plan.rank(layout.instance, r).rank
            reads, local, nbytes = read_ranges(plan, rank)
            needed = {
                s.peer: {(t.tensor, t.offsets, t.sizes): t.nbytes for t in s.bucket.transfers}
                for s in plan.schedule(rank)
                if s.op == "recv"
            }
            for peer, ranges in reads.items():
                remote = segment_layout(plan, peer)[0]
                want = sorted((remote[k], n) for k, n in needed[peer].items())
                got = []
                for lo, ro, n in ranges:  # every read covers regions that lie end to end on both sides
                    assert lo + n <= nbytes
                    got.append((ro, n))
                assert sum(n for _, n in got) == sum(n for _, n in want)
                assert len(ranges) <= len(want)
                for key, at in local[peer].items():  # each region's local place is inside one read, at its offset
                    ro = remote[key]
                    assert any(lo <= at < lo + n and at - lo == ro - r0 for lo, r0, n in ranges), key


def test_receivers_get_every_byte_through_the_transfer_engine():
    engine = _engine()
    trainer, dests, plan = world()
    senders = {}
    for r in range(trainer.world_size):
        shards, _ = rank_views(trainer, r, step=5)
        rank = plan.rank("trainer", r).rank
        senders[rank] = RdmaSender(plan, rank, shards, engine)
        senders[rank].fill()
    infos = {rank: BufferInfo.from_wire(s.info().to_wire(), plan, rank) for rank, s in senders.items()}
    try:
        for layout in dests:
            for r in range(layout.world_size):
                shards, held = rank_views(layout, r, step=None)
                rank = plan.rank(layout.instance, r).rank
                receiver = RdmaReceiver(plan, rank, shards, engine, infos)
                stats = receiver.run(time.monotonic() + 30)
                assert stats.bytes_received == sum(s.bucket.nbytes for s in plan.schedule(rank) if s.op == "recv")
                assert_holds_step(layout, held, 5, where=f"rank {r}")
                receiver.close()
    finally:
        for s in senders.values():
            s.close()


def test_a_receiver_refuses_buffers_that_do_not_match_its_plan():
    _, _, plan = world()
    rank = plan.rank("trainer", 0).rank
    good = {
        "address": "127.0.0.1:15000",
        "base": 1 << 20,
        "nbytes": segment_layout(plan, rank)[1],
        "digest": plan.digest,
        "rank": rank,
    }
    assert BufferInfo.from_wire(good, plan, rank).nbytes == good["nbytes"]
    for bad, why in [
        (dict(good, nbytes=good["nbytes"] + 8), "holds"),
        (dict(good, digest="0" * 64), "laid out for plan"),
        (dict(good, rank=rank + 1), "laid out for plan"),
        (dict(good, base=-1), "integers"),
        (dict(good, base=True), "integers"),
        (dict(good, address="evil.example:80"), "not an IP address"),
        (dict(good, address="127.0.0.1:0"), "not an IP address"),
        (dict(good, address="127.0.0.1"), "not an IP address"),
        (dict(good, extra=1), "malformed"),
        ([good], "malformed"),
    ]:
        with pytest.raises(ValueError, match=why):
            BufferInfo.from_wire(bad, plan, rank)


_SENDER = """
import json, sys, time, torch
from awex.transport.pull.rdma import _Engine
engine = _Engine.get("127.0.0.1", "tcp")
buf = torch.arange({n}, dtype=torch.int64).view(torch.uint8)
engine.register(buf)
print(json.dumps({{"address": engine.address, "base": buf.data_ptr()}}), flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_a_sender_killed_fails_the_read_at_once_a_frozen_one_at_the_deadline(how):
    n = 1 << 20
    proc = subprocess.Popen(
        [sys.executable, "-c", _SENDER.format(n=n)],
        stdout=subprocess.PIPE,
        env={**os.environ, "GLOG_minloglevel": "2"},
        text=True,
    )
    try:
        doc = json.loads(proc.stdout.readline())
        engine = _engine()
        dst = torch.zeros(n * 8, dtype=torch.uint8)
        engine.register(dst)
        receiver = object.__new__(RdmaReceiver)  # reads from that process, as a plan would issue them
        receiver.rank, receiver.engine, receiver.copies, receiver.bytes_received = 1, engine, [], n * 8
        receiver.buffer, receiver._inflight = dst, []
        piece = n * 8 // 64  # 64 ranges in one batch: all of them must have arrived when run returns
        offsets = list(range(0, n * 8, piece))
        receiver.reads = [
            (
                0,
                doc["address"],
                [dst.data_ptr() + o for o in offsets],
                [doc["base"] + o for o in offsets],
                [piece] * len(offsets),
            )
        ]
        receiver.run(time.monotonic() + 20)
        assert torch.equal(dst.view(torch.int64), torch.arange(n, dtype=torch.int64))
        if how == "killed":
            proc.kill()
            proc.wait()
            started = time.monotonic()
            with pytest.raises(TransferError, match="reading from sync rank 0 .* failed"):
                receiver.run(time.monotonic() + 20)
            assert time.monotonic() - started < 10
        else:
            os.kill(proc.pid, signal.SIGSTOP)
            started = time.monotonic()
            with pytest.raises((TransferTimeout, TransferError)):
                receiver.run(time.monotonic() + 2)
            assert time.monotonic() - started < 8
        engine.unregister(dst)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


def test_the_transport_module_imports_and_explains_a_missing_engine():
    """Without Mooncake the registry still lists rdma; making its engine says what to install."""
    code = (
        "import sys; sys.modules['mooncake'] = None; sys.modules['mooncake.engine'] = None\n"
        "from awex.transport.registry import make_transport\n"
        "from awex.transport.pull.rdma import RdmaUnavailable, _Engine\n"
        "make_transport('rdma')\n"
        "try:\n    _Engine('127.0.0.1', 'tcp')\nexcept RdmaUnavailable as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "awex-transport[rdma" in out.stdout, out.stderr[-2000:]


def _gpudirect_unavailable() -> str | None:
    from awex.meta.rdma_devices import active_ports

    if not torch.cuda.is_available():
        return "no CUDA device here"
    if not active_ports():
        return "no active RDMA port here (GPUDirect RDMA needs RDMA NICs)"
    return None


@pytest.mark.skipif(_gpudirect_unavailable() is not None, reason=f"GPUDirect RDMA: {_gpudirect_unavailable()}")
def test_gpu_views_read_over_rdma_nics():
    """CUDA buffers registered with the NICs (Mooncake's CUDA build): the same reads as over TCP, every byte."""
    engine = _Engine.get("127.0.0.1", "rdma")
    trainer, dests, plan = world()
    senders = {}
    for r in range(trainer.world_size):
        shards, _ = rank_views(trainer, r, step=6, device="cuda")
        rank = plan.rank("trainer", r).rank
        senders[rank] = RdmaSender(plan, rank, shards, engine)
        assert senders[rank].buffer.is_cuda
        senders[rank].fill()
    infos = {rank: BufferInfo.from_wire(s.info().to_wire(), plan, rank) for rank, s in senders.items()}
    try:
        layout = dests[0]
        shards, held = rank_views(layout, 0, step=None, device="cuda")
        RdmaReceiver(plan, plan.rank(layout.instance, 0).rank, shards, engine, infos).run(time.monotonic() + 30)
        assert_holds_step(layout, held, 6)
    finally:
        for s in senders.values():
            s.close()
