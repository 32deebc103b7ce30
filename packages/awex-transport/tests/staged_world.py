"""A small world for the pull transports' tests (shm, rdma, CUDA IPC): a Megatron TP trainer and vLLM engines
over a tiny model, each rank's views, and the every-byte check of what a receiver holds."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transport_workers import canonical_value

from awex.meta import PlanOptions, canonical_tensors, plan_transfers
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout
from awex.transport import LocalShards

TINY = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())


def world(train_tp=2, engines=((2,), (1,))):
    """The trainer's layout, the engines' layouts and the plan (planned as the session plans pull transports)."""
    tensors = canonical_tensors(TINY, dtype="float32")
    trainer = megatron_layout(tensors, MegatronParallel(tp=train_tp), instance="trainer")
    dests = [vllm_layout(tensors, VllmParallel(tp=tp), instance=f"vllm-{i}") for i, (tp,) in enumerate(engines)]
    return trainer, dests, plan_transfers([trainer], dests, PlanOptions(relay=False))


def rank_views(layout, rank: int, step: int | None, device: str = "cpu"):
    """Views of one rank: filled with the canonical values of ``step`` (a trainer), or -1 (a receiver); and the
    tensors behind them by (name, offsets)."""
    held = {}

    def view_of(name, box):
        key = (name, box.offsets)
        if key not in held:
            spec = next(t.spec for t in layout.tensors if t.spec.name == name)
            if step is None:
                held[key] = torch.full(box.sizes, -1.0, dtype=torch.float32, device=device)
            else:
                full = canonical_value(name, spec.shape, "float32", step)
                held[key] = full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))].to(device).clone()
        return held[key]

    return LocalShards.from_layout(layout, rank, view_of), held


def assert_holds_step(layout, held, step: int, where: str = "") -> None:
    """Every view a receiver of ``layout`` holds equals the canonical values of ``step``, byte for byte."""
    spec = {t.spec.name: t.spec for t in layout.tensors}
    for (name, offsets), view in held.items():
        full = canonical_value(name, spec[name].shape, "float32", step)
        want = full[tuple(slice(o, o + s) for o, s in zip(offsets, view.shape))]
        assert torch.equal(view.cpu(), want), (layout.instance, where, name, offsets)
