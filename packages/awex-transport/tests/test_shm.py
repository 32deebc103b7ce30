"""The shared-memory transport (``awex.transport.pull.shm``): segments laid out by the plan, filled by senders and
read by receivers in place; what a receiver refuses before any byte moves; no segment outlives a killed creator."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from staged_world import assert_holds_step, rank_views, world

from awex.transport.base import TransferError, TransferTimeout
from awex.transport.pull.segments import SEGMENT_DIR, Segment, sweep_stale
from awex.transport.pull.shm import SegmentInfo, ShmReceiver, ShmSender
from awex.transport.pull.staging import segment_layout

pytestmark = pytest.mark.skipif(not SEGMENT_DIR.is_dir(), reason="no /dev/shm on this machine")


def test_segments_hold_each_region_once_and_receivers_get_every_byte():
    trainer, dests, plan = world()
    senders = {}
    for r in range(trainer.world_size):
        shards, _ = rank_views(trainer, r, step=3)
        rank = plan.rank("trainer", r).rank
        senders[rank] = ShmSender(plan, rank, shards)
        offsets, total = segment_layout(plan, rank)
        assert senders[rank].segment.nbytes == total
        sent = sum(s.bucket.nbytes for s in plan.schedule(rank) if s.op == "send")
        assert total < sent  # two engines need the same regions: the segment holds them once
        senders[rank].fill()
    infos = {rank: SegmentInfo.from_wire(s.wire(), plan, rank) for rank, s in senders.items()}
    try:
        for layout in dests:
            for r in range(layout.world_size):
                shards, held = rank_views(layout, r, step=None)
                rank = plan.rank(layout.instance, r).rank
                receiver = ShmReceiver(plan, rank, shards, infos)
                stats = receiver.run()
                assert stats.bytes_received == sum(s.bucket.nbytes for s in plan.schedule(rank) if s.op == "recv")
                assert_holds_step(layout, held, 3, where=f"rank {r}")
                receiver.close()
    finally:
        for s in senders.values():
            s.close()
    assert not any(os.path.exists(s.segment.path) for s in senders.values())


def test_a_receiver_refuses_segments_that_do_not_match_its_plan():
    trainer, dests, plan = world()
    shards, _ = rank_views(trainer, 0, step=1)
    rank = plan.rank("trainer", 0).rank
    sender = ShmSender(plan, rank, shards)
    try:
        good = sender.wire()
        for bad, why in [
            (dict(good, nbytes=good["nbytes"] + 8), "holds"),
            (dict(good, digest="0" * 64), "laid out for plan"),
            (dict(good, rank=rank + 1), "laid out for plan"),
            (dict(good, nbytes="12"), "must be integers"),
            (dict(good, extra=1), "malformed"),
            ([good], "malformed"),
        ]:
            with pytest.raises(ValueError, match=why):
                SegmentInfo.from_wire(bad, plan, rank)
        with pytest.raises(ValueError, match="not an Awex shared-memory segment"):
            Segment.attach("/etc/passwd", 10)
        with pytest.raises(ValueError, match="not an Awex shared-memory segment"):
            Segment.attach(str(SEGMENT_DIR / "awex-board-1-2-abcd"), 10)
        with pytest.raises(ValueError, match="this rank's plan puts"):  # the file itself is not what was published
            Segment.attach(good["path"], good["nbytes"] - 8)
    finally:
        sender.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine (runs on the GPU machines)")
def test_gpu_views_move_through_pinned_segments():
    """A GPU sender fills its page-locked segment with device-to-host copies; GPU receivers copy out host to
    device; every byte arrives."""
    trainer, dests, plan = world()
    senders = {}
    for r in range(trainer.world_size):
        shards, _ = rank_views(trainer, r, step=4, device="cuda")
        rank = plan.rank("trainer", r).rank
        senders[rank] = ShmSender(plan, rank, shards)
        assert senders[rank].segment._pinned
        senders[rank].fill()
    infos = {rank: SegmentInfo.from_wire(s.wire(), plan, rank) for rank, s in senders.items()}
    try:
        for layout in dests:
            for r in range(layout.world_size):
                shards, held = rank_views(layout, r, step=None, device="cuda")
                receiver = ShmReceiver(plan, plan.rank(layout.instance, r).rank, shards, infos)
                receiver.run()
                assert_holds_step(layout, held, 4, where=f"rank {r}")
                receiver.close()
    finally:
        for s in senders.values():
            s.close()


def test_segments_of_a_killed_creator_are_swept_and_live_ones_kept():
    code = (
        "import os, sys, time; from awex.transport.pull.segments import Segment; s = Segment.create(4096); "
        "print(s.path, flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    mine = Segment.create(64)
    try:
        assert os.path.exists(path)
        assert Path(path).name not in sweep_stale()  # its creator still runs
        proc.kill()
        proc.wait(10)
        assert os.path.exists(path)  # SIGKILL: nothing ran at exit
        assert Path(path).name in sweep_stale()
        assert not os.path.exists(path) and os.path.exists(mine.path)
    finally:
        proc.kill()
        mine.close()
    assert not os.path.exists(mine.path)


def test_receivers_copy_what_the_progress_word_says_is_there_and_never_an_older_version(monkeypatch):
    import awex.transport.pull.shm as shm

    monkeypatch.setattr(shm, "CHUNK_BYTES", 4096)  # many chunks
    trainer, dests, plan = world(train_tp=1, engines=((1,),))
    shards, _ = rank_views(trainer, 0, step=2)
    sender = ShmSender(plan, plan.rank("trainer", 0).rank, shards)
    assert len(sender.chunks) > 4
    info = {0: SegmentInfo.from_wire(sender.wire(), plan, 0)}
    layout = dests[0]
    try:
        sender.fill(count=7)  # the segment holds version 7
        half = sender.chunks[len(sender.chunks) // 2][1]
        sender.segment.set_version(8, "")
        sender.segment.set_progress(8, half)  # version 8: only the first half is there yet
        recv, held = rank_views(layout, 0, step=None)
        receiver = ShmReceiver(plan, plan.rank(layout.instance, 0).rank, recv, info)
        with pytest.raises(TransferTimeout, match="not filled with version 8"):
            receiver.run(count=8, deadline=time.monotonic() + 0.3)
        copied = [k for k, v in held.items() if not torch.equal(v, torch.full_like(v, -1.0))]
        assert 0 < len(copied) < len(held)  # what was there was copied, the rest waits
        with pytest.raises(TransferTimeout, match="not filled with version 9"):  # the segment holds 8, not 9
            ShmReceiver(plan, 1, rank_views(layout, 0, step=None)[0], info).run(
                count=9, deadline=time.monotonic() + 0.2
            )
        sender.segment.set_progress(8, sender.segment.nbytes)
        receiver.run(count=8, deadline=time.monotonic() + 5)
        assert_holds_step(layout, held, 2)
        receiver.close()
    finally:
        sender.close()


def test_a_receiver_refuses_another_jobs_segment_and_another_version_in_it():
    """The same plan in two jobs: a receiver of one refuses the other's segment before any byte moves (its header's
    seal); a segment that holds another version than the one asked for (another writer's, or overwritten) fails the
    run."""
    trainer, dests, plan = world(train_tp=1, engines=((1,),))
    shards, _ = rank_views(trainer, 0, step=2)
    sender = ShmSender(plan, 0, shards, job="job-a")
    info = {0: SegmentInfo.from_wire(sender.wire(), plan, 0)}
    layout = dests[0]
    try:
        sender.fill(count=3, version="step-3")
        recv, held = rank_views(layout, 0, step=None)
        with pytest.raises(ValueError, match="sealed for another job"):
            ShmReceiver(plan, plan.rank(layout.instance, 0).rank, recv, info, job="job-b")
        receiver = ShmReceiver(plan, plan.rank(layout.instance, 0).rank, recv, info, job="job-a")
        with pytest.raises(TransferError, match="does not hold version 'step-4'"):
            receiver.run(count=3, deadline=time.monotonic() + 5, version="step-4")
        assert all(torch.equal(v, torch.full_like(v, -1.0)) for v in held.values())  # refused before a copy
        receiver.run(count=3, deadline=time.monotonic() + 5, version="step-3")
        assert_holds_step(layout, held, 2)
        receiver.close()
    finally:
        sender.close()
