"""The shared-memory transport (``awex.transport.shm``): segments laid out by the plan, filled by senders and read by
receivers in place; what a receiver refuses before any byte moves; no segment outlives a killed creator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transport_workers import canonical_value

from awex.meta import PlanOptions, canonical_tensors, plan_transfers
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout
from awex.transport import LocalShards
from awex.transport.shm import SEGMENT_DIR, Segment, SegmentInfo, ShmReceiver, ShmSender, segment_layout, sweep_stale

TINY = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())

pytestmark = pytest.mark.skipif(not SEGMENT_DIR.is_dir(), reason="no /dev/shm on this machine")


def _world(train_tp=2, engines=((2,), (1,))):
    tensors = canonical_tensors(TINY, dtype="float32")
    trainer = megatron_layout(tensors, MegatronParallel(tp=train_tp), instance="trainer")
    dests = [vllm_layout(tensors, VllmParallel(tp=tp), instance=f"vllm-{i}") for i, (tp,) in enumerate(engines)]
    return trainer, dests, plan_transfers([trainer], dests, PlanOptions(relay=False))  # as the session plans shm


def _views(layout, rank: int, step: int | None):
    """Views of one rank: filled with the canonical values of ``step`` (a trainer), or -1 (a receiver)."""
    held = {}

    def view_of(name, box):
        key = (name, box.offsets)
        if key not in held:
            spec = next(t.spec for t in layout.tensors if t.spec.name == name)
            if step is None:
                held[key] = torch.full(box.sizes, -1.0, dtype=torch.float32)
            else:
                full = canonical_value(name, spec.shape, "float32", step)
                held[key] = full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))].clone()
        return held[key]

    return LocalShards.from_layout(layout, rank, view_of), held


def test_segments_hold_each_region_once_and_receivers_get_every_byte():
    trainer, dests, plan = _world()
    senders = {}
    for r in range(trainer.world_size):
        shards, _ = _views(trainer, r, step=3)
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
                shards, held = _views(layout, r, step=None)
                rank = plan.rank(layout.instance, r).rank
                receiver = ShmReceiver(plan, rank, shards, infos)
                stats = receiver.run()
                assert stats.bytes_received == sum(s.bucket.nbytes for s in plan.schedule(rank) if s.op == "recv")
                spec = {t.spec.name: t.spec for t in layout.tensors}
                for (name, offsets), view in held.items():
                    full = canonical_value(name, spec[name].shape, "float32", 3)
                    want = full[tuple(slice(o, o + s) for o, s in zip(offsets, view.shape))]
                    assert torch.equal(view, want), (layout.instance, r, name)
                receiver.close()
    finally:
        for s in senders.values():
            s.close()
    assert not any(os.path.exists(s.segment.path) for s in senders.values())


def test_a_receiver_refuses_segments_that_do_not_match_its_plan():
    trainer, dests, plan = _world()
    shards, _ = _views(trainer, 0, step=1)
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


def test_gpu_views_are_refused_with_a_clear_error():
    trainer, _, plan = _world()
    shards, _ = _views(trainer, 0, step=1)
    shards.device = torch.device("meta")  # anything but the CPU
    with pytest.raises(ValueError, match="CPU views only"):
        ShmSender(plan, plan.rank("trainer", 0).rank, shards)


def test_segments_of_a_killed_creator_are_swept_and_live_ones_kept():
    code = (
        "import os, sys, time; from awex.transport.shm import Segment; s = Segment.create(4096); "
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
