"""A writer that holds no trainer memory between versions (``hold_trainer_memory=False``: a trainer that offloads
its weights after each version, as colocated RL stacks do): once ``write`` returns, nothing of Awex's (the writer's
views, its transport's executor or staging area, the last transfer's link) keeps the trainer's storages alive, so
they are freed the moment the trainer drops them, and every next version takes its views anew and arrives exact. With
the default (held) the same storages stay alive: what the test checks can fail. WeightsWriter / WeightsReader over
gloo and shared memory, one process, two threads. Over CUDA IPC the engines also close their mappings of the
trainer's export before they report (``integration/tests/test_gpu_sync.py`` measures the GPU memory freed)."""

from __future__ import annotations

import gc

import pytest
import torch
from test_moved_memory import _exact, _failed_version, _pair, _sync, move
from torch.multiprocessing.reductions import StorageWeakRef

from awex.engines.errors import SyncFailedError
from awex.meta.server import start_embedded
from awex.transport.base import TransferError


@pytest.fixture
def server():
    s = start_embedded()
    yield s
    s.stop()


def _offload(model: torch.nn.Module, step: int) -> list[StorageWeakRef]:
    """Each weight moved to new memory with a step's change (offloaded, trained, loaded back); weak references to
    the storages it was in."""
    gone = [StorageWeakRef(p.data.untyped_storage()) for p in model.parameters()]
    move(model, "data", step)
    return gone


@pytest.mark.parametrize("transport", ["p2p", "shm"])
@pytest.mark.parametrize("hold", [False, True])
def test_a_writer_that_holds_no_trainer_memory_lets_it_go_after_each_version(server, transport, hold):
    model, writer, reader, got = _pair(server, f"let-go-{transport}-{hold}", transport)
    writer.hold_trainer_memory = hold
    try:
        for step in range(1, 4):
            _sync(writer, reader, f"v{step}")
            assert _exact(model, got) == [], f"v{step}: stale tensors arrived"
            assert (writer.shards is None) is not hold
            old = _offload(model, step)
            gc.collect()
            alive = sum(not ref.expired() for ref in old)
            # letting go: every old storage freed once the trainer dropped it; held: the writer's views keep each
            assert alive == (len(old) if hold else 0), f"v{step}: {alive} of {len(old)} old storages alive"
    finally:
        writer.close()
        reader.close()


def test_a_failed_version_lets_go_too_and_the_next_version_arrives_exact(server):
    """A version the receiver refuses (its views no longer fit) still leaves nothing of the trainer's held, and the
    version after it takes the views anew (over shared memory; over gloo a send to a receiver that failed mid-version
    can stay pending in the dropped group, holding its buffer, until that group is collected)."""
    model, writer, reader, got = _pair(server, "let-go-failed", "shm")
    writer.hold_trainer_memory = False
    try:
        _sync(writer, reader, "v1")
        name = next(iter(got))
        kept, got[name] = got[name], torch.zeros(1)  # the engine's tensor no longer fits its layout
        _failed_version(writer, reader, "v2", (SyncFailedError, TransferError))
        assert writer.shards is None
        old = _offload(model, 2)
        gc.collect()
        assert all(ref.expired() for ref in old)
        got[name] = kept
        _sync(writer, reader, "v3")
        assert _exact(model, got) == []
    finally:
        writer.close()
        reader.close()


def test_holding_or_letting_go_changed_between_versions_takes_effect_on_the_next(server):
    model, writer, reader, got = _pair(server, "let-go-switched", "shm")
    try:
        held = []
        for step, hold in enumerate([True, False, False, True, True], start=1):
            writer.hold_trainer_memory = hold
            _sync(writer, reader, f"v{step}")
            assert _exact(model, got) == [], f"v{step}: stale tensors arrived"
            old = _offload(model, step)
            gc.collect()
            held.append(sum(not ref.expired() for ref in old))
        n = len(old)
        assert held == [n, 0, 0, n, n], held
    finally:
        writer.close()
        reader.close()


def test_a_transport_that_cannot_let_go_fails_no_version(server, monkeypatch, caplog):
    """Letting go comes after the version landed: where a transport raises there, the version stands on both sides
    (a warning says so) and the next one arrives exact."""
    from awex.transport.pull.shm import ShmTransport

    def broken(self):
        raise RuntimeError("a segment would not close")

    model, writer, reader, got = _pair(server, "let-go-broken", "shm")
    writer.hold_trainer_memory = False
    monkeypatch.setattr(ShmTransport, "let_go", broken)
    try:
        for step in (1, 2):
            _sync(writer, reader, f"v{step}")
            assert _exact(model, got) == [], f"v{step}: stale tensors arrived"
            _offload(model, step)
        said = [r.getMessage() for r in caplog.records if "could not let go" in r.getMessage()]
        assert any(m.startswith("trainer:0") for m in said) and any(m.startswith("hf-in:0") for m in said), said
    finally:
        writer.close()
        reader.close()
