"""Host relays through the real writer and reader: two trainer ranks and two receiving ranks on one host, no host
board (so the version channel carries the signals, as across hosts), over shared memory (a pull transport: every
sender says ready). The second trainer rank tells the first, which puts one ready key for both; the first receiver
reads it and hands it to the second; the second receiver tells the first its outcome, which puts one record for
both; the first trainer rank hands the second the record of every outcome. Every
version's bytes arrive, and what the versions leave on the channel is dropped once they are old."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

import awex.engines.writer
from awex.engines.reader import WeightsReader
from awex.engines.sync import keys
from awex.engines.sync.board import HostBoard
from awex.engines.sync.channel import VersionChannel
from awex.engines.writer import WeightsWriter
from awex.meta import canonical_tensors
from awex.meta.client import MetaClient
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout
from awex.meta.server import start_embedded

CONFIG = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())
TENSORS = canonical_tensors(CONFIG, dtype="float32")


def _views(params):
    return lambda name, box: params[name][box.slices()]


@pytest.mark.parametrize("lanes", [1, 3], ids=["one-lane", "three-lanes"])
def test_versions_arrive_through_host_relays_and_leave_the_channel(monkeypatch, lanes):
    monkeypatch.setattr(HostBoard, "create", staticmethod(lambda: (_ for _ in ()).throw(OSError("no /dev/shm"))))
    monkeypatch.setattr(awex.engines.writer, "lanes_for", lambda trainer_ranks: lanes)  # two ranks have one
    absent: list[str] = []  # keys dropped from the channel that were not there
    real_delete = VersionChannel.delete

    def delete(channel, names):
        absent.extend(k for k in names if not channel.holds(k))
        real_delete(channel, names)

    monkeypatch.setattr(VersionChannel, "delete", delete)
    server = start_embedded()
    sent = {t.name: torch.zeros(t.spec.shape) for t in TENSORS}
    got = [{t.name: torch.full(t.spec.shape, -1.0) for t in TENSORS} for _ in range(2)]  # each receiver's copy

    def client():
        return MetaClient(server.address, job="relays", timeout=30)

    trainer = megatron_layout(TENSORS, MegatronParallel(tp=2), instance="trainer")
    engine = vllm_layout(TENSORS, VllmParallel(tp=2), instance="vllm-0")
    writers = [WeightsWriter(client(), trainer, r, _views(sent), timeout=30.0) for r in range(2)]
    readers = [WeightsReader(client(), engine, r, _views(got[r]), timeout=30.0) for r in range(2)]
    held = []
    try:
        for step in range(1, 6):
            for t in sent.values():
                t.fill_(float(step))
            errors: list = []

            def run(fn, *args):
                try:
                    fn(*args)
                except Exception as e:  # noqa: BLE001 - asserted below
                    errors.append(e)

            threads = [threading.Thread(target=run, args=(r.receive, f"v{step}")) for r in readers]
            threads += [threading.Thread(target=run, args=(w.write, f"v{step}", ["vllm-0"])) for w in writers]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors and not any(t.is_alive() for t in threads), errors
            for r in range(2):  # each receiver's share of every tensor holds this version's bytes, exactly
                boxes = engine.rank_boxes(r)
                assert boxes and all(
                    torch.equal(got[r][name][box.slices()], sent[name][box.slices()])
                    for name, held_boxes in boxes.items()
                    for box in held_boxes
                ), (step, r)
            writers[0].flush()
            held.append(writers[0]._session.channel.num_keys())
        first, second = writers[0]._session, writers[1]._session
        assert first.signals.medium == "channel" and first.transport == "shm" and first.channel.lanes == lanes
        assert readers[1]._session.channel.lanes == lanes
        # the trainers' ready signals: one key for the host, put by the first; none of the second's own; the first
        # trainer rank's key of them all, which the receivers read
        seq, channel = readers[0]._session._last_attempt.seq, first.channel
        assert channel.get(keys.host_ready("shm", "v5", seq, 0)) == [1, 1]
        assert channel.get(keys.all_ready("shm", "v5", seq)) == [1, 1]
        assert channel.get(keys.ready("shm", "v5", seq, "trainer", 1)) is None
        assert second.relay.hears_outcomes and readers[1]._session.relay.roles.receivers_from == 2
        # the receivers' outcomes: one record for the engine's two ranks on this host, put by the first; no own key
        assert channel.get(keys.instance_outcomes("v5", seq, "vllm-0/0")) == {"failed": {}, "silent": []}
        assert [channel.get(keys.channel_outcome("v5", seq, "vllm-0", r)) for r in range(2)] == [None, None]
        assert readers[1]._session.relay.roles.outcome_from == 2
        assert held[2] == held[3] == held[4], held  # old versions' keys go: the store does not grow
        assert absent == [], absent  # and only keys that were there are dropped
    finally:
        for side in (*writers, *readers):
            side.close()
        server.stop()
