"""The writer's claim lease (``awex.engines.sync.lease``): a steady version's claim is sent and its answer read after
the bytes moved, and the name is claimed all the same; over point-to-point transports the claim leaves while the
waves move; a writer that closes gives the lease back; a claim the server refuses in the end fails the write; a bad
lease length is refused at construction."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from test_fencing import _reader as reader_for
from test_version_signals import TENSORS, make_writer, sync, tensors, views

from awex.engines.errors import ClaimRefusedError
from awex.engines.writer import WeightsWriter
from awex.meta.client import MetaClient
from awex.meta.errors import MetaConflictError
from awex.meta.layouts import hf_layout
from awex.meta.server import start_embedded


@pytest.fixture
def server():
    with start_embedded() as s:
        yield s


def _held(writer: WeightsWriter, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not writer._announcer.lease.held:
        assert time.monotonic() < deadline, "the claim lease was not granted"
        time.sleep(0.01)


def test_a_leased_claim_is_made_though_not_waited_for(server, monkeypatch):
    sent, got = tensors(1.0), tensors(-1.0)
    writer, reader = make_writer(server, sent, claim_lease=30.0), reader_for(server, got)
    sync(writer, reader, "v1")
    _held(writer)
    read_after: list = []
    confirm = writer._announcer.confirm
    pending = lambda: writer._announcer._unconfirmed is not None  # noqa: E731 - its claim's answer still to read
    monkeypatch.setattr(writer._announcer, "confirm", lambda **kw: (read_after.append(pending()), confirm(**kw)))
    for t in sent.values():
        t.fill_(2.0)
    sync(writer, reader, "v2")
    assert read_after == [True] and all(torch.equal(got[n], sent[n]) for n in sent)  # read after the transfer
    writer.close()  # gives the lease back: another writer claims at once, and v2 stays claimed
    other = MetaClient(server.address, job="signals", timeout=2).fenced("critic", 1)
    with pytest.raises(MetaConflictError, match="exists"):
        other.put("sync/v2", {}, create_only=True)
    started = time.monotonic()
    make_writer(server, sent).close()  # a replacement of a writer that closed does not wait
    assert time.monotonic() - started < 15.0  # not the 30 s its lease had left
    reader.close()


def test_over_point_to_point_the_leased_claim_leaves_while_the_waves_move(server, monkeypatch):
    """Over NCCL or gloo the writer's work beside the transfer (its leased claim, the rest of the moved-memory check)
    runs once the first waves are posted, so that the claim's round trip overlaps the wire; run after the transport
    returned, it sat between the last byte and the outcomes (about 1 ms a version, seen over NCCL on 4x H200)."""
    from awex.transport.p2p.waves import WaveExecutor

    sent, got = tensors(1.0), tensors(-1.0)
    writer = WeightsWriter(
        MetaClient(server.address, job="signals", timeout=60),
        hf_layout(TENSORS, "trainer", "hf-out"),
        0,
        views(sent),
        timeout=60,
        transport="p2p",
        claim_lease=30.0,
    )
    reader = reader_for(server, got)
    sync(writer, reader, "v1")
    _held(writer)
    moving, seen = set(), []  # threads inside a wave executor's run; whether the claim left from inside one
    run = WaveExecutor.run

    def tracked(self, *args, **kwargs):
        moving.add(threading.get_ident())
        try:
            return run(self, *args, **kwargs)
        finally:
            moving.discard(threading.get_ident())

    send_claim = writer._announcer.send_claim

    def sending() -> None:
        if writer._announcer._unsent is not None:  # a claim to send (not the no-op call of confirm)
            seen.append(threading.get_ident() in moving)
        send_claim()

    monkeypatch.setattr(WaveExecutor, "run", tracked)
    monkeypatch.setattr(writer._announcer, "send_claim", sending)
    for t in sent.values():
        t.fill_(2.0)
    sync(writer, reader, "v2")
    assert writer.transport_in_use == "p2p" and all(torch.equal(got[n], sent[n]) for n in sent)
    assert seen == [True]  # sent once, from inside the transfer
    writer.close()
    reader.close()


def test_a_claim_refused_after_the_transfer_fails_the_write(server, monkeypatch):
    """A lease that did not hold (as when a server without a journal restarted): the name was claimed elsewhere; the
    claim sent on the lease is refused and the write raises instead of returning."""
    sent, got = tensors(1.0), tensors(-1.0)
    # deadlines with room for a loaded machine: after the refusal the writer waits up to its deadline for the
    # receiver's outcome before it reports (a report that never left would leave the engine at v1 below)
    writer, reader = make_writer(server, sent, timeout=30.0), reader_for(server, got, timeout=30.0)
    sync(writer, reader, "v1")
    _held(writer)
    writer._announcer.lease.close()  # taken back: the name can be claimed by another writer
    MetaClient(server.address, job="signals", timeout=2).put("sync/v2", {"by": "another"}, create_only=True)
    monkeypatch.setattr(writer._announcer.lease, "covers", lambda key: True)  # as if it still held
    for t in sent.values():
        t.fill_(2.0)  # v2's bytes: whether any landed is read off the engine's tensors
    receiving = threading.Thread(target=_receive_failing, args=(reader, "v2"))
    receiving.start()
    with pytest.raises(ClaimRefusedError, match="claim lease"):
        writer.write("v2", ["hf-in"])
    receiving.join(60)
    writer.flush()
    # the name is another writer's: where v2's bytes reached the engine before the refusal came back (the claim's
    # answer is read while they move), the server must not record it as serving v2 nor v1 (it serves no consistent
    # version: its weights are no named version's); where the refusal came first, nothing moved and it serves v1
    landed = any(bool((got[n] == 2.0).any()) for n in got)
    plain = MetaClient(server.address, job="signals", timeout=10)
    serves = {p["name"]: p["weight_version"] for p in plain.status()["jobs"]["signals"]["participants"]}
    assert serves.get("hf-in") == (None if landed else "v1"), (landed, serves)
    writer.close()
    reader.close()


def _receive_failing(reader, version: str) -> None:
    try:
        reader.receive(version)
    except Exception:  # the version fails on the receiver too; what the server records is asserted
        pass


@pytest.mark.parametrize("bad", [0, 2, 61, math.nan, "10", True])
def test_a_bad_claim_lease_is_refused_at_construction(server, bad):
    with pytest.raises(ValueError, match="claim_lease"):
        WeightsWriter(
            MetaClient(server.address, job="x", timeout=5),
            hf_layout(TENSORS, "trainer", "t"),
            1,  # not the first rank: checked on every rank
            views(tensors(0.0)),
            claim_lease=bad,
        )
