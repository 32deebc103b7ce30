"""Per-version signals between a WeightsWriter and a WeightsReader (gloo, one process, two threads): through the
host board where the reader maps it, the version channel where it cannot, and the MetaServer where the channel's
host is gone (a new writer); every version's bytes arrive whichever way."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from awex.engines.reader import WeightsReader
from awex.engines.sync import forgetting, keys
from awex.engines.sync.board import HostBoard
from awex.engines.sync.channel import VersionChannel
from awex.engines.writer import WeightsWriter
from awex.meta import canonical_tensors
from awex.meta.client import MetaClient
from awex.meta.layouts import hf_layout
from awex.meta.server import start_embedded

CONFIG = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())
TENSORS = canonical_tensors(CONFIG, dtype="float32")


def tensors(fill: float) -> dict[str, torch.Tensor]:
    return {t.name: torch.full(t.spec.shape, fill) for t in TENSORS}


def views(params):
    return lambda name, box: params[name][box.slices()]


@pytest.fixture
def server():
    s = start_embedded()
    yield s
    s.stop()


def sync(writer: WeightsWriter, reader: WeightsReader, version: str) -> None:
    errors: list = []

    def receive():
        try:
            reader.receive(version)
        except Exception as e:  # asserted below
            errors.append(e)

    t = threading.Thread(target=receive)
    t.start()
    writer.write(version, ["hf-in"])
    t.join(60)
    assert not t.is_alive() and not errors, errors


def make_writer(server, params, timeout=60.0, claim_lease=3.0) -> WeightsWriter:
    """A writer of a short claim lease: a replacement in these tests waits at most that long for it."""
    return WeightsWriter(
        MetaClient(server.address, job="signals", timeout=timeout),
        hf_layout(TENSORS, "trainer", "hf-out"),
        0,
        views(params),
        timeout=timeout,
        claim_lease=claim_lease,
    )


@pytest.mark.parametrize("board", [True, False], ids=["host-board", "channel-only"])
def test_versions_arrive_over_the_board_or_the_channel(server, monkeypatch, board):
    if not board:  # no /dev/shm for the writer: the channel carries every signal

        def no_board():
            raise OSError("no /dev/shm here")

        monkeypatch.setattr(HostBoard, "create", staticmethod(no_board))
    absent: list[str] = []  # keys the writer dropped from the channel that were not there (a round trip for nothing)
    real_delete = VersionChannel.delete

    def delete(channel, names):
        absent.extend(k for k in names if not channel.holds(k))
        real_delete(channel, names)

    monkeypatch.setattr(VersionChannel, "delete", delete)
    monkeypatch.setattr(forgetting, "FORGET_EVERY", 2)  # old versions' MetaServer records: two versions a request
    sent, got = tensors(0.0), tensors(-1.0)
    writer = make_writer(server, sent)
    reader = WeightsReader(
        MetaClient(server.address, job="signals", timeout=60), hf_layout(TENSORS, "inference", "hf-in"), 0, views(got)
    )
    held = []  # keys on the version channel once each version's older ones were dropped
    for step in range(1, 7):
        for t in sent.values():
            t.fill_(float(step))
        sync(writer, reader, f"v{step}")
        assert all(torch.equal(got[n], sent[n]) for n in sent), step
        writer.flush()  # old versions' keys are dropped from the background thread
        held.append(writer._session.channel.num_keys())
    session = reader._session
    assert (session.board is not None) == board and session.channel is not None
    # on the MetaServer, the records of versions older than the last two (keep_versions) went, two versions a time
    kept = [k for k in writer._meta.keys("") if k.startswith((keys.manifest(""), "outcomes/"))]
    assert sorted(kept) == sorted([keys.manifest("v5"), keys.manifest("v6")])
    # every key a version leaves goes once it is old (keep_versions=2): the store does not grow version by version
    assert held[3] == held[4] == held[5], held
    # and only keys a version left there are dropped: on the board nothing but the first version's manifest; on the
    # channel the trainer's ready signals (its transport's), the receiver's outcome and the trainers' record
    assert absent == [], absent
    writer.close()
    # the trainers' record of the last version's outcomes, for ranks that find the channel gone with the writer: put
    # on the MetaServer as it closes (not every version: a request a version fewer)
    records = [k for k in writer.client.keys("") if k.startswith("outcomes/")]
    assert records == ([] if board else [keys.outcomes("v6", 6)]), records
    reader.close()


def test_a_new_writer_with_another_channel_is_found_through_the_metaserver(server):
    sent, got = tensors(1.0), tensors(-1.0)
    first = make_writer(server, sent)
    reader = WeightsReader(
        MetaClient(server.address, job="signals", timeout=60), hf_layout(TENSORS, "inference", "hf-in"), 0, views(got)
    )
    sync(first, reader, "v1")
    old_channel = reader._session.channel.address
    first.close()  # its channel and board go with it
    for t in sent.values():
        t.fill_(2.0)
    second = make_writer(server, sent)
    sync(second, reader, "v2")
    assert all(torch.equal(got[n], sent[n]) for n in sent)
    assert reader._session.channel.address != old_channel
    second.close()
    reader.close()


def channel_pair(server, monkeypatch) -> tuple[WeightsWriter, WeightsReader]:
    """A writer and a reader with no host board (signals over the version channel), after a first version."""
    monkeypatch.setattr(HostBoard, "create", staticmethod(lambda: (_ for _ in ()).throw(OSError("no /dev/shm"))))
    writer = make_writer(server, tensors(1.0), timeout=20.0)
    reader = WeightsReader(
        MetaClient(server.address, job="signals", timeout=20),
        hf_layout(TENSORS, "inference", "hf-in"),
        0,
        views(tensors(-1.0)),
    )
    sync(writer, reader, "v1")
    assert reader._session.signals.medium == "channel"
    return writer, reader


def fail_at_load(writer: WeightsWriter, reader: WeightsReader, version: str) -> list:
    """Write ``version`` while the reader's load step fails (the write raises ``SyncFailedError``); what the
    reader raised."""
    from awex.engines.errors import SyncFailedError

    failed: list = []

    def load_step_fails(shards):
        raise RuntimeError("the engine's load step failed")

    def receive():
        try:
            reader.receive(version, apply=load_step_fails)
        except Exception as e:
            failed.append(e)

    t = threading.Thread(target=receive)
    t.start()
    with pytest.raises(SyncFailedError, match="load step failed"):
        writer.write(version, [reader.layout.instance])
    t.join(30)
    return failed


def test_an_outcome_forged_on_the_channel_never_turns_a_failed_version_into_success(server, monkeypatch):
    """A process that reaches the channel's port (no token, no MetaServer, no secret) writes "ok" for the
    receiver before the receiver's load step fails: the writer drops it and reports the real failure."""
    from datetime import timedelta

    import torch.distributed as dist

    from awex.engines.sync import keys

    writer, reader = channel_pair(server, monkeypatch)
    host, _, port = writer._session.channel.address.rpartition(":")
    forger = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
    forged = json.dumps({"ok": True, "cause": None, "partial": False}).encode()
    forger.set(keys.channel_outcome("v2", 2, "hf-in", 0), forged)  # the next attempt's outcome, ahead of time
    failed = fail_at_load(writer, reader, "v2")
    assert failed and "load step failed" in str(failed[0])
    versions = {p["name"]: p["weight_version"] for p in writer.client.status()["jobs"]["signals"]["participants"]}
    assert versions.get("hf-in") != "v2"
    writer.close()
    reader.close()


def test_a_failed_attempts_keys_leave_the_channel_with_a_later_version(server, monkeypatch):
    """A failed attempt leaves its signals on the version channel (the trainer's ready signal, the receiver's outcome,
    the trainers' record of them): they are dropped with the next successful write (here its retry), as its
    MetaServer records are, not kept for the rest of the run; the retry's own keys stay."""
    from awex.engines.sync import keys

    writer, reader = channel_pair(server, monkeypatch)
    kind = writer.transport_in_use  # the plan's transport (the same on the attempt that fails)
    failed = fail_at_load(writer, reader, "v2")
    assert failed
    left = keys.channel_signals("v2", 2, [("hf-out", 0)], [("hf-in", 0)], [kind])
    channel = writer._session.channel
    assert any(channel.holds(k) for k in left)  # what the failed attempt left there
    sync(writer, reader, "v2")  # the retry, under the same name: the next successful write
    writer.flush()
    assert [k for k in left if channel.holds(k)] == []
    assert channel.holds(keys.channel_manifest("v2"))  # the retry's manifest (one key for both attempts) stays
    writer.close()
    reader.close()


@pytest.mark.parametrize(
    "bad",
    [
        {"channel": "no-port", "channel_secret": "a" * 32},
        {"channel": "127.0.0.1:70000", "channel_secret": "a" * 32},
        {"channel": "127.0.0.1:5000,70000", "channel_secret": "a" * 32},  # lanes: every port checked
        {"channel": "127.0.0.1:5000,", "channel_secret": "a" * 32},
        {"channel": "127.0.0.1:" + ",".join(["5000"] * 65), "channel_secret": "a" * 32},  # at most 64 lanes
        {"channel": "127.0.0.1:5000"},  # a channel without its secret
        {"channel": "127.0.0.1:5000", "channel_secret": "short"},
        {"channel": "127.0.0.1:5000", "channel_secret": "../" * 12},
        {"seq": -1},
        {"seq": "3"},
        {"seq": True},
        {"board": ["/dev/shm/x"]},
        {"board_host": "h" * 2000},
    ],
)
def test_hostile_signal_fields_in_a_manifest_are_refused(bad):
    from awex.engines.sync.manifest import SyncManifest

    doc = SyncManifest("v1", ("t",), ("r",), "127.0.0.1", 5000).to_json()
    SyncManifest.from_json(doc)  # the plain one is fine
    with pytest.raises(ValueError, match="malformed sync manifest"):
        SyncManifest.from_json({**doc, **bad})


def test_a_steady_writers_manifests_reuse_the_checked_fields_and_anything_else_is_checked_again():
    """Readers parse a steady writer's manifests (only version and count change) without checking every field
    again; a changed field, or a hostile count, is parsed (and refused) as usual."""
    from awex.engines.sync.manifest import SyncManifest
    from awex.engines.sync.session import SyncSession

    session = SyncSession(client=None, instance="r", local_rank=0)
    doc = SyncManifest("v1", ("t",), ("r",), "127.0.0.1", 5000, seq=1).to_json()
    first = session._parse(doc)
    second = session._parse({**doc, "version": "v2", "seq": 2})
    assert (second.version, second.seq) == ("v2", 2)
    assert second == SyncManifest.from_json({**doc, "version": "v2", "seq": 2})
    moved = session._parse({**doc, "version": "v3", "seq": 3, "port": 5001})
    assert moved.port == 5001 and first.port == 5000
    for bad in ({"seq": -1}, {"seq": "4"}, {"seq": True}):
        with pytest.raises(ValueError, match="malformed sync manifest"):
            session._parse({**doc, "port": 5001, "version": "v4", **bad})
    with pytest.raises(ValueError, match="malformed sync manifest"):
        session._parse({**doc, "port": 5001, "channel": "127.0.0.1:5000"})  # a channel without its secret


def test_a_failure_before_any_manifest_keeps_the_plan_and_group_the_other_side_keeps():
    """A rank whose attempt never began (no manifest read: a timeout waiting for it, a refused name) keeps its plan
    and group; a failed attempt drops them and is not taken again."""
    from awex.engines.sync.manifest import Attempt, SyncManifest
    from awex.engines.sync.session import SyncSession

    session = SyncSession(None, "trainer", 0)
    plan, key = object(), object()
    session._plan, session._key = plan, key
    session.note_failure(None)
    assert (session._plan, session._key, session._last_attempt) == (plan, key, None)
    manifest = SyncManifest("v2", ("trainer",), ("eng",), "127.0.0.1", 5000, channel="127.0.0.1:1", seq=4)
    session.note_failure(manifest)
    assert session._plan is None and session._last_attempt == Attempt("127.0.0.1:1", "v2", 4)


def test_a_manifest_says_its_transport_and_its_default_is_the_writers():
    from awex.engines.sync.manifest import SyncManifest
    from awex.engines.sync.options import SyncOptions

    assert SyncManifest("v1", ("t",), ("r",), "127.0.0.1", 5000).options == SyncOptions()  # one set of defaults
    ipc = SyncOptions(transport="ipc", verify=True, allow_cast=("*.weight",), timeout=7)
    doc = SyncManifest("v1", ("t",), ("r",), "127.0.0.1", 5000, ipc).to_json()
    assert SyncManifest.from_json(doc).options == ipc  # the writer's record, as every rank reads it
    for name, bad in (("transport", None), ("verify", 1), ("wave_bytes", "8"), ("allow_cast", "*")):
        wrong = {**doc, "options": {**doc["options"], name: bad}}
        with pytest.raises(ValueError, match=f"malformed sync manifest: options: {name}="):
            SyncManifest.from_json(wrong)
    del doc["options"]["transport"]  # every writer says each option: no default to disagree with its own
    with pytest.raises(ValueError, match="malformed sync manifest"):
        SyncManifest.from_json(doc)
