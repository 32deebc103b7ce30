"""Delta syncs over CUDA IPC, the encoding and reading without the IPC: the writer's board handed to the readers as
plain views (as a receiver sees it once opened), on CPU tensors. Reshards an HF-layout trainer into vLLM TP=2
receivers; whole first, then only the changes; a receiver whose weights changed behind the writer's back, or that
missed a confirmation, reads the affected buckets whole; a budget of zero keeps nothing; a missing board and a
malformed header are refused. On GPUs the same runs through the public path (integration/tests/test_gpu_sync.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from awex.meta import PlanOptions, canonical_tensors, plan_transfers
from awex.meta.layouts import VllmParallel, hf_layout, vllm_layout
from awex.transport import LocalShards
from awex.transport.base import TransferError
from awex.transport.ipc.delta import BOARD, IpcDeltaReceiver, IpcDeltaSender

TINY = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())
TENSORS = canonical_tensors(TINY, dtype="bfloat16")


def _world(budget=None):
    trainer = hf_layout(TENSORS, "trainer", "trainer")
    engine = vllm_layout(TENSORS, VllmParallel(tp=2), instance="engine")
    plan = plan_transfers([trainer], [engine], PlanOptions(relay=False))
    g = torch.Generator().manual_seed(0)
    weights = {t.name: torch.randn(t.spec.shape, generator=g).to(torch.bfloat16) for t in TENSORS}
    sent = LocalShards.from_layout(trainer, 0, lambda name, box: weights[name][box.slices()])
    held = [{t.name: torch.zeros(t.spec.shape, dtype=torch.bfloat16) for t in TENSORS} for _ in range(2)]
    got = [LocalShards.from_layout(engine, r, lambda name, box, r=r: held[r][name][box.slices()]) for r in range(2)]
    sender = IpcDeltaSender(plan, plan.rank("trainer", 0).rank, sent, budget)
    board = sender.board_shards(sent)
    receivers = [IpcDeltaReceiver(plan, plan.rank("engine", r).rank, got[r], {0: board}) for r in range(2)]
    return sender, receivers, weights, got, board


def _sync(sender, receivers, confirm=True):
    sender.encode()
    stats = [r.run(timeout=60) for r in receivers]
    if confirm:
        sender.confirm()
    return stats


def _exact(weights, got) -> bool:
    return all(
        torch.equal(view, weights[name][box.slices()])
        for shards in got
        for name in shards.names()
        for box, view in shards.pairs(name)
    )


def _step(weights, fraction, seed):
    g = torch.Generator().manual_seed(seed)
    for t in weights.values():
        mask = torch.rand(t.shape, generator=g) < fraction
        t[mask] = (t[mask].float() * 1.01 + 1e-3).to(torch.bfloat16)


def test_whole_first_then_only_the_changes_and_stale_receivers_read_whole():
    sender, receivers, weights, got, _ = _world()
    dense = sum(s.bytes_dense for s in _sync(sender, receivers))
    assert _exact(weights, got) and sender.bytes_read >= dense
    for step in (2, 3):
        _step(weights, 0.01, step)
        stats = _sync(sender, receivers)
        assert _exact(weights, got), step
        moved = sum(s.bytes_received for s in stats)
        assert moved == sender.bytes_read and moved < dense / 5, (moved, dense)
        assert all(s.buckets_resent == 0 for s in stats)
    got[1].pairs("lm_head.weight")[0][1][0, :3] = 5.0  # receiver 1's weights moved behind the writer's back
    _step(weights, 0.01, 4)
    stats = _sync(sender, receivers)
    assert _exact(weights, got)
    assert stats[1].buckets_resent >= 1 and stats[0].buckets_resent == 0
    _step(weights, 0.01, 5)
    _sync(sender, receivers, confirm=False)  # a version some receiver did not apply: the baseline stays behind
    _step(weights, 0.01, 6)
    stats = _sync(sender, receivers)
    assert _exact(weights, got) and all(s.buckets_resent >= 1 for s in stats)
    _step(weights, 0.01, 7)
    stats = _sync(sender, receivers)
    assert _exact(weights, got) and all(s.buckets_resent == 0 for s in stats)


def test_a_zero_budget_keeps_nothing_and_every_bucket_is_read_whole():
    sender, receivers, weights, got, _ = _world(budget=0)
    dense = sum(s.bytes_dense for s in _sync(sender, receivers))
    _step(weights, 0.01, 2)
    stats = _sync(sender, receivers)
    assert _exact(weights, got) and sum(s.bytes_received for s in stats) >= dense
    assert sender.kept_bytes == 0


def test_a_missing_board_and_a_malformed_header_are_refused():
    sender, receivers, weights, got, board = _world()
    plan = sender.plan
    without = LocalShards({n: board.pairs(n) for n in board.names() if n != BOARD})
    with pytest.raises(ValueError, match="exported no delta board"):
        IpcDeltaReceiver(plan, plan.rank("engine", 0).rank, got[0], {0: without})
    sender.encode()
    sender.board[:8].view(torch.int64).fill_(7)  # bucket 0's mode
    with pytest.raises(TransferError, match="malformed header"):
        receivers[[plan.buckets[sender.buckets[0]].dst == r.rank for r in receivers].index(True)].run(timeout=60)
