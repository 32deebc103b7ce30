"""A trainer rank that fails a version after announcing it (before its bytes were ready) tells its receivers at once
on the host board (``Signals.withhold``), or over gloo drops its group before it waits for their outcomes: they fail
in moments instead of at their deadline, and the writer's wait for their outcomes ends as soon. The retry goes
through and lands exactly the trainer's bytes."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from steady_counts import CONFIG, views_of
from test_moved_memory import module_of

from awex.engines.reader import WeightsReader
from awex.engines.sync.board import HostBoard
from awex.engines.sync.manifest import SyncManifest
from awex.engines.sync.signals import WITHHELD_DETAIL, BoardSignals
from awex.engines.writer import WeightsWriter
from awex.meta import RankDescriptor, Role, canonical_tensors
from awex.meta.client import MetaClient
from awex.meta.errors import AwexValueError
from awex.meta.layouts import hf_layout
from awex.meta.server import start_embedded
from awex.transport.base import TransferError

DEADLINE = 30.0  # each side's timeout: what a receiver waited for a sender that had failed, before
PROMPT = 5.0  # what "at once" allows here (milliseconds on an idle machine)


def _receive(reader: WeightsReader, version: str, out: dict) -> threading.Thread:
    def run():
        started = time.monotonic()
        try:
            reader.receive(version)
            out[version] = (None, time.monotonic() - started)
        except Exception as e:
            out[version] = (e, time.monotonic() - started)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "transport, said",
    [
        ("auto", "version 'v3' from sender out:0 were withheld"),  # shared memory: the mark in the trainer's slot
        ("p2p", "recv from rank 0 failed"),  # gloo: the trainer drops its group before it waits for the outcomes
    ],
)
def test_a_trainer_that_fails_after_announcing_tells_its_receivers_at_once(transport, said):
    specs = canonical_tensors(dict(CONFIG, num_hidden_layers=2), dtype="float32")
    sent, got = (module_of({t.name: torch.zeros(t.spec.shape) for t in specs}) for _ in range(2))
    server = start_embedded()
    failing = {"now": False}

    def refresh():  # the trainer's own step before its bytes are ready (here: after the version was announced)
        if failing["now"]:
            raise RuntimeError("the trainer's refresh failed")

    client = MetaClient(server.address, job="withheld")
    writer = WeightsWriter(
        client,
        hf_layout(specs, "trainer", "out"),
        0,
        views_of(sent),
        timeout=DEADLINE,
        refresh=refresh,
        transport=transport,
    )
    reader = WeightsReader(
        MetaClient(server.address, job="withheld"),
        hf_layout(specs, "inference", "in"),
        0,
        views_of(got),
        timeout=DEADLINE,
    )
    outcomes: dict = {}
    try:
        for step, version in enumerate(("v1", "v2", "v3", "v3"), start=1):
            failing["now"] = step == 3
            for p in sent.parameters():
                p.data.fill_(float(step))
            thread = _receive(reader, version, outcomes)
            started = time.monotonic()
            if failing["now"]:
                with pytest.raises(RuntimeError, match="refresh failed"):
                    writer.write(version, ["in"])
            else:
                writer.write(version, ["in"])
            wrote = time.monotonic() - started
            thread.join(DEADLINE + 10)
            error, took = outcomes.pop(version)
            if failing["now"]:
                assert writer._session.signals.medium == "board"
                assert isinstance(error, TransferError) and said in str(error), error
                assert took < PROMPT and wrote < PROMPT, (took, wrote)  # not the 30-s deadline
                assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in got.parameters())  # nothing moved
            else:
                assert error is None, error
                assert all(torch.equal(a, b) for a, b in zip(sent.parameters(), got.parameters())), version
        assert reader.version == "v3"
    finally:
        writer.close(), reader.close()
        server.stop()


def test_a_generation_that_would_read_as_withheld_is_refused(tmp_path):
    board = HostBoard.create(str(tmp_path))
    try:
        signals = BoardSignals(board, None)
        manifest = SyncManifest("v1", ("t",), ("e",), "127.0.0.1", 1, seq=1)
        me = RankDescriptor(0, "t", Role.TRAINER, 0)
        with pytest.raises(AwexValueError, match="does not fit"):
            signals.ready("shm", manifest, me, WITHHELD_DETAIL)
        signals.ready("shm", manifest, me, WITHHELD_DETAIL - 1)
        assert signals.wait_ready("shm", manifest, [me], 1.0) == [WITHHELD_DETAIL - 1]
        signals.withhold("shm", manifest, me)
        assert signals.wait_ready("shm", manifest, [me], 1.0) == ["withheld"]
    finally:
        board.close()
