"""A version received into staging on a thread of its own (``awex.engines.staged_version``), as vLLM's engines do
with ``receive="staged"`` while they generate: the live weights change only on the trainer's word to commit, after
the whole version arrived; the rank's outcome (so the writer's ``write``) comes after the commit; a dropped
version, or one without a word by the deadline, fails with the live weights untouched and is not reported as
partly applied, and the next version goes. WeightsWriter / WeightsReader over shared memory, one process."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_version_signals import CONFIG, views

from awex.engines.errors import SyncFailedError
from awex.engines.reader import WeightsReader
from awex.engines.staged_version import StagedVersion, VersionDroppedError
from awex.engines.sync import keys
from awex.engines.writer import WeightsWriter
from awex.meta import canonical_tensors
from awex.meta.client import MetaClient
from awex.meta.layouts import hf_layout
from awex.meta.server import start_embedded

TENSORS = canonical_tensors(CONFIG, dtype="float32")


@pytest.fixture(scope="module")
def server():
    s = start_embedded()
    yield s
    s.stop()


class Engine:
    """Live weights and a staging area: received into staging, copied into the live weights when applied."""

    def __init__(self, server, job: str, timeout: float = 30.0):
        self.live = {t.name: torch.zeros(t.spec.shape) for t in TENSORS}
        self.staging = {t.name: torch.zeros(t.spec.shape) for t in TENSORS}
        self.client = MetaClient(server.address, job=job, timeout=30)
        layout = hf_layout(TENSORS, "inference", "eng")
        self.reader = WeightsReader(self.client, layout, 0, views(self.staging), timeout=timeout)
        self.applied: list[str] = []

    def apply(self, shards) -> None:
        for name, t in self.live.items():
            t.copy_(self.staging[name])
        self.applied.append("applied")

    def stage(self, version: str) -> StagedVersion:
        def receive(gate):
            self.reader.receive(version, apply=self.apply, before_apply=gate)

        staged = StagedVersion(
            version, receive, lambda: self.client.put(keys.staged(version, "eng", 0), {"version": version})
        )
        staged.start(self.reader.timeout)
        return staged


def _trainer(server, job: str):
    g = torch.Generator().manual_seed(3)
    weights = {t.name: torch.randn(t.spec.shape, generator=g) for t in TENSORS}
    client = MetaClient(server.address, job=job, timeout=30)
    writer = WeightsWriter(client, hf_layout(TENSORS, "trainer", "trainer"), 0, views(weights), transport="shm")
    return weights, writer


def _write(writer, version: str, out: dict, destinations=("eng",)) -> threading.Thread:
    def run():
        try:
            out["stats"] = writer.write(version, list(destinations))
        except Exception as e:  # asserted by the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _until_staged(engine: Engine, writer, version: str) -> tuple[StagedVersion, threading.Thread, dict]:
    """Receive ``version`` into staging while the writer writes it; return once the rank said it holds it whole
    (the staged receive, the writing thread, and what the write returned or raised)."""
    staged = engine.stage(version)
    out: dict = {}
    w = _write(writer, version, out)
    engine.client.get(keys.staged(version, "eng", 0), timeout=30)
    return staged, w, out


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def test_the_live_weights_change_only_on_the_commit_and_the_write_returns_after_it(server):
    weights, writer = _trainer(server, "staged-commit")
    engine = Engine(server, "staged-commit")
    before = {n: t.clone() for n, t in engine.live.items()}
    try:
        staged, w, out = _until_staged(engine, writer, "v1")  # the whole version is in staging
        time.sleep(0.3)  # the write waits for the outcome, which comes after the commit
        assert w.is_alive() and _same(engine.live, before) and _same(engine.staging, weights)
        assert staged.staged_at is not None and engine.applied == []
        staged.decide(True, timeout=30)
        w.join(30)
        assert "error" not in out, out.get("error")
        assert _same(engine.live, weights) and engine.applied == ["applied"]
    finally:
        writer.close()
        engine.reader.close()


def test_a_dropped_version_fails_untouched_and_not_partly_applied_then_the_next_goes(server):
    weights, writer = _trainer(server, "staged-drop")
    engine = Engine(server, "staged-drop")
    before = {n: t.clone() for n, t in engine.live.items()}
    try:
        staged, w, out = _until_staged(engine, writer, "v1")
        staged.decide(False, timeout=30)  # the trainer's word: drop it (another engine failed, say)
        w.join(30)
        assert isinstance(out.get("error"), SyncFailedError) and isinstance(staged.error, VersionDroppedError)
        outcome = out["error"].failed[("eng", 0)]
        assert outcome is not None and not outcome.partial, outcome  # the weights were not touched
        assert _same(engine.live, before) and engine.applied == []
        for t in weights.values():
            t.add_(1.0)
        staged, w, out = _until_staged(engine, writer, "v2")
        staged.decide(True, timeout=30)
        w.join(30)
        assert "error" not in out and _same(engine.live, weights)
    finally:
        writer.close()
        engine.reader.close()


def test_a_staged_version_without_a_word_by_its_deadline_is_dropped(server):
    weights, writer = _trainer(server, "staged-no-word")
    engine = Engine(server, "staged-no-word", timeout=4.0)
    before = {n: t.clone() for n, t in engine.live.items()}
    try:
        staged = engine.stage("v1")
        out: dict = {}
        w = _write(writer, "v1", out)
        w.join(30)
        assert isinstance(out.get("error"), SyncFailedError), out
        # too late: a commit raises what the receive raised (once its thread ended: the rank's outcome reaches the
        # writer before the thread records its error, so the error is read after the join decide() does)
        with pytest.raises(VersionDroppedError, match="no decision"):
            staged.decide(True, timeout=5)
        assert isinstance(staged.error, VersionDroppedError)
        assert _same(engine.live, before) and engine.applied == []
    finally:
        writer.close()
        engine.reader.close()
